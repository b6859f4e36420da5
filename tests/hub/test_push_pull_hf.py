"""Push and pull through the real huggingface_hub client against a Hub-compatible server on 127.0.0.1."""

from __future__ import annotations

import json

from .helpers import HF_TOKEN, make_artifacts, run_cli


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_push_pull_round_trip_is_byte_identical(hf_hub, artifacts, tmp_path):
    code, out, err = run_cli("push", str(artifacts), "zoo/rotations", "--json")
    assert code == 0, err
    pushed = json.loads(out)
    assert pushed["subfolder"] == "tiny-llama"
    repo = hf_hub.state.repos["zoo/rotations"]
    head = repo["commits"][repo["branches"]["main"]]
    assert sorted(head) == [".gitattributes", "README.md", "tiny-llama/README.md", "tiny-llama/manifest.json",
                            "tiny-llama/rotations.safetensors", "zoo.json"]
    code, out, err = run_cli("pull", "zoo/rotations/tiny-llama", "--dest", str(tmp_path / "pulled"), "--json")
    assert code == 0, err
    assert json.loads(out)["commit"] == pushed["commit"]
    assert _files(tmp_path / "pulled") == _files(artifacts)
