"""The versioned schema of an artifact folder's `manifest.json` (pydantic, frozen, extra fields forbidden).

One canonical JSON form (sorted keys, indent 2, trailing newline) so that a manifest's sha256 is stable. Big numbers
live in `rotations.safetensors`; the manifest says what they are, how they were made and how to check them.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import IntegrityError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
ROTATIONS_NAME = "rotations.safetensors"
ARTIFACT_FILES = (ROTATIONS_NAME,)  # the files a manifest may list: the format has no others (the model card that push
# writes beside them is generated from the manifest, not listed in it)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Granularity(str, Enum):
    PER_HEAD = "per-head"
    PER_LAYER = "per-layer"


class ValueTarget(str, Enum):
    WEIGHTED = "weighted"  # reference code: C_S = mean_t w_t v vᵀ, w_t = kᵀ C_Q k normalised to mean 1
    SOFTMAX = "softmax"  # paper figure: C_S = (1/N) Vᵀ SᵀS V with causal softmax scores


class ClipMode(str, Enum):
    SEARCH = "search"
    FIXED = "fixed"


class ModelIdentity(_Frozen):
    id: str
    revision: str | None = None
    architecture: str
    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool
    rope_theta: float | None = None
    config_sha256: str


class QuantSpec(_Frozen):
    bits: Literal[2] = 2
    group_size: int
    scale_dtype: Literal["float16"] = "float16"
    packing: Literal["quartered"] = "quartered"
    codebook: Literal["uniform", "lloyd-max"] = "uniform"
    sink: int
    recent: int
    flush: int


class RotationSpec(_Frozen):
    granularity: Granularity
    composition: Literal["U·H·P"] = "U·H·P"
    key_target: Literal["qqt"] = "qqt"
    value_target: ValueTarget
    capture_point: Literal["post-qknorm-post-rope"] = "post-qknorm-post-rope"
    hadamard: str
    layer_ids: list[int]


class ClipSpec(_Frozen):
    mode: ClipMode
    grid: list[float]
    k_default: float
    v_default: float
    objective: str


class CalibrationRecord(_Frozen):
    dataset: str
    token_ids_sha256: str
    tokens: int
    sequences: int
    seq_len: int
    heldout_tokens: int
    chat_template: bool
    seed: int
    device: str
    dtype: str
    versions: dict[str, str]
    created: str
    wall_seconds: float


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
    schema_version: Literal[1] = SCHEMA_VERSION
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

    def to_json(self) -> str:
        return canonical_json(self.model_dump(mode="json"))

    @classmethod
    def from_json(cls, text: str, source: str = "manifest.json") -> Manifest:
        return parse_versioned(cls, text, source, "schema_version", SCHEMA_VERSION)


def parse_versioned(model: type[BaseModel], text: str, source: str, version_field: str, version: int):
    """Parse a versioned JSON document into `model`; every failure is an IntegrityError naming the file and place."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise IntegrityError(f"{source} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise IntegrityError(f"{source} must hold a JSON object, found {type(data).__name__}")
    if data.get(version_field) != version:
        raise IntegrityError(
            f"{source} has {version_field} {data.get(version_field)!r}; this oscar-zoo reads version {version}",
            "upgrade oscar-zoo, or re-create the file with this version",
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise IntegrityError(f"{source} is invalid at '{where}': {first['msg']}") from None


def canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
