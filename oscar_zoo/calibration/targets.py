"""Streaming float64 accumulators of the attention-aware targets, per (layer, KV head), mergeable.

A `SecondMoment` holds Σ w·x xᵀ and Σ w per (layer, KV head); `merge` adds two of them, which equals accumulating the
concatenation (what data-parallel calibration all-reduces). The three targets of docs/format.md §2 are all of this form:
- key target   C_Q[h] = mean over tokens and the g query heads of group h of q qᵀ      (x = q, w = 1)
- value target C_S[h] = Σ_t w_t v_t v_tᵀ / Σ_t w_t,  w_t = k_tᵀ C_Q[h] k_t             (x = v, second pass)
- softmax value target (1/N) Vᵀ SᵀS V = mean over queries of o oᵀ, o = S V the attention output per query head
  (x = o, w = 1) — so the paper's softmax form needs no extra pass.
A `FirstMoment` holds Σ w·x and Σ w per (layer, KV head), mergeable the same way: the means μ_K, μ_V the centred
codec subtracts (docs/format.md §6a), streamed in the first pass, and the key-weighted value mean Σ w_t v_t / Σ w_t of
the second, which turns the weighted value target into a covariance about μ_V (`centred_target`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def group_heads(x: Tensor, n_kv_heads: int) -> Tensor:
    """[B, H, T, D] → [H_kv, B·(H/H_kv)·T, D]: samples of KV head h are query heads [h·g, (h+1)·g) (contiguous GQA)."""
    B, H, T, D = x.shape
    g = H // n_kv_heads
    return x.reshape(B, n_kv_heads, g, T, D).permute(1, 0, 2, 3, 4).reshape(n_kv_heads, B * g * T, D)


def second_moment(x: Tensor, w: Tensor | None = None) -> Tensor:
    """Σ_n w_n x_n x_nᵀ per head, in float64 on x's device: x [H, N, D], w [H, N] or None → [H, D, D]. On an H200 a
    float64 product of one q batch [8, 32768, 128] takes 0.39 ms (FP64 tensor cores), no faster in fp32 or in token
    chunks (benchmarks/RESULTS.md), so the sums stay float64 end to end as docs/format.md §2 says."""
    x64 = x.to(torch.float64)
    xw = x64 if w is None else x64 * w.to(x.device, torch.float64)[..., None]
    return torch.einsum("hnd,hne->hde", xw, x64)


@dataclass
class SecondMoment:
    """Σ w x xᵀ [L, H, D, D] and Σ w [L, H], float64."""

    sums: Tensor
    weights: Tensor

    @classmethod
    def zeros(cls, n_layers: int, n_heads: int, dim: int, device: torch.device | str = "cpu") -> SecondMoment:
        return cls(torch.zeros(n_layers, n_heads, dim, dim, dtype=torch.float64, device=device),
                   torch.zeros(n_layers, n_heads, dtype=torch.float64, device=device))

    def add(self, layer: int, x: Tensor, w: Tensor | None = None) -> None:
        """x [H, N, D] samples per head; w [H, N] optional weights. The float64 product is formed where the samples
        are (the layer's device under a device map) and only the [H, D, D] result moves to the sums' device."""
        self.sums[layer] += second_moment(x, w).to(self.sums.device)
        if w is None:
            self.weights[layer] += x.shape[1]
        else:
            self.weights[layer] += w.to(self.weights.device, torch.float64).sum(-1)

    def merge(self, other: SecondMoment) -> SecondMoment:
        device = self.sums.device
        return SecondMoment(self.sums + other.sums.to(device), self.weights + other.weights.to(device))

    def mean(self) -> Tensor:
        """The target [L, H, D, D] (zero where nothing was accumulated)."""
        return self.sums / self.weights.clamp(min=1e-300)[..., None, None]

    def state(self, prefix: str) -> dict[str, Tensor]:
        return {f"{prefix}.sums": self.sums.cpu(), f"{prefix}.weights": self.weights.cpu()}

    @classmethod
    def from_state(cls, state: dict[str, Tensor], prefix: str, device: torch.device | str = "cpu") -> SecondMoment:
        return cls(state[f"{prefix}.sums"].to(device), state[f"{prefix}.weights"].to(device))


def key_weights(k: Tensor, key_target: Tensor) -> Tensor:
    """w_t = k_tᵀ C_Q[h] k_t, the expected squared logit of each key: k [H, N, D], key_target [H, D, D] → [H, N]."""
    k = k.to(key_target.device, torch.float64)
    return torch.einsum("hnd,hde,hne->hn", k, key_target, k)


def per_layer(target: Tensor) -> Tensor:
    """Per-head targets [L, H, D, D] → the reference code's shared per-layer form [L, 1, D, D] (mean over heads)."""
    return target.mean(dim=1, keepdim=True)


@dataclass
class FirstMoment:
    """Σ w·x [L, H, D] and Σ w [L, H] (the sample count when unweighted), float64: the per-(layer, KV head) mean,
    mergeable by addition."""

    sums: Tensor
    weights: Tensor

    @classmethod
    def zeros(cls, n_layers: int, n_heads: int, dim: int, device: torch.device | str = "cpu") -> FirstMoment:
        return cls(torch.zeros(n_layers, n_heads, dim, dtype=torch.float64, device=device),
                   torch.zeros(n_layers, n_heads, dtype=torch.float64, device=device))

    def add(self, layer: int, x: Tensor, w: Tensor | None = None) -> None:
        """x [H, N, D] samples per head, w [H, N] optional weights, summed in float64 where they are; only the [H, D]
        sum moves."""
        x64 = x.to(torch.float64)
        if w is None:
            self.sums[layer] += x64.sum(1).to(self.sums.device)
            self.weights[layer] += x.shape[1]
        else:
            w64 = w.to(x.device, torch.float64)
            self.sums[layer] += torch.einsum("hn,hnd->hd", w64, x64).to(self.sums.device)
            self.weights[layer] += w64.sum(-1).to(self.weights.device)

    def merge(self, other: FirstMoment) -> FirstMoment:
        return FirstMoment(self.sums + other.sums.to(self.sums.device),
                           self.weights + other.weights.to(self.sums.device))

    def mean(self) -> Tensor:
        """The mean [L, H, D] (zero where nothing was accumulated)."""
        return self.sums / self.weights.clamp(min=1e-300)[..., None]

    def state(self, prefix: str) -> dict[str, Tensor]:
        return {f"{prefix}.sums": self.sums.cpu(), f"{prefix}.weights": self.weights.cpu()}

    @classmethod
    def from_state(cls, state: dict[str, Tensor], prefix: str, device: torch.device | str = "cpu") -> FirstMoment:
        return cls(state[f"{prefix}.sums"].to(device), state[f"{prefix}.weights"].to(device))


def centred_target(second: Tensor, weighted_mean: Tensor, mean: Tensor) -> Tensor:
    """Σ w (x − μ)(x − μ)ᵀ / Σ w from the weighted second moment S = Σ w x xᵀ / Σ w [..., D, D], the weighted mean
    m = Σ w x / Σ w [..., D] and the centre μ [..., D]: S − m μᵀ − μ mᵀ + μ μᵀ (float64). With μ = m it is the
    weighted covariance."""
    S, m, mu = second.double(), weighted_mean.double(), mean.double()
    outer = lambda a, b: a[..., :, None] * b[..., None, :]  # noqa: E731
    return S - outer(m, mu) - outer(mu, m) + outer(mu, mu)
