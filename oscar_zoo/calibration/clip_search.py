"""Clip-ratio search per (layer, head, K/V) on held-out calibration tokens, through the reference quantizer.

The objective is the attention error the choice causes (docs/format.md §5), measured in the rotated space the cache
uses:
- keys:   mean over held-out keys of δkᵀ (Mᵀ C_Q M) δk — the expected squared logit error under the calibrated query
          distribution, δk = fake_quant(k·M) − k·M;
- values: mean squared error of the attention output Σ_t p_t δv_t, with the held-out sequences' own causal softmax
          probabilities p (the output error of every query, including the sink/recent positions that stay exact
          in the cache, so it ranks ratios rather than predicting the cache's error).
With the centred codec (docs/format.md §6a) both run on the centred rows x·M − μ·M the cache quantizes (`k_mean`,
`v_mean`: μ·M per head); the errors δ are the same in either frame, so only the rows change. The grid always contains
the fixed defaults, so the searched ratio is never worse on this objective than them.
`objective="reconstruction"` ranks ratios by the plain mean squared error of the rotated rows instead (K and V alike),
the attention-blind criterion the quality sweep (benchmarks/QUALITY.md) compares against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..format import layout, reference

DEFAULT_GRID = (0.80, 0.84, 0.88, 0.90, 0.92, 0.94, 0.96, 0.98, 1.0)
OBJECTIVES = ("attention", "reconstruction")


def search_grid(grid: tuple[float, ...] = DEFAULT_GRID) -> list[float]:
    return sorted(set(grid) | {layout.DEFAULT_K_CLIP, layout.DEFAULT_V_CLIP})


@dataclass(frozen=True)
class LayerSample:
    """Held-out attention inputs of one layer: q [S, H_q, T, D], k/v [S, H_kv, T, D] (unrotated), softmax scale."""

    q: Tensor
    k: Tensor
    v: Tensor
    scaling: float


def _rows(x: Tensor, rotation: Tensor, mean_rot: Tensor | None = None) -> Tensor:
    """[S, H_kv, T, D] rotated by M [H, D, D] (H = H_kv or 1), centred by mean_rot [H, D] when given → [H_kv, S·T, D]
    fp32 rows."""
    xr = reference.rotate_centred(x.float(), rotation, mean_rot)
    return xr.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])


def key_objective(k_rows: Tensor, metric: Tensor, ratio: float, group_size: int) -> Tensor:
    """Mean δkᵀ C δk per head: k_rows [H, N, D] rotated keys, metric [H, D, D] rotated key target → [H] float64."""
    delta = (reference.fake_quant(k_rows, ratio, group_size) - k_rows).double()
    return torch.einsum("hnd,hde,hne->h", delta, metric.double(), delta) / k_rows.shape[1]


def value_objective(probs: Tensor, v: Tensor, rotation: Tensor, ratio: float, group_size: int,
                    mean_rot: Tensor | None = None) -> Tensor:
    """Mean squared attention-output error per KV head: probs [S, H_q, T, T] causal softmax, v [S, H_kv, T, D];
    mean_rot [H, D]: the rows are centred first (the centred codec)."""
    vr = reference.rotate_centred(v.float(), rotation, mean_rot)
    delta = reference.fake_quant(vr, ratio, group_size) - vr  # [S, H_kv, T, D]
    H_kv, g = v.shape[1], probs.shape[1] // v.shape[1]
    err = probs @ delta.repeat_interleave(g, dim=1)  # [S, H_q, T, D]
    per_q_head = err.double().pow(2).sum(-1).mean(dim=(0, 2))  # [H_q]
    return per_q_head.reshape(H_kv, g).mean(-1)


def reconstruction_objective(rows: Tensor, ratio: float, group_size: int) -> Tensor:
    """Mean squared reconstruction error ‖fake_quant(x) − x‖² per head of rotated rows [H, N, D] → [H] float64."""
    return (reference.fake_quant(rows, ratio, group_size) - rows).double().pow(2).sum(-1).mean(-1)


def causal_probs(sample: LayerSample) -> Tensor:
    """Full-precision causal softmax probabilities of a held-out sample, [S, H_q, T, T] fp32."""
    q, k = sample.q.float(), sample.k.float()
    g = q.shape[1] // k.shape[1]
    logits = q @ k.repeat_interleave(g, dim=1).transpose(-1, -2) * sample.scaling
    T = q.shape[2]
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


def objectives(sample: LayerSample, k_rotation: Tensor, v_rotation: Tensor, key_target: Tensor,
               grid: list[float], group_size: int, objective: str = "attention", k_mean: Tensor | None = None,
               v_mean: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Objective tables for one layer: (key [R, H], value [R, H]) for the R grid ratios and H rotation heads
    (H = H_kv per-head; per-layer rotations sum the KV heads into one column). `objective`: "attention" (logit error
    under C_Q for K, attention-output error for V) or "reconstruction" (MSE of the rotated rows, K and V).
    k_mean, v_mean [H, D]: μ·M of the centred codec (`reference.rotate_mean`); None: uncentred rows."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown clip objective {objective!r}; choose from {', '.join(OBJECTIVES)}")
    H_rot = k_rotation.shape[0]
    if objective == "reconstruction":
        k_rows, v_rows = _rows(sample.k, k_rotation, k_mean), _rows(sample.v, v_rotation, v_mean)  # [H_kv, S·T, D]
        key = torch.stack([reconstruction_objective(k_rows, r, group_size) for r in grid])
        value = torch.stack([reconstruction_objective(v_rows, r, group_size) for r in grid])
        if H_rot == 1:
            key, value = key.sum(-1, keepdim=True), value.sum(-1, keepdim=True)
        return key, value
    # Mᵀ C_Q[h] M per KV head (a shared rotation [1, D, D] broadcasts over the per-head targets [H_kv, D, D])
    metric = k_rotation.double().transpose(-1, -2) @ key_target.double() @ k_rotation.double()
    k_rows = _rows(sample.k, k_rotation, k_mean)
    probs = causal_probs(sample)
    key = torch.stack([key_objective(k_rows, metric, r, group_size) for r in grid])
    value = torch.stack([value_objective(probs, sample.v, v_rotation, r, group_size, v_mean) for r in grid])
    if H_rot == 1:
        key, value = key.sum(-1, keepdim=True), value.sum(-1, keepdim=True)
    return key, value


def key_noise(sample: LayerSample, k_rotation: Tensor, key_target: Tensor, group_size: int,
              k_mean: Tensor | None = None) -> Tensor:
    """The logit noise INT2 keys add in one layer: mean δkᵀ (Mᵀ C_Q M) δk of unclipped 2-bit keys per rotation head
    (H_kv per-head, or summed into one for a per-layer rotation) → [H] float64. It ranks the layers for 3-bit keys
    (`choose_key_bits`): a layer whose 2-bit keys move the attention logits most gains most from the third bit."""
    metric = k_rotation.double().transpose(-1, -2) @ key_target.double() @ k_rotation.double()
    noise = key_objective(_rows(sample.k, k_rotation, k_mean), metric, 1.0, group_size)
    return noise.sum(-1, keepdim=True) if k_rotation.shape[0] == 1 else noise


def choose_key_bits(noise: Tensor, mean_bits: float) -> list[int]:
    """Key bits per layer for a mean of `mean_bits` over the L layers (2 ≤ mean_bits ≤ 3): the round((mean_bits − 2)·L)
    layers with the largest INT2 key noise (`key_noise`, [L, H] or [L]; summed over heads) get 3 bits, the rest 2;
    ties go to the earlier layer."""
    if not 2 <= mean_bits <= 3:
        raise ValueError(f"the mean key bits must lie in [2, 3], got {mean_bits}")
    per_layer = noise.double().reshape(noise.shape[0], -1).sum(-1)
    L = per_layer.shape[0]
    n3 = round((mean_bits - 2) * L + 1e-9)
    order = sorted(range(L), key=lambda i: (-per_layer[i].item(), i))
    three = set(order[:n3])
    return [3 if i in three else 2 for i in range(L)]


def pick(table: Tensor, grid: list[float]) -> Tensor:
    """The grid ratio minimising each column of an objective table [R, H] → float32 [H]."""
    return torch.tensor(grid, dtype=torch.float32)[table.argmin(dim=0)]
