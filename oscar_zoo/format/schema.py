"""The versioned schema of an artifact folder's `manifest.json`: frozen records (`records.record`), extra fields
forbidden, one reader for the commands and the runtime.

One canonical JSON form (sorted keys, indent 2, trailing newline) so that a manifest's sha256 is stable. Big numbers
live in `rotations.safetensors`; the manifest says what they are, how they were made and how to check them. Each
schema version after the first added one field of `quant` (`ADDED_IN`): a manifest of an older version is written
without it and read as that version meant. A new version is one row of `ADDED_IN` (and its field).
"""

from __future__ import annotations

import unicodedata
from typing import Any, Literal

from . import layout
from .layout import MAX_WINDOW, Centring, Choice
from .records import Record, SchemaError, canonical_json, parse_document, record, spec
from .verification import VerifyReport, read_report

# Fields of `quant` each schema version added: (field, version, what older versions mean, for the message).
ADDED_IN = (
    ("centring", 2, "are uncentred"),  # the centred codec: quant.centring, tensors k_mean and v_mean (§6a)
    ("key_bits", 3, "have 2-bit keys"),  # per rotation layer: 2- or 3-bit history keys (§6b)
    ("pin", 4, "pin nothing"),  # history tokens a prompt pins in BF16 (§6c)
    ("key_block", 5, "code keys per row"),  # history keys per channel over blocks of that many tokens (§6d)
)
SCHEMA_VERSION = 1 + len(ADDED_IN)  # what this oscar-zoo writes
READ_VERSIONS = tuple(range(1, SCHEMA_VERSION + 1))  # what it reads, each as the version that wrote it
MANIFEST_NAME = "manifest.json"
ROTATIONS_NAME = "rotations.safetensors"
ARTIFACT_FILES = (ROTATIONS_NAME,)  # the files a manifest may list: the format has no others (the model card that push
# writes beside them is generated from the manifest, not listed in it)
# Bounds of a manifest's calibration record (the runtime does not read the record): more tokens than any corpus a
# calibration reads, and a year of wall time. Larger values are a damaged or forged manifest.
MAX_CALIBRATION_TOKENS = 1 << 40
MAX_WALL_SECONDS = 365 * 24 * 3600.0


class Granularity(Choice):
    PER_HEAD = "per-head"
    PER_LAYER = "per-layer"


class ValueTarget(Choice):
    WEIGHTED = "weighted"  # reference code: C_S = mean_t w_t v vᵀ, w_t = kᵀ C_Q k normalised to mean 1
    SOFTMAX = "softmax"  # paper figure: C_S = (1/N) Vᵀ SᵀS V with causal softmax scores


class ClipMode(Choice):
    SEARCH = "search"
    FIXED = "fixed"


_BIDI_OVERRIDES = set("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def line_breaker(text: str) -> str | None:
    """The first character of `text` that may not stand in a one-line name written into a terminal or a shell file:
    a control character (newline, carriage return, NUL, ESC, NEL, …), a Unicode line or paragraph separator, or a
    bidi override/isolate (it reorders what a reader sees); None when there is none. Other format characters (ZWJ in
    emoji, ZWNJ in Persian names) are allowed."""
    return next((ch for ch in text if unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in _BIDI_OVERRIDES), None)


def one_line_name(value: str | None) -> str | None:
    """Names that tools print and write into scripts (export --format sglang): at most 4,096 characters (a path),
    none of them a control, line-break or bidi-override character (`line_breaker`)."""
    if value is not None:
        if len(value) > 4096:
            raise ValueError(f"is {len(value)} characters long (at most 4096)")
        bad = line_breaker(value)
        if bad is not None:
            raise ValueError(f"holds {ascii(bad)}, a control, line-break or bidi-override character")
    return value


@record
class ModelIdentity(Record):
    id: str = spec(check=one_line_name)
    revision: str | None = spec(None, check=one_line_name)
    architecture: str = spec(check=one_line_name)
    model_type: str = spec(check=one_line_name)
    num_layers: int = spec(ge=1, le=layout.MAX_MODEL_DIM)
    num_q_heads: int = spec(ge=1, le=layout.MAX_MODEL_DIM)
    num_kv_heads: int = spec(ge=1, le=layout.MAX_MODEL_DIM)
    head_dim: int = spec(ge=4, le=layout.MAX_MODEL_DIM)
    qk_norm: bool
    rope_theta: float | None = None
    config_sha256: str


@record
class QuantSpec(Record):
    bits: Literal[2] = 2
    group_size: int = spec(ge=1)
    scale_dtype: Literal["float16"] = "float16"
    packing: Literal["quartered"] = "quartered"
    codebook: Literal["uniform", "lloyd-max"] = "uniform"
    # "mean": rows are stored as x·M − μ·M with the calibrated means k_mean, v_mean of rotations.safetensors
    # (docs/format.md §6a); "none": no centring, no mean tensors. A version-1 manifest has no such field: "none".
    centring: Centring = Centring.NONE
    # Bits of the history keys per layer of rotation.layer_ids (2 or 3; docs/format.md §6b), values always `bits`.
    # Absent (None) means 2 everywhere: what versions 1–2 mean (`Manifest.key_bits` resolves it).
    key_bits: list[Literal[2, 3]] | None = spec(None, omit_none=True)
    # History tokens per KV head that a prompt's last queries pin in BF16 beside the sink (docs/format.md §6c).
    # Absent (None) means 0: no pinning, what versions 1–3 mean.
    pin: int | None = spec(None, ge=0, le=MAX_WINDOW, omit_none=True)
    # History keys per channel over blocks of this many tokens (docs/format.md §6d; one of layout.KEY_BLOCKS), values
    # per row. Absent (None) means keys per row, what versions 1–4 mean.
    key_block: int | None = spec(None, omit_none=True)
    sink: int = spec(ge=0, le=MAX_WINDOW)
    recent: int = spec(ge=0, le=MAX_WINDOW)
    flush: int = spec(ge=1, le=MAX_WINDOW)


def _distinct_layers(layer_ids: list[int]) -> list[int]:
    if min(layer_ids) < 0 or len(set(layer_ids)) != len(layer_ids):
        raise ValueError("layer ids must be distinct and non-negative")
    return layer_ids


@record
class RotationSpec(Record):
    granularity: Granularity
    composition: Literal["U·H·P"] = "U·H·P"
    key_target: Literal["qqt"] = "qqt"
    value_target: ValueTarget
    capture_point: Literal["post-qknorm-post-rope"] = "post-qknorm-post-rope"
    hadamard: str
    layer_ids: list[int] = spec(min_length=1, check=_distinct_layers)


@record
class ClipSpec(Record):
    mode: ClipMode
    grid: list[float]
    k_default: float
    v_default: float
    objective: str


@record
class CalibrationRecord(Record):
    dataset: str
    token_ids_sha256: str
    tokens: int = spec(ge=0, le=MAX_CALIBRATION_TOKENS)  # sequences × seq_len (`check`)
    sequences: int = spec(ge=0, le=MAX_CALIBRATION_TOKENS)
    seq_len: int = spec(ge=0, le=MAX_CALIBRATION_TOKENS)
    heldout_tokens: int = spec(ge=0, le=MAX_CALIBRATION_TOKENS)
    chat_template: bool
    seed: int
    device: str
    dtype: str
    versions: dict[str, str]
    created: str
    wall_seconds: float = spec(ge=0, le=MAX_WALL_SECONDS)

    def check(self) -> None:
        if self.tokens != self.sequences * self.seq_len:
            raise ValueError(f"calibration.tokens {self.tokens} is not sequences × seq_len = {self.sequences} × "
                             f"{self.seq_len}")


def _format_file(path: str) -> str:
    if path not in ARTIFACT_FILES:
        raise ValueError(f"{path!r} is not a file of the oscar-zoo artifact format (only "
                         f"{', '.join(ARTIFACT_FILES)}); refusing it")
    return path


@record
class ArtifactFile(Record):
    """One file a manifest lists: its path in the folder, sha256 (hex) and size in bytes."""

    path: str = spec(check=_format_file)
    sha256: str = spec(pattern=r"^[0-9a-f]{64}$")
    bytes: int = spec(ge=0)


def _each_once(artifacts: list[ArtifactFile]) -> list[ArtifactFile]:
    paths = [a.path for a in artifacts]
    if len(set(paths)) != len(paths):
        raise ValueError("a file is listed twice")
    return artifacts


@record
class Manifest(Record):
    schema_version: Literal[READ_VERSIONS] = SCHEMA_VERSION
    tool: Literal["oscar-zoo"] = "oscar-zoo"
    model: ModelIdentity
    quant: QuantSpec
    rotation: RotationSpec
    clip: ClipSpec
    calibration: CalibrationRecord
    artifacts: list[ArtifactFile] = spec(factory=list, check=_each_once)
    bits_per_element: dict[str, float]
    # what `verify --write` stored (a `VerifyReport` as JSON; `report` reads it), or None; any JSON object is kept
    # as it is, so that a manifest stays byte-identical whatever wrote the record
    verification: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        quant = data.get("quant") if isinstance(data, dict) else None
        if isinstance(data, dict) and data.get("schema_version") == 1 and isinstance(quant, dict) \
                and "centring" in quant:
            raise SchemaError((), "quant.centring is a schema-version-2 field; a version-1 manifest has none")
        return super().from_dict(data)

    def check(self) -> None:
        m, q = self.model, self.quant
        if m.num_q_heads % m.num_kv_heads:
            raise ValueError(f"model.num_q_heads {m.num_q_heads} is not a multiple of num_kv_heads {m.num_kv_heads}")
        if m.head_dim % 4 or m.head_dim % q.group_size:
            raise ValueError(f"quant.group_size {q.group_size} does not fit model.head_dim {m.head_dim} (the head dim "
                             "must be a multiple of 4 and the group size divide it)")
        try:
            layout.check_windows(q.sink, q.recent, q.flush, q.pin or 0, q.key_block or 0)
        except ValueError as exc:
            raise ValueError(f"quant: {exc}") from None
        check_layer_ids(self.rotation.layer_ids, m.num_layers)
        for name, version, older in ADDED_IN:
            if getattr(q, name) not in (None, Centring.NONE) and self.schema_version < version:
                raise ValueError(f"quant.{name} needs schema_version {version} (version {self.schema_version} "
                                 f"artifacts {older})")
        if q.key_bits is not None and len(q.key_bits) != len(self.rotation.layer_ids):
            raise ValueError(f"quant.key_bits has {len(q.key_bits)} entries for "
                             f"{len(self.rotation.layer_ids)} rotation layers")
        if q.key_block is not None:
            if q.key_block not in layout.KEY_BLOCKS:
                raise ValueError(f"quant.key_block {q.key_block} is not one of {list(layout.KEY_BLOCKS)}")
            if q.flush != q.key_block or q.group_size != m.head_dim or self.pin:
                raise ValueError(f"quant.key_block {q.key_block} needs flush = key_block (got {q.flush}), values per "
                                 f"row (group_size = head_dim {m.head_dim}, got {q.group_size}) and no pinned tokens "
                                 f"(got pin {self.pin})")

    @property
    def pin(self) -> int:
        """History tokens per KV head pinned in BF16 (0 before schema 4)."""
        return self.quant.pin or 0

    @property
    def key_block(self) -> int:
        """Tokens per block of the per-channel history keys (0: keys per row, before schema 5 and when absent)."""
        return self.quant.key_block or 0

    @property
    def key_bits(self) -> list[int]:
        """Bits of the history keys of each rotation layer, resolved (2 everywhere before schema 3)."""
        return resolve_key_bits(self.quant.key_bits, len(self.rotation.layer_ids))

    @property
    def mean_key_bits(self) -> float:
        """The mean of `key_bits` over the layers: what displays and bits per element show."""
        return mean_bits(self.key_bits)

    @property
    def codec(self) -> str:
        """INT2, or with 3-bit keys the layers' split: 'INT2 values, keys 3-bit in 21/30 layers (mean 2.70)'."""
        bits = self.key_bits
        chan = f", keys per channel over {self.key_block}-token blocks" if self.key_block else ""
        if max(bits) == layout.BITS:
            return f"INT{layout.BITS}{chan}"
        return (f"INT{layout.BITS} values, keys 3-bit in {bits.count(3)}/{len(bits)} layers "
                f"(mean {self.mean_key_bits:.2f}){chan}")

    def bits_at(self, context: int) -> float:
        """Bits per cached element at `context` tokens, K and V averaged (docs/format.md §7): codes, float16 scale and
        zero, the BF16 windows and pinned tokens, and the 3-bit keys of `key_bits`."""
        q = self.quant
        G = layout.resolve_group_size(self.model.head_dim, q.group_size)
        return layout.kv_bits_per_element(context, G, q.sink, q.recent, self.key_bits, self.pin, self.key_block)

    @property
    def centred(self) -> bool:
        """True when rotations.safetensors carries k_mean and v_mean and the cache stores centred rows."""
        return self.quant.centring == Centring.MEAN

    def report(self) -> tuple[VerifyReport | None, str | None]:
        """(the verification record, None) when `verification` is what `oscar-zoo verify --write` stores, else (None,
        why not: "there is none", or the first schema error with its field); `verification.read_report`."""
        return read_report(self.verification)

    def to_dict(self, exclude=()) -> dict[str, Any]:
        """The JSON form; a version-1 manifest is written as version 1 wrote it (no quant.centring), wherever it is
        dumped: its own file, or a catalog entry that embeds it, so both stay byte-identical."""
        data = super().to_dict(exclude)
        if self.schema_version == 1 and isinstance(data.get("quant"), dict):
            data["quant"].pop("centring", None)
        return data

    def to_json(self) -> str:
        return canonical_json(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes | dict, source: str = MANIFEST_NAME) -> Manifest:
        """A manifest from its JSON (text, bytes or the loaded object); IntegrityError naming `source` and the field."""
        return parse_document(cls, text, source, "schema_version", READ_VERSIONS)


def check_layer_ids(layer_ids: list[int], num_layers: Any) -> None:
    """Every rotation layer id lies in [0, num_layers); ValueError otherwise (the schema's and the reader's)."""
    ok = isinstance(num_layers, int) and not isinstance(num_layers, bool) and num_layers >= 1
    if not ok or any(not 0 <= i < num_layers for i in layer_ids):
        raise ValueError(f"rotation.layer_ids must lie in [0, model.num_layers); model.num_layers is "
                         f"{str(num_layers)[:24]}, the largest id {max(layer_ids, default=None)}")


def resolve_key_bits(key_bits: list[int] | None, layers: int) -> list[int]:
    """Per-layer key bits as the format means them: `quant.key_bits`, or 2 in each of `layers` when absent."""
    return [int(b) for b in key_bits] if key_bits is not None else [layout.BITS] * layers


def mean_bits(key_bits: list[int]) -> float:
    """The mean of per-layer key bits, for displays and bits per element."""
    return sum(key_bits) / len(key_bits)

