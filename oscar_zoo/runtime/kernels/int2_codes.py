"""INT2 history codes as tensor-core operands for the decode kernel (`decode.py`, whose docstring has the math): the
PTX unpack templates, integer and biased-bfloat16 codes of a quarter (3-bit keys' plane bits included), q's int8 parts,
the per-token scale/zero words, per-group dequantization, and the per-channel block scales folded into q."""

from __future__ import annotations

import triton
import triton.language as tl

# One unpack template: keep quarter k of every byte under a 0x43 high byte (two byte permutes per four codes).
_PRMT = "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342; }"
UNPACK_ASM_0 = tl.constexpr("{ .reg .b32 t; and.b32 t, $2, 0x03030303; " + _PRMT)
UNPACK_ASM_1 = tl.constexpr("{ .reg .b32 t; and.b32 t, $2, 0x0c0c0c0c; " + _PRMT)
UNPACK_ASM_2 = tl.constexpr("{ .reg .b32 t; and.b32 t, $2, 0x30303030; " + _PRMT)
UNPACK_ASM_3 = tl.constexpr("{ .reg .b32 t; shr.b32 t, $2, 6; and.b32 t, t, 0x03030303; " + _PRMT)


# K's codes as int8 tensor-core operands: quarter k of each byte shifted down and masked (four codes per register)
CODES_ASM_0 = tl.constexpr("and.b32 $0, $1, 0x03030303;")
CODES_ASM_1 = tl.constexpr("{ .reg .b32 t; shr.b32 t, $1, 2; and.b32 $0, t, 0x03030303; }")
CODES_ASM_2 = tl.constexpr("{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x03030303; }")
CODES_ASM_3 = tl.constexpr("{ .reg .b32 t; shr.b32 t, $1, 6; and.b32 $0, t, 0x03030303; }")
# 3-bit keys: a plane byte moved down one bit where sel is 0xFF (a quarter's second half), p ^ ((p ^ p >> 1) & sel)
PLANE_ASM = tl.constexpr("{ .reg .b32 t; shr.b32 t, $1, 1; xor.b32 t, t, $1; and.b32 t, t, $2; xor.b32 $0, $1, t; }")


def _third_asm(k: int) -> str:
    """PTX placing quarter k's third bit (bit 2k of `_plane`'s bytes, register $p) at bit 2 of u."""
    return "shl.b32 u, $p, 2;" if k == 0 else f"shr.b32 u, $p, {2 * k - 2};"


# 3-bit keys' int8 codes: quarter k's low bits | 4·third bit ($1 packed low bits, $2 `_plane` bytes)
CODES3_ASM_0, CODES3_ASM_1, CODES3_ASM_2, CODES3_ASM_3 = (
    tl.constexpr("{ .reg .b32 t, u; shr.b32 t, $1, %d; and.b32 t, t, 0x03030303; %s and.b32 u, u, 0x04040404; "
                 "or.b32 $0, t, u; }" % (2 * k, _third_asm(k).replace("$p", "$2")))
    for k in range(4))  # fmt: skip
# 3-bit keys' biased bfloat16 codes: code·f_k (≤ 112) under the 0x43 high byte ($2 packed low bits, $3 `_plane` bytes)
UNPACK3_ASM_0, UNPACK3_ASM_1, UNPACK3_ASM_2 = (
    tl.constexpr("{ .reg .b32 t, u; and.b32 t, $2, 0x%s; shl.b32 u, $3, 2; and.b32 u, u, 0x%s; or.b32 t, t, u; "
                 % ((f"{3 << 2 * k:02x}" * 4), (f"{4 << 2 * k:02x}" * 4)) + _PRMT)
    for k in range(3))  # fmt: skip
UNPACK3_ASM_3 = tl.constexpr("{ .reg .b32 t, u; shr.b32 t, $2, 6; and.b32 t, t, 0x03030303; shr.b32 u, $3, 4; "
                             "and.b32 u, u, 0x04040404; or.b32 t, t, u; " + _PRMT)
MAGIC = tl.constexpr(12582912.0)  # 1.5·2^23: the float32 with bits 0x4B400000 + n is MAGIC + n for |n| < 2^22


@triton.jit
def _int8_codes(packed, QUARTER: tl.constexpr, USE_ASM: tl.constexpr, plane=None, THIRD: tl.constexpr = False):
    """uint8 packed bytes → int8 codes 0..3 of one quarter (the K side's integer operand); THIRD (3-bit keys): codes
    0..7 with the third bits from `_plane`'s bytes."""
    if THIRD:
        if USE_ASM:
            asm3: tl.constexpr = (CODES3_ASM_0 if QUARTER == 0 else CODES3_ASM_1 if QUARTER == 1 else
                                  CODES3_ASM_2 if QUARTER == 2 else CODES3_ASM_3)  # fmt: skip
            return tl.inline_asm_elementwise(asm3, "=r,r,r", [packed, plane], dtype=tl.int8, is_pure=True, pack=4)
        return (((packed >> (2 * QUARTER)) & 3) | _third_bits(plane, QUARTER)).to(tl.int8)
    if USE_ASM:
        asm: tl.constexpr = (CODES_ASM_0 if QUARTER == 0 else CODES_ASM_1 if QUARTER == 1 else
                             CODES_ASM_2 if QUARTER == 2 else CODES_ASM_3)  # fmt: skip
        return tl.inline_asm_elementwise(asm, "=r,r", [packed], dtype=tl.int8, is_pure=True, pack=4)
    return ((packed >> (2 * QUARTER)) & 3).to(tl.int8)


@triton.jit
def _third_bits(plane, QUARTER: tl.constexpr):
    """3-bit keys: 4 × the third bit of quarter k's codes (uint8 0 or 4) from the tile's plane bytes (`_plane`: the
    bit sits at bit 2k)."""
    if QUARTER == 0:
        out = (plane << 2) & 4
    else:
        out = (plane >> (2 * QUARTER - 2)) & 4
    return out


@triton.jit
def _plane(pl, half, USE_ASM: tl.constexpr):
    """3-bit keys: plane bytes pl loaded per column c of a tile (byte c mod D/8), each moved down by its column's half
    (half = c // (D/8), 0 or 1), so that quarter k's third bit is bit 2k of every byte (bit 7 is left undefined)."""
    if USE_ASM:
        sel = tl.broadcast_to((half * 255).to(tl.uint8), pl.shape)
        return tl.inline_asm_elementwise(PLANE_ASM, "=r,r,r", [pl, sel], dtype=tl.uint8, is_pure=True, pack=4)
    return pl >> half.to(tl.uint8)


@triton.jit
def _int8_parts(q, q_scale, Q_LO: tl.constexpr):
    """fp32 q [dims, GP] times its head's factor q_scale [GP] (largest |q| → 127) as two int8 parts,
    q·q_scale = q_hi + q_lo / Q_LO up to 1/(2·Q_LO), and the float32 integers q_hi·Q_LO + q_lo (exact) for sums.
    Both parts are rounded to nearest by adding MAGIC (|value| ≤ 127 < 2^22: the sum's low bits are the integer, two's
    complement), so neither a rounding nor a float-to-int instruction (quarter rate, once per program) is needed."""
    qs = q * q_scale[None, :]
    t_hi = qs + MAGIC
    hi = t_hi - MAGIC
    t_lo = (qs - hi) * Q_LO + MAGIC  # |·| ≤ 0.5·Q_LO + rounding: the low part fits int8
    lo = t_lo - MAGIC
    return _low_byte(t_hi), _low_byte(t_lo), hi * Q_LO + lo


@triton.jit
def _low_byte(t):
    """MAGIC + n (float32, |n| < 128) → n as int8: the low byte of its bits."""
    return t.to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def _per_head(v, PAIR: tl.constexpr, GP: tl.constexpr):
    """[PAIR·GP] → [GP] of a vector whose entries c, GP + c, … are equal (the block-diagonal q's column blocks)."""
    if PAIR == 1:
        return v
    return tl.max(tl.reshape(v, [PAIR, GP]), axis=0)


@triton.jit
def _biased_codes(packed, QUARTER: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_ASM: tl.constexpr, plane=None,
                  THIRD: tl.constexpr = False):
    """uint8 packed bytes → 128 + code·4^k (k < 3) or 128 + code (k = 3) of one quarter, exact in bfloat16. THIRD
    (3-bit keys): codes 0..7 with the third bits from `_plane`'s bytes (code·4^k ≤ 112, still exact)."""
    if THIRD:
        if USE_ASM:
            asm3: tl.constexpr = (UNPACK3_ASM_0 if QUARTER == 0 else UNPACK3_ASM_1 if QUARTER == 1 else
                                  UNPACK3_ASM_2 if QUARTER == 2 else UNPACK3_ASM_3)  # fmt: skip
            out = tl.inline_asm_elementwise(asm3, "=r,=r,r,r", [packed, plane], dtype=tl.bfloat16, is_pure=True,
                                            pack=4)  # fmt: skip
        else:
            if QUARTER == 3:
                c = ((packed >> 6) & 3) | ((plane >> 4) & 4)
            else:
                c = (packed & (3 << (2 * QUARTER))) | ((plane << 2) & (4 << (2 * QUARTER)))
            out = (c.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
    elif USE_ASM:
        asm: tl.constexpr = (UNPACK_ASM_0 if QUARTER == 0 else UNPACK_ASM_1 if QUARTER == 1 else
                             UNPACK_ASM_2 if QUARTER == 2 else UNPACK_ASM_3)  # fmt: skip
        out = tl.inline_asm_elementwise(asm, "=r,=r,r", [packed], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        if QUARTER == 3:
            c = (packed >> 6) & 3
        else:
            c = packed & (3 << (2 * QUARTER))
        out = (c.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
    return out.to(DOT_DTYPE)


@triton.jit
def _dequant_quarter(packed, sz_rows, tok_off, tok_ok, cols, QUARTER: tl.constexpr, D4: tl.constexpr,
                     G: tl.constexpr, DOT_DTYPE: tl.constexpr, pl=None, THIRD: tl.constexpr = False):
    """One quarter of a packed tile dequantized with its per-group scale/zero (G < D), in DOT_DTYPE. The tile is
    [BLOCK_N, D/4] (K) or [D/4, BLOCK_N] (V); tok_off (token · scale stride), tok_ok and cols broadcast to it.
    THIRD (3-bit keys): pl holds the tile's `_plane` bytes, the code is low | 4·bit."""
    sz_ptrs = sz_rows + tok_off + ((QUARTER * D4 + cols) // G) * 2
    s = tl.load(sz_ptrs, mask=tok_ok, other=0.0).to(tl.float32)
    z = tl.load(sz_ptrs + 1, mask=tok_ok, other=0.0).to(tl.float32)
    if THIRD:
        c = (((packed >> (2 * QUARTER)) & 3) | _third_bits(pl, QUARTER)).to(tl.float32)
    else:
        c = ((packed >> (2 * QUARTER)) & 3).to(tl.float32)
    return ((c - z) * s).to(DOT_DTYPE)


@triton.jit
def _scale_zero(sz_row, tok, stride_t, tok_ok, MASKED: tl.constexpr):
    """[BLOCK_N] fp32 scale and zero of each token, from one 32-bit load of its float16 pair (scale in the low half;
    `ops` guarantees 4-byte alignment and even strides)."""
    if MASKED:
        w = tl.load(sz_row + tok * (stride_t // 2), mask=tok_ok, other=0)
    else:
        w = tl.load(sz_row + tok * (stride_t // 2))
    s = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    z = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return s, z


@triton.jit
def _block_q(qf, sz_blk, cols, QUARTER: tl.constexpr, D4: tl.constexpr, F: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Keys per channel (KEY_BLOCK > 0): quarter k of q (fp32 q_k / f_k, [D/4, GP]) times its tile's block scales s
    (sz_blk: the block's float16 (scale, zero) pairs [D, 2]), a_k = q_k·s / f_k in DOT_DTYPE, and the fp32 terms
    a_k·(128 + f_k·z) [D/4, GP] of the rounded a_k, whose sum over dims (and quarters) the score subtracts (the dot of
    a_k with the biased codes 128 + c·f_k is Σ_d q_k·s·c + 128·Σ_d a_k)."""
    ch = (QUARTER * D4 + cols) * 2
    s = tl.load(sz_blk + ch).to(tl.float32)
    z = tl.load(sz_blk + ch + 1).to(tl.float32)
    a = (qf * s[:, None]).to(DOT_DTYPE)
    return a, a.to(tl.float32) * (128.0 + F * z[:, None])
