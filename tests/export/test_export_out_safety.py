"""`oscar-zoo export --out`: a file already there under one of the export's names is replaced only when an earlier
export wrote it and nobody changed it since; anything else (the user's own files, a published `.pt`, an edited
`sglang.env`, a symlink) makes the export refuse with one line, exit 2, the folder byte for byte as it was. An artifact
folder, or a folder inside one, is never an export's --out."""

from __future__ import annotations

import io
import os

import pytest
import torch

from oscar_zoo.errors import InputError
from oscar_zoo.export import staging
from oscar_zoo.export.oscar_pt import K_FILE, V_FILE, read_oscar_pt
from oscar_zoo.export.sglang import ENV_FILE, LAUNCH_SCRIPT

from ..hub.helpers import make_artifacts, random_rotations

L, D, H_KV = 2, 16, 2


@pytest.fixture
def art(tmp_path):
    make_artifacts(tmp_path / "art", granularity="per-layer", L=L, H_kv=H_KV, D=D)
    return tmp_path / "art"


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): ("dir" if p.is_dir() and not p.is_symlink() else
                                               os.readlink(p) if p.is_symlink() else p.read_bytes())
            for p in sorted(folder.rglob("*"))}


def _refused(result, *names):
    code, out, err = result
    assert code == 2 and "Traceback" not in err, (out, err)
    lines = err.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["error", "hint"], err
    assert "nothing was changed" in lines[0], err
    for name in names:
        assert name in lines[0], err
    return lines[0]


def _published_pt(objective):
    """A reference `.pt` file as the published zoo ships it (not written by oscar-zoo)."""
    rot = random_rotations(L, 1, D, seed=7)[:, 0]
    buf = io.BytesIO()
    torch.save({"format_version": 1, "objective": objective, "source_grouping": "layer",
                "layers": {i: {"layer_id": i, "rotation": rot[i].clone(), "eigenvalues": torch.arange(D) * 1.0}
                           for i in range(L)}}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["sglang", "oscar-pt"])
def test_the_users_files_are_never_overwritten(art, run_cli, tmp_path, fmt):
    out = tmp_path / "serve"
    out.mkdir()
    (out / K_FILE).write_bytes(_published_pt("qqt_r_h_pbr"))  # downloaded from the published zoo
    (out / ENV_FILE).write_text("SGLANG_MY_OWN=1\n")
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    line = _refused(run_cli("export", art, "--format", fmt, "--out", out), K_FILE)
    assert (ENV_FILE in line) == (fmt == "sglang"), line
    assert _snapshot(out) == before


def test_an_export_replaces_its_own_files_but_not_edited_ones(art, run_cli, tmp_path):
    out = tmp_path / "serve"
    code, _, err = run_cli("export", art, "--format", "sglang", "--out", out)
    assert code == 0, err
    for name in (K_FILE, V_FILE, ENV_FILE, LAUNCH_SCRIPT):
        assert staging.written_by_export(out / name), name
    assert read_oscar_pt(out / K_FILE, "qqt_r_h_pbr").rotation.shape == (L, D, D)  # the mark changes nothing read
    code, _, err = run_cli("export", art, "--format", "sglang", "--out", out)  # the same again: replaced
    assert code == 0, err

    env = out / ENV_FILE
    env.write_text(env.read_text().replace("SGLANG_OSCAR_K_CLIP_RATIO=", "SGLANG_OSCAR_K_CLIP_RATIO=0.5 #"))
    before = _snapshot(out)
    _refused(run_cli("export", art, "--format", "sglang", "--out", out), ENV_FILE)
    assert _snapshot(out) == before
    code, _, err = run_cli("export", art, "--format", "oscar-pt", "--out", out)  # writes no sglang.env: fine
    assert code == 0, err
    assert env.read_bytes() == before[ENV_FILE]


def test_an_edited_pt_file_is_the_users(art, run_cli, tmp_path):
    out = tmp_path / "serve"
    assert run_cli("export", art, "--format", "oscar-pt", "--out", out)[0] == 0
    data = bytearray((out / V_FILE).read_bytes())
    data[len(data) // 2] ^= 1
    (out / V_FILE).write_bytes(bytes(data))
    before = _snapshot(out)
    _refused(run_cli("export", art, "--format", "oscar-pt", "--out", out), V_FILE)
    assert _snapshot(out) == before


def test_a_symlink_under_an_exports_name_is_not_followed_or_replaced(art, run_cli, tmp_path):
    out = tmp_path / "serve"
    assert run_cli("export", art, "--format", "oscar-pt", "--out", out)[0] == 0
    elsewhere = tmp_path / "elsewhere.pt"
    os.replace(out / K_FILE, elsewhere)  # an exported file, then linked back in by the user
    (out / K_FILE).symlink_to(elsewhere)
    before, target = _snapshot(out), elsewhere.read_bytes()
    _refused(run_cli("export", art, "--format", "oscar-pt", "--out", out), K_FILE)
    assert _snapshot(out) == before and elsewhere.read_bytes() == target


@pytest.mark.parametrize("where", ["itself", "inside", "inside-new", "another"])
def test_an_artifact_folder_is_never_the_out(art, run_cli, tmp_path, where, monkeypatch):
    other = tmp_path / "other"
    make_artifacts(other, granularity="per-layer", L=L, H_kv=H_KV, D=D, seed=3)
    (art / "sub").mkdir() if where == "inside" else None
    out = {"itself": art, "inside": art / "sub", "inside-new": art / "a" / "b", "another": other}[where]
    if where == "itself":
        monkeypatch.chdir(art)
        out = "."
    before, before_other = _snapshot(art), _snapshot(other)
    line = _refused(run_cli("export", art, "--format", "sglang", "--out", out), "artifact folder")
    assert _snapshot(art) == before and _snapshot(other) == before_other, line


def test_a_file_that_appears_after_the_check_is_not_overwritten(tmp_path, monkeypatch):
    """The user's file lands between the up-front check and the move: the move refuses and undoes itself."""
    out = tmp_path / "serve"
    out.mkdir()
    real = staging.check_out

    def late(*args, **kwargs):
        resolved = real(*args, **kwargs)
        (resolved / V_FILE).write_bytes(b"mine, written just now")
        return resolved

    monkeypatch.setattr(staging, "check_out", late)
    with pytest.raises(InputError, match=f"already holds {V_FILE}"):
        staging.write_export_files(out, {K_FILE: b"k", V_FILE: b"v"})
    assert sorted(p.name for p in out.iterdir()) == [V_FILE]
    assert (out / V_FILE).read_bytes() == b"mine, written just now"
