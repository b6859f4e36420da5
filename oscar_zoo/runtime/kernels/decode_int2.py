"""Split-K decode attention over the INT2 history tier: partial (o, lse) per (batch, query head, split).

One program streams the packed K/V tiles of ONE KV head over one split of its tokens, unpacks them in registers and
serves every query head of the GQA group from the same tile (the head block is padded to a power of two and masked).
Codes become floats without conversion instructions: `(c | 0x4300)` read as bfloat16 is exactly 128 + c, so the dot
products run on tensor cores over 128 + c and the constant is folded back with the per-token scale and zero:
    q·k̂ = s·(q·(128+c) − (128+z)·Σq)          Σ_t p_t·v̂_t = Σ_t (p_t s_t)(128+c_t) − Σ_t (p_t s_t)(128+z_t)
(one group per row, G = D). With G < D each element is dequantized with its group's scale before the dot.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _biased_codes(packed, QUARTER: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """uint8 packed bytes → 128 + code of one quarter, exact in bfloat16 (then DOT_DTYPE).

    On the GPU (USE_ASM) four bytes are handled per 32-bit register: shift, mask 0x03030303, and two byte permutes
    that place each code under a 0x43 high byte (bf16 0x43cc = 128 + c): about one instruction per code."""
    if USE_ASM:
        if QUARTER == 0:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t; and.b32 t, $2, 0x03030303; "
                "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342; }",
                "=r,=r,r", [packed], dtype=tl.bfloat16, is_pure=True, pack=4,
            )  # fmt: skip
        elif QUARTER == 1:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $2, 2; and.b32 t, t, 0x03030303; "
                "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342; }",
                "=r,=r,r", [packed], dtype=tl.bfloat16, is_pure=True, pack=4,
            )  # fmt: skip
        elif QUARTER == 2:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $2, 4; and.b32 t, t, 0x03030303; "
                "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342; }",
                "=r,=r,r", [packed], dtype=tl.bfloat16, is_pure=True, pack=4,
            )  # fmt: skip
        else:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $2, 6; and.b32 t, t, 0x03030303; "
                "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342; }",
                "=r,=r,r", [packed], dtype=tl.bfloat16, is_pure=True, pack=4,
            )  # fmt: skip
        return out.to(DOT_DTYPE)
    c = ((packed >> (2 * QUARTER)) & 3).to(tl.int16) | 0x4300
    return c.to(tl.bfloat16, bitcast=True).to(DOT_DTYPE)

@triton.jit
def _dequant_quarter(packed, sz_base, tok64, tok_ok, stride_t, cols, QUARTER: tl.constexpr, D4: tl.constexpr,
                     G: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One quarter of a packed tile dequantized with per-group scale/zero (G < D): [BLOCK_N, D/4] in DOT_DTYPE."""
    sz_ptrs = sz_base + tok64[:, None] * stride_t + (((QUARTER * D4 + cols) // G) * 2)[None, :]
    s = tl.load(sz_ptrs, mask=tok_ok[:, None], other=0.0).to(tl.float32)
    z = tl.load(sz_ptrs + 1, mask=tok_ok[:, None], other=0.0).to(tl.float32)
    c = ((packed >> (2 * QUARTER)) & 3).to(tl.float32)
    return ((c - z) * s).to(DOT_DTYPE)


@triton.jit
def _decode_int2_kernel(
    # pointers
    q_ptr,  # [B, H_q, D]
    ck_ptr,  # [B, H_kv, T_cap, D/4] uint8 (last dim contiguous)
    szk_ptr,  # [B, H_kv, T_cap, D/G, 2] float16 (last two dims contiguous)
    cv_ptr,
    szv_ptr,
    len_ptr,  # [B] int32 history lengths
    o_ptr,  # [B, H_q, S, D] float32 partial outputs
    lse_ptr,  # [B, H_q, S] float32 partial lse
    # sizes
    H_kv,
    GROUP,
    S,
    qk_scale,  # sm_scale · log2(e)
    # strides
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_szkb,
    stride_szkh,
    stride_szkt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_szvb,
    stride_szvh,
    stride_szvt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    # constexpr
    D: tl.constexpr,
    G: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    D4: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // H_kv
    h = pid_bh % H_kv

    L = tl.load(len_ptr + b)
    per = tl.cdiv(tl.cdiv(L, S), BLOCK_N) * BLOCK_N
    start = pid_s * per
    end = tl.minimum(start + per, L)

    heads = h * GROUP + tl.arange(0, BLOCK_H)
    head_ok = tl.arange(0, BLOCK_H) < GROUP
    cols = tl.arange(0, D4)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + cols[None, :]
    q0 = tl.load(q_base + 0 * D4, mask=head_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)
    q1 = tl.load(q_base + 1 * D4, mask=head_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)
    q2 = tl.load(q_base + 2 * D4, mask=head_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)
    q3 = tl.load(q_base + 3 * D4, mask=head_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)
    # Σq of the values the dot actually sees
    qsum = tl.sum(q0.to(tl.float32) + q1.to(tl.float32) + q2.to(tl.float32) + q3.to(tl.float32), axis=1)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    corr = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, D4], tl.float32)
    acc1 = tl.zeros([BLOCK_H, D4], tl.float32)
    acc2 = tl.zeros([BLOCK_H, D4], tl.float32)
    acc3 = tl.zeros([BLOCK_H, D4], tl.float32)

    k_base = ck_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = cv_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    szk_base = szk_ptr + b.to(tl.int64) * stride_szkb + h.to(tl.int64) * stride_szkh
    szv_base = szv_ptr + b.to(tl.int64) * stride_szvb + h.to(tl.int64) * stride_szvh
    offs_n = tl.arange(0, BLOCK_N)

    for n0 in tl.range(start, end, BLOCK_N):
        tok = n0 + offs_n
        tok_ok = tok < end
        tok64 = tok.to(tl.int64)
        kb = tl.load(k_base + tok64[:, None] * stride_kt + cols[None, :], mask=tok_ok[:, None], other=0)
        vb = tl.load(v_base + tok64[:, None] * stride_vt + cols[None, :], mask=tok_ok[:, None], other=0)
        if NG == 1:
            sk = tl.load(szk_base + tok64 * stride_szkt, mask=tok_ok, other=0.0).to(tl.float32)
            zk = tl.load(szk_base + tok64 * stride_szkt + 1, mask=tok_ok, other=0.0).to(tl.float32)
            raw = tl.dot(q0, tl.trans(_biased_codes(kb, 0, DOT_DTYPE, USE_ASM)))
            raw = tl.dot(q1, tl.trans(_biased_codes(kb, 1, DOT_DTYPE, USE_ASM)), raw)
            raw = tl.dot(q2, tl.trans(_biased_codes(kb, 2, DOT_DTYPE, USE_ASM)), raw)
            raw = tl.dot(q3, tl.trans(_biased_codes(kb, 3, DOT_DTYPE, USE_ASM)), raw)  # [BLOCK_H, BLOCK_N]
            qk = (raw - qsum[:, None] * (128.0 + zk)[None, :]) * sk[None, :]
        else:
            raw = tl.dot(q0, tl.trans(_dequant_quarter(kb, szk_base, tok64, tok_ok, stride_szkt, cols, 0, D4, G, DOT_DTYPE)))
            raw = tl.dot(q1, tl.trans(_dequant_quarter(kb, szk_base, tok64, tok_ok, stride_szkt, cols, 1, D4, G, DOT_DTYPE)), raw)
            raw = tl.dot(q2, tl.trans(_dequant_quarter(kb, szk_base, tok64, tok_ok, stride_szkt, cols, 2, D4, G, DOT_DTYPE)), raw)
            qk = tl.dot(q3, tl.trans(_dequant_quarter(kb, szk_base, tok64, tok_ok, stride_szkt, cols, 3, D4, G, DOT_DTYPE)), raw)
        qk = tl.where(tok_ok[None, :], qk * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        acc0 = acc0 * alpha[:, None]
        acc1 = acc1 * alpha[:, None]
        acc2 = acc2 * alpha[:, None]
        acc3 = acc3 * alpha[:, None]
        if NG == 1:
            sv = tl.load(szv_base + tok64 * stride_szvt, mask=tok_ok, other=0.0).to(tl.float32)
            zv = tl.load(szv_base + tok64 * stride_szvt + 1, mask=tok_ok, other=0.0).to(tl.float32)
            ps = (p * sv[None, :]).to(DOT_DTYPE)
            corr = corr * alpha + tl.sum(ps.to(tl.float32) * (128.0 + zv)[None, :], axis=1)
            acc0 = tl.dot(ps, _biased_codes(vb, 0, DOT_DTYPE, USE_ASM), acc0)
            acc1 = tl.dot(ps, _biased_codes(vb, 1, DOT_DTYPE, USE_ASM), acc1)
            acc2 = tl.dot(ps, _biased_codes(vb, 2, DOT_DTYPE, USE_ASM), acc2)
            acc3 = tl.dot(ps, _biased_codes(vb, 3, DOT_DTYPE, USE_ASM), acc3)
        else:
            pd = p.to(DOT_DTYPE)
            acc0 = tl.dot(pd, _dequant_quarter(vb, szv_base, tok64, tok_ok, stride_szvt, cols, 0, D4, G, DOT_DTYPE), acc0)
            acc1 = tl.dot(pd, _dequant_quarter(vb, szv_base, tok64, tok_ok, stride_szvt, cols, 1, D4, G, DOT_DTYPE), acc1)
            acc2 = tl.dot(pd, _dequant_quarter(vb, szv_base, tok64, tok_ok, stride_szvt, cols, 2, D4, G, DOT_DTYPE), acc2)
            acc3 = tl.dot(pd, _dequant_quarter(vb, szv_base, tok64, tok_ok, stride_szvt, cols, 3, D4, G, DOT_DTYPE), acc3)

    nonempty = l_i > 0
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    o_base = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + pid_s * stride_os + cols[None, :]
    tl.store(o_base + 0 * D4, (acc0 - corr[:, None]) * inv_l[:, None], mask=head_ok[:, None])
    tl.store(o_base + 1 * D4, (acc1 - corr[:, None]) * inv_l[:, None], mask=head_ok[:, None])
    tl.store(o_base + 2 * D4, (acc2 - corr[:, None]) * inv_l[:, None], mask=head_ok[:, None])
    tl.store(o_base + 3 * D4, (acc3 - corr[:, None]) * inv_l[:, None], mask=head_ok[:, None])
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + pid_s, lse, mask=head_ok)
