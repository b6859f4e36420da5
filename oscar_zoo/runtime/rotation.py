"""One layer's fixed OSCAR tensors as `OscarCache` holds them (`Rotation`), and the fingerprint that names a
rotation."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from ..format import layout


@dataclass
class Rotation:
    """One layer's fixed OSCAR tensors: rotations float32 [H, D, D] (H = H_kv, or 1 shared), clip ratios [H, 1], and
    the centred codec's offsets μ·M float32 [H, D] in the rotated basis (`reference.rotate_mean`; None: uncentred)."""

    k: Tensor
    v: Tensor
    k_clip: Tensor
    v_clip: Tensor
    k_mean: Tensor | None = None
    v_mean: Tensor | None = None
    # the smallest positive clip ratio of k_clip / v_clip, read once on the host (None: none positive); lets
    # `ops.quantize_pack` take a top-k build that fits every head's clip (`min_ratio`). The clips must not change after
    # this (OscarCache holds its own copies)
    k_min_clip: float | None = None
    v_min_clip: float | None = None
    k_bits: int = layout.BITS  # bits of the history keys (2 or 3; docs/format.md §6b); values always layout.BITS

    def __post_init__(self):
        for name in ("k", "v"):
            clip = getattr(self, f"{name}_clip")
            if getattr(self, f"{name}_min_clip") is None:  # built once per layer, before any step is captured
                positive = clip[clip > 0]
                setattr(self, f"{name}_min_clip", float(positive.min()) if positive.numel() else None)

    def to(self, device: torch.device) -> Rotation:
        return Rotation(*(None if t is None else t.to(device)
                          for t in (self.k, self.v, self.k_clip, self.v_clip, self.k_mean, self.v_mean)),
                        self.k_min_clip, self.v_min_clip, self.k_bits)

    def per_query_head(self, M: Tensor, n_q_heads: int) -> Tensor:
        """M [H, D, D] → [H_q, D, D], GQA convention (query head j uses KV head j // g); shared stays [1, D, D]."""
        return M if M.shape[0] == 1 else M.repeat_interleave(n_q_heads // M.shape[0], dim=0)


def fingerprint(t: Tensor) -> str:
    """sha256 of a tensor's float32 values (host copy): names a rotation without keeping or comparing tensors."""
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()
