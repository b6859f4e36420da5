"""Split-K decode attention over the two BF16 tiers (sink and recent) in one launch: partial (o, lse) per split.

Program split index s < S_SINK reads the sink tier, the rest the recent tier; each program streams one KV head's
tokens of its split and serves the whole GQA group of query heads from each tile.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _decode_bf16_kernel(
    # pointers
    q_ptr,  # [B, H_q, D]
    sk_ptr,  # sink K/V [B, H_kv, SINK_CAP, D] (last dim contiguous)
    sv_ptr,
    slen_ptr,  # [B] int32
    rk_ptr,  # recent K/V [B, H_kv, RECENT_CAP, D]
    rv_ptr,
    rlen_ptr,  # [B] int32
    o_ptr,  # [B, H_q, S_SINK + S_RECENT, D] float32
    lse_ptr,  # [B, H_q, S_SINK + S_RECENT] float32
    # sizes
    H_kv,
    GROUP,
    S_SINK,
    S_RECENT,
    qk_scale,  # sm_scale · log2(e)
    # strides
    stride_qb,
    stride_qh,
    stride_skb,
    stride_skh,
    stride_skt,
    stride_svb,
    stride_svh,
    stride_svt,
    stride_rkb,
    stride_rkh,
    stride_rkt,
    stride_rvb,
    stride_rvh,
    stride_rvt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    # constexpr
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // H_kv
    h = pid_bh % H_kv
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)

    # both branches must yield identically typed values (integer args equal to 1 are specialised to constants)
    zero32 = tl.zeros([], tl.int32)
    zero64 = tl.zeros([], tl.int64)
    if pid_s < S_SINK:
        k_base = sk_ptr + b64 * stride_skb + h64 * stride_skh
        v_base = sv_ptr + b64 * stride_svb + h64 * stride_svh
        stride_kt = stride_skt + zero64
        stride_vt = stride_svt + zero64
        L = tl.load(slen_ptr + b)
        S = S_SINK + zero32
        split = pid_s + zero32
    else:
        k_base = rk_ptr + b64 * stride_rkb + h64 * stride_rkh
        v_base = rv_ptr + b64 * stride_rvb + h64 * stride_rvh
        stride_kt = stride_rkt + zero64
        stride_vt = stride_rvt + zero64
        L = tl.load(rlen_ptr + b)
        S = S_RECENT + zero32
        split = pid_s - S_SINK + zero32
    per = tl.cdiv(tl.cdiv(L, S), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, L)

    heads = h * GROUP + tl.arange(0, BLOCK_H)
    head_ok = tl.arange(0, BLOCK_H) < GROUP
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None], other=0.0)
    q = q.to(tl.float32).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in tl.range(start, end, BLOCK_N):
        tok = n0 + offs_n
        tok_ok = tok < end
        tok64 = tok.to(tl.int64)
        k = tl.load(k_base + tok64[:, None] * stride_kt + dims[None, :], mask=tok_ok[:, None], other=0.0)
        v = tl.load(v_base + tok64[:, None] * stride_vt + dims[None, :], mask=tok_ok[:, None], other=0.0)
        k = k.to(tl.float32).to(DOT_DTYPE)  # the CPU interpreter has no bf16 arithmetic: go through fp32
        v = v.to(tl.float32).to(DOT_DTYPE)
        qk = tl.dot(q, tl.trans(k))
        qk = tl.where(tok_ok[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None])

    nonempty = l_i > 0
    safe_l = tl.where(nonempty, l_i, 1.0)
    o = tl.where(nonempty[:, None], acc / safe_l[:, None], 0.0)
    lse = tl.where(nonempty, (m_i + tl.log2(safe_l)) / 1.4426950408889634, float("-inf"))
    o_ptrs = o_ptr + b64 * stride_ob + heads[:, None] * stride_oh + pid_s * stride_os + dims[None, :]
    tl.store(o_ptrs, o, mask=head_ok[:, None])
    tl.store(lse_ptr + b64 * stride_lb + heads * stride_lh + pid_s, lse, mask=head_ok)
