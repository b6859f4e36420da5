"""Keys per channel (docs/format.md §6d): each history block's scaled query as the decode kernel's integer operands,
once per step, before the decode launch (`ops._launch_decode`).

A block b of KEY_BLOCK tokens codes channel c of its keys with its own scale and zero, k̂_tc = s_bc·(code_tc − z_bc),
so q·k̂_t = Σ_c q'_c·code_tc − Σ_c q'_c·z_bc with q' = q ⊙ s_b: the row layout's integer score dots
(`decode.py`'s docstring) with q' in place of q. Per (batch, KV head, block) and query head of the GQA group
(padded to GP), this kernel writes
  - qb [B, H_kv, NB, 2, GP, D] int8: λq' as two int8 parts, λq' = hi + lo / Q_LO (λ = 127 / max |q'| of the head,
    `int2_codes._int8_parts`), the parts the decode kernel's dots take (part 0 hi, part 1 lo);
  - qf [B, H_kv, NB, 2, GP] float32: w = qk_scale / (λ·Q_LO) and bias = (MAGIC + Σ_c i_c·z_bc)·w, with
    i = hi·Q_LO + lo the rounded q' in the dots' integers (the constant of the rounded q', so the zero-point term
    cancels as in exact arithmetic).
The decode kernel's score of token t is then (MAGIC + Σ_c code_tc·i_c)·w − bias, one multiply-add per score: the
block's scales and zeros are not read per tile, and no reduction over the dims runs in its loop.

Grid (cdiv(NB, BPP), B·H_kv): a program writes BPP consecutive blocks (one while the grid is small, so that every
block's latency overlaps; more at large batches, where a program's fixed cost — q's load — would dominate). Blocks at
or past cdiv(history length, KEY_BLOCK) are not read (their pairs may be anything) and not written. PDL: launched as a
programmatic dependent of the kernel before it (q's rotation), waiting for it on the device, and letting the decode
kernel launch at once (which waits for this grid in turn).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .int2_codes import MAGIC, _int8_parts


@triton.jit(do_not_specialize=["NB", "BPP"])  # block counts change as the history grows: one build
def _block_query_kernel(
    q_ptr,  # [B, H_q, D] (fp32 or bf16)
    szk_ptr,  # [B, H_kv, NB, D, 2] float16 (scale, zero) per block and channel
    hlen_ptr,  # [B] int32 history lengths
    qb_ptr, qf_ptr,  # outputs, contiguous: [B, H_kv, NB, 2, GP, D] int8, [B, H_kv, NB, 2, GP] float32
    H_kv, GROUP, NB, BPP, qk_scale,
    stride_qb, stride_qh, stride_szkb, stride_szkh, stride_szkt,
    D: tl.constexpr, GP: tl.constexpr, KEY_BLOCK: tl.constexpr, Q_LO: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(1)
    b = pid // H_kv
    h = pid % H_kv
    blk0 = tl.program_id(0) * BPP
    n_blk = tl.cdiv(tl.load(hlen_ptr + b), KEY_BLOCK)
    if blk0 >= n_blk:
        return
    d = tl.arange(0, D)[:, None]
    g = tl.arange(0, GP)[None, :]
    qT = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (h * GROUP + g) * stride_qh + d, mask=g < GROUP,
                 other=0.0).to(tl.float32)  # [D, GP]  # fmt: skip
    sz_row = szk_ptr + b.to(tl.int64) * stride_szkb + h.to(tl.int64) * stride_szkh + tl.arange(0, D) * 2
    row = (b * H_kv + h).to(tl.int64) * NB
    for blk in range(blk0, tl.minimum(blk0 + BPP, n_blk)):
        s = tl.load(sz_row + blk * stride_szkt).to(tl.float32)
        z = tl.load(sz_row + blk * stride_szkt + 1).to(tl.float32)
        qs = qT * s[:, None]
        amax = tl.max(tl.abs(qs), axis=0)
        lam = 127.0 / tl.where(amax > 0, amax, 127.0)  # an all-zero head (or padding) gets 1
        hi, lo, i = _int8_parts(qs, lam, Q_LO)
        w = qk_scale / (lam * Q_LO)
        bias = (MAGIC + tl.sum(i * z[:, None], axis=0)) * w  # [GP]
        qb = qb_ptr + (row + blk) * (2 * GP * D) + g * D + d
        tl.store(qb, hi)
        tl.store(qb + GP * D, lo)
        qf = qf_ptr + (row + blk) * (2 * GP) + tl.arange(0, GP)
        tl.store(qf, w)
        tl.store(qf + GP, bias)
