"""Writing an export's files into its `--out` folder all at once, or not at all.

`--out` may be a new folder or any existing one (the current folder too): export adds or replaces its own file names
there and leaves everything else alone, unlike an artifact folder, which is replaced whole (`artifacts.
write_artifacts`). Every file is first written completely into a staging folder (`artifacts.staging_folder`: beside
a new `--out`, which it then becomes by one rename; inside an existing one, so that the moves stay on its file
system), then moved into place; a file already there is set aside in the staging folder until every new one is in
place and put back if a move fails (if putting back fails too, the error names the staging folder, which is kept: it
holds the only copy; the files a killed run set aside are put back by the next export there). Bad destinations are
refused up front with one line (exit 2), having touched nothing: `--out` is a file or lies under one, cannot be
resolved, is not writable, or holds a folder under one of the names to write.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path

from ..artifacts import (
    atomic_write_bytes,
    folder_destination,
    remove_stale_staging,
    staging_folder,
    usual_mode,
    write_failure,
)
from ..errors import InputError

STAGING_NAME = "oscar-export"  # inside an existing --out, staging folders are named `.oscar-export.<host>-<pid>.…`
_SET_ASIDE = ".replaced"  # the files an export replaces wait here (inside the staging folder) until it succeeds


def check_out(out: Path, names: Collection[str], label: str = "--out") -> Path:
    """Resolve `out` and check that `names` can be written in it without a traceback or a partial result: a writable
    existing folder (none of `names` a folder in it) or one that can be made (`artifacts.folder_destination`).
    Returns the resolved path; InputError (exit 2) otherwise, having touched nothing."""
    resolved = folder_destination(out, label, "pick a new folder or an existing one")
    folders = [n for n in names if (resolved / n).is_dir() and not (resolved / n).is_symlink()]
    if folders:
        raise InputError(f"{label} {out} holds a folder named {folders[0]} where export writes a file; nothing was "
                         "changed", "move that folder away, or pick another --out")
    return resolved


def write_export_files(out: Path, files: Mapping[str, bytes], executable: Collection[str] = (),
                       label: str = "--out") -> Path:
    """Write `files` (name -> content) into the folder `out` atomically as a set: all of them or, on any failure,
    none (the files they replace are put back). Files get the usual modes (those in `executable` 0o777 less the
    umask). Returns the resolved folder."""
    dest = check_out(out, files, label)
    fresh = not dest.exists()
    anchor = dest if fresh else dest / STAGING_NAME  # staging_folder puts its folder beside its argument
    try:
        if fresh:
            dest.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(anchor, _put_back)
        stage = staging_folder(anchor, "tmp")
    except OSError as exc:
        raise (write_failure(exc, dest) or exc) from None
    try:
        for name, data in files.items():
            atomic_write_bytes(stage / name, data)
            if name in executable:
                usual_mode(stage / name, executable=True)
        if fresh and _rename_into_place(stage, dest):
            return dest
        _move_into(stage, dest, list(files), label, out)
    except _UndoFailed:
        raise  # the staging folder is kept: it holds the replaced files
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        raise (write_failure(exc, dest) or
               InputError(f"cannot write the export into {label} {out}: {exc.strerror or exc}; nothing was changed")) \
            from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    shutil.rmtree(stage, ignore_errors=True)
    return dest


def _put_back(stale: Path) -> bool:
    """A killed export's staging folder (inside --out): the files it had set aside go back where they were, undoing a
    run that never finished; True when the folder may then be deleted (False keeps it, and what it holds)."""
    aside = stale / _SET_ASIDE
    try:
        for name in os.listdir(aside) if aside.is_dir() else ():
            os.replace(aside / name, stale.parent / name)
    except OSError:
        return False
    return True


def _rename_into_place(stage: Path, dest: Path) -> bool:
    """Make the staging folder the new `dest` by one rename; False when `dest` appeared meanwhile (the files are then
    moved into it one by one)."""
    try:
        os.rename(stage, dest)  # replaces an empty folder made meanwhile, refuses a non-empty one
    except OSError:
        if dest.is_dir():
            return False
        raise
    return True


def _move_into(stage: Path, dest: Path, names: list[str], label: str, out: Path) -> None:
    """Move the staged `names` into the existing folder `dest`. Files they replace wait in the staging folder; on any
    failure every move made is undone (the new files taken back out, every file set aside put back). An undo that
    fails itself is an `_UndoFailed` naming the folder that still holds the replaced files (which is then kept)."""
    aside = stage / _SET_ASIDE
    aside.mkdir()
    placed: list[str] = []  # names whose new file may be in `dest`
    try:
        for name in names:
            target = dest / name
            if target.is_dir() and not target.is_symlink():  # made since check_out: never move a folder away
                raise InputError(f"{label} {out} holds a folder named {name} where export writes a file; nothing was "
                                 "changed", "move that folder away, or pick another --out")
            if os.path.lexists(target):
                os.replace(target, aside / name)
            placed.append(name)
            os.replace(stage / name, target)
    except BaseException:
        try:
            for name in reversed(placed):
                if not (stage / name).exists() and os.path.lexists(dest / name):
                    os.replace(dest / name, stage / name)
            for kept in os.listdir(aside):  # all of them: a file may be set aside before `placed` knows its name
                os.replace(aside / kept, dest / kept)
        except OSError as exc:
            raise _UndoFailed(f"writing the export into {label} {out} failed and could not be undone "
                              f"({exc.strerror or exc}): the files it replaced are in {aside}",
                              "move them back by hand") from None
        raise


class _UndoFailed(InputError):
    """An export whose undo failed: the staging folder holds the only copy of the replaced files and is kept."""
