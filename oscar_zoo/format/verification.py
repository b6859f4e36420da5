"""The verification record (frozen records, extra fields forbidden): what `verify --json` prints and `--write` stores
in the manifest's `verification` field (`Manifest.report` reads it back); plus the rules that turn it into pass / fail:
the thresholds, the needle gate, and whether a record verified a given manifest (`binding_mismatch`)."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Literal

from .layout import Choice
from .records import Record, SchemaError, record, spec

REPORT_VERSION = 1


@record
class Generation(Record):
    """Greedy continuation of one held-out prompt compared with BF16's."""

    # oscar-cache: the runtime itself (OscarCache + `oscar` attention); dynamic-cache: BF16 (the model's own attention);
    # quantized-cache: transformers' QuantizedCache (a peer baseline)
    path: Literal["oscar-cache", "dynamic-cache", "quantized-cache"]
    prompt_tokens: int
    new_tokens: int
    first_divergence: int | None  # index of the first generated token that differs from BF16's; None: all equal
    matched_tokens: int  # generated tokens equal to BF16's at the same index


@record
class MethodResult(Record):
    name: str
    label: str
    kind: Literal["reference", "artifact", "baseline"]
    bits_per_element: float  # mean of K and V at the verified context (windows and float16 scale/zero included)
    bits_per_element_k: float
    bits_per_element_v: float
    ppl: float  # all scored positions
    ppl_past_windows: float  # positions ≥ positions_from (their attention reads INT2 keys)
    ppl_increase: float  # ppl_past_windows / BF16's − 1
    kl: float  # mean KL(BF16 ‖ method) per token, positions ≥ positions_from
    top1: float  # top-1 agreement with BF16, positions ≥ positions_from
    layer_error: list[float]  # ‖o − o_bf16‖/‖o_bf16‖ per layer, one sequence, same inputs, queries ≥ positions_from
    kl_by_position: list[float]  # mean KL per bin of `bin_size` positions (all positions), over sequences
    generation: Generation | None = None


@record
class Thresholds(Record):
    max_ppl_increase: float
    max_kl: float
    min_top1: float


# Set from the demo model (SmolLM2-135M-Instruct, 8×2048 held-out tokens, per-head OSCAR calibrated on 4096 tokens
# with searched clips), which measured Δ PPL +5.1 %, KL 0.054, top-1 87.7 % past the windows: about 2× margin on the
# perplexity increase and KL, 1.5× on the disagreement rate. Hadamard-only INT2 misses all three there (+13.6 %, 0.126,
# 79.9 %). docs/verify.md has the full table.
DEFAULT_THRESHOLDS = Thresholds(max_ppl_increase=0.10, max_kl=0.10, min_top1=0.82)
DEFAULT_MIN_NEEDLE_ACCURACY = 0.9  # the artifact's needle accuracy relative to BF16's


def looser_than_defaults(thresholds: Thresholds, min_needle_accuracy: float | None = None) -> list[str]:
    """Each threshold (and the needle gate, when given) that lets through more than verify's defaults, as
    `KL ≤ 1 (default 0.1)`; empty when none does (tighter ones are fine)."""
    d = DEFAULT_THRESHOLDS
    looser = []
    if not thresholds.max_ppl_increase <= d.max_ppl_increase:
        looser.append(f"Δ PPL ≤ {100 * thresholds.max_ppl_increase:g} % (default {100 * d.max_ppl_increase:g} %)")
    if not thresholds.max_kl <= d.max_kl:
        looser.append(f"KL ≤ {thresholds.max_kl:g} (default {d.max_kl:g})")
    if not thresholds.min_top1 >= d.min_top1:
        looser.append(f"top-1 ≥ {100 * thresholds.min_top1:g} % (default {100 * d.min_top1:g} %)")
    if min_needle_accuracy is not None and not min_needle_accuracy >= DEFAULT_MIN_NEEDLE_ACCURACY:
        looser.append(f"needle ≥ {min_needle_accuracy:g} × BF16 (default {DEFAULT_MIN_NEEDLE_ACCURACY:g})")
    return looser


def needle_gate(reference: float, artifact: float, min_relative: float, prompts: int) -> list[str]:
    """The needle grid's pass rule: the artifact's overall accuracy ≥ `min_relative` × the reference's, and the
    reference must have answered at least one of the `prompts`: with nothing to compare against there is no pass.
    `min_relative` 0 is no gate (the grid is reported, not judged). Returns the failures (empty: it passes)."""
    if min_relative == 0:
        return []
    if not reference > 0:
        return [f"needle: the reference answered none of the {prompts:,} prompts, so there is nothing to compare the "
                "artifact with"]
    if not artifact >= min_relative * reference:
        return [f"needle accuracy {artifact:.3f} is below {min_relative:g} × BF16's {reference:.3f}"]
    return []


def describe_thresholds(t: Thresholds) -> str:
    return f"Δ PPL ≤ {100 * t.max_ppl_increase:g} %, KL ≤ {t.max_kl:g}, top-1 ≥ {100 * t.min_top1:g} %"


@record
class NeedleMethod(Record):
    name: str
    label: str
    kind: Literal["reference", "artifact", "baseline"]
    accuracy: list[list[float]]  # [length][depth]: fraction of trials answered exactly
    overall: float  # over every (length, depth, trial)
    answers: list[str]  # the decoded answer of every prompt, in grid order (length, depth, trial)


class NeedleProtocol(Choice):
    """How the needle grid's question meets the cached context: "follow-up", the context filed first and the question
    a second chunk read through the tiers; "prompt", context and question one prompt (generate()'s path)."""

    FOLLOW_UP = "follow-up"
    PROMPT = "prompt"


@record
class NeedleReport(Record):
    """`verify --needle`: passkey retrieval through the runtime at several lengths and depths."""

    lengths: list[int]
    depths: list[float]
    trials: int
    seed: int
    needle: str  # the fact, with {key} for the five-digit passkey
    question: str
    sink: int
    recent: int
    methods: list[NeedleMethod]
    min_relative_accuracy: float  # pass: the artifact's overall accuracy ≥ this × BF16's
    passed: bool
    failures: list[str]
    wall_seconds: float
    protocol: NeedleProtocol = NeedleProtocol.FOLLOW_UP  # reports written before the option existed used "follow-up"
    batch: int = 1  # prompts per batch (`--needle-batch`); reports written before the option existed ran one at a time
    keys: list[str] = spec(factory=list)  # every prompt's passkey, in `answers`' order (empty in reports written
    # before it was kept)

    def method(self, name: str) -> NeedleMethod:
        return next(m for m in self.methods if m.name == name)


@record
class ReportBinding(Record):
    """What a report verified, recorded by `verify` from the artifact's manifest: the sha256 of every file it lists
    (the rotations), the model it names, and the sha256 of its quant, rotation and clip settings. Push accepts a
    report only where `binding_of` the folder's own manifest gives the same record (`binding_mismatch`)."""

    files: dict[str, str]  # path → sha256, every file the manifest lists (rotations.safetensors)
    model_id: str
    model_revision: str | None
    config_sha256: str  # the model's config.json, as the manifest records it
    settings_sha256: str  # sha256 of the canonical JSON of the manifest's `quant`, `rotation` and `clip`


@record
class VerifyReport(Record):
    report_version: Literal[1] = REPORT_VERSION
    model: str
    revision: str | None
    artifacts: str
    dataset: str
    context: int
    sequences: int
    positions_from: int
    tokens_scored: int
    sink: int
    recent: int
    group_size: int
    backend: Literal["torch", "triton"]
    device: str
    attention: str  # how the quantized attention was computed
    bin_size: int
    methods: list[MethodResult]
    thresholds: Thresholds
    passed: bool
    failures: list[str]
    wall_seconds: float
    versions: dict[str, str]
    created: str
    needle: NeedleReport | None = None  # with --needle
    # with --as-exported: the artifact's row is its exported form (heads averaged, no means, the median clips;
    # export/as_exported.py), not the artifact itself; `verify --write` never stores such a report
    as_exported: bool = False
    # what was verified (`binding_of` the artifact's manifest); None in reports written before it was recorded, which
    # push refuses (docs/hub.md, "The push gate")
    binding: ReportBinding | None = None

    def method(self, name: str) -> MethodResult:
        return next(m for m in self.methods if m.name == name)

    def to_json(self) -> str:
        """The report as one line of JSON (`verify --json`); a metric that is not a number (NaN, ±inf) is null."""
        return json.dumps(_finite(self.to_dict()), ensure_ascii=False, separators=(",", ":"))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def read_report(data: Any) -> tuple[VerifyReport | None, str | None]:
    """(the report, None) when `data` (a manifest's `verification`) is what `oscar-zoo verify --write` stores, else
    (None, why not: "there is none", or the first schema error with its field)."""
    if data is None:
        return None, "there is none"
    try:
        return VerifyReport.from_dict(data), None
    except SchemaError as exc:
        return None, f"{exc.where}: {exc.msg}"


def binding_of(manifest: Any) -> ReportBinding:
    """The binding of a report to the artifact `manifest` describes (a `Manifest`; read through its JSON form, so that
    the settings hash is the same whichever schema version wrote it). `binding_mismatch` compares two."""
    data = manifest.to_dict()
    settings = json.dumps({k: data[k] for k in ("quant", "rotation", "clip")}, sort_keys=True, ensure_ascii=False,
                          separators=(",", ":"))
    model = data["model"]
    return ReportBinding(files={a["path"]: a["sha256"] for a in data["artifacts"]}, model_id=model["id"],
                         model_revision=model.get("revision"), config_sha256=model["config_sha256"],
                         settings_sha256=hashlib.sha256(settings.encode()).hexdigest())


def binding_mismatch(report: VerifyReport, manifest: Any) -> str | None:
    """None when `report` verified the artifact `manifest` describes; else what differs, for one line: the report has
    no binding, or its files, model or settings are not the manifest's."""
    if report.binding is None:
        return "the report does not record which artifact it verified"
    was, now = report.binding, binding_of(manifest)
    diffs = []
    for path in sorted(set(was.files) | set(now.files)):
        if was.files.get(path) != now.files.get(path):
            diffs.append(f"{path}: verified {(was.files.get(path) or 'none')[:12]}, the folder holds "
                         f"{(now.files.get(path) or 'none')[:12]}")
    for what, a, b in (("model", was.model_id, now.model_id), ("model revision", was.model_revision,
                                                                now.model_revision),
                       ("model config", was.config_sha256[:12], now.config_sha256[:12]),
                       ("quant/rotation/clip settings", was.settings_sha256[:12], now.settings_sha256[:12])):
        if a != b:
            diffs.append(f"{what}: verified {a!r}, the manifest has {b!r}")
    return "; ".join(diffs) or None


def check_thresholds(artifact: MethodResult, thresholds: Thresholds) -> list[str]:
    """Which thresholds the artifact's method misses (empty: it passes); NaN always fails."""
    failures = []
    checks = (
        ("perplexity increase", artifact.ppl_increase, thresholds.max_ppl_increase, "≤", lambda v, t: v <= t),
        ("mean KL", artifact.kl, thresholds.max_kl, "≤", lambda v, t: v <= t),
        ("top-1 agreement", artifact.top1, thresholds.min_top1, "≥", lambda v, t: v >= t),
    )
    for what, value, limit, op, ok in checks:
        if math.isnan(value) or not ok(value, limit):
            failures.append(f"{what} {value:.4g} is not {op} {limit:.4g}")
    return failures
