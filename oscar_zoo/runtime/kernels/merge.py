"""Log-sum-exp merge of split/tier partials (o, lse) into the exact softmax output; all-empty rows give o = 0, −inf.

Grid (output row = batch · query head, slice of D): enough programs to keep the GPU's memory pipes busy when there are
few rows and many splits (batch 1 at long context), and big [splits × dims] tiles so each program has few dependent
loads in flight (one round trip when the splits fit one tile). Partials with lse = −inf contribute nothing. The
decode step's epilogue rides along: the centred codec's value offset is added and the output rounded once to the
model's dtype, so no kernel follows the merge.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .rounding import round_to


@triton.jit(do_not_specialize=["S", "stride_ln"])  # split counts change as the history grows: one build
def _merge_kernel(
    o_ptr,  # [N, S, D] float32 partial outputs (normalised)
    lse_ptr,  # [N, S] float32
    out_ptr,  # [N, D] float32, or the model's dtype (then rounded once, after the mean is added)
    out_lse_ptr,  # [N] float32
    mean_ptr,  # [H_mu, D] float32 added to row n's output (its query head n % H_Q), when MEAN
    S, H_Q, HEADS_PER_MEAN,
    stride_on, stride_os, stride_ln, stride_outn, stride_meanh,
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr, MEAN: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_wait()  # launched early (programmatic dependent launch): the partials are complete only after this
    n = tl.program_id(0).to(tl.int64)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    lse_row = lse_ptr + n * stride_ln

    # one pass, online over chunks of BLOCK_S partials (usually one chunk): a chunk's lse and o loads are issued
    # together, with no dependence between them (o is masked after the load, so garbage in empty partials is dropped)
    m = tl.full([], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s_ok = s0 + offs_s < S
        lse = tl.load(lse_row + s0 + offs_s, mask=s_ok, other=float("-inf"))
        o = tl.load(o_ptr + n * stride_on + (s0 + offs_s)[:, None] * stride_os + dims[None, :], mask=s_ok[:, None],
                    other=0.0)  # fmt: skip
        live = lse > float("-inf")
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m - m_safe)  # 0 while m = −inf
        w = tl.where(live, tl.exp(lse - m_safe), 0.0)
        w_sum = w_sum * alpha + w
        acc = acc * alpha + w[:, None] * tl.where(live[:, None], o, 0.0)
        m = m_new
    nonempty = m > float("-inf")
    m_safe = tl.where(nonempty, m, 0.0)
    total = tl.sum(w_sum, axis=0)
    out = tl.sum(acc, axis=0) / tl.where(nonempty, total, 1.0)
    if MEAN:  # the centred codec's value offset μ_V·M_V of this row's query head
        out = out + tl.load(mean_ptr + ((n % H_Q) // HEADS_PER_MEAN) * stride_meanh + dims)
    tl.store(out_ptr + n * stride_outn + dims, round_to(out, out_ptr.dtype.element_ty))
    if tl.program_id(1) == 0:
        tl.store(out_lse_ptr + n, tl.where(nonempty, m_safe + tl.log(tl.where(nonempty, total, 1.0)), float("-inf")))
