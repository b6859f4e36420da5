"""Keys per channel over token blocks (`_quantize_pack_channel_kernel`, docs/format.md §6d): twin of
`reference.quantize_pack_channel_ref`, bit for bit on finite keys (a float16 (scale, zero) per channel and block of
KB tokens by the same min-max rule, no clip; codes packed per token as the row kernel's, `quantize_pack.py`). One
program per (batch·head, block), D/CPT threads (CPT = 1, 2 or 4 channels a thread: one warp up to D = 128). A token
is loaded one element per thread and the loads are joined along register axes, so each thread holds its channels'
tokens (TC = 16 at a time) and every reduction along the tokens is in-thread; the per-channel work (scale, zero, and
the L thresholds of `_x_threshold`, the only float64 work) is done once per channel and block, not replicated. Pass 1
takes each channel's min/max over the block; pass 2 re-reads the chunks (from cache) and finds each code by a binary
search over its channel's ascending thresholds (2-bit: two compares and a select; 3-bit: three of each), the bits of
the code. Thread p = j·G + g holds channels j + (c·G + g)·D/NP (c < CPT) of pack group j (the NP = 4 or 8 codes
sharing a byte), so a 2-bit byte lies in one thread at CPT = 4, and a byte spread over G lanes is summed with one
shuffle per four tokens. The token stride is a constexpr (every load a pointer plus an immediate). The interpreter
loads a chunk as one tensor (`FLAT`: the same values, far fewer nested calls).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .quantize_pack import (  # the row kernel's float16 scale/zero rule and exact code thresholds
    _C4,
    _C5,
    _C6,
    _C7,
    _H1,
    _H2,
    _H3,
    _H4,
    _H5,
    _H6,
    _H7,
    _TIE1,
    _TIE2,
    _TIE3,
    _TIE4,
    _TIE5,
    _TIE6,
    _TIE7,
    ROUND_THRESHOLDS,
    _scale_zero16,
    _x_threshold,
)

_C1, _C2, _C3 = (tl.constexpr(c) for c in ROUND_THRESHOLDS[:3])


@triton.jit
def _load_joined(ptrs, STEP: tl.constexpr, N: tl.constexpr):
    """ptrs + i·STEP for i < N ([DT] pointers, one per thread), loaded and joined along a register axis: [DT, N] in
    order of i ([DT] for N = 1). A [DT] load has one element per thread; joins only add register axes."""
    if N == 1:
        return tl.load(ptrs)
    else:
        lo = _load_joined(ptrs, STEP, N // 2)
        hi = _load_joined(ptrs + (N // 2) * STEP, STEP, N // 2)
        if N == 2:
            return tl.join(lo, hi)
        else:
            return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [lo.shape[0], N])  # [DT, 2, N/2]: in order


@triton.jit
def _load_tile(ptrs, CSTEP: tl.constexpr, CPT: tl.constexpr, TSTEP: tl.constexpr, N: tl.constexpr,
               FLAT: tl.constexpr):
    """[DT, CPT, N]: CPT channels (pointer steps CSTEP) of N tokens (steps TSTEP) per thread, all in its registers.
    FLAT: one load of that pointer tensor instead (the same values; the interpreter's path: it has no layouts, and
    each nested call of the joins costs it more than the load)."""
    if FLAT:
        return tl.load(ptrs[:, None, None] + CSTEP * tl.arange(0, CPT)[None, :, None]
                       + TSTEP * tl.arange(0, N)[None, None, :])  # fmt: skip
    elif N == 1:
        if CPT == 1:
            return tl.load(ptrs)[:, None]
        else:
            return _load_joined(ptrs, CSTEP, CPT)
    else:
        lo = _load_tile(ptrs, CSTEP, CPT, TSTEP, N // 2, False)
        hi = _load_tile(ptrs + (N // 2) * TSTEP, CSTEP, CPT, TSTEP, N // 2, False)
        both = tl.join(lo, hi)  # [DT, CPT, N/2, 2] (or [DT, CPT, 2])
        if N == 2:
            return both
        else:
            return tl.reshape(tl.permute(both, (0, 1, 3, 2)), [lo.shape[0], CPT, N])


@triton.jit
def _bytes_across_lanes(part, L: tl.constexpr, LB: tl.constexpr):
    """part [DT, TC] float32: each thread's share of a byte per token (an integer < 256; the shares of a byte are
    disjoint bit fields on the L lanes p = (j·L + l)·LB + lb, l < L) → the bytes, [DT / (L·LB), LB, TC] uint8. Across
    lanes four tokens share a 32-bit word, so a shuffle moves four bytes."""
    DT: tl.constexpr = part.shape[0]
    TC: tl.constexpr = part.shape[1]
    byte = (part + 8388608.0).to(tl.int32, bitcast=True) & 0xFF  # the integer bits of 2^23 + part
    if L == 1:
        return tl.reshape(byte, [DT // LB, LB, TC]).to(tl.uint8)
    else:
        w = tl.sum(tl.reshape(byte, [DT, TC // 4, 4]) << (8 * tl.arange(0, 4))[None, None, :], axis=2)
        w = tl.sum(tl.reshape(w, [DT // (L * LB), L, LB, TC // 4]), axis=1)  # across the L lanes
        b = (w[:, :, :, None] >> (8 * tl.arange(0, 4))[None, None, None, :]) & 0xFF
        return tl.reshape(b, [DT // (L * LB), LB, TC]).to(tl.uint8)


@triton.jit
def _channel_codes_store(x, t1, t2, t3, t4, t5, t6, t7, codes_ptr, row0, G: tl.constexpr, BITS: tl.constexpr):
    """Codes of x [DT, CPT, TC] (float32; thread p = j·G + g holds channels j + (c·G + g)·D/NP, c < CPT) against
    their thresholds t_i [DT, CPT], packed per token (`reference.pack_codes`) into the contiguous code rows
    row0 .. row0 + TC."""
    DT: tl.constexpr = x.shape[0]
    CPT: tl.constexpr = x.shape[1]
    TC: tl.constexpr = x.shape[2]
    NP: tl.constexpr = CPT * G  # codes sharing a byte (the group's channels j + k·D/NP, k < NP)
    D: tl.constexpr = DT * CPT
    DP: tl.constexpr = D // NP
    LB: tl.constexpr = NP // 4  # quartered bytes a group fills: 1 (2-bit), 2 (3-bit: even k, then odd k)
    PACKED: tl.constexpr = D // 4 + D // 8 if BITS == 3 else D // 4
    # the count of thresholds reached, bit by bit (they ascend): a binary search, not a compare with each
    if BITS == 3:
        b2 = x >= t4[:, :, None]
        b1 = x >= tl.where(b2, t6[:, :, None], t2[:, :, None])
        t_b0 = tl.where(b2, tl.where(b1, t7[:, :, None], t5[:, :, None]), tl.where(b1, t3[:, :, None], t1[:, :, None]))
    else:
        b1 = x >= t2[:, :, None]
        t_b0 = tl.where(b1, t3[:, :, None], t1[:, :, None])
    low = tl.where(b1, 2.0, 0.0) + tl.where(x >= t_b0, 1.0, 0.0)  # the code's low two bits
    # channel k = c·G + g of a group: its low bits are bits 2·(k // LB) of quartered byte j + (k % LB)·DP (k % LB =
    # g % LB), its third bit is bit k of plane byte D/4 + j; a thread's share of each byte is a float sum
    k = tl.arange(0, CPT)[None, :] * G + (tl.arange(0, DT) % G)[:, None]  # [DT, CPT]
    w_low = (1 << (2 * (k // LB))).to(tl.float32)
    rows = row0 + tl.arange(0, TC)
    cols = tl.arange(0, DP)[:, None, None] + DP * tl.arange(0, LB)[None, :, None]
    low_bytes = _bytes_across_lanes(tl.sum(low * w_low[:, :, None], axis=1), G // LB, LB)
    tl.store(codes_ptr + rows[None, None, :] * PACKED + cols, low_bytes)
    if BITS == 3:
        w_hb = (1 << k).to(tl.float32)
        plane = _bytes_across_lanes(tl.sum(tl.where(b2, w_hb[:, :, None], 0.0), axis=1), G, 1)
        cols = D // 4 + tl.arange(0, DP)[:, None, None]
        tl.store(codes_ptr + rows[None, None, :] * PACKED + cols, plane)


@triton.jit
def _quantize_pack_channel_kernel(
    x_ptr,  # [B, H, T, D] any float dtype (last dim contiguous), T = NB·KB
    codes_ptr,  # [B·H·T, packed_dim(D, BITS)] uint8, contiguous
    sz_ptr,  # [B, H, NB, D, 2] float16, contiguous
    H,
    NB,  # blocks per (batch, head)
    stride_xb,
    stride_xh,
    STRIDE_T: tl.constexpr,  # x's token stride (a constant: every load of a program is its pointer plus an immediate)
    D: tl.constexpr,
    KB: tl.constexpr,  # tokens per block
    TC: tl.constexpr,  # tokens per chunk (a divisor of KB, ≥ 4): a thread holds CPT·TC values at once
    CPT: tl.constexpr,  # channels per thread (D / CPT threads)
    FLAT: tl.constexpr,  # load a chunk as one tensor (the interpreter; `_load_tile`)
    BITS: tl.constexpr,
    REL_FLOOR: tl.constexpr,
    ABS_FLOOR: tl.constexpr,
):
    NP: tl.constexpr = 8 if BITS == 3 else 4  # codes sharing a byte: a pack group
    G: tl.constexpr = NP // CPT  # lanes a pack group spans
    DT: tl.constexpr = D // CPT
    LEVELS: tl.constexpr = 7.0 if BITS == 3 else 3.0
    pid = tl.program_id(0)  # (batch, head) · NB + block
    bh = pid // NB
    b = bh // H
    h = bh % H
    # thread p = j·G + g holds channels j + (c·G + g)·D/NP for c < CPT: a pack group's NP channels on G lanes
    p = tl.arange(0, DT)
    ch0 = p // G + (p % G) * (D // NP)  # its channel c = 0; channel c is ch0 + c·D/CPT
    x_blk = (x_ptr + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh
             + ((pid % NB) * KB).to(tl.int64) * STRIDE_T + ch0)  # fmt: skip
    row0 = pid.to(tl.int64) * KB  # the block's first row of the contiguous outputs (bh·T + block·KB)

    # min and max of each channel over the block, in-thread (chunks of TC tokens; a block of one chunk stays loaded)
    x = _load_tile(x_blk, D // CPT, CPT, STRIDE_T, TC, FLAT).to(tl.float32)
    lo = tl.min(x, axis=2)
    hi = tl.max(x, axis=2)
    for i in range(1, KB // TC):
        xc = _load_tile(x_blk + i * (TC * STRIDE_T), D // CPT, CPT, STRIDE_T, TC, FLAT).to(tl.float32)
        lo = tl.minimum(lo, tl.min(xc, axis=2))
        hi = tl.maximum(hi, tl.max(xc, axis=2))
    # float16 scale and zero by the row kernel's rule (`reference.quantize`), no clip
    scale16, zero16 = _scale_zero16(lo, hi, LEVELS, REL_FLOOR, ABS_FLOOR)
    s = scale16.to(tl.float32)
    z = zero16.to(tl.float32)
    ch = ch0[:, None] + (D // CPT) * tl.arange(0, CPT)[None, :]  # [DT, CPT]
    tl.store(sz_ptr + pid.to(tl.int64) * (2 * D) + ch[:, :, None] * 2 + tl.arange(0, 2)[None, None, :],
             tl.join(scale16, zero16))
    # each channel's thresholds in x's units, once per block (a thread's own channels: no replication)
    t1 = _x_threshold(s, z, _C1, _H1, _TIE1)
    t2 = _x_threshold(s, z, _C2, _H2, _TIE2)
    t3 = _x_threshold(s, z, _C3, _H3, _TIE3)
    if BITS == 3:
        t4 = _x_threshold(s, z, _C4, _H4, _TIE4)
        t5 = _x_threshold(s, z, _C5, _H5, _TIE5)
        t6 = _x_threshold(s, z, _C6, _H6, _TIE6)
        t7 = _x_threshold(s, z, _C7, _H7, _TIE7)
    else:
        t4 = t3
        t5 = t3
        t6 = t3
        t7 = t3
    if KB == TC:
        _channel_codes_store(x, t1, t2, t3, t4, t5, t6, t7, codes_ptr, row0, G, BITS)
    else:  # a second pass over the block's chunks (from the cache: the first pass read them)
        for i in range(KB // TC):
            xc = _load_tile(x_blk + i * (TC * STRIDE_T), D // CPT, CPT, STRIDE_T, TC, FLAT).to(tl.float32)
            _channel_codes_store(xc, t1, t2, t3, t4, t5, t6, t7, codes_ptr, row0 + i * TC, G, BITS)
