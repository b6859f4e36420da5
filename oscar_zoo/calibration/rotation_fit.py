"""Rotations M = U·H·P from the calibrated targets, per (layer, KV head) or shared per layer, with their checks."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import OscarZooError
from ..format import reference
from ..format.schema import Granularity
from .targets import per_layer

ORTHOGONALITY_TOLERANCE = 1e-6  # max |MᵀM − I| in float32 (docs/format.md §3)


def fit_rotations(target: Tensor, granularity: Granularity) -> tuple[Tensor, Tensor]:
    """target [L, H_kv, D, D] float64 → (rotation float32 [L, H, D, D], ascending eigenvalues float32 [L, H, D]) with
    H = H_kv for "per-head" and 1 for "per-layer"."""
    if granularity == Granularity.PER_LAYER:
        target = per_layer(target)
    if target.shape[0] == 0:  # a data-parallel rank with no layers of its own
        return torch.zeros(target.shape, dtype=torch.float32), torch.zeros(target.shape[:-1], dtype=torch.float32)
    M, evals = reference.rotation_from_target(target)
    M32 = M.to(torch.float32)
    eye = torch.eye(M.shape[-1])
    err = (M32.transpose(-1, -2) @ M32 - eye).abs().max().item()
    if err > ORTHOGONALITY_TOLERANCE:
        raise OscarZooError(f"internal error: a fitted rotation is not orthogonal (max |MᵀM − I| = {err:.2e})")
    return M32, evals.to(torch.float32)


def spectrum_ratio(eigenvalues: Tensor) -> Tensor:
    """λmax / λmean per row of ascending eigenvalues [..., D]: how concentrated the target's energy is."""
    ev = eigenvalues.double()
    return ev[..., -1] / ev.mean(-1).clamp(min=1e-300)
