"""The one reader of an artifact folder (docs/format.md §8), for the commands and the runtime alike: `read_artifact`
reads manifest.json as strict JSON under the schema (`schema.Manifest`), checks every file it lists for size and
sha256, loads rotations.safetensors and checks its tensors against the format, the manifest and `validate` (finite,
orthogonal, clips in (0, 1]). Everything it refuses is an `IntegrityError` (a ValueError) naming the file, tensor, layer
and head. Imports torch and safetensors only.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import Tensor

from . import layout
from .integrity import IntegrityError
from .layout import Centring
from .records import MANIFEST_MAX_BYTES, load_json, one_line
from .schema import MANIFEST_NAME, ROTATIONS_NAME, ArtifactFile, Manifest, check_layer_ids
from .validate import MEAN_NAMES, TENSOR_NAMES, check_rotation_tensors, check_tensor_names

QUANT_KEYS = ("group_size", "sink", "recent", "flush", "pin", "key_block")  # what a cache takes from a manifest
TENSOR_DTYPES = {name: torch.int32 if name == "layer_ids" else torch.float32 for name in (*TENSOR_NAMES, *MEAN_NAMES)}
LAYER_SPREAD = 2  # without a model record (no manifest, or one of settings only), layer ids stay below
# LAYER_SPREAD × the rotation layers: every family oscar-zoo calibrates rotates all layers, or every other one


@dataclass(frozen=True)
class Artifact:
    """What `read_artifact` read, all of it checked: the manifest (None: a folder without one, or a manifest of
    settings only), the tensors of rotations.safetensors and the quant settings a cache takes from the manifest
    (`key_bits` resolved per rotation layer)."""

    manifest: Manifest | None
    tensors: dict[str, Tensor]
    settings: dict[str, int | list[int]]


def read_artifact(folder: str | Path, require_manifest: bool = False) -> Artifact:
    """Read and fully check an artifact folder, in this order: the manifest (strict JSON, then the schema), every
    listed file's size and sha256, the tensor names, their dtypes and shapes against the manifest, the manifest's layer
    ids and centring, and the values (`validate.check_rotation_tensors`). IntegrityError (a ValueError) naming the
    file, tensor, layer and head otherwise.

    With `require_manifest` (the commands) the folder must hold a manifest with `schema_version`. Without it (the
    runtime) a folder without manifest.json is read as rotations.safetensors alone, its values checked, layout
    defaults; and a manifest without `schema_version` (hand-written settings) gives settings and lists no file."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    manifest = doc = None
    settings: dict[str, int | list[int]] = {}
    if path.is_file():
        doc = load_json(read_manifest_bytes(path), str(path))
        if not isinstance(doc, dict):
            raise IntegrityError(f"{path} must hold a JSON object, found {type(doc).__name__}")
        if "schema_version" in doc or require_manifest:
            manifest = Manifest.from_json(doc, source=str(path))
            settings = manifest_settings(manifest)
            check_rotations_size(manifest, str(path))
            check_files(folder, manifest.artifacts)
            if ROTATIONS_NAME not in {f.path for f in manifest.artifacts}:
                raise IntegrityError(f"the manifest in {folder} does not list {ROTATIONS_NAME}")
        else:
            settings = quant_settings(doc, path)
    elif require_manifest:
        raise IntegrityError(f"{folder} has no {MANIFEST_NAME}; it is not an oscar-zoo artifact folder")
    elif not (folder / ROTATIONS_NAME).is_file():
        raise FileNotFoundError(f"{folder / ROTATIONS_NAME} not found: pass an OSCAR artifact folder (oscar-zoo pull)")
    tensors = load_tensors(folder / ROTATIONS_NAME)
    try:
        names = check_tensor_names(tensors)
    except ValueError as exc:
        raise IntegrityError(f"{ROTATIONS_NAME}: {exc}") from None
    tensors = {n: tensors[n] for n in names}
    check_dtypes(tensors)
    if manifest is not None:
        check_against_manifest(tensors, manifest)
    else:
        if doc is not None:
            check_centring(tensors, _quant_object(doc, path).get("centring", Centring.NONE.value), None, path)
        check_layer_spread(tensors["layer_ids"])  # no model record: bound what a cache builds by the tensors
    check_values(tensors)
    return Artifact(manifest, tensors, settings)


# -- the manifest ----------------------------------------------------------------------------------------------------
def read_manifest_bytes(path: Path) -> bytes:
    """A manifest's bytes, at most MANIFEST_MAX_BYTES + 1 of them (the parser refuses that many)."""
    try:
        with open(path, "rb") as f:
            return f.read(MANIFEST_MAX_BYTES + 1)
    except OSError as exc:
        raise IntegrityError(f"{path} cannot be read ({exc.strerror or exc})") from None


def load_manifest(path: Path, source: str | None = None) -> Manifest:
    """The schema-checked manifest at `path`, its files unread; `source` names it in messages (default: the path)."""
    return Manifest.from_json(read_manifest_bytes(path), source=source or str(path))


def manifest_settings(manifest: Manifest) -> dict[str, int | list[int]]:
    """The quant settings a cache takes from a manifest: group_size, sink, recent, flush, pin and key_block where the
    manifest has them, and key_bits per rotation layer."""
    q = manifest.quant
    settings = {key: getattr(q, key) for key in QUANT_KEYS if getattr(q, key) is not None}
    return {**settings, "key_bits": manifest.key_bits}


def _quant_object(doc: dict, source: Path) -> dict:
    """doc["quant"] as an object ({} when absent or null); IntegrityError when it is something else."""
    value = doc.get("quant")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise IntegrityError(f"{source} must hold a JSON object with an object 'quant'; found {type(value).__name__}")
    return value


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def quant_settings(doc: dict, source: Path) -> dict[str, int | list[int]]:
    """The quant settings of a manifest of settings only (no `schema_version`: written by hand for the runtime):
    quant.{group_size, sink, recent, flush, pin, key_block} present and not null, each an integer, the windows within
    the format's bounds, and quant.key_bits when present; IntegrityError naming the file when one is not. The values
    themselves are the cache's to check."""
    quant = _quant_object(doc, source)
    settings = {}
    for key in QUANT_KEYS:
        value = quant.get(key)
        if value is None:
            continue
        if not _integer(value):
            raise IntegrityError(f"{source}: quant.{key} is {str(value)[:40]!r}, expected an integer")
        settings[key] = value
    try:
        layout.check_windows(settings.get("sink", layout.SINK), settings.get("recent", layout.RECENT),
                             settings.get("flush", settings.get("key_block") or layout.FLUSH), settings.get("pin", 0),
                             settings.get("key_block", 0))
    except ValueError as exc:
        raise IntegrityError(f"{source}: quant: {exc}") from None
    key_bits = quant.get("key_bits")
    if key_bits is not None:  # per rotation layer, 2 or 3
        if not isinstance(key_bits, list) or any(b not in (2, 3) or isinstance(b, bool) for b in key_bits):
            raise IntegrityError(f"{source}: quant.key_bits is {str(key_bits)[:40]!r}, expected a list of 2s and 3s")
        settings["key_bits"] = key_bits
    return settings


# -- the files -------------------------------------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


SAFETENSORS_HEADER_MAX = 1 << 16  # the JSON header of 7 tensors takes well under 1 KiB


def rotations_size_range(manifest: Manifest) -> tuple[int, int]:
    """(least, most) bytes `rotations.safetensors` can take for this manifest: its tensors (4 bytes per element: all
    float32 but layer_ids int32) plus the 8-byte length and a JSON header of at most 64 KiB."""
    ids, H, D = geometry(manifest)
    payload = 4 * sum(math.prod(shape) for shape in expected_shapes(len(ids), H, D, manifest.centred).values())
    return payload + 8, payload + 8 + SAFETENSORS_HEADER_MAX


def check_rotations_size(manifest: Manifest, where: str) -> None:
    """The size the manifest records for `rotations.safetensors` is one its tensors can take (`rotations_size_range`):
    checked before any byte is read or hashed, so a manifest cannot make a reader hash gigabytes first."""
    least, most = rotations_size_range(manifest)
    for entry in manifest.artifacts:
        if entry.path == ROTATIONS_NAME and not least <= entry.bytes <= most:
            raise IntegrityError(f"{where} says {entry.path} has {entry.bytes:,} bytes, but the tensors it describes "
                                 f"take {least:,} to {most:,}", "the manifest is inconsistent; do not use it")


def check_files(folder: Path, entries: list[ArtifactFile]) -> None:
    """Every listed file exists in `folder` with its recorded size and sha256; IntegrityError naming the file
    otherwise."""
    for entry in entries:
        rel = PurePosixPath(entry.path)
        if rel.is_absolute() or Path(entry.path).is_absolute() or ".." in rel.parts:
            raise IntegrityError(f"manifest lists a file outside the folder: {entry.path}")
        path = Path(folder) / entry.path
        if not path.is_file():
            raise IntegrityError(f"{entry.path} is listed in the manifest but missing from {folder}")
        check_file(path, entry)


def check_file(path: Path, entry: ArtifactFile) -> None:
    """The file at `path` has the size and sha256 the manifest's `entry` records (the size first: it costs nothing)."""
    size = Path(path).stat().st_size
    if size != entry.bytes:
        raise IntegrityError(f"{entry.path} has {size} bytes, the manifest says {entry.bytes}: the file is damaged")
    try:
        digest = sha256_file(path)
    except OSError as exc:  # unreadable (permissions, an I/O error): said as a read, as the manifest's is
        raise IntegrityError(f"{path} cannot be read ({exc.strerror or exc})") from None
    if digest != entry.sha256:
        raise IntegrityError(
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
        raise IntegrityError(f"{path} is not a readable safetensors file: {exc}") from None


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


def geometry(manifest: Manifest) -> tuple[list[int], int, int]:
    """(layer ids, H, D) as the manifest's model and rotation say: H = H_kv (per-head) or 1 (per-layer)."""
    H = manifest.model.num_kv_heads if manifest.rotation.granularity.value == "per-head" else 1
    return list(manifest.rotation.layer_ids), H, manifest.model.head_dim


def check_centring(tensors: Mapping[str, Tensor], centring: Any, version: Any, source: Path) -> None:
    """The means are there exactly when quant.centring is "mean" (absent: a version-1 manifest, uncentred)."""
    if centring not in tuple(c.value for c in Centring):  # a tuple: a fuzzed value may be unhashable
        raise IntegrityError(f"{source}: quant.centring is {str(centring)[:40]!r}, expected 'mean' or 'none'")
    k_mean, v_mean = (tensors.get(n) for n in MEAN_NAMES)
    if (k_mean is not None) != (centring == Centring.MEAN) or (k_mean is None) != (v_mean is None):
        has = "carries" if k_mean is not None or v_mean is not None else "lacks"
        raise IntegrityError(f"{ROTATIONS_NAME} {has} k_mean/v_mean but the manifest (schema_version "
                             f"{one_line(repr(version), 12)}) says quant.centring {centring!r}: the two files do not "
                             "belong together", "re-calibrate or re-download")


def check_against_manifest(tensors: Mapping[str, Tensor], manifest: Manifest) -> None:
    """The tensors are what the format and the manifest say: the means there exactly when the manifest is centred,
    shapes from the manifest's geometry, its layer ids. IntegrityError naming the tensor otherwise."""
    check_centring(tensors, manifest.quant.centring.value, manifest.schema_version, Path(MANIFEST_NAME))
    ids, H, D = geometry(manifest)
    for name, expected in expected_shapes(len(ids), H, D, manifest.centred).items():
        got = tuple(tensors[name].shape)
        if got != expected:
            raise IntegrityError(f"{ROTATIONS_NAME}: {name} has shape {list(got)}, the manifest implies "
                                 f"{list(expected)}")
    if tensors["layer_ids"].tolist() != ids:
        raise IntegrityError(f"{ROTATIONS_NAME}: layer_ids differ from the manifest's rotation.layer_ids")
    try:
        check_layer_ids(ids, manifest.model.num_layers)
    except ValueError as exc:
        raise IntegrityError(f"{MANIFEST_NAME}: {exc}") from None


def check_dtypes(tensors: Mapping[str, Tensor]) -> None:
    """Every tensor has the format's dtype (float32; layer_ids int32), with or without a manifest."""
    for name, dtype in TENSOR_DTYPES.items():
        got = tensors[name].dtype if name in tensors else dtype
        if got != dtype:
            raise IntegrityError(f"{ROTATIONS_NAME}: {name} has dtype {str(got).removeprefix('torch.')}, the format "
                                f"stores {str(dtype).removeprefix('torch.')}")


def check_layer_spread(layer_ids: Tensor) -> None:
    """Without a model record, the layers a cache builds (the largest id + 1) stay below LAYER_SPREAD × the rotation
    layers the file holds; a folder for a model with sparser attention layers needs its manifest."""
    ids = layer_ids.flatten().tolist()
    if ids and max(ids) >= LAYER_SPREAD * len(ids):
        raise IntegrityError(f"{ROTATIONS_NAME}: layer_ids reach layer {max(ids)} with {len(ids)} rotation layers, and "
                            "no manifest says the model has that many layers",
                            "use the artifact folder's manifest.json (oscar-zoo pull or calibrate writes it)")


def check_values(tensors: Mapping[str, Tensor]) -> None:
    """Values a runtime may use (`validate.check_rotation_tensors`); IntegrityError naming tensor, layer and head."""
    try:
        check_rotation_tensors(tensors)
    except ValueError as exc:
        raise IntegrityError(f"{ROTATIONS_NAME}: {exc}", "do not use these rotations; re-calibrate or re-download") \
            from None
