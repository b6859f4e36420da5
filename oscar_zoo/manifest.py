"""The versioned schema of an artifact folder's `manifest.json` (pydantic, frozen, extra fields forbidden).

One canonical JSON form (sorted keys, indent 2, trailing newline) so that a manifest's sha256 is stable. Big numbers
live in `rotations.safetensors`; the manifest says what they are, how they were made and how to check them.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from .errors import IntegrityError
from .format import layout
from .format.layout import MAX_WINDOW, Centring, Choice  # noqa: F401 -- Centring: the format's, re-exported
from .runtime import artifact
from .runtime.artifact import (  # noqa: F401
    ARTIFACT_FILES,
    MANIFEST_MAX_BYTES,
    MANIFEST_NAME,
    MAX_CALIBRATION_TOKENS,
    MAX_WALL_SECONDS,
    READ_VERSIONS,
    ROTATIONS_NAME,
    SCHEMA_VERSION,
    ArtifactError,
    one_line as _one_line,
)

# The format's file names, size limits and schema versions live in `runtime/artifact.py` (the runtime reads folders
# too); they are imported here for the schema and for the modules that read them from `manifest`.


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


class ModelIdentity(_Frozen):
    id: str
    revision: str | None = None
    architecture: str
    model_type: str
    num_layers: int = Field(ge=1)
    num_q_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=4)
    qk_norm: bool
    rope_theta: float | None = None
    config_sha256: str

    @field_validator("id", "revision", "architecture", "model_type")
    @classmethod
    def _one_line(cls, value: str | None) -> str | None:
        """Names that tools print and write into scripts (export --format sglang): at most 4,096 characters (a path),
        none of them a control, line-break or bidi-override character (`line_breaker`)."""
        if value is not None:
            if len(value) > 4096:
                raise ValueError(f"is {len(value)} characters long (at most 4096)")
            bad = line_breaker(value)
            if bad is not None:
                raise ValueError(f"holds {ascii(bad)}, a control, line-break or bidi-override character")
        return value


class QuantSpec(_Frozen):
    bits: Literal[2] = 2
    group_size: int = Field(ge=1)
    scale_dtype: Literal["float16"] = "float16"
    packing: Literal["quartered"] = "quartered"
    codebook: Literal["uniform", "lloyd-max"] = "uniform"
    # "mean": rows are stored as x·M − μ·M with the calibrated means k_mean, v_mean of rotations.safetensors
    # (docs/format.md §6a); "none": no centring, no mean tensors. Schema 2 only (a version-1 manifest has no such field
    # and means "none").
    centring: Centring = Centring.NONE
    # Bits of the history keys per layer of rotation.layer_ids (2 or 3; docs/format.md §6b), values always `bits`.
    # Schema 3 only; absent (None) means 2 everywhere: today's INT2 codec, and what versions 1–2 mean.
    key_bits: list[Literal[2, 3]] | None = None
    # History tokens per KV head that a prompt's last queries pin in BF16 beside the sink (docs/format.md §6c).
    # Schema 4 only; absent (None) means 0: no pinning, what versions 1–3 mean.
    pin: int | None = Field(default=None, ge=0, le=MAX_WINDOW, strict=True)
    # History keys per channel over blocks of this many tokens (docs/format.md §6d; one of layout.KEY_BLOCKS), values
    # per row. Schema 5 only; absent (None) means keys per row, what versions 1–4 mean.
    key_block: int | None = Field(default=None, strict=True)
    sink: int = Field(ge=0, le=MAX_WINDOW)
    recent: int = Field(ge=0, le=MAX_WINDOW)
    flush: int = Field(ge=1, le=MAX_WINDOW)


class RotationSpec(_Frozen):
    granularity: Granularity
    composition: Literal["U·H·P"] = "U·H·P"
    key_target: Literal["qqt"] = "qqt"
    value_target: ValueTarget
    capture_point: Literal["post-qknorm-post-rope"] = "post-qknorm-post-rope"
    hadamard: str
    layer_ids: list[int] = Field(min_length=1)

    @field_validator("layer_ids")
    @classmethod
    def _distinct_layers(cls, layer_ids: list[int]) -> list[int]:
        if min(layer_ids) < 0 or len(set(layer_ids)) != len(layer_ids):
            raise ValueError("layer ids must be distinct and non-negative")
        return layer_ids


class ClipSpec(_Frozen):
    mode: ClipMode
    grid: list[float]
    k_default: float
    v_default: float
    objective: str


class CalibrationRecord(_Frozen):
    dataset: str
    token_ids_sha256: str
    tokens: int = Field(ge=0, le=MAX_CALIBRATION_TOKENS)  # sequences × seq_len (`_whole_sequences`)
    sequences: int = Field(ge=0, le=MAX_CALIBRATION_TOKENS)
    seq_len: int = Field(ge=0, le=MAX_CALIBRATION_TOKENS)
    heldout_tokens: int = Field(ge=0, le=MAX_CALIBRATION_TOKENS)
    chat_template: bool
    seed: int
    device: str
    dtype: str
    versions: dict[str, str]
    created: str
    wall_seconds: float = Field(ge=0, le=MAX_WALL_SECONDS)

    @model_validator(mode="after")
    def _whole_sequences(self) -> CalibrationRecord:
        if self.tokens != self.sequences * self.seq_len:
            raise ValueError(f"calibration.tokens {self.tokens} is not sequences × seq_len = {self.sequences} × "
                             f"{self.seq_len}")
        return self


class ArtifactFile(_Frozen):
    path: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)

    @field_validator("path")
    @classmethod
    def _format_file(cls, path: str) -> str:
        if path not in ARTIFACT_FILES:
            raise ValueError(f"{path!r} is not a file of the oscar-zoo artifact format (only "
                             f"{', '.join(ARTIFACT_FILES)}); refusing it")
        return path


class Manifest(_Frozen):
    schema_version: Literal[READ_VERSIONS] = SCHEMA_VERSION
    tool: Literal["oscar-zoo"] = "oscar-zoo"
    model: ModelIdentity
    quant: QuantSpec
    rotation: RotationSpec
    clip: ClipSpec
    calibration: CalibrationRecord
    artifacts: list[ArtifactFile] = Field(default_factory=list)
    bits_per_element: dict[str, float]
    verification: dict[str, Any] | None = None

    @field_validator("artifacts")
    @classmethod
    def _each_once(cls, artifacts: list[ArtifactFile]) -> list[ArtifactFile]:
        paths = [a.path for a in artifacts]
        if len(set(paths)) != len(paths):
            raise ValueError("a file is listed twice")
        return artifacts

    @model_validator(mode="before")
    @classmethod
    def _version_fields(cls, data: Any) -> Any:
        quant = data.get("quant") if isinstance(data, dict) else None
        if isinstance(data, dict) and data.get("schema_version") == 1 and isinstance(quant, dict) \
                and "centring" in quant:
            raise ValueError("quant.centring is a schema-version-2 field; a version-1 manifest has none")
        return data

    @model_validator(mode="after")
    def _consistent_geometry(self) -> Manifest:
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
        outside = [i for i in self.rotation.layer_ids if i >= m.num_layers]
        if outside:
            raise ValueError(f"rotation.layer_ids {outside[:4]} reach past model.num_layers {m.num_layers}")
        if self.schema_version == 1 and q.centring != Centring.NONE:
            raise ValueError("quant.centring needs schema_version 2 (a version-1 artifact is uncentred)")
        if q.key_bits is not None:
            if self.schema_version < 3:
                raise ValueError(f"quant.key_bits needs schema_version 3 (version {self.schema_version} artifacts "
                                 "have 2-bit keys)")
            if len(q.key_bits) != len(self.rotation.layer_ids):
                raise ValueError(f"quant.key_bits has {len(q.key_bits)} entries for "
                                 f"{len(self.rotation.layer_ids)} rotation layers")
        if q.pin is not None and self.schema_version < 4:
            raise ValueError(f"quant.pin needs schema_version 4 (version {self.schema_version} artifacts pin nothing)")
        if q.key_block is not None:
            if self.schema_version < 5:
                raise ValueError(f"quant.key_block needs schema_version 5 (version {self.schema_version} artifacts "
                                 "code keys per row)")
            if q.key_block not in layout.KEY_BLOCKS:
                raise ValueError(f"quant.key_block {q.key_block} is not one of {list(layout.KEY_BLOCKS)}")
            if q.flush != q.key_block or q.group_size != m.head_dim or self.pin:
                raise ValueError(f"quant.key_block {q.key_block} needs flush = key_block (got {q.flush}), values per "
                                 f"row (group_size = head_dim {m.head_dim}, got {q.group_size}) and no pinned tokens "
                                 f"(got pin {self.pin})")
        return self

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
        """Bits of the history keys of each rotation layer (2 everywhere before schema 3)."""
        return list(self.quant.key_bits) if self.quant.key_bits is not None else [2] * len(self.rotation.layer_ids)

    @property
    def mean_key_bits(self) -> float:
        """The mean of `key_bits` over the layers: what bits per element count for the keys."""
        bits = self.key_bits
        return sum(bits) / len(bits)

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
        return layout.kv_bits_per_element(context, G, q.sink, q.recent, self.mean_key_bits, self.pin, self.key_block)

    @property
    def centred(self) -> bool:
        """True when rotations.safetensors carries k_mean and v_mean and the cache stores centred rows."""
        return self.quant.centring == Centring.MEAN

    @model_serializer(mode="wrap")
    def _version_1_form(self, handler):
        """A version-1 manifest is written as version 1 wrote it (no quant.centring), wherever it is dumped: its own
        file, or a catalog entry that embeds it, so both stay byte-identical."""
        data = handler(self)
        if isinstance(data.get("quant"), dict):
            if self.schema_version == 1:
                data["quant"].pop("centring", None)
            if self.quant.key_bits is None:  # versions 1–2 (and 2-bit keys) are written without the field
                data["quant"].pop("key_bits", None)
            if self.quant.pin is None:  # versions 1–3 are written without it
                data["quant"].pop("pin", None)
            if self.quant.key_block is None:  # versions 1–4 (and keys per row) are written without it
                data["quant"].pop("key_block", None)
        return data

    def to_json(self) -> str:
        return canonical_json(self.model_dump(mode="json"))

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "manifest.json") -> Manifest:
        return parse_versioned(cls, text, source, "schema_version", READ_VERSIONS)


def parse_versioned(model: type[BaseModel], text: str | bytes, source: str, version_field: str,
                    version: int | tuple[int, ...]):
    """Parse a versioned JSON document (text, or bytes that must be UTF-8) into `model`; `version` is the version (or
    the versions) this oscar-zoo reads. Every failure is an IntegrityError naming the file and place."""
    versions = version if isinstance(version, tuple) else (version,)
    data = load_json(text, source)
    if not isinstance(data, dict):
        raise IntegrityError(f"{source} must hold a JSON object, found {type(data).__name__}")
    try:
        artifact.check_version(data, source, version_field, versions)
    except ArtifactError as exc:
        raise IntegrityError(exc.message, exc.advice) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise IntegrityError(f"{source} is invalid at '{_one_line(where, 80)}': {_one_line(first['msg'], 300)}") \
            from None


def load_json(data: str | bytes, source: str) -> Any:
    """A JSON document as strict JSON (`runtime.artifact.load_json`: UTF-8, at most MANIFEST_MAX_BYTES and
    JSON_MAX_DEPTH deep, numbers finite and within int64); IntegrityError naming `source` otherwise."""
    try:
        return artifact.load_json(data, source)
    except ArtifactError as exc:
        raise IntegrityError(exc.message, exc.advice) from None


def canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
