"""Split-K decode attention over the three cache tiers in one launch: partial (o, lse) per (batch, query head, split).

Grid (batch × KV heads, S_SINK + S_HIST + S_RECENT). A program serves one KV head and the GROUP query heads of its GQA
group (padded to GP, a power of two); it streams one split of one tier: split < S_SINK reads the BF16 sink, the next
S_HIST splits the INT2 history, the rest the BF16 recent tier. One body (`_attend`) serves both: a tile is INT2 codes
(`_int2_tile`; a split's whole tiles run unmasked and software-pipelined, its last partial tile masked) or BF16 rows
(a BF16 split is one masked tile), with one online-softmax step (`_softmax_step`) and one epilogue.

The tokens sit on the MMA rows: scores are computed transposed, [BLOCK_N, GP] = K·qᵀ, so a tile of BLOCK_N tokens
fills BLOCK_N / 16 MMA row tiles and the small GQA group only pads the 8-wide column side of the score dot; q stays a
loop-invariant operand, and the softmax runs over the token axis. P·V is computed transposed too, oᵀ [D, GP] =
Vᵀ·p: the dims fill the MMA rows and the tokens are the contraction axis. The cache stores V's codes token-major
(`layout.history_codes`), so a quarter of Vᵀ is read, like a quarter of K, as bytes contiguous along the contraction
axis: one matrix load per operand fragment, no byte gathers (any other strides are correct, only slower).

INT2 codes become tensor-core operands without conversion instructions (one group per row, G = D; s, z the row's
scale and zero):
- K, from D = 128: integer dots. Quarter k of a packed word shifted down and masked is four int8 codes c ∈ 0..3. Each
  head's q is scaled so its largest |q| is 127 (factor λ) and split into two int8 parts, λq = q_hi + q_lo / Q_LO
  (Q_LO = min(128, 8192 / D): each element exact to 1 / (2·127·Q_LO) of the head's largest |q|, finer than a
  bfloat16 q in the score). Two int32 dots per quarter, Σ c·q_hi and Σ c·q_lo, are exact, and
      q·k̂ = s·((Q_LO·Σ c·q_hi + Σ c·q_lo) − z·(Q_LO·Σq_hi + Σq_lo)) / (λ·Q_LO).
  The integer sum (< 2^22 in magnitude) becomes float32 by an add to the bits of 1.5·2^23, not by a conversion
  instruction. An int8 dot's 8 columns and 32-dim contraction decide where it applies: a GQA group padded to 4
  puts two tokens on each row of the score dot (2·D/4 code bytes, contiguous in the cache) against q laid out
  block-diagonally ([2·D/4, 2·4]), so all 8 columns are real heads (the softmax that follows computes no padding)
  and D = 64 reaches 32 dims; groups of 8 or more fill the columns alone from D = 128. Groups of 1–2, and of ≥ 8 at
  D = 64, take the bfloat16 path of V.
- V (and K otherwise): quarter k of a packed byte, masked in place (k < 3: the code times f_k = 4^k, at most 48)
  or shifted down (k = 3: f_3 = 1), under a 0x43 high byte is the bfloat16 128 + c·f_k, exact. The other operand is
  scaled by 1 / f_k (a power of two, exact) and the affine constants come back in fp32:
      q·k̂ = s·(Σ_k (q_k / f_k)·(128 + c_k f_k) − 128·Σ_k Σq_k / f_k − z·Σq)
      Σ_t p_t v̂_t[quarter k] = (Σ_t (p_t s_t)(128 + c_t f_k) − 128·Σ_t p_t s_t) / f_k − Σ_t (p_t s_t) z_t
With G < D every element is dequantized with its group's scale before the dot.

3-bit keys (KEY_BITS = 3, `reference.pack_codes`): a row is D/4 bytes of low two bits, quartered as above, and D/8
bytes of bit plane (byte j holds the third bit of dims j, j + D/8, …, j + 7D/8 in bits 0..7), so column c of quarter k
has its third bit at bit 2k + c // (D/8) of plane byte c mod D/8. The history stores rows in pairs
(`reference.store_pairs`, docs/format.md §6b): tokens 2p and 2p + 1 are 3D/4 contiguous bytes, their two rows of low
bits (2·D/4, one contiguous run: one score-dot row of two tokens) then their two planes, so no load re-reads the
sectors of another. A tile loads the plane bytes with its codes (same rows, same mask), moves each byte down by its
column's half once (quarter k's bit is then bit 2k), and merges the bit into the unpacked codes, c = low | 4·bit (four
codes per 32-bit instruction, as the low bits): on the
integer path the int8 codes are 0..7, and |Σ c·(q_hi·Q_LO + q_lo)| ≤ 7·D·127.5·Q_LO < 2^22 takes Q_LO =
min(128, 4096 / D); on the bfloat16 path quarter k's byte is c·f_k ≤ 7·16 < 128 under the 0x43 high byte, the exact
bfloat16 128 + c·f_k, so the dots, q_bias and the formulas above are unchanged (all linear in c); with G < D the code
is dequantized whole. 2-bit keys compile to the code without the plane.

Keys per channel over token blocks (KEY_BLOCK > 0, docs/format.md §6d): K's codes are packed per token as above, but
its scale/zero are float16 pairs per (block of KEY_BLOCK history tokens, channel), [T_cap / KEY_BLOCK, D, 2]. Tiles
start at multiples of BLOCK_N and `ops` makes BLOCK_N divide KEY_BLOCK, so a tile lies in one block, b = n0 //
KEY_BLOCK. Two builds (V is unchanged: per-token words, G = D):
- BLOCK_Q (`ops.block_query`: the integer dots' shapes, D ≥ 128): K takes the integer dots above with q' = q ⊙ s_b in
  place of q. `block_query.py` writes every block's int8 parts of λ_b·q' and per head (w, bias) once per step; a tile
  loads its block's, and its score is (MAGIC + Σ c·(Q_LO·q'_hi + q'_lo))·w − bias (that module's docstring).
- otherwise K takes the bfloat16 path, reading the pairs as float16 with the block stride: q's quarters stay fp32
  (q_k / f_k) and each tile folds its block's channel scales in, a_k = bf16(q_k·s_k / f_k) [D/4, GP] (s_k, z_k the
  block's pairs of dims k·D/4 + cols, `_block_q`):
      q·k̂_t = Σ_k a_k·(128 + c_k f_k) − Σ_k Σ_d a_k·(128 + f_k·z_k)
  the dots as on the bfloat16 path (3-bit codes included), the constant per tile and head in fp32 of the rounded a_k,
  then times qk_scale.
KEY_BLOCK = 0 compiles to the row layout's code.

A logit softcap (SOFTCAP > 0, Gemma2's): every score of every tier, in the log2 units the softmax uses, becomes
C·tanh((score + b)/C), C = cap·log2(e), b the query head's shift (centred keys lost q·μ_K·M_K, which tanh does not
ignore), before the mask and the online softmax; SOFTCAP = 0 compiles to the code without it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .int2_codes import (  # the codes as tensor-core operands
    MAGIC,
    _biased_codes,
    _block_q,
    _dequant_quarter,
    _int8_codes,
    _int8_parts,
    _per_head,
    _plane,
    _scale_zero,
)

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _softmax_step(sT, m_i, SLACK: tl.constexpr):
    """One online-softmax step over a tile's scores sT [BLOCK_N, GP] (log2 units, −inf where masked): the tile's
    probabilities p, the factor alpha [GP] that rescales the running sums, the new running maximum, and (SLACK > 0)
    whether any maximum moved. SLACK = 0 moves the maximum whenever a head's grows; SLACK > 0 keeps a stale one until
    some head's grows past it by more than SLACK, so most tiles have alpha = 1 and skip the accumulator rescale
    (p ≤ 2^SLACK meanwhile: exact in the fp32 sums, the same relative bf16 rounding)."""
    m_tile = tl.maximum(m_i, tl.max(sT, axis=0))
    if SLACK > 0:
        moved = tl.max((m_tile > m_i + SLACK).to(tl.int32), axis=0)
        m_new = tl.where(moved > 0, m_tile, m_i)
    else:
        moved = 1
        m_new = m_tile
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(sT - m_safe[None, :])
    return p, alpha, m_new, moved


@triton.jit
def _softcap(sT, lbias, C: tl.constexpr):
    """A logit softcap in the kernel's log2 units: C·tanh((sT + lbias)/C) [BLOCK_N, GP], C = cap·log2(e) (the
    natural cap·tanh(x/cap) times log2 e), lbias [GP] a per-head logit shift applied before the cap (the centred keys'
    q·μ_K·M_K, which tanh does not ignore). tanh(y) = 1 − 2/(e^(2y) + 1), as exp2: ±1 where e^(2y) over- or
    underflows."""
    y = (sT + lbias[None, :]) * (2.0 * LOG2E / C)
    return C * (1.0 - 2.0 / (tl.exp2(y) + 1.0))


@triton.jit
def _int8_scores(kb, pl, q_parts, Q_LO: tl.constexpr, USE_ASM: tl.constexpr, K3: tl.constexpr, N: tl.constexpr,
                 GP: tl.constexpr):
    """Integer score dots of a tile: int8 codes 0..3 (0..7: 3-bit keys) against q's int8 high and low parts (int32
    sums, exact), as float32 MAGIC + (Q_LO·Σ c·q_hi + Σ c·q_lo) [N tokens, GP]. |·| < 2^22: to float32 by an integer
    add to MAGIC's bits (no int→float conversion, a quarter-rate instruction; the caller removes MAGIC); [R, PAIR·GP]
    → [N, GP]: row PAIR·r + i is token PAIR·r + i."""
    q0, q1, q2, q3, ql0, ql1, ql2, ql3 = q_parts
    c = _int8_codes(kb, 0, USE_ASM, pl, K3)
    s_hi = tl.dot(c, q0, out_dtype=tl.int32)
    s_lo = tl.dot(c, ql0, out_dtype=tl.int32)
    c = _int8_codes(kb, 1, USE_ASM, pl, K3)
    s_hi = tl.dot(c, q1, s_hi, out_dtype=tl.int32)
    s_lo = tl.dot(c, ql1, s_lo, out_dtype=tl.int32)
    c = _int8_codes(kb, 2, USE_ASM, pl, K3)
    s_hi = tl.dot(c, q2, s_hi, out_dtype=tl.int32)
    s_lo = tl.dot(c, ql2, s_lo, out_dtype=tl.int32)
    c = _int8_codes(kb, 3, USE_ASM, pl, K3)
    s_hi = tl.dot(c, q3, s_hi, out_dtype=tl.int32)
    s_lo = tl.dot(c, ql3, s_lo, out_dtype=tl.int32)
    sT = (s_hi * Q_LO + s_lo + 0x4B400000).to(tl.float32, bitcast=True)
    return tl.reshape(sT, [N, GP])


@triton.jit
def _int2_tile(
    n0, end, offs_n, cols,
    rows,  # (k_rows, v_rows, szk_row, szv_row): this KV head's codes and scale/zero pairs
    strides,  # (stride_kt, stride_vt, stride_vd, stride_szkt, stride_szvt): per token (V's codes also per dim)
    qk,  # (q0..q3, ql0..ql3, q_bias, q_w, qsum, qk_scale, lbias): q's quarters as the score dots take them, and the
    # softcap's per-head logit shift (`_attend`)
    state,  # (m_i, l_t, psum_t, pz_t, acc0..acc3): the running online-softmax state
    chan,  # (qb_row, qf_row, pq, pq_ok): keys per channel on the integer path, this KV head's block operands
    INT8_K: tl.constexpr, PAIR: tl.constexpr, Q_LO: tl.constexpr, D4: tl.constexpr, G: tl.constexpr,
    NG: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_ASM: tl.constexpr, SLACK: tl.constexpr, MASKED: tl.constexpr,
    KEY_BITS: tl.constexpr, KEY_BLOCK: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
):  # fmt: skip
    """One tile of BLOCK_N history tokens from n0: scores, the online-softmax step, P·V; returns the running state.
    MASKED: the tile may pass `end` (the split's last tile); otherwise every token is in range and nothing is masked.
    KEY_BITS = 3: K's rows also hold the third bits' plane, rows stored in pairs (module docstring).
    KEY_BLOCK > 0: K's scale/zero per channel of block n0 // KEY_BLOCK: on the integer path (INT8_K) the block's int8
    q·s parts and (w, bias) from `block_query.py` (chan), else folded here (szk_row: float16 pairs; q0..q3: fp32
    q_k / f_k).
    SOFTCAP > 0: the scores are capped (`_softcap`, C = SOFTCAP, after lbias) before the mask and the softmax."""
    k_rows, v_rows, szk_row, szv_row = rows
    stride_kt, stride_vt, stride_vd, stride_szkt, stride_szvt = strides
    q0, q1, q2, q3, ql0, ql1, ql2, ql3, q_bias, q_w, qsum, qk_scale, lbias = qk
    m_i, l_t, psum_t, pz_t, acc0, acc1, acc2, acc3 = state
    tok = n0 + offs_n
    tok_ok = tok < end
    tok64 = tok.to(tl.int64)
    v_ptrs = v_rows + cols[:, None] * stride_vd + tok64[None, :] * stride_vt  # Vᵀ: [D/4, BLOCK_N]
    K3: tl.constexpr = KEY_BITS == 3
    D8: tl.constexpr = D4 // 2
    if INT8_K:
        # PAIR tokens per row of the score dot: row r holds the codes of tokens PAIR·r + i (PAIR·D/4 bytes, contiguous
        # in the cache), against q laid out block-diagonally ([PAIR·D/4, PAIR·GP], `_attend`)
        R: tl.constexpr = offs_n.shape[0] // PAIR
        pair_j = tl.arange(0, PAIR * D4)[None, :]
        pair_tok = n0 + PAIR * tl.arange(0, R)[:, None] + pair_j // D4
        if K3 and PAIR == 2:  # a stored pair (n0 is even): both rows' low-bit bytes, 2·D/4 contiguous, then the planes
            pair_base = k_rows + (n0 // 2 + tl.arange(0, R)[:, None]).to(tl.int64) * (2 * stride_kt)
            k_ptrs = pair_base + pair_j
        elif K3:  # token t's low-bit bytes: at t·3D/8 in its pair when t is even, D/8 earlier when odd
            k_ptrs = k_rows + pair_tok.to(tl.int64) * stride_kt - (pair_tok % 2) * D8 + pair_j % D4
        else:
            k_ptrs = k_rows + pair_tok.to(tl.int64) * stride_kt + pair_j % D4
        k_ok = pair_tok < end
    elif K3:
        k_ptrs = k_rows + tok64[:, None] * stride_kt - (tok[:, None] % 2) * D8 + cols[None, :]
        k_ok = tok_ok[:, None]
    else:
        k_ptrs = k_rows + tok64[:, None] * stride_kt + cols[None, :]
        k_ok = tok_ok[:, None]
    if MASKED:
        kb = tl.load(k_ptrs, mask=k_ok, other=0)
    else:
        kb = tl.load(k_ptrs)
    if K3:
        # the plane bytes of the same tokens (rows stored in pairs: module docstring): column c's third bits sit in
        # byte c mod D/8 of its row's plane (quarter k's at bit 2k + c // (D/8)), the pair's planes after its low-bit
        # bytes: runs of D/8 contiguous bytes
        if INT8_K and PAIR == 2:
            # (pair_j // D8 % 2 and pair_j % D8, not pair_j % D4 // D8: runs of D/8 the compiler vectorises)
            half = (pair_j // D8) % 2
            pl_ptrs = pair_base + 2 * D4 + (pair_j // D4) * D8 + pair_j % D8
        else:
            t = pair_tok if INT8_K else tok[:, None]
            c = pair_j % D4 if INT8_K else cols[None, :]
            half = c // D8
            pl_ptrs = k_ptrs + 2 * D4 - (t % 2 + half) * D8
        if MASKED:
            pl = tl.load(pl_ptrs, mask=k_ok, other=0)
        else:
            pl = tl.load(pl_ptrs)
        pl = _plane(pl, half, USE_ASM)
    else:
        pl = kb  # unused
    # ---- scores, transposed: [BLOCK_N, GP]
    if KEY_BLOCK > 0 and INT8_K:
        # keys per channel, integer dots: the tile lies in one block (BLOCK_N divides KEY_BLOCK, n0 a multiple of
        # BLOCK_N); its q·s as int8 parts, laid out as q's (block-diagonal for PAIR = 2), and the per-head (w, bias)
        qb_row, qf_row, pq, pq_ok = chan
        GPB: tl.constexpr = q_w.shape[0]
        blk = tl.cast(n0 // KEY_BLOCK, tl.int64)
        qb = qb_row + blk * (2 * GPB * 4 * D4) + pq
        q0 = tl.load(qb + 0 * D4, mask=pq_ok, other=0)
        q1 = tl.load(qb + 1 * D4, mask=pq_ok, other=0)
        q2 = tl.load(qb + 2 * D4, mask=pq_ok, other=0)
        q3 = tl.load(qb + 3 * D4, mask=pq_ok, other=0)
        ql0 = tl.load(qb + GPB * 4 * D4 + 0 * D4, mask=pq_ok, other=0)
        ql1 = tl.load(qb + GPB * 4 * D4 + 1 * D4, mask=pq_ok, other=0)
        ql2 = tl.load(qb + GPB * 4 * D4 + 2 * D4, mask=pq_ok, other=0)
        ql3 = tl.load(qb + GPB * 4 * D4 + 3 * D4, mask=pq_ok, other=0)
        qf = qf_row + blk * (2 * GPB) + tl.arange(0, GPB)
        w = tl.load(qf)
        bias = tl.load(qf + GPB)
        sT = _int8_scores(kb, pl, (q0, q1, q2, q3, ql0, ql1, ql2, ql3), Q_LO, USE_ASM, K3, offs_n.shape[0], GPB)
        sT = sT * w[None, :] - bias[None, :]
    elif KEY_BLOCK > 0:
        # keys per channel, bfloat16 dots: the tile lies in one block, always in range (n0 < end); its channel scales
        # folded into q, its zeros and the codes' +128 bias one constant per head
        sz_blk = szk_row + tl.cast(n0 // KEY_BLOCK, tl.int64) * stride_szkt
        a0, t0 = _block_q(q0, sz_blk, cols, 0, D4, 1.0, DOT_DTYPE)
        a1, t1 = _block_q(q1, sz_blk, cols, 1, D4, 4.0, DOT_DTYPE)
        a2, t2 = _block_q(q2, sz_blk, cols, 2, D4, 16.0, DOT_DTYPE)
        a3, t3 = _block_q(q3, sz_blk, cols, 3, D4, 1.0, DOT_DTYPE)
        const = tl.sum((t0 + t1) + (t2 + t3), axis=0)  # [GP]: one reduction over the dims per tile
        sT = tl.dot(_biased_codes(kb, 0, DOT_DTYPE, USE_ASM, pl, K3), a0)
        sT = tl.dot(_biased_codes(kb, 1, DOT_DTYPE, USE_ASM, pl, K3), a1, sT)
        sT = tl.dot(_biased_codes(kb, 2, DOT_DTYPE, USE_ASM, pl, K3), a2, sT)
        sT = tl.dot(_biased_codes(kb, 3, DOT_DTYPE, USE_ASM, pl, K3), a3, sT)
        sT = (sT - const[None, :]) * qk_scale
    elif NG == 1:
        if INT8_K:
            sT = _int8_scores(kb, pl, (q0, q1, q2, q3, ql0, ql1, ql2, ql3), Q_LO, USE_ASM, K3, offs_n.shape[0],
                              q_w.shape[0])  # fmt: skip
        else:
            # quarters of bfloat16 128 + code·4^k against q_k / 4^k
            sT = tl.dot(_biased_codes(kb, 0, DOT_DTYPE, USE_ASM, pl, K3), q0)
            sT = tl.dot(_biased_codes(kb, 1, DOT_DTYPE, USE_ASM, pl, K3), q1, sT)
            sT = tl.dot(_biased_codes(kb, 2, DOT_DTYPE, USE_ASM, pl, K3), q2, sT)
            sT = tl.dot(_biased_codes(kb, 3, DOT_DTYPE, USE_ASM, pl, K3), q3, sT)
        sk, zk = _scale_zero(szk_row, tok, stride_szkt, tok_ok, MASKED)
        sT = (sT - q_bias[None, :] - zk[:, None] * qsum[None, :]) * sk[:, None] * q_w[None, :]
    else:
        k_off, k_ok, k_cols = tok64[:, None] * stride_szkt, tok_ok[:, None], cols[None, :]
        sT = tl.dot(_dequant_quarter(kb, szk_row, k_off, k_ok, k_cols, 0, D4, G, DOT_DTYPE, pl, K3), q0)
        sT = tl.dot(_dequant_quarter(kb, szk_row, k_off, k_ok, k_cols, 1, D4, G, DOT_DTYPE, pl, K3), q1, sT)
        sT = tl.dot(_dequant_quarter(kb, szk_row, k_off, k_ok, k_cols, 2, D4, G, DOT_DTYPE, pl, K3), q2, sT)
        sT = tl.dot(_dequant_quarter(kb, szk_row, k_off, k_ok, k_cols, 3, D4, G, DOT_DTYPE, pl, K3), q3, sT)
        sT = sT * qk_scale
    if SOFTCAP > 0:
        sT = _softcap(sT, lbias, SOFTCAP)
    if MASKED:
        sT = tl.where(tok_ok[:, None], sT, float("-inf"))

    p, alpha, m_i, moved = _softmax_step(sT, m_i, SLACK)
    l_t = l_t * alpha[None, :] + p
    if SLACK > 0:
        if moved > 0:  # rare: the accumulators are rescaled only when a maximum moved
            acc0 = acc0 * alpha[None, :]
            acc1 = acc1 * alpha[None, :]
            acc2 = acc2 * alpha[None, :]
            acc3 = acc3 * alpha[None, :]
    else:
        acc0 = acc0 * alpha[None, :]
        acc1 = acc1 * alpha[None, :]
        acc2 = acc2 * alpha[None, :]
        acc3 = acc3 * alpha[None, :]

    # ---- P·V transposed: [D/4, BLOCK_N] · [BLOCK_N, GP] per quarter (the tokens are the contraction axis, and the
    # cache stores V's codes token-major, so a quarter's operand is read like K's: no byte gathers)
    if MASKED:
        vb = tl.load(v_ptrs, mask=tok_ok[None, :], other=0)
    else:
        vb = tl.load(v_ptrs)
    if NG == 1:
        sv, zv = _scale_zero(szv_row, tok, stride_szvt, tok_ok, MASKED)
        ps = (p * sv[:, None]).to(DOT_DTYPE)
        psf = ps.to(tl.float32)
        psum_t = psum_t * alpha[None, :] + psf
        pz_t = pz_t * alpha[None, :] + psf * zv[:, None]
        acc0 = tl.dot(_biased_codes(vb, 0, DOT_DTYPE, USE_ASM), ps, acc0)
        acc1 = tl.dot(_biased_codes(vb, 1, DOT_DTYPE, USE_ASM), ps, acc1)
        acc2 = tl.dot(_biased_codes(vb, 2, DOT_DTYPE, USE_ASM), ps, acc2)
        acc3 = tl.dot(_biased_codes(vb, 3, DOT_DTYPE, USE_ASM), ps, acc3)
    else:
        pb = p.to(DOT_DTYPE)
        v_off, v_ok, v_cols = tok64[None, :] * stride_szvt, tok_ok[None, :], cols[:, None]
        acc0 = tl.dot(_dequant_quarter(vb, szv_row, v_off, v_ok, v_cols, 0, D4, G, DOT_DTYPE), pb, acc0)
        acc1 = tl.dot(_dequant_quarter(vb, szv_row, v_off, v_ok, v_cols, 1, D4, G, DOT_DTYPE), pb, acc1)
        acc2 = tl.dot(_dequant_quarter(vb, szv_row, v_off, v_ok, v_cols, 2, D4, G, DOT_DTYPE), pb, acc2)
        acc3 = tl.dot(_dequant_quarter(vb, szv_row, v_off, v_ok, v_cols, 3, D4, G, DOT_DTYPE), pb, acc3)
    return m_i, l_t, psum_t, pz_t, acc0, acc1, acc2, acc3


@triton.jit
def _attend(
    q_in,  # (q_ptr, stride_qb, stride_qh, lb_ptr, stride_lbb): q, and the softcap's logit shift per (batch, query head)
    kv_in,  # (k_ptr, v_ptr, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_vd): the tier
    sz_in,  # (szk_ptr, szv_ptr, stride_szkb, stride_szkh, stride_szkt, stride_szvb, stride_szvh, stride_szvt): INT2
    len_in,  # (len_ptr, split, S): the tier's lengths [B], and which of its S splits this program reads
    out_in,  # (o_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, out_split)
    chan_in,  # (qb_ptr, qf_ptr, row0): keys per channel on the integer path, `block_query.py`'s operands and the
    # index of this (batch, KV head)'s first block in them
    b, h, GROUP, qk_scale,
    INT2: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_ASM: tl.constexpr, STAGES: tl.constexpr, SLACK: tl.constexpr,
    KEY_BITS: tl.constexpr, KEY_BLOCK: tl.constexpr = 0, BLOCK_Q: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0,
):  # fmt: skip
    """Online softmax over one split of one tier for KV head h and its GROUP query heads; writes (o, lse) of
    `out_split`. Scores are computed transposed, [BLOCK_N tokens, GP query heads] = K·qᵀ, so the tokens fill the MMA
    rows; P·V is Vᵀ·p (oᵀ, dims on the rows) over INT2 codes, pᵀ·V over BF16 rows. KEY_BITS: K's codes are 2- or
    3-bit (INT2 tiers only). KEY_BLOCK > 0: K's scale/zero per channel over blocks of KEY_BLOCK tokens (G = D);
    BLOCK_Q: the host ran `block_query.py` (the integer path's shapes), whose operands replace the scales.
    SOFTCAP > 0 (log2 units): every score becomes SOFTCAP·tanh((score + shift)/SOFTCAP) before the softmax."""
    q_ptr, stride_qb, stride_qh, lb_ptr, stride_lbb = q_in
    k_ptr, v_ptr, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_vd = kv_in
    szk_ptr, szv_ptr, stride_szkb, stride_szkh, stride_szkt, stride_szvb, stride_szvh, stride_szvt = sz_in
    len_ptr, split, S = len_in
    o_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, out_split = out_in
    D4: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    # q's low int8 part in units of 1/Q_LO: |Σ codes·(q_hi·Q_LO + q_lo)| ≤ 3·D·127.5·Q_LO < 2^22 (2-bit keys), and
    # ≤ 7·D·127.5·Q_LO < 2^22 (3-bit keys)
    Q_LO: tl.constexpr = min(128, (4096 if KEY_BITS == 3 else 8192) // D)
    # Integer score dots need a contraction of ≥ 32 dims and fill the MMA's 8 columns: a group padded to 4 puts two
    # tokens on each row (PAIR = 2: 8 real columns, 32 dims from D = 64); groups of ≥ 8 fill them alone (D ≥ 128).
    # Smaller groups (1, 2), groups of ≥ 8 at D = 64 and per-group scales (G < D) keep the bfloat16 dots. Keys per
    # channel (KEY_BLOCK > 0) take them with the block operands of `block_query.py` (BLOCK_Q), else fold q·s per tile.
    PAIRS: tl.constexpr = 2 if GP == 4 else 1
    INT8_SHAPE: tl.constexpr = NG == 1 and PAIRS * GP >= 8 and PAIRS * D4 >= 32
    tl.static_assert(not BLOCK_Q or (INT8_SHAPE and KEY_BLOCK > 0))
    INT8_K: tl.constexpr = INT8_SHAPE and (KEY_BLOCK == 0 or BLOCK_Q)
    PAIR: tl.constexpr = PAIRS if INT8_K else 1  # the bfloat16 dots take one token per row
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    L = tl.load(len_ptr + b)
    per = tl.cdiv(tl.cdiv(L, S), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, L)

    g = tl.arange(0, GP)
    g_ok = g < GROUP
    qhead = h * GROUP + g
    offs_n = tl.arange(0, BLOCK_N)
    if SOFTCAP > 0:
        lbias = tl.load(lb_ptr + b64 * stride_lbb + qhead, mask=g_ok, other=0.0)
    else:
        lbias = tl.zeros([GP], tl.float32)  # unused
    if KEY_BITS == 3:
        # rows of 3D/8 bytes (24 at D = 64): `ops` passes K strides that are multiples of 8 bytes, and so written the
        # compiler knows it (8-byte vector loads of the codes and the plane instead of byte loads)
        stride_kb = stride_kb // 8 * 8
        stride_kh = stride_kh // 8 * 8
        stride_kt = stride_kt // 8 * 8
    k_rows = k_ptr + b64 * stride_kb + h64 * stride_kh
    v_rows = v_ptr + b64 * stride_vb + h64 * stride_vh

    # running sums are kept per (token slot, query head) and reduced once after the loop: no cross-thread sums per tile
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_t = tl.zeros([BLOCK_N, GP], tl.float32)
    if INT2:
        cols = tl.arange(0, D4)
        # qᵀ per quarter, block-diagonal for the paired tokens of `_int2_tile`: [PAIR·D/4, PAIR·GP], rows of token slot
        # j // (D/4) against that slot's columns (query head c % GP); with PAIR = 1 the plain [D/4, GP] quarter
        pj = tl.arange(0, PAIR * D4)[:, None]
        pc = tl.arange(0, PAIR * GP)[None, :]
        q_blk = q_ptr + b64 * stride_qb + (h * GROUP + pc % GP) * stride_qh + pj % D4
        blk_ok = (pj // D4 == pc // GP) & (pc % GP < GROUP)
        qb_ptr, qf_ptr, row0 = chan_in
        # keys per channel on the integer path: a block's operands sit as [2, GP, D] int8 (`block_query.py`)
        chan = (qb_ptr + row0 * (2 * GP * D), qf_ptr + row0 * (2 * GP), (pc % GP) * D + pj % D4, blk_ok)
        q0 = tl.load(q_blk + 0 * D4, mask=blk_ok, other=0.0).to(tl.float32)
        q1 = tl.load(q_blk + 1 * D4, mask=blk_ok, other=0.0).to(tl.float32)
        q2 = tl.load(q_blk + 2 * D4, mask=blk_ok, other=0.0).to(tl.float32)
        q3 = tl.load(q_blk + 3 * D4, mask=blk_ok, other=0.0).to(tl.float32)
        if NG == 1:
            # scores = (dots − q_bias − z·qsum)·s·q_w, per head
            if INT8_K and KEY_BLOCK > 0:
                # keys per channel: each tile loads its block's parts (`_int2_tile`); q_w only carries GP
                qsum = tl.zeros([GP], tl.float32)
                q_bias, q_w = qsum, qsum
                ql0, ql1, ql2, ql3 = q0, q1, q2, q3  # unused
            elif INT8_K:
                # K side: each head's q as int8 high and low parts (7 + log2 Q_LO bits of its range, 13 at d = 128)
                amax = tl.maximum(tl.maximum(tl.max(tl.abs(q0), axis=0), tl.max(tl.abs(q1), axis=0)),
                                  tl.maximum(tl.max(tl.abs(q2), axis=0), tl.max(tl.abs(q3), axis=0)))
                q_scale = 127.0 / tl.where(amax > 0, amax, 127.0)  # an all-zero head (or padding) gets 1
                q0, ql0, i0 = _int8_parts(q0, q_scale, Q_LO)
                q1, ql1, i1 = _int8_parts(q1, q_scale, Q_LO)
                q2, ql2, i2 = _int8_parts(q2, q_scale, Q_LO)
                q3, ql3, i3 = _int8_parts(q3, q_scale, Q_LO)
                # per head ([GP]; columns c, GP + c, … hold the same head): Σq in the dots' integers, the factor back
                qsum = tl.sum(i0, axis=0) + tl.sum(i1, axis=0) + tl.sum(i2, axis=0) + tl.sum(i3, axis=0)
                qsum = _per_head(qsum, PAIR, GP)
                q_bias = tl.full([GP], MAGIC, tl.float32)
                q_w = qk_scale / (_per_head(q_scale, PAIR, GP) * Q_LO)
            elif KEY_BLOCK > 0:
                # keys per channel: q_k / f_k (exact) stays fp32; each tile folds its block's scales in and rounds to
                # DOT_DTYPE (`_block_q`), so q_bias, q_w and qsum are unused
                q1 = q1 * 0.25
                q2 = q2 * 0.0625
                qsum = tl.zeros([GP], tl.float32)
                q_bias, q_w = qsum, qsum
                ql0, ql1, ql2, ql3 = q0, q1, q2, q3  # unused
            else:
                # Σq and Σ_k w_k Σq_k of the bf16 values the dots see (w_k q_k is exact: a power-of-two scaling)
                q0 = q0.to(DOT_DTYPE).to(tl.float32)
                q1 = q1.to(DOT_DTYPE).to(tl.float32)
                q2 = q2.to(DOT_DTYPE).to(tl.float32)
                q3 = q3.to(DOT_DTYPE).to(tl.float32)
                s0, s1, s2, s3 = tl.sum(q0, axis=0), tl.sum(q1, axis=0), tl.sum(q2, axis=0), tl.sum(q3, axis=0)
                qsum = s0 + s1 + s2 + s3
                q_bias = 128.0 * (s0 + s1 * 0.25 + s2 * 0.0625 + s3)
                q_w = tl.full([GP], qk_scale, tl.float32)
                q0 = q0.to(DOT_DTYPE)
                q1 = (q1 * 0.25).to(DOT_DTYPE)
                q2 = (q2 * 0.0625).to(DOT_DTYPE)
                q3 = q3.to(DOT_DTYPE)
                ql0, ql1, ql2, ql3 = q0, q1, q2, q3  # unused
            if KEY_BLOCK > 0:  # float16 pairs [T_cap / KEY_BLOCK, D, 2] (`_block_q`)
                szk_row = szk_ptr + b64 * stride_szkb + h64 * stride_szkh
            else:
                szk_row = (szk_ptr + b64 * stride_szkb + h64 * stride_szkh).to(tl.pointer_type(tl.int32), bitcast=True)
            szv_row = (szv_ptr + b64 * stride_szvb + h64 * stride_szvh).to(tl.pointer_type(tl.int32), bitcast=True)
        else:
            qsum = tl.zeros([GP], tl.float32)  # unused: each element is dequantized before its dot
            q_bias, q_w = qsum, qsum
            szk_row = szk_ptr + b64 * stride_szkb + h64 * stride_szkh
            szv_row = szv_ptr + b64 * stride_szvb + h64 * stride_szvh
            q0 = q0.to(DOT_DTYPE)
            q1 = q1.to(DOT_DTYPE)
            q2 = q2.to(DOT_DTYPE)
            q3 = q3.to(DOT_DTYPE)
            ql0, ql1, ql2, ql3 = q0, q1, q2, q3  # unused
        acc0 = tl.zeros([D4, GP], tl.float32)  # oᵀ per quarter
        acc1 = tl.zeros([D4, GP], tl.float32)
        acc2 = tl.zeros([D4, GP], tl.float32)
        acc3 = tl.zeros([D4, GP], tl.float32)
        psum_t = tl.zeros([BLOCK_N, GP], tl.float32)  # Σ p·s of the bf16 values the P·V dots see
        pz_t = tl.zeros([BLOCK_N, GP], tl.float32)  # Σ p·s·z
    else:
        dims = tl.arange(0, D)
        q_cols = q_ptr + b64 * stride_qb + qhead[None, :] * stride_qh  # qᵀ: [dims, GP]
        q = tl.load(q_cols + dims[:, None], mask=g_ok[None, :], other=0.0).to(tl.float32).to(DOT_DTYPE)
        acc = tl.zeros([GP, D], tl.float32)

    if INT2:
        # the split's whole tiles unmasked and software-pipelined, then its last, partial tile (if any) masked
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        rows = (k_rows, v_rows, szk_row, szv_row)
        strides = (stride_kt, stride_vt, stride_vd, stride_szkt, stride_szvt)
        qk = (q0, q1, q2, q3, ql0, ql1, ql2, ql3, q_bias, q_w, qsum, qk_scale, lbias)
        state = (m_i, l_t, psum_t, pz_t, acc0, acc1, acc2, acc3)
        for n0 in tl.range(start, full_end, BLOCK_N, num_stages=STAGES):
            state = _int2_tile(n0, end, offs_n, cols, rows, strides, qk, state, chan,
                               INT8_K, PAIR, Q_LO, D4, G, NG, DOT_DTYPE, USE_ASM, SLACK, False, KEY_BITS, KEY_BLOCK,
                               SOFTCAP)
        if full_end < end:
            state = _int2_tile(full_end, end, offs_n, cols, rows, strides, qk, state, chan,
                               INT8_K, PAIR, Q_LO, D4, G, NG, DOT_DTYPE, USE_ASM, SLACK, True, KEY_BITS, KEY_BLOCK,
                               SOFTCAP)
        m_i, l_t, psum_t, pz_t, acc0, acc1, acc2, acc3 = state
    else:  # a BF16 split is one tile (`ops` sizes them so): masked, not pipelined
        for n0 in tl.range(start, end, BLOCK_N, num_stages=1):
            tok = n0 + offs_n
            tok_ok = tok < end
            tok64 = tok.to(tl.int64)
            kt = tl.load(k_rows + tok64[:, None] * stride_kt + dims[None, :], mask=tok_ok[:, None], other=0.0)
            sT = tl.dot(kt.to(tl.float32).to(DOT_DTYPE), q) * qk_scale
            if SOFTCAP > 0:
                sT = _softcap(sT, lbias, SOFTCAP)
            sT = tl.where(tok_ok[:, None], sT, float("-inf"))
            p, alpha, m_i, moved = _softmax_step(sT, m_i, 0.0)
            l_t = l_t * alpha[None, :] + p
            vt = tl.load(v_rows + tok64[:, None] * stride_vt + dims[None, :], mask=tok_ok[:, None], other=0.0)
            acc = tl.dot(tl.trans(p.to(DOT_DTYPE)), vt.to(tl.float32).to(DOT_DTYPE), acc * alpha[:, None])

    # ---- epilogue: normalised partial output and its lse (empty split: o = 0, lse = −inf)
    l_i = tl.sum(l_t, axis=0)
    nonempty = l_i > 0
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) / LOG2E, float("-inf"))
    o_base = o_ptr + b64 * stride_ob + out_split * stride_os
    if INT2:
        if NG == 1:
            psum = tl.sum(psum_t, axis=0)[None, :]
            pz = tl.sum(pz_t, axis=0)[None, :]
            # undo the +128 bias and the 4^k code factor per quarter, then the zero point
            acc0 = acc0 - 128.0 * psum - pz
            acc1 = (acc1 - 128.0 * psum) * 0.25 - pz
            acc2 = (acc2 - 128.0 * psum) * 0.0625 - pz
            acc3 = acc3 - 128.0 * psum - pz
        o_cols = o_base + qhead[None, :] * stride_oh  # oᵀ: [dims, GP]
        tl.store(o_cols + (0 * D4 + cols)[:, None], acc0 * inv_l[None, :], mask=g_ok[None, :])
        tl.store(o_cols + (1 * D4 + cols)[:, None], acc1 * inv_l[None, :], mask=g_ok[None, :])
        tl.store(o_cols + (2 * D4 + cols)[:, None], acc2 * inv_l[None, :], mask=g_ok[None, :])
        tl.store(o_cols + (3 * D4 + cols)[:, None], acc3 * inv_l[None, :], mask=g_ok[None, :])
    else:
        tl.store(o_base + qhead[:, None] * stride_oh + dims[None, :], acc * inv_l[:, None], mask=g_ok[:, None])
    tl.store(lse_ptr + b64 * stride_lb + qhead * stride_lh + out_split, lse, mask=g_ok)


# the split and block counts (and the lse strides, which are split counts) change as the history grows: not
# specialised on their values, so one compiled kernel serves a whole generation (`attention.warm_up` builds it before
# the first decode step)
@triton.jit(do_not_specialize=["S_SINK", "S_HIST", "S_RECENT", "NB", "stride_lb", "stride_lh"])
def _decode_kernel(
    q_ptr,  # [B, H_q, D]
    sk_ptr, sv_ptr, slen_ptr,  # sink K/V [B, H_kv, SINK_CAP, D] bf16, lengths [B] int32
    ck_ptr, szk_ptr, cv_ptr, szv_ptr, hlen_ptr,  # history codes [B, H_kv, T_cap, D/4] u8 (K's 3D/8 for 3-bit keys;
    # V's any strides, fastest token-major), scale/zero [.., D/G, 2] f16
    rk_ptr, rv_ptr, rlen_ptr,  # recent K/V [B, H_kv, RECENT_CAP, D] bf16
    o_ptr, lse_ptr,  # partials [B, H_q, S, D] f32, [B, H_q, S] f32
    qb_ptr, qf_ptr,  # keys per channel, BLOCK_Q: the blocks' int8 q·s parts and (w, bias) (`block_query.py`)
    lb_ptr,  # SOFTCAP > 0: the logit shift per (batch, query head) [B, H_q] f32, log2 units, added before the cap
    H_kv, GROUP, S_SINK, S_HIST, S_RECENT, qk_scale, NB,  # sizes: heads, splits per tier; scale·log2(e); blocks
    # per (batch, KV head) in qb/qf
    stride_qb, stride_qh, stride_lbb,  # strides: q, the logit shift, sink K/V, history codes and scales, recent K/V,
    # o, lse
    stride_skb, stride_skh, stride_skt, stride_svb, stride_svh, stride_svt,
    stride_ckb, stride_ckh, stride_ckt, stride_szkb, stride_szkh, stride_szkt,
    stride_cvb, stride_cvh, stride_cvt, stride_cvd, stride_szvb, stride_szvh, stride_szvt,
    stride_rkb, stride_rkh, stride_rkt, stride_rvb, stride_rvh, stride_rvt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr,  # constexprs
    BLOCK_NB: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_ASM: tl.constexpr, STAGES: tl.constexpr,
    SLACK: tl.constexpr, PDL: tl.constexpr, KEY_BITS: tl.constexpr, KEY_BLOCK: tl.constexpr = 0,
    BLOCK_Q: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0,
):  # fmt: skip
    if PDL:
        # programmatic dependent launch: wait for the kernel before (it may have written q or the cache), then let
        # the merge launch and wait on this grid while it runs (no launch gap between the two)
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    b = pid // H_kv
    h = pid % H_kv
    s = tl.program_id(1)
    q_in = (q_ptr, stride_qb, stride_qh, lb_ptr, stride_lbb)
    out_in = (o_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, s)
    chan_in = (qb_ptr, qf_ptr, pid.to(tl.int64) * NB)
    if (s < S_SINK) | (s >= S_SINK + S_HIST):
        # a BF16 tier: sink or recent (one instantiation of the loop; both branches give identically typed values).
        # Names bound here are not bound in the INT2 branch: Triton would merge them, and the types differ.
        in_sink = s < S_SINK
        z = tl.zeros([], tl.int64)
        bf16_kv = (tl.where(in_sink, sk_ptr, rk_ptr), tl.where(in_sink, sv_ptr, rv_ptr),
                   tl.where(in_sink, stride_skb + z, stride_rkb), tl.where(in_sink, stride_skh + z, stride_rkh),
                   tl.where(in_sink, stride_skt + z, stride_rkt), tl.where(in_sink, stride_svb + z, stride_rvb),
                   tl.where(in_sink, stride_svh + z, stride_rvh), tl.where(in_sink, stride_svt + z, stride_rvt),
                   1)  # stride_vd: BF16 rows are dims-contiguous
        bf16_len = (tl.where(in_sink, slen_ptr, rlen_ptr), tl.where(in_sink, s, s - S_SINK - S_HIST),
                    tl.where(in_sink, S_SINK, S_RECENT))
        _attend(q_in, bf16_kv, (q_ptr, q_ptr, 0, 0, 0, 0, 0, 0), bf16_len, out_in, chan_in, b, h, GROUP, qk_scale,
                False, D, G, GP, BLOCK_NB, DOT_DTYPE, USE_ASM, 1, 0.0, 2,
                SOFTCAP=SOFTCAP)  # (no scales: placeholders)
    else:
        _attend(q_in,
                (ck_ptr, cv_ptr, stride_ckb, stride_ckh, stride_ckt, stride_cvb, stride_cvh, stride_cvt, stride_cvd),
                (szk_ptr, szv_ptr, stride_szkb, stride_szkh, stride_szkt, stride_szvb, stride_szvh, stride_szvt),
                (hlen_ptr, s - S_SINK, S_HIST), out_in, chan_in, b, h, GROUP, qk_scale,
                True, D, G, GP, BLOCK_N, DOT_DTYPE, USE_ASM, STAGES, SLACK, KEY_BITS, KEY_BLOCK, BLOCK_Q, SOFTCAP)
