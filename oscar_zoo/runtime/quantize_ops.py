"""Host wrappers of quantize/pack (the prefill history, the demotion step and the pinned tokens): validate inputs,
then run the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) or fall back to the pure-PyTorch
reference (`reference.quantize_pack_ref`, `reference.quantize_pack_channel_ref`). The dispatch and the buffers are
`dispatch`'s, the launch settings `config.current()`'s; `ops` re-exports both ops."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..format import layout, reference
from . import config, dispatch
from .checks import check


@functools.lru_cache(maxsize=None)
def _ratio_scalar(ratio: float, device: torch.device) -> Tensor:
    """A float clip ratio as a 0-dim float64 device tensor, made once and kept (a captured CUDA graph may read it). The
    first call with a ratio copies it to the device, which a CUDA-graph capture does not allow: the runtime's cache
    passes per-head clip tensors."""
    return torch.tensor(ratio, dtype=torch.float64, device=device)


def quantize_pack(
    x: Tensor, clip_ratio: float | Tensor, group_size: int = 0, rotation: Tensor | None = None,
    min_ratio: float | None = None, bits: int = layout.BITS,
) -> tuple[Tensor, Tensor]:
    """x [B, H_kv, T, D] → packed uint8 [B, H_kv, T, layout.packed_dim(D, bits)] (D/4 bytes for 2-bit codes, 3D/8 for
    3-bit: the quartered low bits, then the third bits' plane), scale_zero float16 [B, H_kv, T, D/G, 2].
    `clip_ratio`: float or [H_kv, 1] tensor; `rotation`: optional [H_kv, D, D] applied first (result rounded to x's
    dtype, as the cache stores it). `min_ratio` (a tensor `clip_ratio` only): a host-side bound, every positive ratio
    in the tensor is ≥ it; it lets the kernel take the top-8 or top-16 build instead of the per-row dispatch (fewer
    registers). A bound above a ratio gives wrong codes for that row: pass it only for tensors that do not change
    (`Rotation.k_min_clip`)."""
    check(isinstance(x, Tensor) and x.is_floating_point(), "x must be a floating-point tensor [..., D]")
    check(x.dim() >= 1, "x must have at least one dim")
    D = x.shape[-1]
    G = layout.resolve_group_size(D, group_size)
    bits = layout.check_bits(bits)
    check(bits == 2 or D % 8 == 0, lambda: f"3-bit codes need a head dim that is a multiple of 8, got {D}")
    if rotation is not None:
        check(isinstance(rotation, Tensor),
              lambda: f"rotation must be a tensor [H_kv, D, D] or [D, D], got {type(rotation)}")
        check(
            rotation.dim() in (2, 3) and rotation.shape[-2:] == (D, D),
            lambda: f"rotation must be [H_kv, {D}, {D}] or [{D}, {D}], got {tuple(rotation.shape)}",
        )
        check(rotation.device == x.device, lambda: f"rotation is on {rotation.device}, x on {x.device}")
        if rotation.dim() == 3:
            check(
                x.dim() >= 3 and x.shape[-3] == rotation.shape[0],
                lambda: f"rotation has {rotation.shape[0]} heads but x {tuple(x.shape)} has no matching head dim (-3)",
            )
    kernel_ok = layout.is_power_of_two(D) and D >= 16 and x.numel() > 0
    if not (dispatch.use_kernel(x) and kernel_ok):
        return reference.quantize_pack_ref(x, clip_ratio, group_size, rotation, bits)

    # view x as [B, H, T, D] (leading dims folded into B)
    x4 = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape)) if x.dim() < 4 else x.reshape(-1, *x.shape[-3:])
    x4 = dispatch.last_contiguous(x4, 1)
    B, H, T, _ = x4.shape
    check(rotation is not None or B * H * T < 2**31, lambda: f"{B * H * T} rows exceed the kernel's int32 row index")
    # the kernel computes the clip index per row from a ratio tensor (no host op, no extra launch); a float ratio goes
    # the same way through a cached device scalar. A host bound on the clipped count m picks one of three builds: the
    # top-8 or top-16 path alone, or the per-row dispatch (whose general path holds 255 registers; the two others 167)
    if not isinstance(clip_ratio, Tensor):  # a float ratio ≤ 0 clips nothing: any build serves it, the smallest best
        min_ratio = float(clip_ratio) if clip_ratio > 0 else 1.0
    max_m = max_m_build(D, min_ratio)
    ratio = clip_ratio if isinstance(clip_ratio, Tensor) else _ratio_scalar(float(clip_ratio), x.device)
    ratio = ratio if ratio.device == x.device else ratio.to(x.device)
    ratio = ratio.float() if ratio.dtype == torch.bool else ratio
    try:
        r3 = ratio.expand(x.shape[:-1]).reshape(x4.shape[:-1])
    except RuntimeError as err:
        raise ValueError(
            f"clip_ratio of shape {tuple(ratio.shape)} does not broadcast to the rows of x {tuple(x.shape[:-1])}"
        ) from err
    codes = dispatch.alloc((B, H, T, layout.packed_dim(D, bits)), layout.CODE_DTYPE, x.device)
    scale_zero = dispatch.alloc((B, H, T, D // G, 2), layout.SCALE_DTYPE, x.device)

    table, cfg = dispatch.kernels(), config.current()
    import triton
    import triton.language as tl

    rotate = rotation is not None
    rot = rotation.contiguous() if rotate else x4  # dummy pointer when not rotating
    stride_rh = (rot.stride(0) if rot.dim() == 3 else 0) if rotate else 0
    x_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}.get(x.dtype)
    check(x_dtype is not None, lambda: f"x must be bfloat16, float16 or float32, got {x.dtype}")
    warps = 8 if rotate else cfg.quant_warps
    block_t = 16 if rotate else 32 * cfg.quant_warps  # one row per thread
    grid = (triton.cdiv(T, block_t), B * H) if rotate else (triton.cdiv(B * H * T, block_t),)
    table.quantize_pack[grid](
        x4, rot, r3, codes, scale_zero,
        B * H * T, H, T,
        x4.stride(0), x4.stride(1), x4.stride(2), stride_rh, *r3.stride(),
        D=D, G=G, BLOCK_T=block_t, ROTATE=rotate, X_DTYPE=x_dtype,
        MAX_M=max_m, NET16=cfg.quant_asm and not dispatch.interpret() and x.dtype != torch.float32,
        REL_FLOOR=layout.RANGE_REL_FLOOR, ABS_FLOOR=layout.RANGE_ABS_FLOOR,
        C1=table.round_thresholds[0], C2=table.round_thresholds[1], C3=table.round_thresholds[2], BITS=bits,
        num_warps=warps,
    )  # fmt: skip
    out_shape = tuple(x.shape[:-1])
    return codes.reshape(*out_shape, layout.packed_dim(D, bits)), scale_zero.reshape(*out_shape, D // G, 2)


_CHANNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def quantize_pack_channel(x: Tensor, block: int, bits: int = layout.BITS) -> tuple[Tensor, Tensor]:
    """Keys per channel over token blocks (docs/format.md §6d): x [..., T, D] (rows already rotated; T a multiple of
    `block`) → packed uint8 [..., T, layout.packed_dim(D, bits)] (the codes packed per token as `quantize_pack`'s rows)
    and scale_zero float16 [..., T / block, D, 2]: one min-max (scale, zero) per channel and block of `block` tokens,
    no clip. Bit for bit `reference.quantize_pack_channel_ref` on finite x (the float16 zero's sign aside where a
    block's minimum is a zero and both signed zeros occur there: that order is the reduction's).

    The kernel runs on CUDA tensors (and on CPU ones under TRITON_INTERPRET=1) for power-of-two D in 16..256 and
    bf16/fp16/fp32/fp64 x; otherwise the reference. No host sync and no host→device copy (CUDA-graph capturable once
    compiled); x may be a strided view (e.g. `tier[:, :, :F]` of a [B, H, W, D] buffer) with its last dim contiguous
    (else it is copied)."""
    check(isinstance(x, Tensor) and x.is_floating_point(), "x must be a floating-point tensor [..., T, D]")
    check(x.dim() >= 2, lambda: f"x must be [..., T, D] (at least two dims), got shape {tuple(x.shape)}")
    check(isinstance(block, int) and block >= 16 and layout.is_power_of_two(block),
          lambda: f"block must be a power of two ≥ 16 (tokens per scale/zero block), got {block!r}")  # fmt: skip
    bits = layout.check_bits(bits)
    T, D = x.shape[-2:]
    check(T % block == 0, lambda: f"x has {T} tokens, not whole blocks of {block}")
    check(D % layout.CODES_PER_BYTE == 0, lambda: f"head dim {D} must be a multiple of {layout.CODES_PER_BYTE}")
    check(bits == 2 or D % 8 == 0, lambda: f"3-bit codes need a head dim that is a multiple of 8, got {D}")
    kernel_ok = layout.is_power_of_two(D) and 16 <= D <= 256 and x.dtype in _CHANNEL_DTYPES and x.numel() > 0
    if not (dispatch.use_kernel(x) and kernel_ok):
        return reference.quantize_pack_channel_ref(x, block, bits)

    # view x as [B, H, T, D] (leading dims folded into B; a view where the strides allow)
    x4 = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape)) if x.dim() < 4 else x.reshape(-1, *x.shape[-3:])
    x4 = dispatch.last_contiguous(x4, 1)
    B, H = x4.shape[:2]
    NB = T // block
    check(B * H * NB < 2**31, lambda: f"{B * H * NB} blocks exceed the kernel's grid")
    codes = dispatch.alloc((B, H, T, layout.packed_dim(D, bits)), layout.CODE_DTYPE, x.device)
    scale_zero = dispatch.alloc((B, H, NB, D, 2), layout.SCALE_DTYPE, x.device)

    cfg = config.current()
    cpt = min(4, max(1, D // 32))  # channels per thread: a warp a program up to D = 128 (two at 256)
    flat = dispatch.interpret() and not cfg.quant_channel_interpret_gpu_build
    dispatch.kernels().quantize_pack_channel[(B * H * NB,)](
        x4, codes, scale_zero, H, NB, x4.stride(0), x4.stride(1), STRIDE_T=x4.stride(2),
        D=D, KB=block, TC=block if flat else min(block, cfg.quant_channel_chunk), CPT=cpt, FLAT=flat, BITS=bits,
        REL_FLOOR=layout.RANGE_REL_FLOOR, ABS_FLOOR=layout.RANGE_ABS_FLOOR,
        num_warps=max(1, D // cpt // 32),
    )  # fmt: skip
    lead = tuple(x.shape[:-2])
    return codes.reshape(*lead, T, layout.packed_dim(D, bits)), scale_zero.reshape(*lead, NB, D, 2)


def max_m_build(D: int, min_ratio: float | None) -> int:
    """The quantize kernel's top-k build (MAX_M) for rows whose positive clip ratios are all ≥ `min_ratio`: 8 or 16
    when every clipped row's m = D − clip_index fits that path (a ratio ≤ 0 clips nothing), else 0 (the dispatch)."""
    if min_ratio is None:
        return 0
    k = int(reference.clip_index(float(min_ratio), D))
    if k < 0:  # a bound ≤ 0 bounds nothing
        return 0
    m = D - k
    return 8 if m <= 8 else 16 if m <= 16 else 0
