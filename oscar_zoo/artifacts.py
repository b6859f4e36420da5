"""Artifact folders: atomic writes, sha256 of every file, manifest ↔ files ↔ model consistency, safetensors I/O.

Nothing is pickled. Loading (`load_artifacts`) is the format's one reader (`format.io.read_artifact`: the manifest's
schema, every listed file's size and sha256, the tensors against the format and the manifest, their values), the
runtime's too; a model is checked against the manifest by `check_model_matches`. Writing replaces a destination
only if it is absent, empty, or recognisably an artifact folder (`check_destination`): never someone else's files.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import math
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from .errors import InputError, IntegrityError
from .format import io
from .format.io import sha256_file
from .format.schema import MANIFEST_NAME, ROTATIONS_NAME, ArtifactFile, Manifest
from .format.validate import MEAN_NAMES, TENSOR_NAMES


@dataclass(frozen=True)
class Rotations:
    """The tensors of `rotations.safetensors`; L layers, H = H_kv (per-head) or 1 (per-layer), D head dim."""

    k_rotation: torch.Tensor  # float32 [L, H, D, D]
    v_rotation: torch.Tensor  # float32 [L, H, D, D]
    k_eigenvalues: torch.Tensor  # float32 [L, H, D], ascending
    v_eigenvalues: torch.Tensor  # float32 [L, H, D], ascending
    k_clip: torch.Tensor  # float32 [L, H]
    v_clip: torch.Tensor  # float32 [L, H]
    layer_ids: torch.Tensor  # int32 [L]
    k_mean: torch.Tensor | None = None  # float32 [L, H, D]: the centred codec's key mean (schema 2, centring "mean")
    v_mean: torch.Tensor | None = None  # float32 [L, H, D]: its value mean; both None for an uncentred artifact

    @property
    def centred(self) -> bool:
        return self.k_mean is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        names = (*TENSOR_NAMES, *(n for n in MEAN_NAMES if getattr(self, n) is not None))
        return {name: getattr(self, name).contiguous() for name in names}


# -- writing: usual modes, and disk failures a user can act on --------------------------------------------------------
WRITE_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted",
                errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                errno.EPERM: "permission denied",
                errno.EFBIG: "the file grew past the largest size allowed (a file-size limit such as `ulimit -f`, "
                             "or the file system's own)",
                errno.EIO: "an input/output error on the device", errno.EMLINK: "too many links in the folder",
                errno.ETXTBSY: "the file is busy"}


PATH_ERRNOS = {errno.ELOOP: "a loop of symbolic links", errno.ENAMETOOLONG: "a name too long for the file system"}


# errors of writing: a copy or rename that fails with one of them names its source first, the file written second
_WRITE_SIDE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def write_failure(exc: OSError, path: Path) -> InputError | None:
    """The InputError (exit 2) naming `path` for an OSError a user fixes on their side (full disk, read-only file
    system, no permission, a path that cannot be looked up), or None for any other OSError. The file named is the one
    the OS error names — for a full disk or a read-only file system during a copy or rename, the file being written,
    not the one read (`shutil.copyfile` names both) — with a staging folder shown as the destination it becomes
    (`shown_path`)."""
    named = exc.filename2 if exc.errno in _WRITE_SIDE and exc.filename2 else exc.filename
    shown = shown_path(named) if isinstance(named, (str, bytes, os.PathLike)) and named else path
    if exc.errno in PATH_ERRNOS:
        return InputError(f"cannot use {shown}: {PATH_ERRNOS[exc.errno]}; nothing was changed",
                          "pick another path")
    why = WRITE_ERRNOS.get(exc.errno)
    if why is None:
        return None
    return InputError(f"cannot write {shown}: {why} ({exc.strerror or exc}); nothing was changed there",
                      "free space, or pick a writable folder (--out / --dest, or OSCAR_ZOO_CACHE for the cache)")


EXPORT_STAGING = "oscar-export"  # the name export's staging folders are made beside, inside its --out
_STAGED = re.compile(r"^\.(?P<dest>.+)\.[0-9a-f]{8}-\d+\.[a-z0-9_]+\.(?:tmp|pull)$")  # `staging_folder`'s names


def shown_path(path: str | os.PathLike) -> str:
    """`path` with a staging folder (`staging_folder`) in it shown as the destination it is built for: what a user
    asked to write is `DEST/rotations.safetensors`, not `.DEST.<host>-<pid>.<random>.pull/rotations.safetensors`."""
    parts = []
    for part in Path(os.fsdecode(path)).parts:
        match = _STAGED.match(part)
        if match is None:
            parts.append(part)
        elif match["dest"] != EXPORT_STAGING:  # export stages inside --out: its files go to the folder holding it
            parts.append(match["dest"])
    return str(Path(*parts)) if parts else os.fsdecode(path)


@functools.cache
def _umask() -> int:
    """The process umask, read once (reading it means setting it: not while writer threads run)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def usual_mode(path: Path, executable: bool = False) -> None:
    """Give a file 0o666 (0o777 if `executable`) and a folder 0o777, less the umask (what `open` and `mkdir` give):
    temp files and folders from `tempfile` are 0o600 / 0o700, which would hide artifacts from other users."""
    os.chmod(path, (0o777 if executable or Path(path).is_dir() else 0o666) & ~_umask())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp name in the same folder, fsync, rename: readers see the old file or the new one, never half.
    The file gets the usual mode (0o666 less the umask); a full disk or a read-only folder is an InputError naming
    it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise (write_failure(exc, path) or exc) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        usual_mode(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and write_failure(exc, path):
            raise write_failure(exc, path) from None
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save

    atomic_write_bytes(path, save({k: v.contiguous().cpu() for k, v in tensors.items()}))


def describe_file(folder: Path, name: str) -> ArtifactFile:
    path = Path(folder) / name
    return ArtifactFile(path=name, sha256=sha256_file(path), bytes=path.stat().st_size)


def write_artifacts(out_dir: Path, manifest: Manifest, rotations: Rotations, label: str = "--out") -> Manifest:
    """Write a complete artifact folder atomically: build it in a sibling temp folder, then swap it into place.

    `out_dir` must pass `check_destination` (checked again here, just before the swap; `label` names the option in its
    message). An existing artifact folder is replaced only once the new one is complete; an interrupted write leaves
    the old one (or nothing) behind, never a partial folder. Returns the manifest with its `artifacts` list filled
    in."""
    out_dir = check_destination(out_dir, label)
    check_rotations(rotations, manifest)  # never write what loading would refuse
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(out_dir)
        tmp = staging_folder(out_dir, "tmp")
    except OSError as exc:
        raise (write_failure(exc, out_dir) or exc) from None
    try:
        save_tensors(tmp / ROTATIONS_NAME, rotations.tensors())
        manifest = manifest.replace(artifacts=[describe_file(tmp, ROTATIONS_NAME)])
        atomic_write_text(tmp / MANIFEST_NAME, manifest.to_json())
        check_destination(out_dir, label)  # the folder may have changed while this run worked
        swap_into_place(tmp, out_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and write_failure(exc, out_dir):
            raise write_failure(exc, out_dir) from None
        raise
    return manifest


def swap_into_place(new: Path, dest: Path) -> None:
    """Move the complete folder `new` to `dest`, replacing an existing `dest` only after `new` is in place.

    `dest` is resolved first (`.`, `..`, symlinks): a symlinked destination has its target replaced and the link kept.
    `new` must live in the same folder as the resolved `dest` (`staging_folder` makes it so). An existing `dest` is
    renamed aside to a fresh `.<dest>.<host>-<pid>.<random>.old` first, then `new` is renamed in and the old folder
    deleted; a run killed in between leaves states that `recover_interrupted_swap` resolves on the next run."""
    dest = Path(dest).resolve()
    if not dest.exists():
        os.replace(new, dest)
        return
    # a fresh, empty folder to rename `dest` onto: its name is never in use, whatever process ids are reused
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{_owner_tag()}.", suffix=f".{SWAP_OLD}", dir=dest.parent))
    try:
        os.replace(dest, old)
    except BaseException:
        with contextlib.suppress(OSError):
            old.rmdir()  # still empty unless the rename happened after all: then it is left to the recovery
        raise
    try:
        os.replace(new, dest)
    except BaseException:
        if not os.path.lexists(dest):
            os.replace(old, dest)  # the old folder goes back: `dest` is never left missing by a failed swap
        raise
    shutil.rmtree(old, ignore_errors=True)


SWAP_OLD = "old"  # the kind of the name an existing folder is renamed to while a swap replaces it


def recover_interrupted_swap(dest: Path) -> None:
    """Finish or undo the swap into `dest` (a resolved path) of a run that was killed part-way (`swap_into_place`),
    keeping the last complete folder the user had there. For each `.<dest>.<host>-<pid>.<random>.old` made on this
    machine by a process that is gone (and each `.<dest>.old-<pid>` of older versions whose process is gone), newest
    first: when `dest` exists, the new folder is in place and this one (perhaps half deleted) is deleted; when `dest`
    is missing, the swap was cut between its two renames and this is the complete old folder: it is renamed back to
    `dest` (if it is empty or an artifact folder; anything else is left where it is). Folders of live processes (a
    running swap, or a process id now reused) and of other machines are left alone; nothing here raises."""
    host = _owner_tag().split("-")[0]
    current = re.compile(rf"^\.{re.escape(dest.name)}\.{host}-(?P<pid>\d+)\.[a-z0-9_]+\.{SWAP_OLD}$")
    legacy = re.compile(rf"^\.{re.escape(dest.name)}\.old-(?P<pid>\d+)$")
    try:
        entries = list(dest.parent.iterdir())
        found = []
        for entry in entries:
            match = current.match(entry.name) or legacy.match(entry.name)
            if match and entry.is_dir() and not entry.is_symlink() and not _process_alive(int(match["pid"])):
                found.append((entry.lstat().st_ctime_ns, entry))
    except OSError:
        return
    for _, entry in sorted(found, reverse=True):
        try:
            if os.path.lexists(dest):
                shutil.rmtree(entry)
            elif not any(entry.iterdir()) or artifact_folder_problem(entry) is None:
                os.rename(entry, dest)
        except OSError:
            continue  # e.g. another run recovered it first; the next run looks again


# -- may a destination be replaced? ---------------------------------------------------------------------------------
def artifact_folder_problem(folder: Path) -> str | None:
    """None when `folder` is recognisably an oscar-zoo artifact folder: its manifest.json parses under the schema and
    the folder holds exactly manifest.json and the files the manifest lists, nothing else (calibration caches live
    elsewhere, under $OSCAR_ZOO_CACHE). Otherwise a short reason, for an error message."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return f"it has no {MANIFEST_NAME}"
    try:
        manifest = io.load_manifest(path, source=MANIFEST_NAME)
    except IntegrityError as exc:
        return f"its {exc.message}"
    listed = {MANIFEST_NAME} | {a.path for a in manifest.artifacts}
    if any(PurePosixPath(p).is_absolute() or ".." in PurePosixPath(p).parts for p in listed):
        return "its manifest lists a file outside the folder"
    parents = {str(parent) for p in listed for parent in PurePosixPath(p).parents if str(parent) != "."}
    extra: list[str] = []
    for root, dirs, files in os.walk(folder):  # symlinks are entries, never followed
        rel = Path(root).relative_to(folder).as_posix()
        names = {name: name if rel == "." else f"{rel}/{name}" for name in [*dirs, *files]}
        extra += sorted(names[d] + "/" for d in dirs if names[d] not in parents)
        dirs[:] = [d for d in dirs if names[d] in parents]
        extra += sorted(names[f] for f in files if names[f] not in listed)
        listed -= {names[f] for f in files}
        if len(extra) > 3:
            break
    if extra:
        return f"it holds {', '.join(extra[:3])}{', …' if len(extra) > 3 else ''} besides the manifest's files"
    if listed:
        return f"{', '.join(sorted(listed))} listed in its manifest is missing"
    return None


def check_destination(dest: Path, label: str) -> Path:
    """Resolve `dest` (`~`, `.`, `..`, symlinks) and make sure an artifact folder may be written there without losing
    anyone's files: it must be absent, an empty folder, or an artifact folder (`artifact_folder_problem`), not inside
    one (whose files are its manifest's alone), and it must not be the current folder or hold it (a swap would pull it
    out from under the shell), and the folder it is built in (its parent, or the nearest existing folder above) must be
    writable. Returns the resolved path; raises InputError (exit 2) otherwise, having touched nothing but a swap into
    `dest` that a killed run left unfinished (`recover_interrupted_swap`, first). `label` names the option in the
    message."""
    resolved = folder_destination(dest, label, "pick a new or empty folder")
    inside = next((f for f in resolved.parents if artifact_folder_problem(f) is None), None)
    if inside is not None:  # a folder in it would make it hold more than its manifest's files
        raise InputError(f"{label} {dest} lies inside {inside}, which is an oscar-zoo artifact folder: it holds its "
                         "manifest's files and nothing else; nothing was changed",
                         "pick a folder outside the artifact folder, e.g. a new one beside it")
    recover_interrupted_swap(resolved)
    if resolved.is_dir() and any(resolved.iterdir()):
        problem = artifact_folder_problem(resolved)
        if problem:
            raise InputError(f"{label} {dest} is a non-empty folder that is not an oscar-zoo artifact folder "
                             f"({problem}); nothing was changed",
                             "pick a new or empty folder, or an earlier artifact folder")
    cwd = Path.cwd().resolve()
    if resolved.is_dir() and (resolved == cwd or resolved in cwd.parents):
        raise InputError(f"{label} {dest} is the current folder or holds it: it is replaced by moving a new folder into"
                         " its place, which would leave this shell in a deleted folder; nothing was changed",
                         "name the folder from outside it (e.g. `cd ..` first)")
    return resolved


def folder_destination(dest: Path, label: str, advice: str) -> Path:
    """`dest` resolved (`~`, `.`, `..`, symlinks), where a folder may be made or written into: an existing folder, or
    a path with only folders above it, the nearest of them writable. InputError (exit 2) otherwise: a path that cannot
    be looked up (a symlink loop, a name too long), an existing non-folder (`advice` says what to pick instead), a path
    under a file, a folder we may not write in. `label` names the option in the messages."""
    try:
        resolved = Path(dest).expanduser().resolve()
        above = nearest_existing(resolved)
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13), a name too long, …
        why = (PATH_ERRNOS.get(exc.errno) or exc.strerror or str(exc)) if isinstance(exc, OSError) \
            else PATH_ERRNOS[errno.ELOOP]
        raise InputError(f"{label} {dest} cannot be used: {why}; nothing was changed", "pick another path") from None
    if above == resolved and not resolved.is_dir():
        raise InputError(f"{label} {dest} exists and is not a folder; nothing was changed", advice)
    if not above.is_dir():
        raise InputError(f"{label} {dest} lies under {above}, which is a file; nothing was changed")
    check_writable(above, f"{label} {dest}")
    return resolved


def check_writable(folder: Path, what: str) -> None:
    """InputError (exit 2) unless files can be created in the existing folder `folder` (asked of the OS: permission
    bits, read-only file systems); `what` names what needs it."""
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{what}: cannot write in {folder} (read-only file system or no permission); nothing was "
                         "changed", "pick a folder you can write in")


def nearest_existing(path: Path) -> Path:
    """`path` itself if it exists, else its nearest existing parent."""
    path = Path(path).expanduser().resolve()
    return path if path.exists() else next(p for p in path.parents if p.exists())


# -- staging folders beside a destination ---------------------------------------------------------------------------
def _owner_tag() -> str:
    """`<host hash>-<pid>`: which process on which machine made a staging folder."""
    return f"{hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]}-{os.getpid()}"


def staging_folder(dest: Path, kind: str) -> Path:
    """A new hidden folder beside `dest` to build its replacement in, named `.<dest>.<host>-<pid>.<random>.<kind>` so
    that a later run can recognise the leftovers of a run that was killed (`remove_stale_staging`)."""
    folder = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{_owner_tag()}.", suffix=f".{kind}", dir=dest.parent))
    usual_mode(folder)  # it becomes the artifact folder: 0o755 under the usual umask, not mkdtemp's 0o700
    return folder


def remove_stale_staging(dest: Path, recover: Callable[[Path], bool] | None = None) -> None:
    """Delete staging folders beside `dest` left by killed runs: made on this machine by a process that is gone.
    Folders of live processes, of other machines (a shared filesystem) and anything else are left alone. `recover`
    (when given) sees each such folder first and keeps it by returning False."""
    host = _owner_tag().split("-")[0]
    pattern = re.compile(rf"^\.{re.escape(dest.name)}\.{host}-(?P<pid>\d+)\.[a-z0-9_]+\.(?:tmp|pull)$")
    try:
        entries = list(dest.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = pattern.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() and not _process_alive(int(match["pid"])):
            if recover is None or recover(entry):
                shutil.rmtree(entry, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return True
    return True


def artifact_folder(folder: Path) -> Path:
    """`folder` as a Path, if it is an existing folder; InputError (exit 2) for a file or a missing path. A missing
    folder that a killed run's swap left renamed aside is put back first (`recover_interrupted_swap`)."""
    folder = Path(folder)
    if not folder.exists():  # missing, or a symlink to a missing folder
        with contextlib.suppress(OSError, RuntimeError):
            recover_interrupted_swap(folder.expanduser().resolve())
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder} is a file, not an artifact folder", "pass the folder that holds manifest.json")
    if not folder.is_dir():
        raise InputError(f"artifact folder {folder} does not exist", "run `oscar-zoo calibrate` or `oscar-zoo pull`")
    return folder


def read_manifest(folder: Path) -> Manifest:
    """The schema-checked manifest of an artifact folder, its files unread (`load_artifacts` reads them too)."""
    path = artifact_folder(folder) / MANIFEST_NAME
    if not path.is_file():
        raise IntegrityError(f"{folder} has no {MANIFEST_NAME}; it is not an oscar-zoo artifact folder")
    return io.load_manifest(path)


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Replace a folder's manifest (e.g. to store a verification report); its files are re-checksummed first."""
    check_files(folder, manifest)
    atomic_write_text(Path(folder) / MANIFEST_NAME, manifest.to_json())


def check_files(folder: Path, manifest: Manifest) -> None:
    """Every file the manifest lists exists with its recorded size and sha256; raises IntegrityError naming the file."""
    io.check_files(folder, manifest.artifacts)


def check_file(path: Path, entry: ArtifactFile) -> None:
    """The file at `path` has the size and sha256 the manifest's `entry` records (the size first: it costs nothing)."""
    io.check_file(path, entry)


def load_artifacts(folder: Path) -> tuple[Manifest, Rotations]:
    """Read and fully check an artifact folder through the format's one reader (`format.io.read_artifact`, the reader
    of `OscarCache.from_folder` too): schema, checksums, tensor names, dtypes and shapes, and the values. Every command
    that reads an artifact folder (inspect, verify, export, push, pull) reads it here; what it refuses is an
    IntegrityError (exit 4) with the reader's message."""
    art = io.read_artifact(artifact_folder(folder), require_manifest=True)
    return art.manifest, Rotations(**art.tensors)


def check_rotations(r: Rotations, manifest: Manifest) -> None:
    """The tensors are what the format and the manifest say and values a runtime may use: the reader's own checks
    (`format.io.check_against_manifest`, `check_values`), for what is about to be written. IntegrityError (exit 4)
    naming the tensor, layer and head otherwise."""
    tensors = {name: getattr(r, name) for name in (*TENSOR_NAMES, *MEAN_NAMES) if getattr(r, name) is not None}
    io.check_against_manifest(tensors, manifest)
    io.check_values(tensors)


def expected_shapes(manifest: Manifest) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of `rotations.safetensors`, as the manifest's model and rotation spec imply."""
    ids, H, D = io.geometry(manifest)
    return io.expected_shapes(len(ids), H, D, manifest.centred)


def check_model_matches(manifest: Manifest, identity) -> None:
    """Raise IntegrityError naming every field where the manifest's model differs from `identity` (a ModelIdentity)."""
    fields = ("architecture", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "qk_norm", "config_sha256")
    diffs = [
        f"{f}: manifest {getattr(manifest.model, f)!r} vs model {getattr(identity, f)!r}"
        for f in fields
        if getattr(manifest.model, f) != getattr(identity, f)
    ]
    if diffs:
        raise IntegrityError(
            f"the artifacts were calibrated for {manifest.model.id}, not this model ({'; '.join(diffs)})",
            "pass the model the manifest names, or calibrate this one",
        )
