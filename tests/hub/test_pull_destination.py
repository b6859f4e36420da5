"""`pull --dest`: only an earlier pull (or calibrate) is ever replaced, recognised by its content, not by a file name;
a symlinked destination keeps its link; staging folders of killed pulls are cleaned by the next pull."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from .helpers import make_artifacts, run_cli

SOURCE = "zoo/rotations/tiny-llama"


def _tree(folder):
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None) for p in folder.rglob("*")}


@pytest.fixture
def pushed(hf_hub, artifacts):
    code, _, err = run_cli("push", str(artifacts), "zoo/rotations")
    assert code == 0, err
    return artifacts


def test_a_file_named_manifest_json_does_not_make_a_folder_replaceable(pushed, tmp_path):
    manifest, rotations = (pushed / "manifest.json").read_bytes(), (pushed / "rotations.safetensors").read_bytes()
    cases = {
        "junk manifest": {"manifest.json": b"{}", "thesis.tex": b"t\n"},
        "valid manifest plus a file of yours": {"manifest.json": manifest, "rotations.safetensors": rotations,
                                                "notes.txt": b"keep me"},
        "valid manifest, listed file missing": {"manifest.json": manifest, "sub/data.bin": b"mine"},
    }
    for name, files in cases.items():
        dest = tmp_path / name.replace(" ", "-").replace(",", "")
        for rel, data in files.items():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(data)
        before = _tree(dest)
        code, _, err = run_cli("pull", SOURCE, "--dest", str(dest))
        assert code == 2, (name, err)
        assert "not an oscar-zoo artifact folder" in err and "nothing was changed" in err, (name, err)
        assert _tree(dest) == before, name
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_an_earlier_pull_is_replaced(pushed, tmp_path):
    dest = tmp_path / "rot"
    make_artifacts(dest, seed=5)  # an earlier artifact folder with other rotations
    code, _, err = run_cli("pull", SOURCE, "--dest", str(dest))
    assert code == 0, err
    assert _tree(dest) == _tree(pushed)
    code, _, err = run_cli("pull", SOURCE, "--dest", str(dest))  # and a pull replaces itself
    assert code == 0, err


def test_symlinked_dest_replaces_its_target_and_leaves_nothing_beside_it(pushed, tmp_path):
    target = tmp_path / "store" / "rot"
    make_artifacts(target, seed=5)
    link = tmp_path / "links" / "rot"
    link.parent.mkdir()
    link.symlink_to(target)
    code, _, err = run_cli("pull", SOURCE, "--dest", str(link))
    assert code == 0, err
    assert link.is_symlink() and link.resolve() == target.resolve() and _tree(target) == _tree(pushed)
    assert [p.name for p in link.parent.iterdir()] == ["rot"]
    assert [p.name for p in target.parent.iterdir()] == ["rot"]


def test_staging_folders_of_killed_pulls_are_cleaned(pushed, tmp_path):
    from oscar_zoo.artifacts import staging_folder

    dest = tmp_path / "rot"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = staging_folder(dest, "pull")  # as a pull killed mid-copy leaves it, but owned by a dead process
    stale = leftover.with_name(leftover.name.replace(f"-{os.getpid()}.", f"-{dead.stdout.strip()}."))
    leftover.rename(stale)
    (stale / "rotations.safetensors").write_bytes(b"half a file")
    live = staging_folder(dest, "pull")  # this process is alive: its folder is not touched
    other = tmp_path / ".rot.somebody-else.pull"  # not a name oscar-zoo makes: left alone
    other.mkdir()
    code, _, err = run_cli("pull", SOURCE, "--dest", str(dest))
    assert code == 0, err
    assert not stale.exists() and live.is_dir() and other.is_dir()
    shutil.rmtree(live)


def test_pull_under_a_file_size_limit(pushed, tmp_path):
    """`ulimit -f` (RLIMIT_FSIZE) below the rotations' size: exit 2 with one line, no destination, no staging folder."""
    from ..test_file_size_limit import file_size_limit, refused

    assert (pushed / "rotations.safetensors").stat().st_size > 1024
    dest = tmp_path / "limited"
    with file_size_limit(1024):
        result = run_cli("pull", SOURCE, "--dest", str(dest))
    refused(result, dest)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
