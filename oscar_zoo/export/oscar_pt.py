"""The published OSCAR-RotationZoo `.pt` form, in and out.

One pickle dict per K and V: `{"format_version": 1, "objective": "qqt_r_h_pbr" | "sst_r_h_pbr" | "hadamard" | …,
"source_grouping": "layer", "layers": {layer_id: {"layer_id", "rotation": fp32[D, D], "eigenvalues": fp32[D]}}}`.
Reading checks the file's zip archive first, from its headers alone (`check_archive`: nothing is unpacked or
unpickled): every record's unpacked size, and their sum, must fit what the model's shapes allow (`pt_limits`), so a
small deflated file cannot unpack to gigabytes. Then it uses `torch.load(weights_only=True)` only, on the bytes just
checked, and checks every field; the reference runtime needs only
`{"layers": {layer_id: {"rotation": …}}}` (int or str keys), so that minimal form is read too. Anything malformed is
refused (exit 4); a missing path or a folder is bad input (exit 2). Rotations must pass the runtime's check
(`runtime.validate`: finite and orthogonal) before anything is written.
Writing per-head artifacts needs `average_heads`: the mean of per-head rotations is not orthogonal, so it is
re-orthogonalised by polar decomposition (the orthogonal factor U·Vᵀ of the mean's SVD, the nearest rotation in
Frobenius norm), and the agreement between heads (mean |diag(R_0ᵀ R_h)|) is reported so the caller can warn.
"""

from __future__ import annotations

import io
import os
import shlex
import warnings
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..artifacts import Rotations, load_artifacts, write_artifacts
from ..errors import InputError, IntegrityError
from ..format import layout
from ..format.io import sha256_file
from ..format.schema import (
    CalibrationRecord,
    ClipMode,
    ClipSpec,
    Granularity,
    Manifest,
    ModelIdentity,
    QuantSpec,
    RotationSpec,
    ValueTarget,
)
from ..format.validate import check_finite, check_rotation
from .sglang import ENV_FILE, LAUNCH_SCRIPT, SglangSettings, sglang_file_texts, sglang_settings
from .staging import check_out, write_export_files

K_FILE = "k_rotation_qqt_r_h_pbr.pt"
V_FILE = "v_rotation_sst_r_h_pbr.pt"
K_OBJECTIVE, V_OBJECTIVE = "qqt_r_h_pbr", "sst_r_h_pbr"
TARGETS = {K_OBJECTIVE: ("qqt", "ktk"), V_OBJECTIVE: ("sst", "vtv")}  # the reference script's key / value targets;
# its data-free `hadamard` and the `uresidual` method write the same objective into both files
REFERENCE_GROUP_SIZE = 128  # the reference runtime's --kv-cache-quant-group-size


@dataclass(frozen=True)
class LayerRotations:
    """One `.pt` file's content: `rotation` float32 [L, D, D], `eigenvalues` float32 [L, D] (ascending; zeros when
    the file has none), `objective` as the file states it (None in the minimal form)."""

    objective: str | None
    layer_ids: list[int]
    rotation: torch.Tensor
    eigenvalues: torch.Tensor


@dataclass(frozen=True)
class PtLimits:
    """The most a reference `.pt` file for one model may hold, from the model's shapes alone (`pt_limits`)."""

    model: str  # for messages
    record: int  # bytes of one unpacked archive record (a tensor storage)
    total: int  # bytes of all unpacked records together
    pickle: int  # bytes of the unpacked `data.pkl`
    records: int  # records in the archive
    file: int  # bytes of the file


PT_FLOOR = 1 << 20  # the limits never go below 1 MiB: a file of a slightly larger model is refused for its shapes


def pt_limits(identity: ModelIdentity) -> PtLimits:
    """Limits for a model of N layers and head dim D: one storage at most N·D·(D+1) float64 values (every layer's
    rotation and eigenvalues in one storage, in the widest float type; at least `PT_FLOOR`), twice that for all
    records together, 4N + 64 records, a pickle of 64 KiB + 4 KiB per layer, and the file at most what those take
    plus 1 KiB of headers per record."""
    N, D = identity.num_layers, identity.head_dim
    record = max(N * D * (D + 1) * 8, PT_FLOOR)
    records = 4 * N + 64
    pickle_max = (64 << 10) + (4 << 10) * N
    return PtLimits(f"{identity.id} ({N} layers, head_dim {D})", record, 2 * record, pickle_max, records,
                    2 * record + pickle_max + (1 << 10) * records)


def check_archive(name: str, data: bytes, limits: PtLimits) -> None:
    """Before anything is unpacked or unpickled: `data` (a `.pt` file's bytes) is a zip archive as torch.save writes
    (the legacy and other formats are refused: their sizes cannot be read up front) whose central directory promises
    no record, and no sum of records, past `limits`. IntegrityError (exit 4) naming the record otherwise."""
    def refused(what: str) -> IntegrityError:
        return IntegrityError(f"{name} was refused before loading: {what}",
                              "this is not a rotation file for this model; nothing was loaded")

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError) as exc:
        raise IntegrityError(f"{name} was refused: it is not a zip archive as torch.save writes ({exc}); older and "
                             "other formats are not read, as their sizes cannot be checked before loading",
                             "only files that load with torch.load(weights_only=True) are accepted; re-save it with "
                             "a current torch") from None
    if len(infos) > limits.records:
        raise refused(f"its archive holds {len(infos):,} records, more than the {limits.records:,} a rotation file "
                      f"for {limits.model} can need")
    total = 0
    for info in infos:
        most = limits.pickle if info.filename.endswith("/data.pkl") else limits.record
        if info.file_size > most:
            raise refused(f"its archive record {_short(info.filename)} unpacks to {info.file_size:,} bytes, more than "
                          f"the {most:,} that {limits.model} allows")
        total += info.file_size
    if total > limits.total:
        raise refused(f"its archive records unpack to {total:,} bytes in all, more than the {limits.total:,} that "
                      f"{limits.model} allows")


def read_oscar_pt(path: Path, expected_objective: str, limits: PtLimits | None = None) -> LayerRotations:
    """Read one reference `.pt` file meant to hold `expected_objective`'s side (K_OBJECTIVE or V_OBJECTIVE): its
    structure, shapes and dtypes; the values are checked by `check_layer_rotations`. With `limits` (`pt_limits` of
    the model), the file's size and its archive's headers are checked against them first (`check_archive`), and
    torch.load reads the bytes that were checked."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path} is a directory, not a rotation file", "pass the .pt file itself")
    if not path.is_file():
        raise InputError(f"{path} does not exist" if not path.exists() else f"{path} is not a regular file")
    source: Path | io.BytesIO = path
    if limits is not None:
        with open(path, "rb") as f:  # read no more than the file holds: the limit can be far larger (a huge model)
            data = f.read(min(limits.file, os.fstat(f.fileno()).st_size) + 1)
        if len(data) > limits.file:
            raise IntegrityError(f"{path.name} was refused before loading: it has more than {limits.file:,} bytes, "
                                 f"more than a rotation file for {limits.model} can take",
                                 "this is not a rotation file for this model; nothing was loaded")
        check_archive(path.name, data, limits)
        source = io.BytesIO(data)
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": noise on the way to a refusal
            warnings.simplefilter("ignore")
            obj = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- malformed input makes torch.load raise anything (KeyError on a text
        # file, IndexError, struct.error, RuntimeError, UnpicklingError, …); each is a refusal, never a traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise IntegrityError(f"{path.name} was refused: it is not a plain tensor file that torch.load(weights_only="
                             f"True) reads ({type(exc).__name__}{': ' + first[:160] if first else ''})",
                             "only files that load with torch.load(weights_only=True) are accepted") from None

    def bad(what: str) -> IntegrityError:
        return IntegrityError(f"{path.name} is not an OSCAR-RotationZoo rotation file: {what}")

    if not isinstance(obj, dict):
        raise bad(f"top level is {type(obj).__name__}, not a dict")
    if "format_version" in obj and (type(obj["format_version"]) is not int or obj["format_version"] != 1):
        raise bad(f"format_version {_short(obj['format_version'])}, expected 1 (one rotation per layer)")
    objective = obj.get("objective")
    if objective is not None and not isinstance(objective, str):
        raise bad(f"objective is a {type(objective).__name__}, not a string")
    other = V_OBJECTIVE if expected_objective == K_OBJECTIVE else K_OBJECTIVE
    if objective is not None and objective.split("_")[0] in TARGETS[other]:
        side = "K" if expected_objective == K_OBJECTIVE else "V"
        raise bad(f"objective {_short(objective)} is a {'V' if side == 'K' else 'K'} rotation, passed as the {side} "
                  "file (K and V swapped?)")
    if obj.get("source_grouping", "layer") != "layer":
        raise bad(f"source_grouping {_short(obj.get('source_grouping'))}, expected 'layer'")
    layers = obj.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise bad("'layers' is missing, empty or not a dict")
    keys: dict[int, object] = {}
    rots, eigs = [], []
    for key, entry in layers.items():
        lid = _layer_key(key)
        if lid is None:
            raise bad(f"layer key {_short(key)} is not a non-negative integer (or its decimal string)")
        if lid in keys:
            raise bad(f"layer {lid} appears twice, under the keys {_short(keys[lid])} and {_short(key)}")
        keys[lid] = key
        if not isinstance(entry, dict):
            raise bad(f"layer {lid} holds {type(entry).__name__}, not a dict")
        rot, eig = entry.get("rotation"), entry.get("eigenvalues")
        if not isinstance(rot, torch.Tensor) or not (eig is None or isinstance(eig, torch.Tensor)):
            raise bad(f"layer {lid}: rotation/eigenvalues must be tensors, found {type(rot).__name__}/"
                      f"{type(eig).__name__}")
        if rot.dim() != 2 or rot.shape[0] != rot.shape[1] or rot.shape[0] == 0 or (
                eig is not None and tuple(eig.shape) != (rot.shape[0],)):
            raise bad(f"layer {lid}: rotation {list(rot.shape)} / eigenvalues "
                      f"{list(eig.shape) if eig is not None else None}, expected [D, D] / [D]")
        for name, t in (("rotation", rot), ("eigenvalues", eig)):
            if t is not None and (not t.is_floating_point() or t.layout != torch.strided):
                raise bad(f"layer {lid}: {name} is a {str(t.dtype).removeprefix('torch.')} "
                          f"{'tensor' if t.layout == torch.strided else 'sparse tensor'}, expected dense float32")
            if t is not None and t.device.type != "cpu":  # a meta tensor (torch.load keeps it): no values at all
                raise bad(f"layer {lid}: {name} is a tensor on device {t.device.type}, with no values to read")
        if "layer_id" in entry and _layer_key(entry["layer_id"], strings=False) != lid:
            raise bad(f"layer key {_short(key)} holds layer_id {_short(entry['layer_id'])}")
        rots.append(rot.float())
        eigs.append(eig.float() if eig is not None else torch.zeros(rot.shape[0]))
    ids = list(keys)
    if len({r.shape[0] for r in rots}) != 1:
        raise bad("layers have different head dims")
    order = sorted(range(len(ids)), key=ids.__getitem__)
    return LayerRotations(objective, [ids[i] for i in order], torch.stack([rots[i] for i in order]),
                          torch.stack([eigs[i] for i in order]))


def check_layer_rotations(path: Path, lr: LayerRotations) -> None:
    """The runtime's check of one file's values (finite, orthogonal rotations; finite eigenvalues); IntegrityError
    naming the file and layer."""
    try:
        check_rotation("rotation", lr.rotation.unsqueeze(1), lr.layer_ids)  # [L, 1, D, D]
        check_finite("eigenvalues", lr.eigenvalues.unsqueeze(1), lr.layer_ids)
    except ValueError as exc:
        raise IntegrityError(f"{Path(path).name}: {exc}", "these are not usable rotations; nothing was written") \
            from None


def _layer_key(key, strings: bool = True) -> int | None:
    """A layer id from a dict key or `layer_id` value: a non-negative int (a 0-d integer tensor too), or with
    `strings` its ASCII decimal string (the reference loader accepts both); None for anything else."""
    if isinstance(key, torch.Tensor) and key.dim() == 0 and not key.is_floating_point() and key.dtype != torch.bool:
        key = int(key)
    if strings and isinstance(key, str) and key.isascii() and key.isdigit():
        key = int(key)
    return key if type(key) is int and key >= 0 else None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


def oscar_pt_bytes(objective: str, layer_ids: list[int], rotation: torch.Tensor, eigenvalues: torch.Tensor) -> bytes:
    """One reference `.pt` file's content: rotation float32 [L, D, D], eigenvalues float32 [L, D]."""
    layers = {lid: {"layer_id": lid, "rotation": rotation[i].float().contiguous().clone(),
                    "eigenvalues": eigenvalues[i].float().contiguous().clone()} for i, lid in enumerate(layer_ids)}
    buf = io.BytesIO()
    torch.save({"format_version": 1, "objective": objective, "source_grouping": "layer", "layers": layers}, buf)
    return buf.getvalue()


# -- per-head -> per-layer --------------------------------------------------------------------------------------------
def head_agreement(R: torch.Tensor) -> float:
    """Mean over layers and heads h > 0 of mean |diag(R_0ᵀ R_h)|; 1.0 when every head has the same rotation.
    R: [L, H, D, D]."""
    if R.shape[1] == 1:
        return 1.0
    prod = R[:, :1].transpose(-1, -2).double() @ R[:, 1:].double()  # [L, H-1, D, D]
    return torch.diagonal(prod, dim1=-2, dim2=-1).abs().mean().item()


def average_heads(R: torch.Tensor) -> torch.Tensor:
    """[L, H, D, D] -> [L, D, D]: the orthogonal polar factor of the head mean (nearest rotation to it)."""
    mean = R.double().mean(dim=1)  # [L, D, D], not orthogonal in general
    U, _, Vh = torch.linalg.svd(mean)
    return (U @ Vh).float()


def is_per_head(manifest: Manifest, r: Rotations) -> bool:
    """True when export must average the heads (`average_heads`): a per-head artifact with more than one KV head."""
    return manifest.rotation.granularity == Granularity.PER_HEAD and r.k_rotation.shape[1] > 1


def layer_rotations(r: Rotations, per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rotations [L, D, D] as export writes them: each layer's heads averaged (`average_heads`), or its one."""
    if per_head:
        return average_heads(r.k_rotation), average_heads(r.v_rotation)
    return r.k_rotation[:, 0], r.v_rotation[:, 0]


@dataclass(frozen=True)
class SglangExport:
    """What `export_oscar_pt(…, sglang=True)` wrote beside the `.pt` files."""

    settings: SglangSettings
    env_path: Path
    launch_script: Path


@dataclass(frozen=True)
class ExportResult:
    k_path: Path
    v_path: Path
    averaged: bool
    k_agreement: float
    v_agreement: float
    manifest: Manifest
    sglang: SglangExport | None = None  # with sglang=True


def export_oscar_pt(artifacts: Path, out: Path, allow_average: bool, allow_degraded: bool = False,
                    sglang: bool = False) -> ExportResult:
    """Write the two reference `.pt` files into the folder `out` (and with `sglang` the runtime's `sglang.env` and
    `launch_sglang.sh`, `export.sglang`): every refusal (the artifacts, per-head without `allow_average`, centred or
    3-bit keys, per-channel keys or pinned tokens without `allow_degraded`, the sglang windows and shell values, a bad
    `out`) comes before anything is written, and the files land together or not at all
    (`staging.write_export_files`)."""
    manifest, r = load_artifacts(artifacts)
    if manifest.key_block and not allow_degraded:
        raise InputError(f"{artifacts} codes history keys per channel over {manifest.key_block}-token blocks "
                         "(quant.key_block, docs/format.md §6d); the reference runtime codes every key per row, so the "
                         "exported rotations would be served with per-row INT2 keys (needle retrieval drops: "
                         "benchmarks/QUALITY.md)",
                         "pass --accept-degraded to export anyway, or calibrate with --key-block 0 for a faithful "
                         f"export; measure the exported form first with `oscar-zoo verify "
                         f"{shlex.quote(str(artifacts))} --as-exported`")
    if max(manifest.key_bits) > layout.BITS and not allow_degraded:
        raise InputError(f"{artifacts} stores 3-bit keys in {manifest.key_bits.count(3)} of {len(manifest.key_bits)} "
                         "layers (docs/format.md §6b); the reference runtime quantizes every key to INT2, so the "
                         "exported rotations would be served with 2-bit keys in those layers (needle "
                         "retrieval drops: benchmarks/QUALITY.md)",
                         "pass --accept-degraded to export them anyway, or calibrate with --key-bits 2 for a faithful "
                         f"export; measure the exported form first with `oscar-zoo verify "
                         f"{shlex.quote(str(artifacts))} --as-exported`")
    if manifest.pin and not allow_degraded:
        raise InputError(f"{artifacts} pins {manifest.pin} history tokens per KV head in BF16 (quant.pin, "
                         "docs/format.md §6c); the reference runtime pins none, so a long prompt's history would "
                         "all be served at INT2 (needle retrieval drops: benchmarks/QUALITY.md)",
                         "pass --accept-degraded to export anyway, or calibrate with --pin 0 for a faithful export; "
                         f"measure the exported form first with `oscar-zoo verify {shlex.quote(str(artifacts))} "
                         "--as-exported`")
    if manifest.centred and not allow_degraded:
        raise InputError(f"{artifacts} uses the centred codec (k_mean/v_mean, docs/format.md §6a); the OSCAR .pt "
                         "format and the reference runtime have no means, so the exported rotations would be served "
                         "uncentred, with clips searched for centred rows",
                         "pass --accept-degraded to export them anyway (the means are dropped), or calibrate with "
                         "--centring none for a faithful export; measure the exported form first with "
                         f"`oscar-zoo verify {shlex.quote(str(artifacts))} --as-exported`")
    layer_ids = [int(x) for x in r.layer_ids.tolist()]
    per_head = is_per_head(manifest, r)
    if per_head and not allow_average:
        raise InputError(f"{artifacts} holds per-head rotations ({r.k_rotation.shape[1]} KV heads); the OSCAR .pt "
                         "format has one rotation per layer",
                         "pass --average-heads to average them (quality may drop), or calibrate with "
                         "--granularity per-layer; measure the averaged form first with "
                         f"`oscar-zoo verify {shlex.quote(str(artifacts))} --as-exported`")
    k_agree, v_agree = head_agreement(r.k_rotation), head_agreement(r.v_rotation)
    k_rot, v_rot = layer_rotations(r, per_head)
    k_eig = r.k_eigenvalues.mean(dim=1)  # per head ascending -> their mean stays ascending (informational only)
    v_eig = r.v_eigenvalues.mean(dim=1)
    out = Path(out)
    files = {K_FILE: oscar_pt_bytes(K_OBJECTIVE, layer_ids, k_rot, k_eig),
             V_FILE: oscar_pt_bytes(V_OBJECTIVE, layer_ids, v_rot, v_eig)}
    written = None
    if sglang:
        check_out(out, (*files, ENV_FILE, LAUNCH_SCRIPT), source=artifacts)  # the settings resolve paths under it
        settings = sglang_settings(manifest, r.k_clip, r.v_clip, out / K_FILE, out / V_FILE, base=out)
        files.update((name, text.encode()) for name, text in sglang_file_texts(settings, manifest.model.id).items())
        written = SglangExport(settings, out / ENV_FILE, out / LAUNCH_SCRIPT)
    write_export_files(out, files, executable={LAUNCH_SCRIPT}, source=artifacts)
    return ExportResult(out / K_FILE, out / V_FILE, per_head, k_agree, v_agree, manifest, written)


# -- import -----------------------------------------------------------------------------------------------------------
def model_identity_for(model: str, revision: str | None = None) -> ModelIdentity:
    """The model's geometry from its config only (no weights): `demo`, a local folder, or a Hugging Face id."""
    from ..models import (
        DEMO,
        DEMO_HF_ID,
        DEMO_REVISION,
        check_revision_applies,
        ensure_demo_model,
        load_config,
        model_identity,
    )

    check_revision_applies(model, revision)
    model_id, source = model, model
    if model == DEMO:
        model_id, revision, source = DEMO_HF_ID, DEMO_REVISION, str(ensure_demo_model())
    try:
        config = load_config(source, revision=None if Path(source).is_dir() else revision)
    except OSError as exc:
        raise InputError(f"could not read the config of {model!r}: {str(exc).splitlines()[0]}",
                         "pass `demo`, a local model folder, or a Hugging Face id that is in the cache") from None
    return model_identity(model_id, revision, config)


def import_oscar_pt(k_path: Path, v_path: Path, identity: ModelIdentity, out: Path,
                    group_size: int | None = None) -> Manifest:
    """Two reference `.pt` files -> an oscar-zoo artifact folder (per-layer, fixed clips 0.96 / 0.92). Both files are
    read and checked (structure, the model's geometry, then the runtime's value check) before anything is written."""
    D, N = identity.head_dim, identity.num_layers
    if group_size is not None and (group_size < 0 or (group_size and D % group_size)):
        raise InputError(f"--group-size {group_size}: expected 0 (one group per row) or a divisor of {identity.id}'s "
                         f"head_dim {D}")
    if D % layout.CODES_PER_BYTE:
        raise InputError(f"{identity.id} has head_dim {D}; the INT2 format needs a multiple of {layout.CODES_PER_BYTE}")
    limits = pt_limits(identity)  # what the model's shapes allow, checked before anything is unpacked
    k = read_oscar_pt(k_path, K_OBJECTIVE, limits)
    v = read_oscar_pt(v_path, V_OBJECTIVE, limits)
    for name, lr in (("K", k), ("V", v)):
        if lr.rotation.shape[-1] != D:
            raise IntegrityError(f"{name} rotations are {lr.rotation.shape[-1]}×{lr.rotation.shape[-1]}, but "
                                 f"{identity.id} has head_dim {D}", "these files belong to another model")
        outside = [i for i in lr.layer_ids if not 0 <= i < N]
        if outside:
            listed = ", ".join(map(str, outside[:8])) + (f", … ({len(outside):,} in all)" if len(outside) > 8 else "")
            raise IntegrityError(f"{name} file has layers [{listed}] but {identity.id} has {N} layers")
        missing = sorted(set(range(N)) - set(lr.layer_ids))
        if missing:
            raise IntegrityError(f"{name} file lacks layers {missing[:8]}{'…' if len(missing) > 8 else ''} of "
                                 f"{identity.id}'s {N}", "every attention layer needs a rotation")
    if k.layer_ids != v.layer_ids:
        raise IntegrityError("the K and V files cover different layers")
    check_layer_rotations(k_path, k)
    check_layer_rotations(v_path, v)
    if group_size is None:  # the reference runtime's default where it divides head_dim, else one group per row
        group_size = REFERENCE_GROUP_SIZE if D % REFERENCE_GROUP_SIZE == 0 else 0
    G = group_size or D
    L = len(k.layer_ids)
    rotations = Rotations(
        k_rotation=k.rotation.unsqueeze(1), v_rotation=v.rotation.unsqueeze(1),  # [L, 1, D, D]
        k_eigenvalues=k.eigenvalues.unsqueeze(1), v_eigenvalues=v.eigenvalues.unsqueeze(1),  # [L, 1, D]
        k_clip=torch.full((L, 1), layout.DEFAULT_K_CLIP), v_clip=torch.full((L, 1), layout.DEFAULT_V_CLIP),
        layer_ids=torch.tensor(k.layer_ids, dtype=torch.int32))
    import oscar_zoo

    now = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    manifest = Manifest(
        model=identity,
        quant=QuantSpec(group_size=G, sink=layout.SINK, recent=layout.RECENT, flush=layout.FLUSH),
        rotation=RotationSpec(granularity=Granularity.PER_LAYER, value_target=ValueTarget.WEIGHTED,
                              hadamard="sylvester (as published; imported)", layer_ids=k.layer_ids),
        clip=ClipSpec(mode=ClipMode.FIXED, grid=[], k_default=layout.DEFAULT_K_CLIP, v_default=layout.DEFAULT_V_CLIP,
                      objective="fixed reference ratios (imported)"),
        calibration=CalibrationRecord(
            dataset=f"imported from OSCAR-RotationZoo files {Path(k_path).name} (sha256 {sha256_file(k_path)}) and "
                    f"{Path(v_path).name} (sha256 {sha256_file(v_path)}), objectives {_short(k.objective)} / "
                    f"{_short(v.objective)}",
            token_ids_sha256="unknown", tokens=0, sequences=0, seq_len=0, heldout_tokens=0, chat_template=False,
            seed=0, device="n/a", dtype="float32",
            versions={"oscar-zoo": getattr(oscar_zoo, "__version__", "unknown"), "torch": torch.__version__},
            created=now, wall_seconds=0.0),
        bits_per_element={str(c): round(layout.bits_per_element(c, G), 4) for c in (32768, 131072)},
        verification=None,
    )
    return write_artifacts(out, manifest, rotations)
