"""Catalog resolution, offline pulls from the hub cache, and token hygiene."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from oscar_zoo.format.schema import Manifest
from oscar_zoo.hub.catalog import CatalogEntry, HubLocation, manifest_sha256

from .helpers import HF_TOKEN, run_cli

REPO_ROOT = Path(__file__).resolve().parents[2]


def _catalog_entry(folder: Path, artifacts: Path, name: str, repo: str, sub: str, revision: str | None = None,
                   published: bool = True) -> None:
    manifest = Manifest.from_json((artifacts / "manifest.json").read_text())
    entry = CatalogEntry(name=name, description="test entry", manifest=manifest,
                         manifest_sha256=manifest_sha256(manifest),
                         locations=[HubLocation(hub="hf", repo_id=repo, subfolder=sub, revision=revision,
                                                published=published)])
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.json").write_text(entry.to_json())


def test_pull_by_catalog_name(hf_hub, artifacts, tmp_path, monkeypatch):
    code, out, _ = run_cli("push", str(artifacts), "zoo/rotations", "--json")
    commit = json.loads(out)["commit"]
    catalog = tmp_path / "catalog"
    _catalog_entry(catalog, artifacts, "tiny-llama", "zoo/rotations", "tiny-llama", revision=commit)
    _catalog_entry(catalog, artifacts, "planned", "zoo/later", "x", published=False)
    monkeypatch.setenv("OSCAR_ZOO_CATALOG", str(catalog))
    code, out, err = run_cli("pull", "tiny-llama", "--dest", str(tmp_path / "p"), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["catalog_name"] == "tiny-llama" and result["commit"] == commit
    assert (tmp_path / "p" / "manifest.json").read_bytes() == (artifacts / "manifest.json").read_bytes()
    code, _, err = run_cli("pull", "planned", "--dest", str(tmp_path / "q"))
    assert code == 2 and "not published yet" in err
    code, out, err = run_cli("list")
    # the table may wrap the cell "(planned, not published)" between any two of its words, whatever the width
    assert code == 0 and "tiny-llama" in out and "(planned," in out and "published)" in out
    listed = json.loads(run_cli("list", "--json")[1])
    assert [e["name"] for e in listed] == ["planned", "tiny-llama"]
    assert listed[1]["verification"] == "✓ +2.1 % PPL, KL 0.012"
    # the catalog pins content: a manifest that changed on the hub after cataloguing is refused
    other = tmp_path / "other-catalog"
    _catalog_entry(other, artifacts, "tiny-llama", "zoo/rotations", "tiny-llama")
    data = json.loads((other / "tiny-llama.json").read_text())
    data["manifest"]["calibration"]["seed"] = 1
    import hashlib

    from oscar_zoo.format.records import canonical_json

    data["manifest_sha256"] = hashlib.sha256(canonical_json(data["manifest"]).encode()).hexdigest()
    (other / "tiny-llama.json").write_text(json.dumps(data))
    monkeypatch.setenv("OSCAR_ZOO_CATALOG", str(other))
    code, _, err = run_cli("pull", "tiny-llama", "--dest", str(tmp_path / "r"))
    assert code == 4 and "differs from the catalog" in err


def test_pull_offline_from_cache_with_server_stopped(hf_hub, artifacts, tmp_path, hub_env):
    assert run_cli("push", str(artifacts), "zoo/rotations")[0] == 0
    assert run_cli("pull", "zoo/rotations/tiny-llama", "--dest", str(tmp_path / "online"))[0] == 0
    hf_hub.stop()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(hub_env), "HF_ENDPOINT": hf_hub.url,
           "COLUMNS": "200"}
    env.pop("HF_TOKEN", None)
    proc = subprocess.run([sys.executable, "-m", "oscar_zoo", "pull", "zoo/rotations/tiny-llama", "--dest",
                           str(tmp_path / "offline"), "--json"], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=900)  # a hang guard
    assert proc.returncode == 0, proc.stderr
    for name in ("manifest.json", "rotations.safetensors"):
        assert (tmp_path / "offline" / name).read_bytes() == (artifacts / name).read_bytes()
    # a repo never pulled is a clear offline error, not a traceback
    proc = subprocess.run([sys.executable, "-m", "oscar_zoo", "pull", "zoo/never/x", "--dest",
                           str(tmp_path / "none")], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=900)  # a hang guard
    assert proc.returncode == 5 and "not in the cache" in proc.stderr and "Traceback" not in proc.stderr


def test_no_token_ever_appears_in_output_or_files(hf_hub, artifacts, tmp_path, monkeypatch):
    outputs = []
    outputs += run_cli("push", str(artifacts), "zoo/rotations", "--json")[1:]
    outputs += run_cli("push", str(artifacts), "zoo/rotations")[1:]
    outputs += run_cli("pull", "zoo/rotations/tiny-llama", "--dest", str(tmp_path / "p"), "--json")[1:]
    outputs += run_cli("pull", "zoo/rotations/missing", "--dest", str(tmp_path / "q"))[1:]
    monkeypatch.setenv("HF_TOKEN", "hf_WrongTokenAlsoSecret42424242")
    code, out, err = run_cli("push", str(artifacts), "zoo/rotations")
    assert code == 5 and "rejected the token" in err
    outputs += [out, err]
    monkeypatch.delenv("HF_TOKEN")
    code, out, err = run_cli("push", str(artifacts), "zoo/new")
    assert code == 5 and "no hf token" in err and "HF_TOKEN" in err
    outputs += [out, err]
    for text in outputs:
        assert HF_TOKEN not in text and "hf_WrongTokenAlsoSecret42424242" not in text
        assert "Bearer" not in text
    repo = hf_hub.state.repos["zoo/rotations"]
    for commit in repo["commits"].values():
        for data in commit.values():
            assert HF_TOKEN.encode() not in data
    for path in (tmp_path / "p").rglob("*"):
        if path.is_file():
            assert HF_TOKEN.encode() not in path.read_bytes()


def test_redaction_of_hub_messages():
    from oscar_zoo.hub.base import redact

    text = "401 for url with header Authorization: Bearer hf_abcdef123456 and cookie m_session_id=secret123; x"
    cleaned = redact(text, ["hf_abcdef123456"])
    assert "hf_abcdef123456" not in cleaned and "secret123" not in cleaned
