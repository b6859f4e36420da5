"""Fused (optional rotate) → clip → 2- or 3-bit quantize → quartered pack of K/V rows into the history layout.

Twin of `reference.quantize_pack_ref`, bit for bit on finite rows when no rotation is given (the demotion path: rows
already rotated). A NaN in a row makes the reference's scale/zero NaN; the kernel's min/max skip it.

Layout: one row per thread. A program takes BLOCK_T consecutive rows of the flattened [B·H·T] row space (so an
8-token demotion of 32×8 heads is 16 programs, not 256 mostly-masked ones) and each thread holds its row's D values
in registers, so every reduction along the row (order statistic, group min/max, packing) is in-thread: no shuffles, no
shared memory.

Clip: τ = k-th smallest |x| of the row, k = ⌊r·D + 1e-6⌋ (`reference.clip_index`, computed here in float64 from the
ratio tensor, so the host launches nothing but this kernel). With m = D − k ≤ 8 (or ≤ 16) τ is the m-th largest |x|,
taken from a register-resident top-8 (top-16): Batcher-sort chunks of 8 (16) values, then merge chunk lists pairwise
(bitonic max + half-cleaners) down to one sorted list. Ties are kept with multiplicity, as sort() keeps them. Other
ratios (m > 16, rare: r < 0.875) take the exact peeling loop.

Quantize (BITS = 2 or 3, L = 2^BITS − 1 = 3 or 7): scale = range/L and zero rounded to float16 as the reference,
codes from the rounded values. The reference's code is clamp(⌊u + ½⌋, 0, L) with u = RN(RN(x/s) + z) (IEEE
division): the number of L thresholds C_i on u that u reaches. Both roundings are monotone in x, so u ≥ C_i ⇔ x ≥ X_i
for one float32 X_i per group, computed exactly once per group in float64 from the two rounding midpoints
(`_x_threshold`); the clip folds into those thresholds and the group's min/max. Per value that leaves L compares and
L − 1 adds (2 bits: three and two): no division, no + z, no clamp, no float→int conversion.

Pack: the low two bits quartered (D/4 bytes: byte j holds dims j, j+D/4, j+D/2, j+3D/4 in bits 0/2/4/6); 3-bit codes
then a bit plane of their third bit (u ≥ C_4; D/8 bytes: byte D/4 + j holds dims j, j+D/8, …, j+7D/8 in bits 0..7),
`layout.packed_dim(D, BITS)` bytes a row (`reference.pack_codes`). BITS is a constexpr: the 2-bit build holds none of
the 3-bit code.

Keys per channel over token blocks: `quantize_channel.py`, which shares this module's scale/zero rule and thresholds.
"""

from __future__ import annotations

import triton
import triton.language as tl

# u ≥ C_i  ⇔  float32(u + 0.5) ≥ i (round to nearest even), i = 1..7: the code is the number of thresholds reached
# (2-bit codes use C_1..C_3, 3-bit codes all seven). C_1 is the float32 just below ½ (C_1 + ½ = 1 − 2^-25 is a tie
# that rounds to the even 1.0), C_i = i − ½ for i ≥ 2 (there u + ½ is exact)
ROUND_THRESHOLDS = (0.5 - 2.0**-25, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5)
# For the thresholds in x's units: half the float32 spacing below each C_i, and whether a sum exactly at that midpoint
# rounds up to C_i (ties go to the even significand: C_1's is odd, those of C_2..C_7 = i − ½ even)
ROUND_HALF_ULPS = (2.0**-26, 2.0**-24, 2.0**-23, 2.0**-23, 2.0**-22, 2.0**-22, 2.0**-22)
ROUND_TIES_UP = (False, True, True, True, True, True, True)
_H1, _H2, _H3, _H4, _H5, _H6, _H7 = (tl.constexpr(h) for h in ROUND_HALF_ULPS)
_TIE1, _TIE2, _TIE3, _TIE4, _TIE5, _TIE6, _TIE7 = (tl.constexpr(t) for t in ROUND_TIES_UP)
# C_1..C_3 are launch arguments (ops.quantize_pack); the 3-bit build's C_4..C_7 come from here
_C4, _C5, _C6, _C7 = (tl.constexpr(c) for c in ROUND_THRESHOLDS[3:])


@triton.jit
def _scale_zero16(lo, hi, LEVELS: tl.constexpr, REL_FLOOR: tl.constexpr, ABS_FLOOR: tl.constexpr):
    """float16 scale and zero of a group whose minimum and maximum are lo, hi (fp32): `reference.quantize`'s rule,
    range floors included, IEEE-rounded divisions."""
    amax = tl.maximum(tl.abs(lo), tl.abs(hi))
    rng = tl.maximum(tl.maximum(hi - lo, amax * REL_FLOOR), ABS_FLOOR)
    scale16 = tl.div_rn(rng, LEVELS).to(tl.float16)
    return scale16, tl.div_rn(_negate(lo), scale16.to(tl.float32)).to(tl.float16)


@triton.jit
def _f32_next(x, UP: tl.constexpr):
    """The float32 just above (UP) or just below finite x, by its bits (±0 count as zero)."""
    x = x + 0.0  # −0 → +0
    bits = x.to(tl.int32, bitcast=True)
    if UP:
        bits = tl.where(x >= 0, bits + 1, bits - 1)
    else:
        bits = tl.where(x > 0, bits - 1, tl.where(x < 0, bits + 1, -0x7FFFFFFF))  # below +0: −(smallest denormal)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _least_f32_above(r, INCLUSIVE):
    """The least float32 v with v > r, or v = r where INCLUSIVE (r float64)."""
    v = r.to(tl.float32)
    vd = v.to(tl.float64)
    return tl.where((vd < r) | ((vd == r) & (~INCLUSIVE)), _f32_next(v, True), v)


@triton.jit
def _x_threshold(s, z, C: tl.constexpr, HALF_ULP: tl.constexpr, TIE_UP: tl.constexpr):
    """The least float32 x whose u = RN(RN(x/s) + z) reaches C (s > 0, z float32 of float16 values; IEEE division,
    as the reference's). Both roundings are monotone, so u ≥ C ⇔ x ≥ this; each boundary is a midpoint between two
    float32 values, exact in float64 (b − z: ≤ 42 significant bits; s·midpoint: ≤ 36), and a value exactly on it
    rounds to the even neighbour."""
    b = tl.full(s.shape, C, tl.float64) - HALF_ULP  # RN(q + z) ≥ C ⇔ q + z ≥ b (= b only when TIE_UP)
    w = _least_f32_above(b - z.to(tl.float64), tl.full(s.shape, TIE_UP, tl.int1)) + 0.0  # least q: RN(q + z) ≥ C
    mid = (_f32_next(w, False).to(tl.float64) + w.to(tl.float64)) * 0.5  # RN(x/s) ≥ w ⇔ x/s ≥ mid (= when w even)
    w_even = (w.to(tl.int32, bitcast=True) & 1) == 0
    return _least_f32_above(s.to(tl.float64) * mid, w_even)


@triton.jit
def _clipped_threshold(t, neg_tau, tau):
    """t for x clipped to [−τ, τ], applied to unclipped x: −∞ (always) if −τ reaches it, NaN (never) if τ does not."""
    return tl.where(neg_tau[:, None] >= t, float("-inf"), tl.where(tau[:, None] >= t, t, float("nan")))


@triton.jit
def _negate(x):
    """IEEE negation (sign-bit flip): compiled `-x` is `0 - x`, which maps +0.0 to +0.0 where torch gives −0.0."""
    return (x.to(tl.int32, bitcast=True) ^ -0x80000000).to(tl.float32, bitcast=True)


@triton.jit
def _mx(a, b, ASM: tl.constexpr):
    """max(a, b); ASM: two 16-bit lanes per instruction (max.bf16x2 / max.f16x2, exact like any max)."""
    if ASM:
        op: tl.constexpr = "max.bf16x2 $0, $1, $2;" if a.dtype == tl.bfloat16 else "max.f16x2 $0, $1, $2;"
        return tl.inline_asm_elementwise(op, "=r,r,r", [a, b], dtype=a.dtype, is_pure=True, pack=2)
    else:
        return tl.maximum(a, b)


@triton.jit
def _cx(a, b, ASM: tl.constexpr):
    """Compare-exchange: (max(a, b), min(a, b)), two 16-bit lanes per instruction with ASM."""
    if ASM:
        op: tl.constexpr = "min.bf16x2 $0, $1, $2;" if a.dtype == tl.bfloat16 else "min.f16x2 $0, $1, $2;"
        return _mx(a, b, ASM), tl.inline_asm_elementwise(op, "=r,r,r", [a, b], dtype=a.dtype, is_pure=True, pack=2)
    else:
        return tl.maximum(a, b), tl.minimum(a, b)


@triton.jit
def _split_last(v):
    """[R, C, 2n] → the even and odd entries of the last axis, [R, C, n] each (register renaming, no data movement)."""
    return tl.split(tl.reshape(v, [v.shape[0], v.shape[1], v.shape[2] // 2, 2]))


@triton.jit
def _pair_chunks(t):
    """[R, C] → chunks [0, C/2) and [C/2, C), [R, C/2] each (halves keep a thread's register pairs together)."""
    return tl.split(tl.permute(tl.reshape(t, [t.shape[0], 2, t.shape[1] // 2]), (0, 2, 1)))


@triton.jit
def _split8(v):
    """[R, C, 8] → 8 tensors [R, C] (one per position within a chunk; which is which does not matter)."""
    e, o = _split_last(v)
    ee, eo = _split_last(e)
    oe, oo = _split_last(o)
    v0, v1 = tl.split(ee)
    v2, v3 = tl.split(eo)
    v4, v5 = tl.split(oe)
    v6, v7 = tl.split(oo)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _split16(v):
    e, o = _split_last(v)
    v0, v1, v2, v3, v4, v5, v6, v7 = _split8(e)
    v8, v9, v10, v11, v12, v13, v14, v15 = _split8(o)
    return v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15


@triton.jit
def _mth_largest8(a, m, BLOCK_T: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr):
    """a [BLOCK_T, D] ≥ 0 → its m-th largest per row (1 ≤ m ≤ 8; other m give an unspecified value). Position p of
    chunk c is element p·D/8 + c, so a thread's neighbouring chunks sit in one 32-bit register (ASM pairs)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _split8(tl.permute(tl.reshape(a, [BLOCK_T, 8, D // 8]), (0, 2, 1)))
    v0, v1, v2, v3, v4, v5, v6, v7 = _sort8(v0, v1, v2, v3, v4, v5, v6, v7, ASM)
    for _ in tl.static_range(D // 8 - 1):  # unrolled; the chunk count halves each time down to one
        if v0.shape[1] > 1:
            a0, b0 = _pair_chunks(v0)
            a1, b1 = _pair_chunks(v1)
            a2, b2 = _pair_chunks(v2)
            a3, b3 = _pair_chunks(v3)
            a4, b4 = _pair_chunks(v4)
            a5, b5 = _pair_chunks(v5)
            a6, b6 = _pair_chunks(v6)
            a7, b7 = _pair_chunks(v7)
            if v0.shape[1] >= 4:  # two or more chunks per half: packed pairs
                v0, v1, v2, v3, v4, v5, v6, v7 = _merge8(
                    a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, ASM)
            else:
                v0, v1, v2, v3, v4, v5, v6, v7 = _merge8(
                    a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, False)
    t = tl.reshape(v0, [BLOCK_T]).to(tl.float32)
    t = tl.where(m == 2, tl.reshape(v1, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 3, tl.reshape(v2, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 4, tl.reshape(v3, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 5, tl.reshape(v4, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 6, tl.reshape(v5, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 7, tl.reshape(v6, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 8, tl.reshape(v7, [BLOCK_T]).to(tl.float32), t)
    return t


@triton.jit
def _sort8(v0, v1, v2, v3, v4, v5, v6, v7, ASM: tl.constexpr):
    """Batcher odd-even merge sort of 8 tensors, descending (19 compare-exchanges)."""
    v0, v1 = _cx(v0, v1, ASM)
    v2, v3 = _cx(v2, v3, ASM)
    v4, v5 = _cx(v4, v5, ASM)
    v6, v7 = _cx(v6, v7, ASM)
    v0, v2 = _cx(v0, v2, ASM)
    v1, v3 = _cx(v1, v3, ASM)
    v4, v6 = _cx(v4, v6, ASM)
    v5, v7 = _cx(v5, v7, ASM)
    v1, v2 = _cx(v1, v2, ASM)
    v5, v6 = _cx(v5, v6, ASM)
    v0, v4 = _cx(v0, v4, ASM)
    v1, v5 = _cx(v1, v5, ASM)
    v2, v6 = _cx(v2, v6, ASM)
    v3, v7 = _cx(v3, v7, ASM)
    v2, v4 = _cx(v2, v4, ASM)
    v3, v5 = _cx(v3, v5, ASM)
    v1, v2 = _cx(v1, v2, ASM)
    v3, v4 = _cx(v3, v4, ASM)
    v5, v6 = _cx(v5, v6, ASM)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _merge8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, ASM: tl.constexpr):
    """The 8 largest of two descending lists, descending: bitonic max then half-cleaners."""
    v0 = _mx(a0, b7, ASM)
    v1 = _mx(a1, b6, ASM)
    v2 = _mx(a2, b5, ASM)
    v3 = _mx(a3, b4, ASM)
    v4 = _mx(a4, b3, ASM)
    v5 = _mx(a5, b2, ASM)
    v6 = _mx(a6, b1, ASM)
    v7 = _mx(a7, b0, ASM)
    v0, v4 = _cx(v0, v4, ASM)
    v1, v5 = _cx(v1, v5, ASM)
    v2, v6 = _cx(v2, v6, ASM)
    v3, v7 = _cx(v3, v7, ASM)
    v0, v2 = _cx(v0, v2, ASM)
    v1, v3 = _cx(v1, v3, ASM)
    v4, v6 = _cx(v4, v6, ASM)
    v5, v7 = _cx(v5, v7, ASM)
    v0, v1 = _cx(v0, v1, ASM)
    v2, v3 = _cx(v2, v3, ASM)
    v4, v5 = _cx(v4, v5, ASM)
    v6, v7 = _cx(v6, v7, ASM)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _sort16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15, ASM: tl.constexpr):
    """Batcher odd-even merge sort of 16 tensors, descending (63 compare-exchanges): the two halves sorted, then the
    odd-even merge of two sorted 8-lists (25)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _sort8(v0, v1, v2, v3, v4, v5, v6, v7, ASM)
    v8, v9, v10, v11, v12, v13, v14, v15 = _sort8(v8, v9, v10, v11, v12, v13, v14, v15, ASM)
    v0, v8 = _cx(v0, v8, ASM)
    v1, v9 = _cx(v1, v9, ASM)
    v2, v10 = _cx(v2, v10, ASM)
    v3, v11 = _cx(v3, v11, ASM)
    v4, v12 = _cx(v4, v12, ASM)
    v5, v13 = _cx(v5, v13, ASM)
    v6, v14 = _cx(v6, v14, ASM)
    v7, v15 = _cx(v7, v15, ASM)
    v4, v8 = _cx(v4, v8, ASM)
    v5, v9 = _cx(v5, v9, ASM)
    v6, v10 = _cx(v6, v10, ASM)
    v7, v11 = _cx(v7, v11, ASM)
    v2, v4 = _cx(v2, v4, ASM)
    v3, v5 = _cx(v3, v5, ASM)
    v6, v8 = _cx(v6, v8, ASM)
    v7, v9 = _cx(v7, v9, ASM)
    v10, v12 = _cx(v10, v12, ASM)
    v11, v13 = _cx(v11, v13, ASM)
    v1, v2 = _cx(v1, v2, ASM)
    v3, v4 = _cx(v3, v4, ASM)
    v5, v6 = _cx(v5, v6, ASM)
    v7, v8 = _cx(v7, v8, ASM)
    v9, v10 = _cx(v9, v10, ASM)
    v11, v12 = _cx(v11, v12, ASM)
    v13, v14 = _cx(v13, v14, ASM)
    return v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15


@triton.jit
def _merge16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
             b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15, ASM: tl.constexpr):
    """The 16 largest of two descending lists, descending: bitonic max then half-cleaners."""
    v0 = _mx(a0, b15, ASM)
    v1 = _mx(a1, b14, ASM)
    v2 = _mx(a2, b13, ASM)
    v3 = _mx(a3, b12, ASM)
    v4 = _mx(a4, b11, ASM)
    v5 = _mx(a5, b10, ASM)
    v6 = _mx(a6, b9, ASM)
    v7 = _mx(a7, b8, ASM)
    v8 = _mx(a8, b7, ASM)
    v9 = _mx(a9, b6, ASM)
    v10 = _mx(a10, b5, ASM)
    v11 = _mx(a11, b4, ASM)
    v12 = _mx(a12, b3, ASM)
    v13 = _mx(a13, b2, ASM)
    v14 = _mx(a14, b1, ASM)
    v15 = _mx(a15, b0, ASM)
    v0, v8 = _cx(v0, v8, ASM)
    v1, v9 = _cx(v1, v9, ASM)
    v2, v10 = _cx(v2, v10, ASM)
    v3, v11 = _cx(v3, v11, ASM)
    v4, v12 = _cx(v4, v12, ASM)
    v5, v13 = _cx(v5, v13, ASM)
    v6, v14 = _cx(v6, v14, ASM)
    v7, v15 = _cx(v7, v15, ASM)
    v0, v4 = _cx(v0, v4, ASM)
    v1, v5 = _cx(v1, v5, ASM)
    v2, v6 = _cx(v2, v6, ASM)
    v3, v7 = _cx(v3, v7, ASM)
    v8, v12 = _cx(v8, v12, ASM)
    v9, v13 = _cx(v9, v13, ASM)
    v10, v14 = _cx(v10, v14, ASM)
    v11, v15 = _cx(v11, v15, ASM)
    v0, v2 = _cx(v0, v2, ASM)
    v1, v3 = _cx(v1, v3, ASM)
    v4, v6 = _cx(v4, v6, ASM)
    v5, v7 = _cx(v5, v7, ASM)
    v8, v10 = _cx(v8, v10, ASM)
    v9, v11 = _cx(v9, v11, ASM)
    v12, v14 = _cx(v12, v14, ASM)
    v13, v15 = _cx(v13, v15, ASM)
    v0, v1 = _cx(v0, v1, ASM)
    v2, v3 = _cx(v2, v3, ASM)
    v4, v5 = _cx(v4, v5, ASM)
    v6, v7 = _cx(v6, v7, ASM)
    v8, v9 = _cx(v8, v9, ASM)
    v10, v11 = _cx(v10, v11, ASM)
    v12, v13 = _cx(v12, v13, ASM)
    v14, v15 = _cx(v14, v15, ASM)
    return v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15


@triton.jit
def _mth_largest16(a, m, BLOCK_T: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr):
    """a [BLOCK_T, D] ≥ 0 → its m-th largest per row (1 ≤ m ≤ 16; other m give an unspecified value). Position p of
    chunk c is element p·D/16 + c, so a thread's neighbouring chunks sit in one 32-bit register (ASM pairs)."""
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _split16(
        tl.permute(tl.reshape(a, [BLOCK_T, 16, D // 16]), (0, 2, 1)))
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _sort16(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15, ASM)
    for _ in tl.static_range(D // 16 - 1):  # unrolled; the chunk count halves each time down to one
        if v0.shape[1] > 1:
            a0, b0 = _pair_chunks(v0)
            a1, b1 = _pair_chunks(v1)
            a2, b2 = _pair_chunks(v2)
            a3, b3 = _pair_chunks(v3)
            a4, b4 = _pair_chunks(v4)
            a5, b5 = _pair_chunks(v5)
            a6, b6 = _pair_chunks(v6)
            a7, b7 = _pair_chunks(v7)
            a8, b8 = _pair_chunks(v8)
            a9, b9 = _pair_chunks(v9)
            a10, b10 = _pair_chunks(v10)
            a11, b11 = _pair_chunks(v11)
            a12, b12 = _pair_chunks(v12)
            a13, b13 = _pair_chunks(v13)
            a14, b14 = _pair_chunks(v14)
            a15, b15 = _pair_chunks(v15)
            if v0.shape[1] >= 4:  # two or more chunks per half: packed pairs
                v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _merge16(
                    a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
                    b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15, ASM)
            else:
                v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _merge16(
                    a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
                    b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15, False)
    t = tl.reshape(v0, [BLOCK_T]).to(tl.float32)
    t = tl.where(m == 2, tl.reshape(v1, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 3, tl.reshape(v2, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 4, tl.reshape(v3, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 5, tl.reshape(v4, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 6, tl.reshape(v5, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 7, tl.reshape(v6, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 8, tl.reshape(v7, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 9, tl.reshape(v8, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 10, tl.reshape(v9, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 11, tl.reshape(v10, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 12, tl.reshape(v11, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 13, tl.reshape(v12, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 14, tl.reshape(v13, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 15, tl.reshape(v14, [BLOCK_T]).to(tl.float32), t)
    t = tl.where(m == 16, tl.reshape(v15, [BLOCK_T]).to(tl.float32), t)
    return t


@triton.jit
def _kth_smallest_peel(ax, kk, D: tl.constexpr):
    """The exact k-th smallest |x| per row for any k (the general path): walk from the nearer end of the sorted order
    (largest values for k ≥ D/2, smallest otherwise), removing all copies of the current extreme per step, until the
    k-th position is reached."""
    from_top = kk >= D // 2
    rem = tl.where(from_top, D - 1 - kk, kk)  # sorted positions to skip from that end
    rem = tl.where(kk < 0, 0, rem)
    cur = tl.where(from_top[:, None], ax, -ax)  # peel maxima of cur either way (ax = |x|)
    tau = tl.zeros_like(kk).to(tl.float32)
    done = kk < -1  # all False
    for _ in range(tl.max(rem, axis=0) + 1):
        mx = tl.max(cur, axis=1)
        hit = cur == mx[:, None]
        cnt = tl.sum(hit.to(tl.int32), axis=1)
        now = (rem < cnt) & (~done)
        tau = tl.where(now, tl.abs(mx), tau)
        done = done | now
        rem = rem - cnt
        cur = tl.where(hit, float("-inf"), cur)
    return tau


@triton.jit
def _load_rows(row_ptrs, row_ok, LO: tl.constexpr, N: tl.constexpr):
    """Dims 8·LO .. 8·(LO + N) of every row, [BLOCK_T, 8·N], as N 16-byte loads per thread, so each thread holds its
    row: a load of [BLOCK_T, 8] has one thread per row (its fast axis is one vector), and joining such loads only adds
    register axes. (Triton lays a [BLOCK_T, D] load, or a [D/8, BLOCK_T, 8] one, out along D instead, spreading a row
    over 16 lanes, and every row reduction then needs shuffles.)"""
    if N == 1:
        return tl.load(row_ptrs[:, None] + LO * 8 + tl.arange(0, 8)[None, :], mask=row_ok[:, None], other=0.0)
    else:
        lo = _load_rows(row_ptrs, row_ok, LO, N // 2)
        hi = _load_rows(row_ptrs, row_ok, LO + N // 2, N // 2)
        both = tl.permute(tl.join(lo, hi), (0, 2, 1))  # [BLOCK_T, 2, 4·N]: the halves in order
        return tl.reshape(both, [both.shape[0], 8 * N])


@triton.jit
def _quantize_pack_kernel(
    # pointers
    x_ptr,  # [B, H, T, D] any float dtype (last dim contiguous)
    rot_ptr,  # [H, D, D] or [D, D] float (unused unless ROTATE)
    r_ptr,  # clip ratio per row, broadcast strides allowed
    codes_ptr,  # [B·H·T, packed_dim(D, BITS)] uint8, contiguous
    sz_ptr,  # [B, H, T, D/G, 2] float16, contiguous
    # sizes
    N,  # B·H·T rows
    H,
    T,
    # strides
    stride_xb,
    stride_xh,
    stride_xt,
    stride_rh,
    stride_cb,
    stride_ch,
    stride_ct,
    # constexpr
    D: tl.constexpr,
    G: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROTATE: tl.constexpr,
    X_DTYPE: tl.constexpr,
    MAX_M: tl.constexpr,  # 8 or 16: every row has m ≤ MAX_M (only that path is compiled; ops._max_m_build); 0: any m
    NET16: tl.constexpr,  # sort |x| as 16-bit pairs with inline PTX (GPU, bf16/fp16 x)
    REL_FLOOR: tl.constexpr,
    ABS_FLOOR: tl.constexpr,
    C1: tl.constexpr,
    C2: tl.constexpr,
    C3: tl.constexpr,
    BITS: tl.constexpr,  # 2: codes 0..3 (D/4 bytes a row); 3: codes 0..7 (D/4 + D/8 bytes)
):
    NG: tl.constexpr = D // G
    D4: tl.constexpr = D // 4
    D8: tl.constexpr = D // 8
    LEVELS: tl.constexpr = 7.0 if BITS == 3 else 3.0  # largest code, the scale's divisor
    PACKED: tl.constexpr = D4 + D8 if BITS == 3 else D4  # bytes an output row
    if ROTATE:  # BLOCK_T rows of one (batch, KV head): the rotation is one [D, D] matrix per program
        pid_bh = tl.program_id(1)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = t < T
        n = pid_bh * T + t
        b = pid_bh // H
        h = pid_bh % H
    else:  # BLOCK_T consecutive rows of the flattened row space
        n = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = n < N
        t = n % T
        bh = n // T
        b = bh // H
        h = bh % H
    dims = tl.arange(0, D)
    x_row = b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh + t.to(tl.int64) * stride_xt
    x_in = _load_rows(x_ptr + x_row, row_ok, 0, D // 8)  # [BLOCK_T, D], each row in one thread

    if ROTATE:
        rot = tl.load(rot_ptr + h * stride_rh + dims[:, None] * D + dims[None, :]).to(tl.float32)  # [D, D]
        # the cache stores rotated rows in x's dtype
        x_in = tl.dot(x_in.to(tl.float32), rot, input_precision="ieee").to(X_DTYPE)
    # |x| for the order statistic, apart from x (not kept alive next to it through the sorting network): 16-bit with
    # packed min/max on the GPU, float32 otherwise (min/max are exact either way)
    if NET16:
        a = tl.abs(x_in)
    else:
        a = tl.abs(x_in).to(tl.float32)

    # clip index k = ⌊r·D + 1e-6⌋ clamped to [0, D−1], −1 when r ≤ 0 (float64, as reference.clip_index; D is a power
    # of two, so r·D is exact and a fused multiply-add rounds the same)
    r = tl.load(r_ptr + b * stride_cb + h * stride_ch + t * stride_ct, mask=row_ok, other=0.0).to(tl.float64)
    kf = tl.minimum(tl.maximum(tl.floor(r * D + 1e-6), 0.0), D - 1.0)
    kk = tl.where(row_ok & (r > 0), kf.to(tl.int32), -1)
    m = D - kk  # τ is the m-th largest |x|
    if MAX_M == 8:  # every row has m ≤ 8 (benchmarks/experiments/quantize_sass.py's count of one path)
        tau = _mth_largest8(a, m, BLOCK_T, D, NET16)
    elif MAX_M == 16:
        tau = _mth_largest16(a, m, BLOCK_T, D, NET16)
    else:  # per-row ratios: the block's largest m picks the path
        m_max = tl.max(tl.where(kk < 0, 1, m), axis=0)
        if m_max <= 8:
            tau = _mth_largest8(a, m, BLOCK_T, D, NET16)
        elif m_max <= 16:
            tau = _mth_largest16(a, m, BLOCK_T, D, NET16)
        else:
            tau = _kth_smallest_peel(tl.abs(x_in).to(tl.float32), kk, D)
    tau = tl.where(kk < 0, float("inf"), tau.to(tl.float32))
    neg_tau = _negate(tau)
    x = x_in.to(tl.float32)  # converted only now: not live through the order statistic
    # the clip moves into the group's min/max and the thresholds
    xg = tl.reshape(x, [BLOCK_T, NG, G])
    lo = tl.min(xg, axis=2)
    hi = tl.max(xg, axis=2)
    lo = tl.where(lo >= neg_tau[:, None], lo, neg_tau[:, None])  # a value equal to the bound keeps its own
    hi = tl.where(hi <= tau[:, None], hi, tau[:, None])  # zero's sign, as the reference's clamp
    # asymmetric min-max per group, float16 scale/zero, codes from the rounded values
    scale16, zero16 = _scale_zero16(lo, hi, LEVELS, REL_FLOOR, ABS_FLOOR)
    s = scale16.to(tl.float32)
    z = zero16.to(tl.float32)
    # the reference's count against each group's thresholds in x's units (float64 arithmetic once per group, no
    # division and no clamp per element); a NaN x reaches none
    t1 = _clipped_threshold(_x_threshold(s, z, C1, _H1, _TIE1), neg_tau, tau)
    t2 = _clipped_threshold(_x_threshold(s, z, C2, _H2, _TIE2), neg_tau, tau)
    t3 = _clipped_threshold(_x_threshold(s, z, C3, _H3, _TIE3), neg_tau, tau)
    code = (tl.where(xg >= t1[:, :, None], 1.0, 0.0) + tl.where(xg >= t2[:, :, None], 1.0, 0.0)
            + tl.where(xg >= t3[:, :, None], 1.0, 0.0))  # fmt: skip
    if BITS == 3:  # the third bit is t4 reached; the low two bits count t1..t3 below it, t5..t7 above (thresholds
        # ascend, and a clipped one is −∞ only if all below it are, NaN only if all above it are)
        t4 = _clipped_threshold(_x_threshold(s, z, _C4, _H4, _TIE4), neg_tau, tau)
        t5 = _clipped_threshold(_x_threshold(s, z, _C5, _H5, _TIE5), neg_tau, tau)
        t6 = _clipped_threshold(_x_threshold(s, z, _C6, _H6, _TIE6), neg_tau, tau)
        t7 = _clipped_threshold(_x_threshold(s, z, _C7, _H7, _TIE7), neg_tau, tau)
        hi_bit = tl.where(xg >= t4[:, :, None], 1.0, 0.0)
        upper = (tl.where(xg >= t5[:, :, None], 1.0, 0.0) + tl.where(xg >= t6[:, :, None], 1.0, 0.0)
                 + tl.where(xg >= t7[:, :, None], 1.0, 0.0))  # fmt: skip
        code = tl.where(hi_bit > 0.0, upper, code)  # code & 3
        # bit plane: byte j holds the third bit of dims j, j+D/8, …, j+7D/8 in bits 0..7
        q8 = tl.reshape(hi_bit, [BLOCK_T, 8, D8])
        weights8 = tl.exp2(tl.arange(0, 8).to(tl.float32))
        byte8 = tl.sum(q8 * weights8[None, :, None], axis=1) + 8388608.0
        plane = (byte8.to(tl.int32, bitcast=True) & 0xFF).to(tl.uint8)  # [BLOCK_T, D8]

    # quartered pack: byte j holds dims j, j+D/4, j+D/2, j+3D/4 in bits 0/2/4/6 (float sum, then the integer bits
    # of 2^23 + byte)
    q4 = tl.reshape(code, [BLOCK_T, 4, D4])
    weights = tl.exp2((tl.arange(0, 4) * 2).to(tl.float32))
    byte = tl.sum(q4 * weights[None, :, None], axis=1) + 8388608.0
    packed = (byte.to(tl.int32, bitcast=True) & 0xFF).to(tl.uint8)  # [BLOCK_T, D4]

    out_rows = n.to(tl.int64)  # contiguous outputs
    cols = tl.arange(0, D4)
    tl.store(codes_ptr + out_rows[:, None] * PACKED + cols[None, :], packed, mask=row_ok[:, None])
    if BITS == 3:
        cols8 = D4 + tl.arange(0, D8)
        tl.store(codes_ptr + out_rows[:, None] * PACKED + cols8[None, :], plane, mask=row_ok[:, None])
    sz = tl.join(scale16, zero16)  # [BLOCK_T, NG, 2]
    sz_off = out_rows[:, None, None] * (2 * NG) + tl.arange(0, NG)[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    tl.store(sz_ptr + sz_off, sz, mask=row_ok[:, None, None])
