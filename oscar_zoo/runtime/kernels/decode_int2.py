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


# ------------------------------------------------------------------------------------------ CUDA-core (no tl.dot) path


@triton.jit
def _code_floats(packed, QUARTER: tl.constexpr, USE_ASM: tl.constexpr):
    """uint8 packed bytes → one quarter's codes as fp32 f = A + c·BC (see `_decode_int2_cc_kernel`).

    GPU (USE_ASM): per 32-bit register of 4 bytes, one shift + one mask, then one byte permute per code that writes
    the code under the bits of 0.5 (0x3F00_0000 | c << 16 = 0.5 + c/256, exact): no conversion instructions.
    CPU: f = c (A = 0, BC = 1)."""
    if USE_ASM:
        if QUARTER == 0:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t; and.b32 t, $4, 0x03030303; prmt.b32 $0, t, 0x3F00, 0x5044; prmt.b32 $1, t, 0x3F00, 0x5144; "
                "prmt.b32 $2, t, 0x3F00, 0x5244; prmt.b32 $3, t, 0x3F00, 0x5344; }",
                "=r,=r,=r,=r,r", [packed], dtype=tl.float32, is_pure=True, pack=4,
            )  # fmt: skip
        elif QUARTER == 1:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $4, 2; and.b32 t, t, 0x03030303; prmt.b32 $0, t, 0x3F00, 0x5044; prmt.b32 $1, t, 0x3F00, 0x5144; "
                "prmt.b32 $2, t, 0x3F00, 0x5244; prmt.b32 $3, t, 0x3F00, 0x5344; }",
                "=r,=r,=r,=r,r", [packed], dtype=tl.float32, is_pure=True, pack=4,
            )  # fmt: skip
        elif QUARTER == 2:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $4, 4; and.b32 t, t, 0x03030303; prmt.b32 $0, t, 0x3F00, 0x5044; prmt.b32 $1, t, 0x3F00, 0x5144; "
                "prmt.b32 $2, t, 0x3F00, 0x5244; prmt.b32 $3, t, 0x3F00, 0x5344; }",
                "=r,=r,=r,=r,r", [packed], dtype=tl.float32, is_pure=True, pack=4,
            )  # fmt: skip
        else:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $4, 6; and.b32 t, t, 0x03030303; prmt.b32 $0, t, 0x3F00, 0x5044; prmt.b32 $1, t, 0x3F00, 0x5144; "
                "prmt.b32 $2, t, 0x3F00, 0x5244; prmt.b32 $3, t, 0x3F00, 0x5344; }",
                "=r,=r,=r,=r,r", [packed], dtype=tl.float32, is_pure=True, pack=4,
            )  # fmt: skip
    else:
        out = ((packed >> (2 * QUARTER)) & 3).to(tl.float32)
    return out


@triton.jit
def _group_sz(sz_base, tok64, tok_ok, stride_t, cols, QUARTER: tl.constexpr, D4: tl.constexpr, G: tl.constexpr):
    """Per-element (scale, zero) of one quarter when G < D: two [BLOCK_N, D/4] fp32 tiles."""
    ptrs = sz_base + tok64[:, None] * stride_t + (((QUARTER * D4 + cols) // G) * 2)[None, :]
    s = tl.load(ptrs, mask=tok_ok[:, None], other=0.0).to(tl.float32)
    z = tl.load(ptrs + 1, mask=tok_ok[:, None], other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _decode_int2_cc_kernel(
    q_ptr, ck_ptr, szk_ptr, cv_ptr, szv_ptr, len_ptr, o_ptr, lse_ptr,
    sk_ptr, sv_ptr, slen_ptr, rk_ptr, rv_ptr, rlen_ptr,  # BF16 sink / recent tiers [B, H_kv, CAP, D], lengths [B]
    H_kv, GROUP, S, S_SINK, S_RECENT, qk_scale,
    stride_qb, stride_qh,
    stride_skb, stride_skh, stride_skt, stride_svb, stride_svh, stride_svt,
    stride_rkb, stride_rkh, stride_rkt, stride_rvb, stride_rvh, stride_rvt,
    stride_kb, stride_kh, stride_kt,
    stride_szkb, stride_szkh, stride_szkt,
    stride_vb, stride_vh, stride_vt,
    stride_szvb, stride_szvh, stride_szvt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    D: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """Same contract as `_decode_int2_kernel`, on CUDA cores: no tensor-core dot, no shared-memory layout conversion.
Splits S .. S + S_SINK − 1 read the BF16 sink tier and the next S_RECENT splits the recent tier (the same partial
buffer, one launch for all three tiers).

    A tile is BLOCK_N tokens = BLOCK_N *slots*; every slot keeps its own online-softmax state (m, l, Σ p·s·z and a
    [BLOCK_H, D] accumulator) across the tiles, so the loop has no cross-token reduction: the only cross-thread work
    per tile is the q·c sum over one packed row. The slots are merged once at the end. Codes are read as f = A + c·BC
    and the affine constants folded into the per-token scale and zero: k̂ = s(c − z) = (s/BC)(f − (A + BC·z))."""
    D4: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    if USE_ASM:
        A: tl.constexpr = 0.5
        BC: tl.constexpr = 1.0 / 256.0
    else:
        A: tl.constexpr = 0.0
        BC: tl.constexpr = 1.0
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // H_kv
    h = pid_bh % H_kv
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)

    hh = tl.arange(0, BLOCK_H)
    heads = h * GROUP + hh
    head_ok = hh < GROUP
    cols = tl.arange(0, D4)
    q_base = q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + cols[None, :]
    q0 = tl.load(q_base + 0 * D4, mask=head_ok[:, None], other=0.0).to(tl.float32)
    q1 = tl.load(q_base + 1 * D4, mask=head_ok[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_base + 2 * D4, mask=head_ok[:, None], other=0.0).to(tl.float32)
    q3 = tl.load(q_base + 3 * D4, mask=head_ok[:, None], other=0.0).to(tl.float32)
    qsum = tl.sum(q0 + q1 + q2 + q3, axis=1)  # [BLOCK_H]
    q0 = q0[:, None, :]
    q1 = q1[:, None, :]
    q2 = q2[:, None, :]
    q3 = q3[:, None, :]

    m_i = tl.full([BLOCK_H, BLOCK_N], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    corr = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    acc0 = tl.zeros([BLOCK_H, BLOCK_N, D4], tl.float32)
    acc1 = tl.zeros([BLOCK_H, BLOCK_N, D4], tl.float32)
    acc2 = tl.zeros([BLOCK_H, BLOCK_N, D4], tl.float32)
    acc3 = tl.zeros([BLOCK_H, BLOCK_N, D4], tl.float32)

    k_base = ck_ptr + b64 * stride_kb + h64 * stride_kh
    v_base = cv_ptr + b64 * stride_vb + h64 * stride_vh
    szk_base = szk_ptr + b64 * stride_szkb + h64 * stride_szkh
    szv_base = szv_ptr + b64 * stride_szvb + h64 * stride_szvh
    offs_n = tl.arange(0, BLOCK_N)

    if pid_s < S:
        L = tl.load(len_ptr + b)
        per = tl.cdiv(tl.cdiv(L, S), BLOCK_N) * BLOCK_N
        start = pid_s * per
        end = tl.minimum(start + per, L)
    else:
        start = tl.zeros([], tl.int32)
        end = start
    for n0 in tl.range(start, end, BLOCK_N):
        tok = n0 + offs_n
        tok_ok = tok < end
        tok64 = tok.to(tl.int64)
        kb = tl.load(k_base + tok64[:, None] * stride_kt + cols[None, :], mask=tok_ok[:, None], other=0)
        vb = tl.load(v_base + tok64[:, None] * stride_vt + cols[None, :], mask=tok_ok[:, None], other=0)
        if NG == 1:
            sk = tl.load(szk_base + tok64 * stride_szkt, mask=tok_ok, other=0.0).to(tl.float32)
            zk = tl.load(szk_base + tok64 * stride_szkt + 1, mask=tok_ok, other=0.0).to(tl.float32)
            raw = tl.sum(q0 * _code_floats(kb, 0, USE_ASM)[None, :, :] + q1 * _code_floats(kb, 1, USE_ASM)[None, :, :]
                         + q2 * _code_floats(kb, 2, USE_ASM)[None, :, :] + q3 * _code_floats(kb, 3, USE_ASM)[None, :, :],
                         axis=2)  # fmt: skip
            qk = (raw - qsum[:, None] * (A + BC * zk)[None, :]) * (sk * (qk_scale / BC))[None, :]
        else:
            s0, z0 = _group_sz(szk_base, tok64, tok_ok, stride_szkt, cols, 0, D4, G)
            s1, z1 = _group_sz(szk_base, tok64, tok_ok, stride_szkt, cols, 1, D4, G)
            s2, z2 = _group_sz(szk_base, tok64, tok_ok, stride_szkt, cols, 2, D4, G)
            s3, z3 = _group_sz(szk_base, tok64, tok_ok, stride_szkt, cols, 3, D4, G)
            k0 = ((_code_floats(kb, 0, USE_ASM) - A) / BC - z0) * s0
            k1 = ((_code_floats(kb, 1, USE_ASM) - A) / BC - z1) * s1
            k2 = ((_code_floats(kb, 2, USE_ASM) - A) / BC - z2) * s2
            k3 = ((_code_floats(kb, 3, USE_ASM) - A) / BC - z3) * s3
            raw = tl.sum(q0 * k0[None, :, :] + q1 * k1[None, :, :] + q2 * k2[None, :, :] + q3 * k3[None, :, :], axis=2)
            qk = raw * qk_scale
        qk = tl.where(tok_ok[None, :], qk, float("-inf"))

        m_new = tl.maximum(m_i, qk)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe)  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + p
        m_i = m_new
        a3 = alpha[:, :, None]
        if NG == 1:
            sv = tl.load(szv_base + tok64 * stride_szvt, mask=tok_ok, other=0.0).to(tl.float32)
            zv = tl.load(szv_base + tok64 * stride_szvt + 1, mask=tok_ok, other=0.0).to(tl.float32)
            ps = p * (sv / BC)[None, :]
            corr = corr * alpha + ps * (A + BC * zv)[None, :]
            ps3 = ps[:, :, None]
            acc0 = acc0 * a3 + ps3 * _code_floats(vb, 0, USE_ASM)[None, :, :]
            acc1 = acc1 * a3 + ps3 * _code_floats(vb, 1, USE_ASM)[None, :, :]
            acc2 = acc2 * a3 + ps3 * _code_floats(vb, 2, USE_ASM)[None, :, :]
            acc3 = acc3 * a3 + ps3 * _code_floats(vb, 3, USE_ASM)[None, :, :]
        else:
            s0, z0 = _group_sz(szv_base, tok64, tok_ok, stride_szvt, cols, 0, D4, G)
            s1, z1 = _group_sz(szv_base, tok64, tok_ok, stride_szvt, cols, 1, D4, G)
            s2, z2 = _group_sz(szv_base, tok64, tok_ok, stride_szvt, cols, 2, D4, G)
            s3, z3 = _group_sz(szv_base, tok64, tok_ok, stride_szvt, cols, 3, D4, G)
            p3 = p[:, :, None]
            acc0 = acc0 * a3 + p3 * (((_code_floats(vb, 0, USE_ASM) - A) / BC - z0) * s0)[None, :, :]
            acc1 = acc1 * a3 + p3 * (((_code_floats(vb, 1, USE_ASM) - A) / BC - z1) * s1)[None, :, :]
            acc2 = acc2 * a3 + p3 * (((_code_floats(vb, 2, USE_ASM) - A) / BC - z2) * s2)[None, :, :]
            acc3 = acc3 * a3 + p3 * (((_code_floats(vb, 3, USE_ASM) - A) / BC - z3) * s3)[None, :, :]

    # BF16 tiers (splits S and up): the same slots, k and v read as four [BLOCK_N, D/4] quarters
    if pid_s >= S:
        if pid_s < S + S_SINK:
            tk_base = sk_ptr + b64 * stride_skb + h64 * stride_skh
            tv_base = sv_ptr + b64 * stride_svb + h64 * stride_svh
            t_stride_k = stride_skt + tl.zeros([], tl.int64)
            t_stride_v = stride_svt + tl.zeros([], tl.int64)
            TL = tl.load(slen_ptr + b)
            TS = S_SINK + tl.zeros([], tl.int32)
            split = pid_s - S + tl.zeros([], tl.int32)
        else:
            tk_base = rk_ptr + b64 * stride_rkb + h64 * stride_rkh
            tv_base = rv_ptr + b64 * stride_rvb + h64 * stride_rvh
            t_stride_k = stride_rkt + tl.zeros([], tl.int64)
            t_stride_v = stride_rvt + tl.zeros([], tl.int64)
            TL = tl.load(rlen_ptr + b)
            TS = S_RECENT + tl.zeros([], tl.int32)
            split = pid_s - S - S_SINK + tl.zeros([], tl.int32)
        t_per = tl.cdiv(tl.cdiv(TL, TS), BLOCK_N) * BLOCK_N
        t_start = split * t_per
        t_end = tl.minimum(t_start + t_per, TL)
        for n0 in tl.range(t_start, t_end, BLOCK_N):
            tok = n0 + offs_n
            tok_ok = tok < t_end
            tok64 = tok.to(tl.int64)
            kp = tk_base + tok64[:, None] * t_stride_k + cols[None, :]
            vp = tv_base + tok64[:, None] * t_stride_v + cols[None, :]
            k0 = tl.load(kp + 0 * D4, mask=tok_ok[:, None], other=0.0).to(tl.float32)
            k1 = tl.load(kp + 1 * D4, mask=tok_ok[:, None], other=0.0).to(tl.float32)
            k2 = tl.load(kp + 2 * D4, mask=tok_ok[:, None], other=0.0).to(tl.float32)
            k3 = tl.load(kp + 3 * D4, mask=tok_ok[:, None], other=0.0).to(tl.float32)
            raw = tl.sum(q0 * k0[None, :, :] + q1 * k1[None, :, :] + q2 * k2[None, :, :] + q3 * k3[None, :, :], axis=2)
            qk = tl.where(tok_ok[None, :], raw * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, qk)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe)
            l_i = l_i * alpha + p
            m_i = m_new
            corr = corr * alpha
            a3 = alpha[:, :, None]
            p3 = p[:, :, None]
            acc0 = acc0 * a3 + p3 * tl.load(vp + 0 * D4, mask=tok_ok[:, None], other=0.0).to(tl.float32)[None, :, :]
            acc1 = acc1 * a3 + p3 * tl.load(vp + 1 * D4, mask=tok_ok[:, None], other=0.0).to(tl.float32)[None, :, :]
            acc2 = acc2 * a3 + p3 * tl.load(vp + 2 * D4, mask=tok_ok[:, None], other=0.0).to(tl.float32)[None, :, :]
            acc3 = acc3 * a3 + p3 * tl.load(vp + 3 * D4, mask=tok_ok[:, None], other=0.0).to(tl.float32)[None, :, :]

    # merge the slots: weights 2^(m_slot − m_max); empty slots (m = −inf) weigh 0
    m_max = tl.max(m_i, axis=1)  # [BLOCK_H]
    nonempty = m_max > float("-inf")
    m_ref = tl.where(nonempty, m_max, 0.0)
    w = tl.exp2(m_i - m_ref[:, None])  # [BLOCK_H, BLOCK_N]
    l_tot = tl.sum(l_i * w, axis=1)
    c_tot = tl.sum(corr * w, axis=1)
    w3 = w[:, :, None]
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l_tot, 1.0), 0.0)
    lse = tl.where(nonempty, (m_ref + tl.log2(tl.where(nonempty, l_tot, 1.0))) / 1.4426950408889634, float("-inf"))
    o_base = o_ptr + b64 * stride_ob + heads[:, None] * stride_oh + pid_s * stride_os + cols[None, :]
    tl.store(o_base + 0 * D4, (tl.sum(acc0 * w3, axis=1) - c_tot[:, None]) * inv_l[:, None], mask=head_ok[:, None])
    tl.store(o_base + 1 * D4, (tl.sum(acc1 * w3, axis=1) - c_tot[:, None]) * inv_l[:, None], mask=head_ok[:, None])
    tl.store(o_base + 2 * D4, (tl.sum(acc2 * w3, axis=1) - c_tot[:, None]) * inv_l[:, None], mask=head_ok[:, None])
    tl.store(o_base + 3 * D4, (tl.sum(acc3 * w3, axis=1) - c_tot[:, None]) * inv_l[:, None], mask=head_ok[:, None])
    tl.store(lse_ptr + b64 * stride_lb + heads * stride_lh + pid_s, lse, mask=head_ok)
