"""Writing an export's files into its `--out` folder all at once, or not at all.

`--out` may be a new folder or any existing one (the current folder too) but an artifact folder or a folder inside
one: export adds its own file names there and leaves everything else alone, unlike an artifact folder, which is
replaced whole (`artifacts.write_artifacts`). A file already there under one of those names is replaced only if
export wrote it and nobody changed it since: every file export writes carries a mark with the sha256 of its content
(`stamp`: a comment line in a text file, the archive comment of a `.pt` zip, which torch.load ignores), and a file
whose mark is missing or does not match (`written_by_export`) is the user's: the export is refused (exit 2) before
anything is written, naming it.

Every file is first written completely into a staging folder (`artifacts.staging_folder`: beside a new `--out`,
which it then becomes by one rename; inside an existing one, so that the moves stay on its file system), then moved
into place; a file already there is set aside in the staging folder until every new one is in
place and put back if a move fails (if putting back fails too, the error names the staging folder, which is kept: it
holds the only copy; the files a killed run set aside are put back by the next export there). Bad destinations are
refused up front with one line (exit 2), having touched nothing: `--out` is a file or lies under one, cannot be
resolved, is not writable, or holds a folder under one of the names to write.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path

from ..artifacts import (
    EXPORT_STAGING,
    artifact_folder_problem,
    atomic_write_bytes,
    folder_destination,
    remove_stale_staging,
    staging_folder,
    usual_mode,
    write_failure,
)
from ..errors import InputError
from ..format.schema import MANIFEST_NAME

STAGING_NAME = EXPORT_STAGING  # inside an existing --out, staging folders are named `.oscar-export.<host>-<pid>.…`
_SET_ASIDE = ".replaced"  # the files an export replaces wait here (inside the staging folder) until it succeeds


def check_out(out: Path, names: Collection[str], label: str = "--out", source: Path | None = None) -> Path:
    """Resolve `out` and check that `names` can be written in it without a traceback, a partial result or a lost
    file: a writable existing folder or one that can be made (`artifacts.folder_destination`), neither an artifact
    folder nor inside one (`source`, the folder being exported, counts as one whatever it holds), none of `names` a
    folder in it, and none a file that export may not replace (`check_replaceable`). Returns the resolved path;
    InputError (exit 2) otherwise, having touched nothing."""
    resolved = folder_destination(out, label, "pick a new folder or an existing one")
    source = Path(source).expanduser().resolve() if source is not None else None
    for folder in (resolved, *resolved.parents):
        if folder == source or (folder / MANIFEST_NAME).is_file() and artifact_folder_problem(folder) is None:
            where = "is" if folder == resolved else f"lies inside {folder}, which is"
            what = "the artifact folder being exported" if folder == source else "an oscar-zoo artifact folder"
            raise InputError(f"{label} {out} {where} {what}: an artifact folder holds its manifest's files and "
                             "nothing else, so export does not write there; nothing was changed",
                             "pick a folder outside the artifact folder, e.g. a new one beside it")
    folders = [n for n in names if (resolved / n).is_dir() and not (resolved / n).is_symlink()]
    if folders:
        raise InputError(f"{label} {out} holds a folder named {folders[0]} where export writes a file; nothing was "
                         "changed", "move that folder away, or pick another --out")
    check_replaceable(resolved, names, label, out)
    return resolved


def check_replaceable(folder: Path, names: Collection[str], label: str, out: Path) -> None:
    """InputError (exit 2) naming the files among `names` in `folder` that export may not replace: any that export
    did not write, or that changed since (`written_by_export`)."""
    mine = [n for n in names if os.path.lexists(folder / n) and not written_by_export(folder / n)]
    if mine:
        shown = ", ".join(mine[:4]) + (", …" if len(mine) > 4 else "")
        raise InputError(f"{label} {out} already holds {shown}, which export did not write (or which changed since "
                         "it did); export does not overwrite them; nothing was changed",
                         "move them away (or delete them), or pick another --out")


# -- the mark every exported file carries ------------------------------------------------------------------------------
_MARK = b"oscar-zoo export sha256 "  # + 64 hex digits: the sha256 of the file's content without its mark
_MARK_LINE = b"# written by " + _MARK  # a text file's mark: a comment line, the first after any `#!` line
_ZIP_END = b"PK\x05\x06"  # the zip end-of-central-directory record: 22 bytes, its last 2 the comment's length
_ZIP_END_SIZE = 22
_MARK_SIZE = len(_MARK) + 64


def stamp(data: bytes) -> bytes:
    """`data` with a mark saying export wrote it (`written_by_export` checks it): a zip archive (torch.save's `.pt`)
    gets it as the archive comment, which zip readers and torch.load ignore; text gets a `# …` line, after the `#!`
    line of a script."""
    digest = hashlib.sha256(data).hexdigest().encode()
    end = data[-_ZIP_END_SIZE:]
    if data.startswith(b"PK\x03\x04") and end.startswith(_ZIP_END) and end[-2:] == b"\0\0":
        return data[:-2] + _MARK_SIZE.to_bytes(2, "little") + _MARK + digest
    line = _MARK_LINE + digest + b"\n"
    if data.startswith(b"#!") and b"\n" in data:
        first, rest = data.split(b"\n", 1)
        return first + b"\n" + line + rest
    return line + data


def written_by_export(path: Path) -> bool:
    """Whether `path` is a regular file (not a symlink) that carries export's mark (`stamp`) with the sha256 of its
    content: a file export wrote and nobody changed since. Reads at most the file once; False on any OSError."""
    try:
        if not os.path.isfile(path) or os.path.islink(path):
            return False
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size >= _ZIP_END_SIZE + _MARK_SIZE:  # a zip with the mark as its comment?
                f.seek(size - _ZIP_END_SIZE - _MARK_SIZE)
                end = f.read()
                comment_size = end[_ZIP_END_SIZE - 2:_ZIP_END_SIZE]
                if end.startswith(_ZIP_END) and comment_size == _MARK_SIZE.to_bytes(2, "little") \
                        and end[_ZIP_END_SIZE:].startswith(_MARK):
                    f.seek(0)
                    digest = _sha256_of(f, size - _MARK_SIZE - 2)
                    digest.update(b"\0\0")
                    return digest.hexdigest().encode() == end[-64:]
            f.seek(0)
            head = f.readline(4096)
            if head.startswith(b"#!"):
                line = f.readline(len(_MARK_LINE) + 66)
            else:
                head, line = b"", head
            if not (line.startswith(_MARK_LINE) and len(line) == len(_MARK_LINE) + 65 and line.endswith(b"\n")):
                return False
            digest = hashlib.sha256(head)
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
            return digest.hexdigest().encode() == line[len(_MARK_LINE):-1]
    except OSError:
        return False


def _sha256_of(f, nbytes: int):
    """sha256 of the next `nbytes` bytes of the open file `f`."""
    digest = hashlib.sha256()
    while nbytes > 0:
        chunk = f.read(min(nbytes, 1 << 20))
        if not chunk:
            break
        digest.update(chunk)
        nbytes -= len(chunk)
    return digest


def write_export_files(out: Path, files: Mapping[str, bytes], executable: Collection[str] = (),
                       label: str = "--out", source: Path | None = None) -> Path:
    """Write `files` (name -> content) into the folder `out` atomically as a set: all of them or, on any failure,
    none (the files they replace are put back). Files get the usual modes (those in `executable` 0o777 less the
    umask). Every file is marked as export's (`stamp`); a file of the same name already in `out` is replaced only
    when it carries that mark unchanged (`check_out`). Returns the resolved folder."""
    dest = check_out(out, files, label, source)
    files = {name: stamp(data) for name, data in files.items()}
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
    run that never finished; True when the folder may then be deleted (False keeps it, and what it holds). Export sets
    aside only files it wrote, so only a file with export's mark goes back, and only over nothing or over another file
    with the mark (the dead run's new one): never over a user's file, whatever a staging folder holds."""
    aside = stale / _SET_ASIDE
    kept = False
    try:
        for name in os.listdir(aside) if aside.is_dir() else ():
            home = stale.parent / name
            if written_by_export(aside / name) and (not os.path.lexists(home) or written_by_export(home)):
                os.replace(aside / name, home)
            else:
                kept = True
    except OSError:
        return False
    return not kept


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
                check_replaceable(dest, [name], label, out)  # again: the file may have been replaced since
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
