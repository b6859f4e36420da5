"""Host wrappers of the runtime ops: validate inputs, then run the Triton kernel (CUDA tensors, or CPU tensors under
TRITON_INTERPRET=1) or fall back to the pure-PyTorch reference. Signatures equal their `reference` twins.

(Skeleton: the Triton dispatch lands with the kernels; until then every op runs its reference.)
"""

from __future__ import annotations

from torch import Tensor

from . import reference


def quantize_pack(
    x: Tensor, clip_ratio: float | Tensor, group_size: int = 0, rotation: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """x [B, H_kv, T, D] → packed uint8 [B, H_kv, T, D/4], scale_zero float16 [B, H_kv, T, D/G, 2].
    `clip_ratio`: float or [H_kv, 1] tensor; `rotation`: optional [H_kv, D, D] applied first (result rounded to x's
    dtype, as the cache stores it)."""
    return reference.quantize_pack_ref(x, clip_ratio, group_size, rotation)


def tiered_decode_attention(*args, **kwargs) -> tuple[Tensor, Tensor]:
    """Decode attention over sink / INT2 history / recent tiers; same arguments as
    `reference.tiered_decode_attention_ref`. Returns o [B, H_q, D] fp32 and lse [B, H_q]."""
    return reference.tiered_decode_attention_ref(*args, **kwargs)
