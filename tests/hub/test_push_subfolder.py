"""The subfolder push writes (`--path-in-repo`, or derived from the model id) is held to the rule zoo.json's schema
applies, before any network call: push never records an entry its own reader refuses."""

from __future__ import annotations

import json

import pytest

from oscar_zoo.hub.zoo import ZooIndex

from .helpers import make_artifacts, run_cli

REFUSED = ["a//b", "./x", "x/.", "x/./y", ".", "..", "a/../b", "a b", "a\\b", "x\n", "ü", "zoo.json/x", "README.md",
           "x" * 1025]


def _refused_before_any_request(hf_hub, code: int, err: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err and "validation error" not in err
    assert hf_hub.state.requests == [] and hf_hub.state.repos == {}  # no repo was created


@pytest.mark.parametrize("sub", REFUSED, ids=[repr(s) for s in REFUSED])
def test_path_in_repo_the_zoo_index_refuses_is_an_input_error(hf_hub, artifacts, sub):
    code, _, err = run_cli("push", str(artifacts), "zoo/rotations", "--path-in-repo", sub)
    _refused_before_any_request(hf_hub, code, err)
    assert "--path-in-repo" in err


BAD_REPOS = ["../x", "o/..", "o/r.git", "ownér/répo", "a" * 97 + "/r", "o/-r", "o/r-", "o/a--b", "o/a..b", "o"]


@pytest.mark.parametrize("repo", BAD_REPOS, ids=[repr(r[:20]) for r in BAD_REPOS])
def test_a_repo_id_neither_hub_takes_is_an_input_error_for_push_and_pull(hf_hub, artifacts, tmp_path, repo):
    code, _, err = run_cli("push", str(artifacts), repo, "--dry-run")
    assert code == 2 and "is not a repo id" in err and "Traceback" not in err, err
    if "/" in repo:  # (without one, pull reads a catalog name)
        code, _, err = run_cli("pull", f"{repo}/sub", "--dest", str(tmp_path / "d"))
        assert code == 2 and "is not a repo id" in err, err
    assert hf_hub.state.requests == []


@pytest.mark.parametrize("model_id", ["org/.", "org/..", "org/!!!"])
def test_subfolder_derived_from_the_model_id_is_checked_too(hf_hub, tmp_path, model_id):
    make_artifacts(tmp_path / "art", model_id=model_id)
    code, _, err = run_cli("push", str(tmp_path / "art"), "zoo/rotations")
    _refused_before_any_request(hf_hub, code, err)
    assert repr(model_id) in err and "--path-in-repo" in err  # the hint: name the folder yourself


def test_every_subfolder_push_accepts_reads_back_from_zoo_json(hf_hub, artifacts, tmp_path):
    for given, stored in [("a/b.c-d_e", "a/b.c-d_e"), ("/x/", "x"), ("...", "..."), ("", "")]:
        code, out, err = run_cli("push", str(artifacts), "zoo/rotations", "--path-in-repo", given, "--json")
        assert code == 0, err
        assert json.loads(out)["subfolder"] == stored
    repo = hf_hub.state.repos["zoo/rotations"]
    index = ZooIndex.from_json(repo["commits"][repo["branches"]["main"]]["zoo.json"])
    assert [m.subfolder for m in index.models] == ["", "...", "a/b.c-d_e", "x"]
    # and the repo stays pushable and pullable
    make_artifacts(tmp_path / "other", model_id="org/Other")
    assert run_cli("push", str(tmp_path / "other"), "zoo/rotations")[0] == 0
    code, _, err = run_cli("pull", "zoo/rotations/a/b.c-d_e", "--dest", str(tmp_path / "p"))
    assert code == 0, err


def test_pull_refuses_dot_parts_in_the_subfolder(hf_hub, artifacts, tmp_path):
    assert run_cli("push", str(artifacts), "zoo/rotations", "--path-in-repo", "x/y")[0] == 0
    requests = len(hf_hub.state.requests)
    for spec in ("zoo/rotations/./x/y", "zoo/rotations/x/./y", "zoo/rotations/x/y/."):
        code, _, err = run_cli("pull", spec, "--dest", str(tmp_path / "p"))
        assert code == 2 and repr(spec) in err and "Traceback" not in err, err
    assert len(hf_hub.state.requests) == requests and not (tmp_path / "p").exists()
