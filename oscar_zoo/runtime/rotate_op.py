"""`rotate_rows`: the decode step's rotate / centre / file launch (x·M − μ·M per head, optionally written into a
tier slot), on the Triton kernel of `kernels/rotate.py` or `reference.rotate_rows_ref` (`dispatch`; the block
sizes are `config.current()`'s rotate_rows and rotate_block_e).
`rotate_chunk`: the same rows for a prompt chunk, as one tensor-core GEMM on a GPU."""

from __future__ import annotations

import torch
from torch import Tensor

from ..format import layout, reference
from . import config, dispatch
from .checks import check, check_tensor


def rotate_rows(
    x: Tensor,
    M: Tensor | None,
    mean_rot: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    dest: Tensor | None = None,
    slot: Tensor | None = None,
) -> Tensor:
    """x [B, H, D] → x·M − μ·M per head, float32 math rounded once to `out_dtype` (default x's), in one launch; same
    contract as `reference.rotate_rows_ref` (M [H_M, D, D] or [D, D] and mean_rot [H_μ, D] serve H / H_M and H / H_μ
    consecutive heads; either may be None). With `dest` [B, H, T, D] and `slot` (an integer tensor [B], read on the
    device) each row b is also written to dest[b, :, slot[b]] in dest's dtype. With neither M nor mean_rot and
    out_dtype = x's dtype the result is x itself (only the write runs)."""
    check_tensor("x", x, 3)
    check(x.is_floating_point(), lambda: f"x must be floating point, got {x.dtype}")
    B, H, D = x.shape
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if M is not None:
        check(isinstance(M, Tensor) and M.dim() in (2, 3) and M.shape[-2:] == (D, D),
              lambda: f"M must be [H_M, {D}, {D}] or [{D}, {D}], got {tuple(getattr(M, 'shape', ()))}")  # fmt: skip
        M = M.reshape(-1, D, D)
        check(H % M.shape[0] == 0,
              lambda: f"M has {M.shape[0]} heads, which does not divide the {H} heads of x")
        check(M.device == x.device, lambda: f"M is on {M.device}, x on {x.device}")
    if mean_rot is not None:
        check(isinstance(mean_rot, Tensor) and mean_rot.dim() == 2 and mean_rot.shape[1] == D
              and H % mean_rot.shape[0] == 0,
              lambda: f"mean_rot must be [H_mu, {D}] with H_mu dividing {H}, got {tuple(mean_rot.shape)}")  # fmt: skip
        check(mean_rot.device == x.device, lambda: f"mean_rot is on {mean_rot.device}, x on {x.device}")
    if dest is not None:
        check_tensor("dest", dest, 4)
        check(dest.shape[:2] == (B, H) and dest.shape[3] == D and dest.device == x.device,
              lambda: f"dest must be [{B}, {H}, T, {D}] on {x.device}, got {tuple(dest.shape)} on {dest.device}")
        check(isinstance(slot, Tensor) and slot.shape == (B,) and not slot.is_floating_point()
              and slot.device == x.device, lambda: f"slot must be an integer tensor [{B}] on x's device")  # fmt: skip
    identity = M is None and mean_rot is None and out_dtype == x.dtype
    if not (dispatch.use_kernel(x) and layout.is_power_of_two(D) and D >= 16 and B > 0):
        y = x if identity else reference.rotate_rows_ref(x, M, mean_rot, out_dtype)
        if dest is not None:
            dest[torch.arange(B, device=dest.device), :, slot.long()] = y.to(dest.dtype)
        return y
    x = dispatch.last_contiguous(x, 1)
    out = x if identity else dispatch.alloc((B, H, D), out_dtype, x.device)
    mean = mean_rot.contiguous() if mean_rot is not None else out  # placeholders where a pointer is unused
    cfg = config.current()
    block_e = min(D, cfg.rotate_block_e)
    grid = (H, D // block_e, -(-B // cfg.rotate_rows))
    dispatch.kernels().rotate_rows[grid](
        x, M if M is not None else out, mean, out, dest if dest is not None else out,
        slot if slot is not None else x,
        B, H // (M.shape[0] if M is not None else 1), H // (mean_rot.shape[0] if mean_rot is not None else 1),
        x.stride(0), x.stride(1), *(M.stride() if M is not None else (0, 0, 0)), mean.stride(0),
        out.stride(0), out.stride(1), *(dest.stride()[:3] if dest is not None else (0, 0, 0)),
        D=D, ROWS=cfg.rotate_rows, BLOCK_E=block_e, ROTATE=M is not None, CENTRE=mean_rot is not None,
        STORE_OUT=not identity, WRITE=dest is not None, num_warps=4,
    )  # fmt: skip
    return out


def rotate_chunk(x: Tensor, M: Tensor | None, mean_rot: Tensor | None = None) -> Tensor:
    """A prompt chunk's rows x [B, H, T, D] → x·M − μ·M per head, rounded once to x's dtype:
    `reference.rotate_centred`'s contract (M [H, D, D] or [1, D, D], None: x is rotated already; mean_rot [H, D] or
    [1, D], None: uncentred).

    On a GPU in bfloat16 this is one tensor-core GEMM instead of float32 math: M is split into two parts of x's
    dtype, M = M_hi + M_lo + ε (|ε| ≤ 2⁻¹⁶|M|), and −μ·M likewise, so that [x, x, 1, 1]·[M_hi; M_lo; −μ_hi;
    −μ_lo] accumulates x·M − μ·M in float32 from exact products and rounds once. The result is the float32 path's
    but for the last bit of the few elements whose value lies within ≈ 2⁻¹⁶·Σ|x||M| of a rounding boundary (GPU
    test: within one unit in the last place plus that bound everywhere, the last bit differing in under 1 %).
    Elsewhere the float32 reference runs."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and M is not None):  # no M: a subtraction at most
        return reference.rotate_centred(x, M, mean_rot)
    D = x.shape[-1]
    weights, cols = list(_split(M.reshape(-1, D, D), x.dtype)), [x, x]
    if mean_rot is not None:
        hi, lo = _split(-mean_rot.reshape(-1, 1, D), x.dtype)
        pad = hi.new_zeros(hi.shape[0], 6, D)  # K padded to a multiple of 8 (cuBLAS's fast alignment)
        weights += [hi, lo, pad]
        cols.append(x.new_ones(*x.shape[:-1], 8))
    heads = max(w.shape[0] for w in weights)
    W = torch.cat([w.expand(heads, -1, -1) for w in weights], dim=1)  # [H or 1, K, D]
    return torch.matmul(torch.cat(cols, dim=-1), W)


def _split(M: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """M (float32) as hi + lo in `dtype`: hi = M rounded, lo = the remainder rounded (|M − hi − lo| ≤ 2⁻¹⁶|M| in
    bfloat16)."""
    M = M.float()
    hi = M.to(dtype)
    return hi, (M - hi.float()).to(dtype)
