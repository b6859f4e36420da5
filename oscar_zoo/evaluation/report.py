"""The verification report (pydantic, frozen, extra fields forbidden): what `verify --json` prints and `--write` stores
in the manifest's `verification` field; plus the threshold check that turns it into pass / fail."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ..runtime.layout import Choice

REPORT_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Generation(_Frozen):
    """Greedy continuation of one held-out prompt compared with BF16's."""

    # oscar-cache: the runtime itself (OscarCache + `oscar` attention); dynamic-cache: BF16 (the model's own attention);
    # quantized-cache: transformers' QuantizedCache (a peer baseline)
    path: Literal["oscar-cache", "dynamic-cache", "quantized-cache"]
    prompt_tokens: int
    new_tokens: int
    first_divergence: int | None  # index of the first generated token that differs from BF16's; None: all equal
    matched_tokens: int  # generated tokens equal to BF16's at the same index


class MethodResult(_Frozen):
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


class Thresholds(_Frozen):
    max_ppl_increase: float
    max_kl: float
    min_top1: float


# Set from the demo model (SmolLM2-135M-Instruct, 8×2048 held-out tokens, per-head OSCAR calibrated on 4096 tokens
# with searched clips), which measured Δ PPL +5.1 %, KL 0.054, top-1 87.7 % past the windows: about 2× margin on the
# perplexity increase and KL, 1.5× on the disagreement rate. Hadamard-only INT2 misses all three there (+13.6 %, 0.126,
# 79.9 %). docs/verify.md has the full table.
DEFAULT_THRESHOLDS = Thresholds(max_ppl_increase=0.10, max_kl=0.10, min_top1=0.82)
DEFAULT_MIN_NEEDLE_ACCURACY = 0.9  # the artifact's needle accuracy relative to BF16's


def describe_thresholds(t: Thresholds) -> str:
    return f"Δ PPL ≤ {100 * t.max_ppl_increase:g} %, KL ≤ {t.max_kl:g}, top-1 ≥ {100 * t.min_top1:g} %"


class NeedleMethod(_Frozen):
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


class NeedleReport(_Frozen):
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
    keys: list[str] = []  # every prompt's passkey, in `answers`' order (empty in reports written before it was kept)

    def method(self, name: str) -> NeedleMethod:
        return next(m for m in self.methods if m.name == name)


class VerifyReport(_Frozen):
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

    def method(self, name: str) -> MethodResult:
        return next(m for m in self.methods if m.name == name)


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
