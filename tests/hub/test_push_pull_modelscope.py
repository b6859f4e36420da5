"""Push and pull through the real `modelscope` HubApi against a ModelScope-compatible server on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from .helpers import MS_TOKEN, make_artifacts, run_cli


@pytest.fixture(autouse=True)
def fast_integrity_retries(monkeypatch):
    """The client retries a hash mismatch with 1 s, 2 s backoff, and a failed write (EFBIG under `ulimit -f`) five times
    6 s apart; the tests need the verdict, not the wait."""
    import modelscope_hub._download as download

    monkeypatch.setattr(download, "DOWNLOAD_INTEGRITY_RETRY_BACKOFF", 0.01)
    monkeypatch.setattr(download, "DOWNLOAD_RETRY_MAX_DELAY_SECONDS", 0.01)


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_modelscope_round_trip_and_zoo(ms_hub, artifacts, tmp_path):
    code, out, err = run_cli("push", str(artifacts), "zoo/rotations", "--hub", "modelscope", "--json")
    assert code == 0, err
    assert json.loads(out)["commit"] == ms_hub.state.commits[-1]  # stdout is pure JSON (the client's report muted)
    files = ms_hub.state.repos["zoo/rotations"]["branches"]["master"]
    assert sorted(files) == ["README.md", "tiny-llama/README.md", "tiny-llama/manifest.json",
                             "tiny-llama/rotations.safetensors", "zoo.json"]
    assert len(ms_hub.state.commits) == 1  # one commit for all files
    assert len(ms_hub.state.blobs) == 1  # the safetensors went through the LFS batch + PUT path
    code, out, err = run_cli("pull", "zoo/rotations/tiny-llama", "--hub", "modelscope", "--dest",
                             str(tmp_path / "pulled"))
    assert code == 0, err
    assert _files(tmp_path / "pulled") == _files(artifacts)
    make_artifacts(tmp_path / "b", model_id="org/Beta-2B", seed=4)
    assert run_cli("push", str(tmp_path / "b"), "zoo/rotations", "--hub", "modelscope")[0] == 0
    zoo = json.loads(ms_hub.state.repos["zoo/rotations"]["branches"]["master"]["zoo.json"])
    assert [m["subfolder"] for m in zoo["models"]] == ["beta-2b", "tiny-llama"]


def test_modelscope_altered_file_is_refused(ms_hub, artifacts, tmp_path):
    assert run_cli("push", str(artifacts), "zoo/rotations", "--hub", "modelscope")[0] == 0
    data = bytearray(ms_hub.state.repos["zoo/rotations"]["branches"]["master"]["tiny-llama/rotations.safetensors"])
    data[-7] ^= 0x10
    ms_hub.state.tamper("zoo/rotations", "tiny-llama/rotations.safetensors", bytes(data))
    code, _, err = run_cli("pull", "zoo/rotations/tiny-llama", "--hub", "modelscope", "--dest", str(tmp_path / "d"))
    assert code == 4, err
    assert "does not match the manifest" in err
    assert not (tmp_path / "d").exists()


def test_modelscope_errors_and_tokens(ms_hub, artifacts, tmp_path, monkeypatch):
    outputs = list(run_cli("push", str(artifacts), "zoo/rotations", "--hub", "modelscope")[1:])
    code, out, err = run_cli("pull", "zoo/nothing/x", "--hub", "modelscope", "--dest", str(tmp_path / "n"))
    assert code == 5 and "not found" in err, err
    outputs += [out, err]
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", "ms-WrongSecretToken-1234567")
    code, out, err = run_cli("push", str(artifacts), "zoo/rotations", "--hub", "modelscope")
    assert code == 5 and "rejected the token" in err, err
    outputs += [out, err]
    monkeypatch.delenv("MODELSCOPE_API_TOKEN")
    code, out, err = run_cli("push", str(artifacts), "zoo/rotations", "--hub", "modelscope")
    assert code == 5 and "MODELSCOPE_API_TOKEN" in err
    outputs += [out, err]
    for text in outputs:
        assert MS_TOKEN not in text and "ms-WrongSecretToken-1234567" not in text


def test_modelscope_pull_under_a_file_size_limit(ms_hub, artifacts, tmp_path):
    """`ulimit -f` below the rotations' size: the client's failed cache write is exit 2 with one line, not a hub
    error, and no destination is left."""
    from ..test_file_size_limit import file_size_limit, refused

    assert run_cli("push", str(artifacts), "zoo/rotations", "--hub", "modelscope")[0] == 0
    with file_size_limit(1024):
        result = run_cli("pull", "zoo/rotations/tiny-llama", "--hub", "modelscope", "--dest", str(tmp_path / "p"))
    refused(result, tmp_path / "p")
