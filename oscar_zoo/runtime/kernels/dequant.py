"""Dequantize INT2 (or 3-bit) history rows straight into a dense buffer in the model's dtype: what a later prefill
chunk attends over (`cache.OscarLayer.dense_kv`).

Grid (B·H, token tiles). A program reads BLOCK_T rows of packed codes ([BLOCK_T, D/4] bytes, plus D/8 bytes of bit
plane for 3-bit keys; any strides, so V's token-major codes read as they are stored) and their scale/zero pairs, and
writes x̂ = (c − z)·s (float32, `reference.dequantize`'s order of operations, so the values are bit for bit the
reference's) rounded once to the output's dtype (to nearest even; bfloat16 by integer ops on the bits, which the
interpreter runs as the GPU does). Code layout (`reference.pack_codes`): dim d's low two bits are bits
2·(d // (D/4)) of byte d mod D/4; a 3-bit code's third bit is bit d // (D/8) of plane byte D/4 + d mod D/8.
Scales: per row in groups of G dims ([.., T, D/G, 2]) or, KEY_BLOCK > 0, per channel over blocks of KEY_BLOCK tokens
([.., T/KEY_BLOCK, D, 2]); the pair's two halves are adjacent (stride 1).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dequant_kernel(
    codes_ptr, sz_ptr, out_ptr, T, H,
    stride_cb, stride_ch, stride_ct, stride_cd,  # codes [B, H, T, W] bytes
    stride_sb, stride_sh, stride_st, stride_sg,  # scale/zero pairs [B, H, T or T/KEY_BLOCK, D/G or D, 2] f16
    stride_ob, stride_oh, stride_ot,  # out [B, H, T, D], dims contiguous
    D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, KEY_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = (t < T)[:, None]
    t64 = t.to(tl.int64)[:, None]
    d = tl.arange(0, D)[None, :]
    D4: tl.constexpr = D // 4
    rows = codes_ptr + b * stride_cb + h * stride_ch + t64 * stride_ct
    c = (tl.load(rows + (d % D4) * stride_cd, mask=ok, other=0).to(tl.int32) >> (2 * (d // D4))) & 3
    if BITS == 3:
        D8: tl.constexpr = D // 8
        plane = tl.load(rows + (D4 + d % D8) * stride_cd, mask=ok, other=0).to(tl.int32)
        c = c | (((plane >> (d // D8)) & 1) << 2)
    pairs = sz_ptr + b * stride_sb + h * stride_sh
    if KEY_BLOCK > 0:
        pairs = pairs + (t64 // KEY_BLOCK) * stride_st + d * stride_sg
    else:
        pairs = pairs + t64 * stride_st + (d // G) * stride_sg
    s = tl.load(pairs, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(pairs + 1, mask=ok, other=0.0).to(tl.float32)
    x = (c.to(tl.float32) - z) * s
    if out_ptr.dtype.element_ty == tl.bfloat16:
        # round to nearest even on the bits (the GPU's conversion does the same; the interpreter's truncates)
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        x = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        x = x.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + t64 * stride_ot + d, x, mask=ok)
