"""What a pull refuses, and that it refuses before (or while) downloading and keeps nothing of a refused file, neither
in the destination nor in the hub client's cache: files outside the artifact format, a manifest too large to be one,
a size that differs from the manifest's, a body that keeps coming past it, and bytes whose sha256 differs."""

from __future__ import annotations

import json

import pytest

from .helpers import run_cli

REPO, SUB = "zoo/rotations", "tiny-llama"
SOURCE = f"{REPO}/{SUB}"


@pytest.fixture(autouse=True)
def fast_integrity_retries(monkeypatch):
    """The ModelScope client retries a mismatch with 1 s, 2 s backoff; the tests need the verdict, not the wait."""
    import modelscope_hub._download as download

    monkeypatch.setattr(download, "DOWNLOAD_INTEGRITY_RETRY_BACKOFF", 0.01)


def _cached(root, data: bytes) -> list[str]:
    """Files under a hub cache whose bytes are `data` (symlinks followed once: snapshot entries point at blobs)."""
    return [str(p) for p in root.rglob("*") if p.is_file() and p.stat().st_size == len(data) and p.read_bytes() == data]


def _hf_files(hf_hub):
    repo = hf_hub.state.repos[REPO]
    return repo["commits"][repo["branches"]["main"]]


@pytest.fixture
def pushed_hf(hf_hub, artifacts):
    assert run_cli("push", str(artifacts), REPO)[0] == 0
    return _hf_files(hf_hub)


@pytest.mark.parametrize("extra", ["payload.pkl", "install.sh", "../../.bashrc", "README.md"])
def test_a_manifest_listing_files_outside_the_format_is_refused_before_any_download(hf_hub, pushed_hf, hub_env,
                                                                                      tmp_path, extra):
    manifest = json.loads(pushed_hf[f"{SUB}/manifest.json"])
    manifest["artifacts"].append({"path": extra, "sha256": "0" * 64, "bytes": 150 << 20})
    bad = json.dumps(manifest).encode()
    hf_hub.state.tamper(REPO, f"{SUB}/manifest.json", bad)
    hf_hub.state.requests.clear()
    code, _, err = run_cli("pull", SOURCE, "--dest", str(tmp_path / "dest"))
    assert code == 4, err
    assert "not a file of the oscar-zoo artifact format" in err and "Traceback" not in err
    assert not (tmp_path / "dest").exists()
    assert [r for r in hf_hub.state.requests if "/resolve/" in r and "manifest.json" not in r] == []
    assert _cached(hub_env / "hub", bad) == []  # the refused manifest is not kept either


def test_a_rotations_size_the_tensors_cannot_take_is_refused_before_any_download(hf_hub, pushed_hf, hub_env,
                                                                                   tmp_path):
    manifest = json.loads(pushed_hf[f"{SUB}/manifest.json"])
    manifest["artifacts"][0]["bytes"] = 150 << 30  # a repo file of that size would be downloaded, then hashed
    hf_hub.state.tamper(REPO, f"{SUB}/manifest.json", json.dumps(manifest).encode())
    hf_hub.state.requests.clear()
    code, _, err = run_cli("pull", SOURCE, "--dest", str(tmp_path / "dest"))
    assert code == 4 and "but the tensors it describes take" in err and "Traceback" not in err, err
    assert not (tmp_path / "dest").exists()
    assert [r for r in hf_hub.state.requests if "/resolve/" in r and "manifest.json" not in r] == []


def test_a_manifest_too_large_to_be_one_is_not_downloaded(hf_hub, pushed_hf, hub_env, tmp_path):
    hf_hub.state.tamper(REPO, f"{SUB}/manifest.json", b" " * (2 << 20))
    hf_hub.state.requests.clear()
    code, _, err = run_cli("pull", SOURCE, "--dest", str(tmp_path / "dest"))
    assert code == 4 and "too many for a manifest" in err, err
    assert [r for r in hf_hub.state.requests if "/resolve/" in r] == []


def test_a_size_that_differs_from_the_manifest_is_refused_before_downloading(hf_hub, pushed_hf, hub_env, tmp_path):
    bigger = pushed_hf[f"{SUB}/rotations.safetensors"] + b"\0" * (1 << 20)
    hf_hub.state.tamper(REPO, f"{SUB}/rotations.safetensors", bigger)
    hf_hub.state.requests.clear()
    code, _, err = run_cli("pull", SOURCE, "--dest", str(tmp_path / "dest"))
    assert code == 4, err
    assert "bytes on the hub, the manifest says" in err and "nothing was downloaded" in err
    assert [r for r in hf_hub.state.requests if "rotations.safetensors" in r] == []
    assert not (tmp_path / "dest").exists() and _cached(hub_env / "hub", bigger) == []


def test_a_body_that_keeps_coming_is_cut_at_the_manifest_size(hf_hub, pushed_hf, hub_env, tmp_path):
    """The listing and the HEAD tell the truth, the GET streams 64 MiB more with no Content-Length."""
    honest = pushed_hf[f"{SUB}/rotations.safetensors"]
    flood = honest + b"\0" * (64 << 20)
    hf_hub.state.overlong[f"{SUB}/rotations.safetensors"] = flood
    code, _, err = run_cli("pull", SOURCE, "--dest", str(tmp_path / "dest"))
    assert code == 4, err
    assert "more than the" in err and "bytes the manifest allows" in err
    assert hf_hub.state.sent[f"{SUB}/rotations.safetensors"] < len(flood) // 2  # stopped early, not after the flood
    assert not (tmp_path / "dest").exists()
    leftovers = [p for p in (hub_env / "hub").rglob("*")
                 if p.is_file() and (p.name.endswith(".incomplete") or p.stat().st_size >= len(honest))]
    assert leftovers == []


def test_altered_bytes_of_the_right_size_leave_nothing_in_the_cache(hf_hub, pushed_hf, hub_env, tmp_path):
    good = pushed_hf[f"{SUB}/rotations.safetensors"]
    altered = bytearray(good)
    altered[-5] ^= 0x01
    hf_hub.state.tamper(REPO, f"{SUB}/rotations.safetensors", bytes(altered))
    code, _, err = run_cli("pull", SOURCE, "--dest", str(tmp_path / "dest"))
    assert code == 4 and "does not match" in err, err
    assert _cached(hub_env / "hub", bytes(altered)) == []
    # once the hub serves the right bytes again, a plain pull (no --force-download) gets them: nothing bad was cached
    hf_hub.state.tamper(REPO, f"{SUB}/rotations.safetensors", good)
    code, _, err = run_cli("pull", SOURCE, "--dest", str(tmp_path / "dest"))
    assert code == 0, err
    assert (tmp_path / "dest" / "rotations.safetensors").read_bytes() == good


def test_modelscope_refuses_outside_files_and_wrong_sizes_before_downloading(ms_hub, artifacts, hub_env, tmp_path):
    assert run_cli("push", str(artifacts), REPO, "--hub", "modelscope")[0] == 0
    files = ms_hub.state.repos[REPO]["branches"]["master"]
    original = files[f"{SUB}/manifest.json"]
    manifest = json.loads(original)
    manifest["artifacts"].append({"path": "payload.pkl", "sha256": "0" * 64, "bytes": 10})
    ms_hub.state.tamper(REPO, f"{SUB}/manifest.json", json.dumps(manifest).encode())
    ms_hub.state.requests.clear()
    code, _, err = run_cli("pull", SOURCE, "--hub", "modelscope", "--dest", str(tmp_path / "d"))
    assert code == 4 and "not a file of the oscar-zoo artifact format" in err, err

    ms_hub.state.tamper(REPO, f"{SUB}/manifest.json", original)
    bigger = files[f"{SUB}/rotations.safetensors"] + b"\0" * 4096
    ms_hub.state.tamper(REPO, f"{SUB}/rotations.safetensors", bigger)
    ms_hub.state.requests.clear()
    code, _, err = run_cli("pull", SOURCE, "--hub", "modelscope", "--dest", str(tmp_path / "d"))
    assert code == 4 and "bytes on the hub, the manifest says" in err, err
    downloads = [r for r in ms_hub.state.requests if r.endswith("/repo")]
    assert len(downloads) == 1  # the manifest only
    assert not (tmp_path / "d").exists() and _cached(tmp_path / "ms-cache", bigger) == []
