"""The one reader of an artifact folder (docs/format.md §8): `read_artifact` reads manifest.json as strict JSON, checks
every file it lists for size and sha256, loads rotations.safetensors and checks its tensors against the format, the
manifest and `validate` (finite, orthogonal, clips in (0, 1]). `OscarCache.from_folder` and, through
`oscar_zoo.artifacts.load_artifacts`, every command read here; the commands add the pydantic schema (`parse`), which
the runtime, standing on torch alone, does not import. The format's file names, size limits and versions live here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import Tensor

from ..format import layout
from ..format.layout import Centring
from .validate import MEAN_NAMES, TENSOR_NAMES, check_rotation_tensors, check_tensor_names

SCHEMA_VERSION = 5  # what this oscar-zoo writes; 2 adds quant.centring and the tensors k_mean, v_mean; 3 adds
# quant.key_bits (per layer: 2- or 3-bit history keys); 4 adds quant.pin (history tokens a prompt pins in BF16); 5 adds
# quant.key_block (history keys per channel over blocks of that many tokens)
READ_VERSIONS = (1, 2, 3, 4, 5)  # what it reads: a version-1 manifest is an uncentred artifact, versions 1–2 have
# 2-bit keys everywhere and versions 1–4 keys per row (each read as the version that wrote it)
MANIFEST_NAME = "manifest.json"
ROTATIONS_NAME = "rotations.safetensors"
ARTIFACT_FILES = (ROTATIONS_NAME,)  # the files a manifest may list: the format has no others (the model card that push
# writes beside them is generated from the manifest, not listed in it)
MANIFEST_MAX_BYTES = 1 << 20  # a manifest (or catalog entry) takes a few KiB; anything near this is not one
JSON_MAX_DEPTH = 32  # a manifest nests 4 deep, a catalog entry with a verification report 6
QUANT_KEYS = ("group_size", "sink", "recent", "flush", "pin", "key_block")  # what the runtime reads of a manifest
TENSOR_DTYPES = {name: torch.int32 if name == "layer_ids" else torch.float32 for name in (*TENSOR_NAMES, *MEAN_NAMES)}
SHA256_HEX = frozenset("0123456789abcdef")
# Bounds of a manifest's calibration record (the schema's; the runtime does not read the record): more tokens than any
# corpus a calibration reads, and a year of wall time. Larger values are a damaged or forged manifest.
MAX_CALIBRATION_TOKENS = 1 << 40
MAX_WALL_SECONDS = 365 * 24 * 3600.0
LAYER_SPREAD = 2  # without a model record (no manifest, or one of settings only), layer ids stay below
# LAYER_SPREAD × the rotation layers: every family oscar-zoo calibrates rotates all layers, or every other one


class ArtifactError(ValueError):
    """An artifact folder that must not be used: unreadable or invalid manifest, a file whose size or sha256 differs
    from the manifest's, tensors the format or a runtime refuses. `oscar_zoo.errors.IntegrityError` (exit 4) is one."""

    def __init__(self, message: str, advice: str | None = None):
        super().__init__(message)
        self.message = message
        self.advice = advice

    def __str__(self) -> str:
        return self.message if not self.advice else f"{self.message} ({self.advice})"


@dataclass(frozen=True)
class FileEntry:
    """One file a manifest lists (`artifacts[i]`): its path in the folder, sha256 (hex) and size in bytes."""

    path: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Artifact:
    """What `read_artifact` read, all of it checked: the manifest as JSON (None: a folder without one), what `parse`
    made of it, the tensors of rotations.safetensors and the quant settings a cache takes from the manifest."""

    doc: dict | None
    manifest: Any
    tensors: dict[str, Tensor]
    settings: dict[str, int | list[int]]


def read_artifact(folder: str | Path, parse: Callable[[bytes], Any] | None = None) -> Artifact:
    """Read and fully check an artifact folder, in this order: the manifest (strict JSON, then `parse(bytes)` — the
    commands' schema — when given), every listed file's size and sha256, the tensor names, their dtypes and shapes
    against the manifest, the manifest's layer ids and centring, and the values (`validate.check_rotation_tensors`).
    ArtifactError (a ValueError) naming the file, tensor, layer and head otherwise.

    With `parse` the manifest is required. Without it (the runtime) a folder without manifest.json is read as the
    runtime always read one: rotations.safetensors alone, its values checked, layout defaults; and a manifest without
    `schema_version` (hand-written settings) gives settings and lists no file. A manifest with `schema_version` must
    list rotations.safetensors, as every manifest oscar-zoo writes does."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    doc = manifest = None
    if path.is_file():
        data = read_manifest_bytes(path)
        doc = load_json(data, str(path))
        manifest = parse(data) if parse is not None else None
        if not isinstance(doc, dict):
            raise ArtifactError(f"{path} must hold a JSON object, found {type(doc).__name__}")
        versioned = "schema_version" in doc
        if versioned:
            check_version(doc, str(path), "schema_version", READ_VERSIONS)
        settings = quant_settings(doc, path)
        files = listed_files(doc, path)
        check_files(folder, files)
        if (versioned or parse is not None) and ROTATIONS_NAME not in {f.path for f in files}:
            raise ArtifactError(f"the manifest in {folder} does not list {ROTATIONS_NAME}")
    elif parse is not None:
        raise ArtifactError(f"{folder} has no {MANIFEST_NAME}; it is not an oscar-zoo artifact folder")
    else:
        settings = {}
        if not (folder / ROTATIONS_NAME).is_file():
            raise FileNotFoundError(f"{folder / ROTATIONS_NAME} not found: pass an OSCAR artifact folder (oscar-zoo "
                                    "pull)")
    tensors = load_tensors(folder / ROTATIONS_NAME)
    try:
        names = check_tensor_names(tensors)
    except ValueError as exc:
        raise ArtifactError(f"{ROTATIONS_NAME}: {exc}") from None
    tensors = {n: tensors[n] for n in names}
    check_dtypes(tensors)
    if doc is not None:
        check_against_manifest(tensors, doc, path)
    if doc is None or geometry(doc, path) is None:  # no model record: bound what a cache builds by the tensors
        check_layer_spread(tensors["layer_ids"])
    check_values(tensors)
    return Artifact(doc, manifest, tensors, settings)


# -- the manifest ----------------------------------------------------------------------------------------------------
def read_manifest_bytes(path: Path) -> bytes:
    """A manifest's bytes, at most MANIFEST_MAX_BYTES + 1 of them (the parser refuses that many)."""
    try:
        with open(path, "rb") as f:
            return f.read(MANIFEST_MAX_BYTES + 1)
    except OSError as exc:
        raise ArtifactError(f"{path} cannot be read ({exc.strerror or exc})") from None


class _BadNumber(ValueError):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _BadNumber(f"the number {text[:40]} is out of range")
    return value


def _int64(text: str) -> int:
    if len(text.lstrip("-")) > 19 or not -(2**63) <= int(text) < 2**63:
        raise _BadNumber(f"the integer {text[:40]}{'…' if len(text) > 40 else ''} is out of range")
    return int(text)


def _no_constant(name: str):
    raise _BadNumber(f"{name} is not a JSON number")


def load_json(data: str | bytes, source: str) -> Any:
    """A JSON document as strict JSON: UTF-8, at most MANIFEST_MAX_BYTES and JSON_MAX_DEPTH deep, numbers finite and
    within int64 (no NaN/Infinity); ArtifactError naming `source` otherwise."""
    if len(data) > MANIFEST_MAX_BYTES:
        raise ArtifactError(f"{source} has {len(data):,} bytes, too many for an oscar-zoo document")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ArtifactError(f"{source} is not UTF-8 text (byte {exc.start}); it is not an oscar-zoo document") \
                from None
    too_deep = f"{source} nests JSON too deep: deeper than {JSON_MAX_DEPTH} levels"
    try:
        doc = json.loads(data, parse_float=_finite_float, parse_int=_int64, parse_constant=_no_constant)
    except RecursionError:
        raise ArtifactError(too_deep) from None
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{source} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except _BadNumber as exc:
        raise ArtifactError(f"{source} is not valid oscar-zoo JSON: {exc}") from None
    stack = [(doc, 1)]
    while stack:  # iterative: the depth limit also keeps every later recursive walk (pydantic, json.dumps) safe
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > JSON_MAX_DEPTH:
                raise ArtifactError(too_deep)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
            stack.extend((key, depth) for key in (node if isinstance(node, dict) else ()))
        elif isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (\ud800): no file or terminal could take it back
                raise ArtifactError(f"{source} holds a string that is not valid Unicode "
                                    f"({one_line(repr(node), 60)})") from None
    return doc


def check_version(doc: dict, source: str, field: str, versions: tuple[int, ...]) -> None:
    """`doc[field]` is one of `versions` (what this oscar-zoo reads); ArtifactError naming `source` otherwise."""
    found = doc.get(field)
    if isinstance(found, bool) or found not in versions:
        raise ArtifactError(
            f"{source} has {field} {one_line(repr(found), 40)}; this oscar-zoo reads version "
            f"{' and '.join(str(v) for v in versions)}",
            "upgrade oscar-zoo, or re-create the file with this version",
        )


def one_line(text: str, limit: int) -> str:
    """User-controlled text for a one-line message: control characters escaped, at most `limit` characters."""
    flat = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _object(doc: dict, key: str, source: Path) -> dict:
    """doc[key] as an object ({} when absent or null); ArtifactError when it is something else."""
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ArtifactError(f"{source} must hold a JSON object with an object {key!r}; found {type(value).__name__}")
    return value


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def quant_settings(doc: dict, source: Path) -> dict[str, int | list[int]]:
    """The quant settings a cache takes from a manifest: quant.{group_size, sink, recent, flush, pin, key_block} present
    and not null, each an integer, and quant.key_bits (schema 3) when present; ArtifactError naming the file when one
    is not. The values themselves are the cache's to check."""
    quant = _object(doc, "quant", source)
    settings = {}
    for key in QUANT_KEYS:
        value = quant.get(key)
        if value is None:
            continue
        if not _integer(value):
            raise ArtifactError(f"{source}: quant.{key} is {str(value)[:40]!r}, expected an integer")
        settings[key] = value
    try:
        layout.check_windows(settings.get("sink", layout.SINK), settings.get("recent", layout.RECENT),
                             settings.get("flush", settings.get("key_block") or layout.FLUSH), settings.get("pin", 0),
                             settings.get("key_block", 0))
    except ValueError as exc:
        raise ArtifactError(f"{source}: quant: {exc}") from None
    key_bits = quant.get("key_bits")
    if key_bits is not None:  # schema 3: per rotation layer, 2 or 3
        if not isinstance(key_bits, list) or any(b not in (2, 3) or isinstance(b, bool) for b in key_bits):
            raise ArtifactError(f"{source}: quant.key_bits is {str(key_bits)[:40]!r}, expected a list of 2s and 3s")
        settings["key_bits"] = key_bits
    return settings


def listed_files(doc: dict, source: Path) -> list[FileEntry]:
    """The manifest's `artifacts`: files of the format, each once, with a sha256 and a size ([] when absent)."""
    entries = doc.get("artifacts") or []
    if not isinstance(entries, list):
        raise ArtifactError(f"{source}: artifacts must be a list of files, found {type(entries).__name__}")
    files = []
    for item in entries:
        entry = item if isinstance(item, dict) else {}
        path, sha, size = entry.get("path"), entry.get("sha256"), entry.get("bytes")
        if not (isinstance(path, str) and isinstance(sha, str) and len(sha) == 64 and set(sha) <= SHA256_HEX
                and _integer(size) and size >= 0):
            raise ArtifactError(f"{source}: artifacts entry {one_line(repr(item), 80)} is not a file record "
                                "{path, sha256 (64 hex digits), bytes}")
        if path not in ARTIFACT_FILES:
            raise ArtifactError(f"{source}: {path!r} is not a file of the oscar-zoo artifact format (only "
                                f"{', '.join(ARTIFACT_FILES)}); refusing it")
        files.append(FileEntry(path, sha, size))
    if len({f.path for f in files}) != len(files):
        raise ArtifactError(f"{source}: a file is listed twice in artifacts")
    return files


# -- the files -------------------------------------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_files(folder: Path, entries) -> None:
    """Every listed file (`entries`: records with path, sha256, bytes) exists in `folder` with its recorded size and
    sha256; ArtifactError naming the file otherwise."""
    for entry in entries:
        rel = PurePosixPath(entry.path)
        if rel.is_absolute() or Path(entry.path).is_absolute() or ".." in rel.parts:
            raise ArtifactError(f"manifest lists a file outside the folder: {entry.path}")
        path = Path(folder) / entry.path
        if not path.is_file():
            raise ArtifactError(f"{entry.path} is listed in the manifest but missing from {folder}")
        check_file(path, entry)


def check_file(path: Path, entry) -> None:
    """The file at `path` has the size and sha256 the manifest's `entry` records (the size first: it costs nothing)."""
    size = Path(path).stat().st_size
    if size != entry.bytes:
        raise ArtifactError(f"{entry.path} has {size} bytes, the manifest says {entry.bytes}: the file is damaged")
    digest = sha256_file(path)
    if digest != entry.sha256:
        raise ArtifactError(
            f"{entry.path} sha256 {digest[:12]}… does not match the manifest's {entry.sha256[:12]}…: "
            "the file was altered or corrupted",
            "re-download or re-calibrate; do not use these rotations",
        )


def load_tensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ArtifactError(f"{path} is not a readable safetensors file: {exc}") from None


# -- the tensors -----------------------------------------------------------------------------------------------------
def expected_shapes(L: int, H: int, D: int, centred: bool) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of rotations.safetensors: L rotation layers, H = H_kv (per-head) or 1 (per-layer)
    rotations per layer, head dim D, and the means when the codec is centred."""
    return {
        "k_rotation": (L, H, D, D),
        "v_rotation": (L, H, D, D),
        "k_eigenvalues": (L, H, D),
        "v_eigenvalues": (L, H, D),
        "k_clip": (L, H),
        "v_clip": (L, H),
        "layer_ids": (L,),
        **({name: (L, H, D) for name in MEAN_NAMES} if centred else {}),
    }


def geometry(doc: dict, source: Path) -> tuple[list[int], int, int] | None:
    """(layer ids, H, D) as the manifest's model and rotation say, or None for a manifest without them (settings)."""
    model, rotation = _object(doc, "model", source), _object(doc, "rotation", source)
    if not model or not rotation:
        return None
    ids, D = rotation.get("layer_ids"), model.get("head_dim")
    H = model.get("num_kv_heads") if rotation.get("granularity") == "per-head" else 1
    if not (isinstance(ids, list) and all(_integer(i) for i in ids) and _integer(D) and _integer(H)):
        raise ArtifactError(f"{source}: model.head_dim, model.num_kv_heads and rotation.layer_ids must be integers")
    return ids, H, D


def check_against_manifest(tensors: Mapping[str, Tensor], doc: dict, source: Path) -> None:
    """The tensors are what the format and the manifest say: the means there exactly when quant.centring is "mean"
    (absent: a version-1 manifest, uncentred), float32 / int32, shapes from the manifest's geometry, its layer ids.
    ArtifactError naming the tensor otherwise."""
    centring = _object(doc, "quant", source).get("centring", Centring.NONE.value)
    if centring not in tuple(c.value for c in Centring):  # a tuple: a fuzzed value may be unhashable
        raise ArtifactError(f"{source}: quant.centring is {str(centring)[:40]!r}, expected 'mean' or 'none'")
    k_mean, v_mean = (tensors.get(n) for n in MEAN_NAMES)
    if (k_mean is not None) != (centring == Centring.MEAN) or (k_mean is None) != (v_mean is None):
        has = "carries" if k_mean is not None or v_mean is not None else "lacks"
        raise ArtifactError(f"{ROTATIONS_NAME} {has} k_mean/v_mean but the manifest (schema_version "
                            f"{one_line(repr(doc.get('schema_version')), 12)}) says quant.centring {centring!r}: the "
                            "two files do not belong together", "re-calibrate or re-download")
    shape = geometry(doc, source)
    if shape is None:
        return
    ids, H, D = shape
    for name, expected in expected_shapes(len(ids), H, D, centring == Centring.MEAN).items():
        got = tuple(tensors[name].shape)
        if got != expected:
            raise ArtifactError(f"{ROTATIONS_NAME}: {name} has shape {list(got)}, the manifest implies "
                                f"{list(expected)}")
    if tensors["layer_ids"].tolist() != ids:
        raise ArtifactError(f"{ROTATIONS_NAME}: layer_ids differ from the manifest's rotation.layer_ids")
    layers = _object(doc, "model", source).get("num_layers")
    if not (_integer(layers) and 1 <= layers) or any(not 0 <= i < layers for i in ids):
        raise ArtifactError(f"{source}: rotation.layer_ids must lie in [0, model.num_layers); model.num_layers is "
                            f"{one_line(repr(layers), 24)}, the largest id {max(ids, default=None)}")


def check_dtypes(tensors: Mapping[str, Tensor]) -> None:
    """Every tensor has the format's dtype (float32; layer_ids int32), with or without a manifest."""
    for name, dtype in TENSOR_DTYPES.items():
        got = tensors[name].dtype if name in tensors else dtype
        if got != dtype:
            raise ArtifactError(f"{ROTATIONS_NAME}: {name} has dtype {str(got).removeprefix('torch.')}, the format "
                                f"stores {str(dtype).removeprefix('torch.')}")


def check_layer_spread(layer_ids: Tensor) -> None:
    """Without a model record, the layers a cache builds (the largest id + 1) stay below LAYER_SPREAD × the rotation
    layers the file holds; a folder for a model with sparser attention layers needs its manifest."""
    ids = layer_ids.flatten().tolist()
    if ids and max(ids) >= LAYER_SPREAD * len(ids):
        raise ArtifactError(f"{ROTATIONS_NAME}: layer_ids reach layer {max(ids)} with {len(ids)} rotation layers, and "
                            "no manifest says the model has that many layers",
                            "use the artifact folder's manifest.json (oscar-zoo pull or calibrate writes it)")


def check_values(tensors: Mapping[str, Tensor]) -> None:
    """Values a runtime may use (`validate.check_rotation_tensors`); ArtifactError naming tensor, layer and head."""
    try:
        check_rotation_tensors(tensors)
    except ValueError as exc:
        raise ArtifactError(f"{ROTATIONS_NAME}: {exc}", "do not use these rotations; re-calibrate or re-download") \
            from None
