"""Push and pull through the real huggingface_hub client against a Hub-compatible server on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json

from .helpers import make_artifacts, run_cli


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_push_pull_round_trip_is_byte_identical(hf_hub, artifacts, tmp_path):
    """The round trip through the paths the real Hub makes the client take (Xet off): the safetensors file as an LFS
    object (batch → PUT to the pre-signed href on the storage host → verify → `lfsFile` commit line), text files as
    regular commit lines, the root README through validate-yaml; its download a 302 from the Hub to the CDN host,
    fetched there without the token."""
    code, out, err = run_cli("push", str(artifacts), "zoo/rotations", "--json")
    assert code == 0, err
    pushed = json.loads(out)
    assert pushed["subfolder"] == "tiny-llama"
    state = hf_hub.state
    repo = state.repos["zoo/rotations"]
    head = repo["commits"][repo["branches"]["main"]]
    assert sorted(head) == [".gitattributes", "README.md", "tiny-llama/README.md", "tiny-llama/manifest.json",
                            "tiny-llama/rotations.safetensors", "zoo.json"]
    tensors = (artifacts / "rotations.safetensors").read_bytes()
    oid = hashlib.sha256(tensors).hexdigest()
    kinds = {line["value"]["path"]: line["key"] for line in state.commit_lines}
    assert kinds == {"tiny-llama/rotations.safetensors": "lfsFile", "tiny-llama/manifest.json": "file",
                     "tiny-llama/README.md": "file", "README.md": "file", "zoo.json": "file"}
    lfs_line = next(line["value"] for line in state.commit_lines if line["key"] == "lfsFile")
    assert lfs_line == {"path": "tiny-llama/rotations.safetensors", "algo": "sha256", "oid": oid, "size": len(tensors)}
    assert state.lfs_objects == {oid: tensors}
    assert "POST /zoo/rotations.git/info/lfs/objects/batch" in state.requests
    assert "POST /zoo/rotations.git/info/lfs/objects/verify" in state.requests
    assert state.cdn_requests == [("PUT", f"/lfs-upload/{oid}", False)]  # pre-signed: no token to the storage host
    assert len(state.validated_yaml) == 1 and state.validated_yaml[0] == head["README.md"].decode()

    state.cdn_requests.clear()
    code, out, err = run_cli("pull", "zoo/rotations/tiny-llama", "--dest", str(tmp_path / "pulled"), "--json")
    assert code == 0, err
    assert json.loads(out)["commit"] == pushed["commit"]
    assert _files(tmp_path / "pulled") == _files(artifacts)
    assert state.cdn_requests == [("GET", f"/cdn-lfs/{oid}/tiny-llama/rotations.safetensors", False)]
    resolves = [r for r in state.requests if "/resolve/" in r and r.endswith("rotations.safetensors")]
    assert resolves and all(r.startswith("HEAD ") for r in resolves)  # the client reads the 302, not follows it


def test_a_corrupted_lfs_object_is_caught_by_the_sha256_check(hf_hub, artifacts, tmp_path, hub_env):
    """The Hub announces the committed sha256 and size (X-Linked-Etag/-Size) but the CDN serves other bytes of the
    same size: huggingface_hub does not hash downloads, the pull's own sha256 check refuses them, and neither the
    destination nor the hub cache keeps them."""
    assert run_cli("push", str(artifacts), "zoo/rotations")[0] == 0
    bad = bytearray((artifacts / "rotations.safetensors").read_bytes())
    bad[-7] ^= 0x10
    hf_hub.state.corrupt_lfs_object("zoo/rotations", "tiny-llama/rotations.safetensors", bytes(bad))
    code, _, err = run_cli("pull", "zoo/rotations/tiny-llama", "--dest", str(tmp_path / "dest"))
    assert code == 4 and "rotations.safetensors sha256" in err and "does not match" in err, err
    assert not (tmp_path / "dest").exists()
    assert [p for p in (hub_env / "hub").rglob("*") if p.is_file() and p.read_bytes() == bytes(bad)] == []


def test_second_model_joins_the_zoo_index(hf_hub, tmp_path):
    make_artifacts(tmp_path / "a", model_id="org/Alpha-1B")
    make_artifacts(tmp_path / "b", model_id="org/Beta-2B", granularity="per-layer", seed=3)
    assert run_cli("push", str(tmp_path / "a"), "zoo/rotations")[0] == 0
    code, out, err = run_cli("push", str(tmp_path / "b"), "zoo/rotations", "--json")
    assert code == 0, err
    repo = hf_hub.state.repos["zoo/rotations"]
    head = repo["commits"][repo["branches"]["main"]]
    zoo = json.loads(head["zoo.json"])
    assert [(m["subfolder"], m["model_id"], m["granularity"]) for m in zoo["models"]] == [
        ("alpha-1b", "org/Alpha-1B", "per-head"), ("beta-2b-per-layer", "org/Beta-2B", "per-layer")]
    assert all(m["verification"] == "✓ +2.1 % PPL, KL 0.012" for m in zoo["models"])
    assert "alpha-1b" in head["README.md"].decode() and "beta-2b-per-layer" in head["README.md"].decode()
    assert json.loads(out)["zoo"] == ["alpha-1b", "beta-2b-per-layer"]
    # re-pushing a model replaces its entry instead of duplicating it
    assert run_cli("push", str(tmp_path / "a"), "zoo/rotations")[0] == 0
    zoo = json.loads(repo["commits"][repo["branches"]["main"]]["zoo.json"])
    assert [m["subfolder"] for m in zoo["models"]] == ["alpha-1b", "beta-2b-per-layer"]


def test_pull_of_altered_file_fails_and_leaves_destination_untouched(hf_hub, artifacts, tmp_path):
    assert run_cli("push", str(artifacts), "zoo/rotations")[0] == 0
    fresh = tmp_path / "fresh"
    data = bytearray((artifacts / "rotations.safetensors").read_bytes())
    data[-5] ^= 0x01  # same size, one bit flipped
    hf_hub.state.tamper("zoo/rotations", "tiny-llama/rotations.safetensors", bytes(data))
    code, out, err = run_cli("pull", "zoo/rotations/tiny-llama", "--dest", str(fresh))
    assert code == 4, err
    assert "rotations.safetensors sha256" in err and "does not match" in err
    assert not fresh.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left behind
    # an earlier good pull in the destination survives a failed one byte for byte
    earlier = tmp_path / "earlier"
    make_artifacts(earlier, seed=9)
    before = _files(earlier)
    code, _, err = run_cli("pull", "zoo/rotations/tiny-llama", "--dest", str(earlier), "--force-download")
    assert code == 4, err
    assert _files(earlier) == before


def test_pull_refuses_a_foreign_folder(hf_hub, artifacts, tmp_path):
    assert run_cli("push", str(artifacts), "zoo/rotations")[0] == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, _, err = run_cli("pull", "zoo/rotations/tiny-llama", "--dest", str(mine))
    assert code == 2 and "nothing was changed" in err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_hub_failures_are_one_line_exit_5(hf_hub, artifacts, tmp_path):
    assert run_cli("push", str(artifacts), "zoo/rotations")[0] == 0
    cases = [
        (("pull", "zoo/missing/tiny-llama"), "repository not found"),
        (("pull", "zoo/rotations/tiny-llama", "--revision", "no-such-branch"), "revision not found"),
        (("pull", "zoo/rotations/other-model"), "has no manifest.json"),
    ]
    for args, text in cases:
        code, out, err = run_cli(*args, "--dest", str(tmp_path / "x"))
        assert code == 5, (args, err)
        assert text in err and "Traceback" not in err
        assert len(err.strip().splitlines()) <= 2  # error line + hint line
    hf_hub.stop()
    code, _, err = run_cli("pull", "zoo/rotations/tiny-llama", "--dest", str(tmp_path / "x"))
    assert code == 5 and "cannot reach" in err, err


def test_push_refuses_unverified_and_damaged_artifacts(hf_hub, tmp_path):
    make_artifacts(tmp_path / "raw", verification=None)
    code, _, err = run_cli("push", str(tmp_path / "raw"), "zoo/rotations")
    assert code == 3 and "not been verified" in err
    assert "zoo/rotations" not in hf_hub.state.repos
    code, _, err = run_cli("push", str(tmp_path / "raw"), "zoo/rotations", "--allow-unverified")
    assert code == 0, err
    card = hf_hub.state.repos["zoo/rotations"]["commits"][hf_hub.state.repos["zoo/rotations"]["branches"]["main"]]
    assert b"Not verified" in card["tiny-llama/README.md"]
    make_artifacts(tmp_path / "bad")
    with open(tmp_path / "bad" / "rotations.safetensors", "r+b") as f:
        f.seek(-3, 2)
        f.write(b"\x00\x01\x02")
    code, _, err = run_cli("push", str(tmp_path / "bad"), "zoo/other", "--allow-unverified")
    assert code == 4 and "rotations.safetensors" in err
    assert "zoo/other" not in hf_hub.state.repos


def test_dry_run_touches_no_network(hf_hub, artifacts, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    code, out, err = run_cli("push", str(artifacts), "zoo/rotations", "--dry-run", "--path-in-repo", "x/y")
    assert code == 0, err
    assert "would upload" in out and "x/y/rotations.safetensors" in out and "nothing was uploaded" in out
    assert hf_hub.state.requests == []


def test_model_card_renders_verification_table(hf_hub, artifacts):
    assert run_cli("push", str(artifacts), "zoo/rotations", "--path-in-repo", "")[0] == 0
    repo = hf_hub.state.repos["zoo/rotations"]
    head = repo["commits"][repo["branches"]["main"]]
    card = head["README.md"].decode()  # single-model repo: the model card sits at the root
    assert card.startswith("---\nbase_model:\n- \"org/Tiny-Llama\"\nlibrary_name: oscar-zoo\ntags:\n")
    # manifest JSON is canonical (sorted keys): methods come back sorted, metrics kl/top1/ppl_increase first
    assert "| method | kl | top1 | ppl_increase | bits_per_element |" in card
    assert "\n| naive-int2 | 1.52 | 0.41 | 3.2 | 2.5 |" in card and "\n| oscar | 0.0123 | 0.981 | 0.021 | 2.5 |" in card
    assert "Summary: **✓ +2.1 % PPL, KL 0.012**" in card
    assert "oscar-zoo pull zoo/rotations --dest rotations/" in card
    assert "| 128K | 4.03 |" in card  # G = head_dim 16 here: 2 + 32/16 bits, plus the BF16 windows
    assert json.loads(head["zoo.json"])["models"][0]["subfolder"] == ""


def test_concurrent_commit_is_a_clear_error(hf_hub, artifacts, tmp_path):
    from oscar_zoo.errors import HubError
    from oscar_zoo.hub.huggingface import HuggingFaceHub
    from oscar_zoo.hub.publish import plan_push, push

    class Racing(HuggingFaceHub):
        def head(self, repo_id, revision):
            sha = super().head(repo_id, revision)  # someone else commits right after we pinned the parent
            HuggingFaceHub().commit(repo_id, {"other.txt": artifacts / "manifest.json"}, "other", None, None)
            return sha

    plan = plan_push(artifacts, "zoo/rotations", "hf", None, None, False, tmp_path)
    import pytest

    with pytest.raises(HubError, match="concurrent commit"):
        push(plan, private=False, workdir=tmp_path, client=Racing())
    repo = hf_hub.state.repos["zoo/rotations"]
    assert "zoo.json" not in repo["commits"][repo["branches"]["main"]]


def test_branch_revision_and_private_repo(hf_hub, artifacts, tmp_path):
    code, out, err = run_cli("push", str(artifacts), "zoo/private", "--private", "--revision", "v1", "--json")
    assert code == 0, err
    repo = hf_hub.state.repos["zoo/private"]
    assert repo["private"] and repo["branches"]["v1"] == json.loads(out)["commit"]
    assert "zoo.json" not in repo["commits"][repo["branches"]["main"]]
    code, _, err = run_cli("pull", "zoo/private/tiny-llama", "--revision", "v1", "--dest", str(tmp_path / "p"))
    assert code == 0, err


def test_verify_report_shape_renders():
    """The `verify` report stores methods as a list of {name, label, metrics..., lists}; lists are left out."""
    from oscar_zoo.hub.zoo import verification_rows, verification_summary

    report = {"context": 4096, "passed": False, "methods": [
        {"name": "bf16", "label": "BF16", "kl": 0.0, "top1": 1.0, "ppl_increase": 0.0, "layer_error": [0.0]},
        {"name": "oscar", "label": "OSCAR INT2", "kl": 0.02, "top1": 0.95, "ppl_increase": 0.03, "ppl": 9.1,
         "kl_by_position": [0.1, 0.2]}]}
    columns, rows = verification_rows(report)
    assert columns == ["kl", "top1", "ppl_increase", "ppl"]
    assert [name for name, _ in rows] == ["bf16", "oscar"]
    assert verification_summary(report) == "not a verify report"  # hand-written: no thresholds, no schema
