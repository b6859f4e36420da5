"""Artifact folders, pulled folders and exports get the usual modes (files 0o666, folders 0o777, less the umask), not
the 0o600 / 0o700 of the temp files they are built from (issue 16)."""

import os
import stat

import pytest

from .helpers import make_artifacts, run_cli


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _modes(folder):
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.iterdir()]}


def test_written_pulled_and_exported_folders_have_the_usual_modes(hf_hub, tmp_path, umask_022):
    art = tmp_path / "art"
    make_artifacts(art, granularity="per-layer")
    assert _modes(art) == {"art": 0o755, "manifest.json": 0o644, "rotations.safetensors": 0o644}

    assert run_cli("push", str(art), "zoo/rotations")[0] == 0
    code, _, err = run_cli("pull", "zoo/rotations/tiny-llama-per-layer", "--dest", str(tmp_path / "pulled"))
    assert code == 0, err
    assert _modes(tmp_path / "pulled") == {"pulled": 0o755, "manifest.json": 0o644, "rotations.safetensors": 0o644}

    code, _, err = run_cli("export", str(art), "--format", "sglang", "--out", str(tmp_path / "sg"))
    assert code == 0, err
    assert _modes(tmp_path / "sg") == {"sg": 0o755, "k_rotation_qqt_r_h_pbr.pt": 0o644,
                                       "v_rotation_sst_r_h_pbr.pt": 0o644, "sglang.env": 0o644,
                                       "launch_sglang.sh": 0o755}
