"""`pull --dest` on a disk that fills up (or under a file-size limit) while the files are copied out of the hub client's
cache: exit 2 with one line that names the destination being written, never the cached file being read, and no
destination or staging folder left behind."""

from __future__ import annotations

import errno
import os

import pytest

from .helpers import run_cli

SOURCE = "zoo/rotations/tiny-llama"


@pytest.fixture
def cached(hf_hub, artifacts, tmp_path):
    """Pushed, and pulled once so that every file is in the hub client's cache; returns that cache's folder."""
    code, _, err = run_cli("push", str(artifacts), "zoo/rotations")
    assert code == 0, err
    code, _, err = run_cli("pull", SOURCE, "--dest", str(tmp_path / "first"))
    assert code == 0, err
    return hf_hub


def _refused_naming_dest(result, dest, why):
    code, out, err = result
    assert code == 2 and "Traceback" not in err, (out, err)
    lines = err.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["error", "hint"], err
    assert why in lines[0], err
    named = lines[0].split("cannot write ", 1)[1].split(":")[0]
    assert named.startswith(str(dest.resolve()) + os.sep) or named == str(dest.resolve()), err
    assert ".pull" not in named, err  # the staging folder is shown as the destination it becomes
    assert not dest.exists()
    assert not [p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.")]


def test_a_full_disk_names_the_destination(cached, tmp_path, monkeypatch):
    """ENOSPC as the kernel reports it during `shutil.copyfile` (from its sendfile loop, which names both files)."""
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "sendfile", full)
    dest = tmp_path / "second"
    result = run_cli("pull", SOURCE, "--dest", str(dest))
    monkeypatch.undo()
    _refused_naming_dest(result, dest, "the disk is full")


def test_a_file_size_limit_names_the_destination(cached, tmp_path):
    from ..test_file_size_limit import file_size_limit

    dest = tmp_path / "second"
    with file_size_limit(1024):
        result = run_cli("pull", SOURCE, "--dest", str(dest))
    _refused_naming_dest(result, dest, "largest size allowed")
