"""Token-level quality metrics of a method's logits against the BF16 reference: next-token NLL (→ perplexity),
KL(BF16 ‖ method), top-1 agreement, and the relative error of attention outputs. fp32 per position (chunked over
positions to bound memory at vocabulary size), float64 for every mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

POSITION_CHUNK = 256


@dataclass
class Reference:
    """What the BF16 run leaves for comparisons: log-probabilities fp32 [T, V], argmax [T], and the probabilities
    exp(logprobs) fp32 [T, V] that every method's KL weighs by (made once, not once per method; None: made when
    needed)."""

    logprobs: Tensor
    top1: Tensor
    probs: Tensor | None = None


@dataclass
class TokenMetrics:
    """Per-position values for one sequence (position t predicts token t+1): nll, kl and agree are [T-1]."""

    nll: Tensor
    kl: Tensor
    agree: Tensor


def reference_of(logits: Tensor) -> Reference:
    """logits [T, V] (any float dtype) → fp32 log-probabilities, the greedy token per position, and the
    probabilities."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return Reference(logprobs, logprobs.argmax(-1), logprobs.exp())


def kl_divergence(ref_logprobs: Tensor, logprobs: Tensor, ref_probs: Tensor | None = None) -> Tensor:
    """KL(p_ref ‖ p) = Σ_v p_ref (log p_ref − log p) over the last dim, from log-probabilities (`ref_probs`: p_ref
    when it is at hand, exp(ref_logprobs)); fp32 [...]."""
    p = ref_logprobs.exp() if ref_probs is None else ref_probs
    return (p * (ref_logprobs - logprobs)).sum(-1).clamp(min=0.0)


def token_metrics(logits: Tensor, targets: Tensor, ref: Reference | None) -> TokenMetrics:
    """logits [T, V] of one sequence, targets [T-1] (the next tokens). Without a reference (the BF16 run itself) KL is
    0 and agreement 1 by definition.

    Per chunk of positions: one fp32 copy of the logits (into a buffer kept across chunks), their log-softmax, and
    the KL terms formed in place in the log-softmax's memory once NLL and agreement have read it; the same operations
    on the same values as `kl_divergence`, without its temporaries ([chunk, V] each, fresh pages every time)."""
    T = targets.shape[0]
    nll = torch.empty(T, dtype=torch.float32)
    kl = torch.zeros(T, dtype=torch.float32)
    agree = torch.ones(T, dtype=torch.bool)
    buffer = None
    for a in range(0, T, POSITION_CHUNK):
        b = min(T, a + POSITION_CHUNK)
        chunk = logits[a:b]
        if chunk.dtype == torch.float32:
            x = chunk
        else:  # what chunk.float() holds, in one buffer for every chunk
            buffer = torch.empty(chunk.shape, dtype=torch.float32, device=chunk.device) if buffer is None else buffer
            x = buffer[: b - a].copy_(chunk)
        lp = torch.log_softmax(x, dim=-1)  # [n, V]
        nll[a:b] = -lp.gather(-1, targets[a:b, None].to(lp.device)).squeeze(-1).cpu()
        if ref is not None:
            agree[a:b] = (lp.argmax(-1) == ref.top1[a:b]).cpu()
            p = ref.logprobs[a:b].exp() if ref.probs is None else ref.probs[a:b]
            terms = torch.sub(ref.logprobs[a:b], lp, out=lp).mul_(p)  # p_ref (log p_ref − log p), lp's memory
            kl[a:b] = terms.sum(-1).clamp(min=0.0).cpu()
    return TokenMetrics(nll, kl, agree)


def reference_metrics(ref: Reference, targets: Tensor) -> TokenMetrics:
    """`token_metrics` of the reference run itself from its `Reference` (no second log-softmax): the NLL read from
    its log-probabilities (the rows `token_metrics` would compute: log-softmax is per row), KL 0, agreement 1."""
    T = targets.shape[0]
    nll = -ref.logprobs[:T].gather(-1, targets[:, None].to(ref.logprobs.device)).squeeze(-1).cpu()
    return TokenMetrics(nll, torch.zeros(T, dtype=torch.float32), torch.ones(T, dtype=torch.bool))


def perplexity(nll: Tensor) -> float:
    """exp(mean NLL), the mean in float64."""
    return math.exp(nll.double().mean().item()) if nll.numel() else float("nan")


def mean(x: Tensor) -> float:
    return x.double().mean().item() if x.numel() else float("nan")


def relative_error(out: Tensor, ref: Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ (Frobenius over all elements), float64."""
    ref64 = ref.double()
    denom = ref64.norm().item()
    return (out.double() - ref64).norm().item() / denom if denom > 0 else float("nan")


def binned_mean(values: Tensor, bin_size: int) -> list[float]:
    """values [N, P] (N sequences × P positions) → mean over sequences and over each run of `bin_size` positions."""
    P = values.shape[-1]
    return [mean(values[..., a : a + bin_size]) for a in range(0, P, bin_size)]
