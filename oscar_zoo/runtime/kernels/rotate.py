"""One row per (batch, head) rotated, centred and filed, in one launch: the per-token work of a decode step.

    y[b, h] = x[b, h]·M[h // (H / H_M)] − μ[h // (H / H_μ)]      (float32 math; M absent: y = x − μ)

stored in the output's dtype and, optionally, also at row `slot[b]` of a tier buffer dest [B, H, T, D] (each batch
row at its own slot, read on the device, so a CUDA graph can hold the launch). The decode step uses it three times:
the new key and value (rotated, centred, written to the recent tier), the query (rotated by its KV head's M_K, kept
float32) and, when the value rotation is not folded into the weights, the attention output (by M_Vᵀ, a transposed
view: M is read through its strides).

Grid (H, D / BLOCK_E, ⌈B / ROWS⌉): a program loads one [D, BLOCK_E] column block of its head's M once and serves up
to ROWS rows with it, each as float32 products summed over D (no tensor-core dot: a decode step has a few rows, and an
MMA would pad them to 16 and round through TF32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .rounding import round_to


@triton.jit
def _rotate_rows_kernel(
    x_ptr, m_ptr, mean_ptr, out_ptr, dest_ptr, slot_ptr,
    B, HEADS_PER_M, HEADS_PER_MEAN,
    stride_xb, stride_xh, stride_mh, stride_mr, stride_mc, stride_meanh, stride_ob, stride_oh,
    stride_db, stride_dh, stride_dt,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
    ROTATE: tl.constexpr, CENTRE: tl.constexpr, STORE_OUT: tl.constexpr, WRITE: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    dims = tl.arange(0, D)
    if ROTATE:
        m_head = m_ptr + (h // HEADS_PER_M).to(tl.int64) * stride_mh
        m = tl.load(m_head + dims[:, None] * stride_mr + cols[None, :] * stride_mc).to(tl.float32)  # [D, BLOCK_E]
    if CENTRE:
        mu = tl.load(mean_ptr + (h // HEADS_PER_MEAN) * stride_meanh + cols).to(tl.float32)
    row0 = tl.program_id(2) * ROWS
    for b in range(row0, tl.minimum(row0 + ROWS, B)):
        x_row = x_ptr + b * stride_xb + h * stride_xh
        if ROTATE:
            y = tl.sum(tl.load(x_row + dims).to(tl.float32)[:, None] * m, axis=0)  # [BLOCK_E]
        else:
            y = tl.load(x_row + cols).to(tl.float32)
        if CENTRE:
            y = y - mu
        if STORE_OUT:
            tl.store(out_ptr + b * stride_ob + h * stride_oh + cols, round_to(y, out_ptr.dtype.element_ty))
        if WRITE:
            slot = tl.load(slot_ptr + b).to(tl.int64)
            dest = dest_ptr + b * stride_db + h * stride_dh + slot * stride_dt + cols
            tl.store(dest, round_to(y, dest_ptr.dtype.element_ty))
