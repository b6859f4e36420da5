"""Host wrappers of the runtime ops: validate inputs, then run the Triton kernel (CUDA tensors, or CPU tensors under
TRITON_INTERPRET=1) or fall back to the pure-PyTorch reference. Signatures equal their `reference` twins.

Triton is imported lazily (`dispatch.kernels()`), so importing this module needs only torch. No op reads a length
back to the host: split counts come from shapes and the SM count, so decode is CUDA-graph friendly. Launch settings
come from `config.current()` (a `RuntimeConfig`; `config.use` scopes another).

This module holds the decode-attention ops (decode, merge, dequantize); quantize/pack (`quantize_pack`,
`quantize_pack_channel`) live in `quantize_ops.py` and are re-exported here; the dispatch and the buffers are
`dispatch.py`'s.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ..format import layout, reference
from . import config, dispatch
from .checks import check, codes_key_bits, validate_bf16, validate_int2
from .config import DecodeConfig, RuntimeConfig
from .quantize_ops import max_m_build, quantize_pack, quantize_pack_channel

__all__ = [
    "DecodeConfig", "RuntimeConfig", "bf16_splits", "block_query", "decode_bf16_partial", "decode_config",
    "decode_int2_partial", "dequantize_into", "gpu_block_n", "int2_splits", "launch_decode", "max_m_build",
    "merge_partials", "quantize_pack", "quantize_pack_channel", "tiered_decode_attention",
]  # fmt: skip

LOG2E = 1.4426950408889634


def decode_config(D: int) -> DecodeConfig:
    """The decode launch settings for head dim D in the current config."""
    return config.current().decode_config(D)


def _programs_target(device: torch.device, D: int) -> int:
    if not dispatch.gpu_plan(device):
        return 8  # interpreter: a few splits suffice to exercise the split logic
    return decode_config(D).programs_per_sm * dispatch.sm_count_of(device)


def _group_block(group: int) -> int:
    """Query heads per program padded to a power of two (the column side of the score dot)."""
    return dispatch.next_pow2(group)


def _warps(group: int, D: int) -> int:
    """Warps per program: the head dim's setting, and one more warp per 16 query heads of a large GQA group (in one
    warp, a group of 64 keeps its [64, D] fp32 accumulator in that warp's registers and spills 5 KB per thread)."""
    return max(decode_config(D).warps, _group_block(group) // 16)


# -------------------------------------------------------------------------------------------------------- buffers


def _pairs_as_words(sz: Tensor) -> Tensor:
    """scale/zero [B, H, T, NG, 2] float16 whose (scale, zero) pairs the decode kernel may read as one 32-bit word each:
    4-byte aligned with even outer strides (a copy only for odd views)."""
    if sz.data_ptr() % 4 or any(st % 2 for n, st in zip(sz.shape[:-1], sz.stride()[:-1]) if n > 1):
        return sz.contiguous()
    return sz


# ------------------------------------------------------------------------------------------------- decode attention


def _block_n(device: torch.device, D: int | None, G: int | None = None) -> int:
    """Tokens per tile: of the INT2 history for head dim D (scale groups of G dims), of the BF16 tiers for D = None."""
    if not dispatch.gpu_plan(device):
        return 16  # interpreter: small tiles, many of them
    return gpu_block_n(D, G)


def gpu_block_n(D: int | None, G: int | None = None) -> int:
    if not D:
        return config.current().decode_block_nb
    # per-group scales (G < D) dequantize every element before its dot: more live registers, and 64-token tiles at
    # d = 128 spill (tests/runtime/test_kernel_compiles.py), so those tiles stay at 32 tokens
    n = decode_config(D).block_n
    return min(n, 32) if G is not None and G < D else n


def int2_splits(B: int, H_kv: int, group: int, D: int, T_cap: int, device: torch.device,
                num_splits: int | None = None, waves: int = 1) -> int:
    """The INT2 history's split count for a launch (`num_splits` given: that one): `waves` times the one-warp programs
    that fit the SMs at once, but at least `decode_min_tiles` tiles per split (which can cap it first)."""
    if num_splits is not None:
        check(int(num_splits) >= 1, lambda: f"num_splits must be ≥ 1, got {num_splits}")
        return int(num_splits)
    programs = B * H_kv
    # rounded down: the INT2 programs of one wave fit the SMs at once (the few short BF16-tier programs of the same
    # grid come on top); rounding up left a second wave whenever B · KV heads does not divide the target. Programs
    # with more warps (large GQA groups) count for as many one-warp slots.
    by_programs = max(1, waves * _programs_target(device, D) * decode_config(D).warps // _warps(group, D) // programs)
    # at least decode_min_tiles tiles per split
    by_tokens = -(-T_cap // (config.current().decode_min_tiles * _block_n(device, D)))
    return max(1, min(by_programs, by_tokens))


def bf16_splits(T_cap: int, device: torch.device) -> int:
    """The split count of a BF16 tier (sink or recent) of capacity T_cap: one per tile."""
    return max(1, -(-T_cap // _block_n(device, None)))


def _kernel_head_dim_ok(D: int) -> bool:
    return layout.is_power_of_two(D) and D >= 64


@functools.lru_cache(maxsize=None)
def _dummy(device: torch.device, dtype: torch.dtype, n: int = 16) -> Tensor:
    """A placeholder for a tier a launch does not read (its split count is 0): n zeros, made once, never written."""
    return torch.zeros(n, dtype=dtype, device=device)


def _strides(t: Tensor, n: int) -> tuple[int, ...]:
    return tuple(t.stride())[:n] if t.dim() > 1 else (0,) * n


def launch_decode(q, o, lse, sm_scale, sink=None, hist=None, recent=None, s_sink=0, s_hist=0, s_recent=0,
                   key_block=0, softcap=None, logit_bias=None):
    """The one decode launch: `s_sink` splits over sink = (k, v, len), `s_hist` over hist = (codes_k, sz_k, codes_v,
    sz_v, len), `s_recent` over recent = (k, v, len), into o [B, H_q, S, D] / lse [B, H_q, S] (S = the sum).
    An absent tier gets 0 splits and placeholders. codes_k's width says its keys' bits (`codes_key_bits`).
    `key_block` > 0: the history keys are per channel over blocks of that many tokens (sz_k [B, H_kv, T_cap /
    key_block, D, 2], read as float16 per block; tiles of at most key_block tokens: a tile lies in one block).
    `softcap`: every logit becomes softcap·tanh((logit + logit_bias)/softcap), `logit_bias` [B, H_q] or None (0)."""
    cfg = config.current()
    B, H_q, D = q.shape
    dev = q.device
    q = dispatch.last_contiguous(q, 1)
    any_bf16 = sink or recent
    sink = tuple(dispatch.last_contiguous(t, 1) for t in sink[:2]) + (sink[2],) if sink else None
    recent = tuple(dispatch.last_contiguous(t, 1) for t in recent[:2]) + (recent[2],) if recent else None
    if hist:
        ck, szk, cv, szv, hlen = hist
        ck = dispatch.last_contiguous(ck, 1)
        cv = cv if 1 in cv.stride()[2:] else cv.contiguous()  # token-major (the cache's) or dims-major
        szk = dispatch.last_contiguous(szk, 2) if key_block else _pairs_as_words(dispatch.last_contiguous(szk, 2))
        szv = _pairs_as_words(dispatch.last_contiguous(szv, 2))
        H_kv, G, key_bits = ck.shape[1], D if key_block else D // szk.shape[-2], codes_key_bits(ck, D)
        if key_bits == 3 and (ck.stride(2) != ck.shape[3] or any(st % 8 for st in ck.stride()[:2])):
            # the kernel reads 3-bit rows in pairs (docs/format.md §6b: a pair's 3D/4 bytes contiguous, from an even
            # row) with strides that are multiples of 8; a copy keeps the pairs (T_cap is even, `validate_int2`)
            ck = ck.contiguous()
    else:
        ck = cv = _dummy(dev, layout.CODE_DTYPE)
        szk = szv = _dummy(dev, layout.SCALE_DTYPE)
        hlen, H_kv, G, key_bits = any_bf16[2], any_bf16[0].shape[1], D, layout.BITS
    if not any_bf16:  # placeholders made only when a tier is absent (never inside a captured decode step)
        sink = (_dummy(dev, torch.bfloat16), _dummy(dev, torch.bfloat16), hlen)
    sink, recent = sink or recent, recent or sink
    group = H_q // H_kv
    dcfg, pdl = cfg.decode_config(D), dispatch.pdl(q, cfg)
    block_q = bool(hist and key_block and s_hist and szk.shape[2] and block_query(_group_block(group), D)
                   and B * H_kv < 65536)  # (the prepass's grid: blocks on x, B·H_kv on y)
    if block_q:  # keys per channel on the integer score path: each block's q·s as int8 parts first
        qb, qf = _block_query(q, szk, hlen, key_block, key_bits, sm_scale * LOG2E, H_kv)
    else:
        qb = qf = _dummy(dev, torch.float32)
    if softcap is None:
        lb = _dummy(dev, torch.float32)
    else:  # the kernel's scores are in log2 units
        lb = _dummy(dev, torch.float32, H_q).expand(B, H_q) if logit_bias is None else logit_bias.float() * LOG2E
    grid = (B * H_kv, s_sink + s_hist + s_recent)
    # the kernel's arguments in its order: pointers, sizes, strides (positional), then its constexprs
    pointers = (q, *sink, ck, szk, cv, szv, hlen, *recent, o, lse, qb, qf, lb)
    sizes = (H_kv, group, s_sink, s_hist, s_recent, sm_scale * LOG2E, qb.shape[2] if block_q else 0)
    strides = (*q.stride()[:2], *_strides(lb, 1), *_strides(sink[0], 3), *_strides(sink[1], 3), *_strides(ck, 3),
               *_strides(szk, 3), *_strides(cv, 4), *_strides(szv, 3), *_strides(recent[0], 3), *_strides(recent[1], 3),
               *o.stride()[:3], *lse.stride()[:2])  # fmt: skip
    block_n = min(_block_n(dev, D, G), key_block) if key_block else _block_n(dev, D, G)  # a tile in one key block
    constexprs = dict(D=D, G=G, GP=_group_block(group), BLOCK_N=block_n, BLOCK_NB=_block_n(dev, None),
                      DOT_DTYPE=dispatch.dot_dtype(), USE_ASM=dispatch.gpu_plan(q.device) and cfg.int2_asm,
                      STAGES=dcfg.stages, SLACK=dcfg.rescale_slack, PDL=pdl, KEY_BITS=key_bits, KEY_BLOCK=key_block,
                      BLOCK_Q=block_q, SOFTCAP=0.0 if softcap is None else float(softcap) * LOG2E)  # fmt: skip
    dispatch.kernels().decode[grid](*pointers, *sizes, *strides, **constexprs, num_warps=_warps(group, D),
                                    maxnreg=dcfg.maxnreg, launch_pdl=pdl)


def block_query(GP: int, D: int) -> bool:
    """Whether keys per channel take the integer score dots (`kernels/decode.py`, INT8_SHAPE) with the block operands
    of `kernels/block_query.py`: GQA groups padded to 4 (two tokens per score row) or ≥ 8, from D = 128. At D = 64 the
    operands (2·GP·D bytes a block) cost more than the integer dots save (benchmarks/RESULTS.md): q·s is folded per
    tile there, as for groups of 1–2."""
    return config.current().block_query and D >= 128 and (GP == 4 or GP >= 8)


def _block_query(q: Tensor, szk: Tensor, hlen: Tensor, key_block: int, key_bits: int, qk_scale: float,
                 H_kv: int) -> tuple[Tensor, Tensor]:
    """Keys per channel: every history block's q·s as the decode kernel's int8 operands and its (w, bias)
    (`kernels/block_query.py`): qb [B, H_kv, NB, 2, GP, D] int8, qf [B, H_kv, NB, 2, GP] float32, NB = szk's blocks.
    Blocks past a row's history are left unwritten (the decode reads none)."""
    B, H_q, D = q.shape
    NB = szk.shape[2]
    GP = _group_block(H_q // H_kv)
    qb = dispatch.alloc((B, H_kv, NB, 2, GP, D), torch.int8, q.device)
    qf = dispatch.alloc((B, H_kv, NB, 2, GP), torch.float32, q.device)
    q_lo = min(128, (4096 if key_bits == 3 else 8192) // D)  # the decode kernel's Q_LO
    pdl = dispatch.pdl(q, config.current())
    # blocks per program: one until the grid is ≈ 16 one-warp programs per SM, then up to 8 (a power of two; the
    # interpreter takes 8 for any but the smallest grids)
    resident = 16 * dispatch.sm_count_of(q.device) if dispatch.gpu_plan(q.device) else 1
    bpp = 1
    while bpp < 8 and NB * B * H_kv >= 2 * bpp * resident:
        bpp *= 2
    dispatch.kernels().block_query[(-(-NB // bpp), B * H_kv)](
        q, szk, hlen, qb, qf, H_kv, H_q // H_kv, NB, bpp, qk_scale, *q.stride()[:2], *szk.stride()[:3],
        D=D, GP=GP, KEY_BLOCK=key_block, Q_LO=q_lo, PDL=pdl, num_warps=min(8, max(1, GP * D // 1024)),
        launch_pdl=pdl,
    )  # fmt: skip
    return qb, qf


def decode_int2_partial(
    q: Tensor,
    codes_k: Tensor,
    scale_zero_k: Tensor,
    codes_v: Tensor,
    scale_zero_v: Tensor,
    hist_len: Tensor,
    sm_scale: float,
    num_splits: int | None = None,
    key_block: int = 0,
) -> tuple[Tensor, Tensor]:
    """Split-K attention over the INT2 history: partial o fp32 [B, H_q, S, D] and lse fp32 [B, H_q, S] (normalised
    per split; empty splits give o = 0, lse = −inf). Merge them with `merge_partials`. `codes_k` [..., D/4] holds
    2-bit keys, [..., 3D/8] 3-bit keys (`layout.packed_dim`) in the history's pairs (`reference.store_pairs`, T_cap
    even); values are 2-bit. `key_block` > 0: the keys are coded
    per channel over blocks of that many history tokens (docs/format.md §6d): scale_zero_k [B, H_kv, T_cap /
    key_block, D, 2] (T_cap = codes_k.shape[2], whole blocks), values per row (scale_zero_v [B, H_kv, T_cap, 1, 2])."""
    H_kv, G, hist_len, key_bits = validate_int2(q, codes_k, scale_zero_k, codes_v, scale_zero_v, hist_len, key_block)
    B, H_q, D = q.shape
    S = int2_splits(B, H_kv, H_q // H_kv, D, codes_k.shape[2], q.device, num_splits)
    if not (dispatch.use_kernel(q) and _kernel_head_dim_ok(D)):
        return _int2_partial_ref(q, codes_k, scale_zero_k, codes_v, scale_zero_v, hist_len, sm_scale, S, key_bits,
                                 key_block)  # fmt: skip
    o = dispatch.alloc((B, H_q, S, D), torch.float32, q.device)
    lse = dispatch.alloc((B, H_q, S), torch.float32, q.device)
    launch_decode(q, o, lse, sm_scale, hist=(codes_k, scale_zero_k, codes_v, scale_zero_v, hist_len), s_hist=S,
                   key_block=key_block)  # fmt: skip
    return o, lse


def _int2_partial_ref(q, codes_k, sz_k, codes_v, sz_v, hist_len, sm_scale, S, key_bits=layout.BITS, key_block=0):
    """Reference fallback of `decode_int2_partial`: the whole history as split 0, the other splits empty."""
    B, H_q, D = q.shape
    dequant_k = reference.dequantize_unpack_channel if key_block else reference.dequantize_unpack
    k = dequant_k(reference.load_pairs(codes_k, key_bits), sz_k, key_bits)
    v = reference.dequantize_unpack(codes_v, sz_v)
    o0, lse0 = reference.attention_partial_ref(q, k, v, hist_len, sm_scale)
    o = torch.zeros(B, H_q, S, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H_q, S), -math.inf, dtype=torch.float32, device=q.device)
    o[:, :, 0], lse[:, :, 0] = o0, lse0
    return o, lse


def decode_bf16_partial(
    q: Tensor,
    sink_k: Tensor,
    sink_v: Tensor,
    sink_len: Tensor,
    recent_k: Tensor,
    recent_v: Tensor,
    recent_len: Tensor,
    sm_scale: float,
    num_splits: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Split-K attention over the BF16 sink and recent tiers in one launch: partial o fp32 [B, H_q, S, D] and lse
    [B, H_q, S], the sink's splits first. The recent tier is split per tile of tokens, or into `num_splits` parts
    (several tiles each: fewer partials to merge when the tier is long). `softcap`: logits capped as in
    `tiered_decode_attention` (no shift)."""
    sink_len, recent_len = validate_bf16(q, sink_k, sink_v, sink_len, recent_k, recent_v, recent_len)
    B, H_q, D = q.shape
    if not (dispatch.use_kernel(q) and _kernel_head_dim_ok(D)):
        parts = [
            reference.attention_partial_ref(q, sink_k, sink_v, sink_len, sm_scale, softcap),
            reference.attention_partial_ref(q, recent_k, recent_v, recent_len, sm_scale, softcap),
        ]
        return torch.stack([p[0] for p in parts], 2), torch.stack([p[1] for p in parts], 2)
    s_sink, s_recent = bf16_splits(sink_k.shape[2], q.device), bf16_splits(recent_k.shape[2], q.device)
    if num_splits is not None:
        check(int(num_splits) >= 1, lambda: f"num_splits must be ≥ 1, got {num_splits}")
        s_recent = int(num_splits)
    o = dispatch.alloc((B, H_q, s_sink + s_recent, D), torch.float32, q.device)
    lse = dispatch.alloc((B, H_q, s_sink + s_recent), torch.float32, q.device)
    launch_decode(q, o, lse, sm_scale, sink=(sink_k, sink_v, sink_len), recent=(recent_k, recent_v, recent_len),
                   s_sink=s_sink, s_recent=s_recent, softcap=softcap)  # fmt: skip
    return o, lse


def merge_partials(o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Exact softmax merge of partials: o [..., S, D], lse [..., S] → o fp32 [..., D], lse fp32 [...]; same contract as
    `reference.merge_partials_ref` (empty partials contribute nothing; all-empty gives o = 0, lse = −inf)."""
    check(isinstance(o, Tensor) and isinstance(lse, Tensor), "o and lse must be tensors")
    check(o.dim() >= 2 and lse.shape == o.shape[:-1],
          lambda: f"lse {tuple(lse.shape)} must equal o's {tuple(o.shape)}[:-1]")
    check(o.device == lse.device, lambda: f"o is on {o.device}, lse on {lse.device}")
    S, D = o.shape[-2], o.shape[-1]
    if not (dispatch.use_kernel(o) and layout.is_power_of_two(D) and S > 0):
        return reference.merge_partials_ref(o, lse)
    lead = o.shape[:-2]
    o3 = o.float().reshape(-1, S, D)
    o3 = dispatch.last_contiguous(o3, 1)
    l2 = lse.float().reshape(-1, S)
    l2 = dispatch.last_contiguous(l2, 1)
    N = o3.shape[0]
    out = dispatch.alloc((N, D), torch.float32, o.device)
    out_lse = dispatch.alloc((N,), torch.float32, o.device)
    if N:
        _launch_merge(o3, l2, out, out_lse)
    return out.reshape(*lead, D), out_lse.reshape(lead)


def _launch_merge(o3: Tensor, l2: Tensor, out: Tensor, out_lse: Tensor, mean: Tensor | None = None,
                  H_q: int = 1) -> None:
    """Merge [N, S, D] partials into out [N, D] (its dtype: float32, or the model's, rounded once) and out_lse [N];
    `mean` [H_mu, D] float32 is added to row n (query head n % H_q, served by head (n % H_q) // (H_q / H_mu))."""
    cfg = config.current()
    N, S, D = o3.shape
    # split D (slices of ≥ 16 floats) until there are ~merge_programs programs; tiles of ~merge_tile elements, sized
    # by the batch shape alone (not by S, which grows with the history: one build serves a whole generation)
    parts = max(1, min(D // 16, dispatch.next_pow2(-(-cfg.merge_programs // N))))
    block_d, pdl = D // parts, dispatch.pdl(o3, cfg)
    dispatch.kernels().merge[(N, parts)](
        o3, l2, out, out_lse, mean if mean is not None else out_lse,
        S, H_q, H_q // (mean.shape[0] if mean is not None else 1),
        o3.stride(0), o3.stride(1), l2.stride(0), out.stride(0), mean.stride(0) if mean is not None else 0,
        BLOCK_D=block_d, BLOCK_S=max(16, cfg.merge_tile // block_d), PDL=pdl,
        MEAN=mean is not None, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip


def tiered_decode_attention(
    q: Tensor,
    sink_k: Tensor,
    sink_v: Tensor,
    sink_len: Tensor,
    codes_k: Tensor,
    scale_zero_k: Tensor,
    codes_v: Tensor,
    scale_zero_v: Tensor,
    hist_len: Tensor,
    recent_k: Tensor,
    recent_v: Tensor,
    recent_len: Tensor,
    sm_scale: float,
    v_mean: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    key_block: int = 0,
    softcap: float | None = None,
    logit_bias: Tensor | None = None,
    ragged: bool = False,
) -> tuple[Tensor, Tensor]:
    """Decode attention over sink / INT2 history / recent tiers (layout as in `layout`; the history's keys 2- or 3-bit
    by codes_k's width, `layout.packed_dim`, 3-bit ones in pairs: `reference.store_pairs`), exact softmax over their
    union. q [B, H_q, D] already rotated by M_K.
    Returns o [B, H_q, D] (in M_V space) and lse fp32 [B, H_q].
    Two launches: the split-K decode kernel over all three tiers, then the merge; lengths are read on the device (no
    host sync). The merge also finishes the output: `v_mean` [H_q, D] or [1, D] (the centred codec's μ_V·M_V per query
    head, `reference.add_value_mean`) is added in float32, and o is rounded once to `out_dtype`.
    `key_block` > 0: the history keys are coded per channel over blocks of that many tokens (docs/format.md §6d),
    scale_zero_k [B, H_kv, T_cap / key_block, D, 2], values per row (scale_zero_v [B, H_kv, T_cap, 1, 2]); the kernel
    folds each block's channel scales into q once per tile (`kernels/decode.py`).
    `softcap` (Gemma2's attention logit softcap): every logit x = q·k·sm_scale becomes softcap·tanh((x + b)/softcap),
    b = `logit_bias` [B, H_q] per query (the centred codec's q·μ_K·M_K·sm_scale, which the cap does not ignore; None:
    0), inside the decode kernel: the step stays two launches and capturable.
    `ragged`: the rows' lengths differ (a padded batch): the history takes up to `RuntimeConfig.ragged_waves` times
    the splits (`int2_splits`), so that the step's time follows the rows' total length rather than B × the longest."""
    H_kv, G, hist_len_i, key_bits = validate_int2(q, codes_k, scale_zero_k, codes_v, scale_zero_v, hist_len,
                                                  key_block)  # fmt: skip
    sink_len_i, recent_len_i = validate_bf16(q, sink_k, sink_v, sink_len, recent_k, recent_v, recent_len)
    check(sink_k.shape[1] == H_kv, lambda: f"sink tiers have {sink_k.shape[1]} KV heads, the history {H_kv}")
    B, H_q, D = q.shape
    if v_mean is not None:
        check(isinstance(v_mean, Tensor) and v_mean.shape in ((H_q, D), (1, D)) and v_mean.device == q.device,
              lambda: f"v_mean must be [{H_q}, {D}] or [1, {D}] on {q.device}, got {tuple(v_mean.shape)}")  # fmt: skip
    check(softcap is None or (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0),
          lambda: f"softcap must be a finite number > 0 or None, got {softcap!r}")
    if logit_bias is not None:
        check(softcap is not None, lambda: "logit_bias is only read with a softcap (without one it cancels)")
        check(isinstance(logit_bias, Tensor) and logit_bias.shape == (B, H_q) and logit_bias.device == q.device,
              lambda: f"logit_bias must be [{B}, {H_q}] on {q.device}, got {tuple(logit_bias.shape)}")
    if not (dispatch.use_kernel(q) and _kernel_head_dim_ok(D)):
        o, lse = reference.tiered_decode_attention_ref(
            q, sink_k, sink_v, sink_len, reference.load_pairs(codes_k, key_bits), scale_zero_k, codes_v, scale_zero_v,
            hist_len,
            recent_k, recent_v, recent_len, sm_scale, key_bits=key_bits, key_block=key_block, softcap=softcap,
            logit_bias=logit_bias,
        )  # fmt: skip
        return reference.add_value_mean(o.unsqueeze(2), v_mean)[:, :, 0].to(out_dtype), lse
    waves = config.current().ragged_waves if ragged else 1
    s_hist = int2_splits(B, H_kv, H_q // H_kv, D, codes_k.shape[2], q.device, None, waves)
    s_sink, s_recent = bf16_splits(sink_k.shape[2], q.device), bf16_splits(recent_k.shape[2], q.device)
    S = s_sink + s_hist + s_recent
    o_part = dispatch.alloc((B, H_q, S, D), torch.float32, q.device)
    lse_part = dispatch.alloc((B, H_q, S), torch.float32, q.device)
    launch_decode(q, o_part, lse_part, sm_scale, sink=(sink_k, sink_v, sink_len_i),
                   hist=(codes_k, scale_zero_k, codes_v, scale_zero_v, hist_len_i),
                   recent=(recent_k, recent_v, recent_len_i), s_sink=s_sink, s_hist=s_hist, s_recent=s_recent,
                   key_block=key_block, softcap=softcap, logit_bias=logit_bias)
    out = dispatch.alloc((B * H_q, D), out_dtype, q.device)
    out_lse = dispatch.alloc((B * H_q,), torch.float32, q.device)
    mean = v_mean.float().contiguous() if v_mean is not None else None
    _launch_merge(o_part.view(B * H_q, S, D), lse_part.view(B * H_q, S), out, out_lse, mean, H_q)
    return out.view(B, H_q, D), out_lse.view(B, H_q)


def dequantize_into(out: Tensor, codes: Tensor, scale_zero: Tensor, bits: int = layout.BITS,
                    key_block: int = 0) -> None:
    """Write packed history rows, dequantized, into `out` [B, H, T, D] (a view whose dims are contiguous; any float
    dtype): codes [B, H, T, packed_dim(D, bits)] (any strides), scale_zero [B, H, T, D/G, 2] per row or, `key_block` >
    0, [B, H, T/key_block, D, 2] per channel over token blocks. The values are `reference.dequantize_unpack`'s (or
    `dequantize_unpack_channel`'s) float32 ones rounded once to out's dtype; one launch (`kernels/dequant.py`), no
    float32 copy."""
    B, H, T, D = out.shape
    check(out.stride(-1) == 1 and codes.shape[:3] == (B, H, T) and codes.shape[-1] == layout.packed_dim(D, bits),
          lambda: f"dequantize_into: out {tuple(out.shape)} (dims contiguous), codes {tuple(codes.shape)}")
    if T == 0:
        return
    if not (dispatch.use_kernel(codes) and _kernel_head_dim_ok(D)):
        dq = reference.dequantize_unpack_channel if key_block else reference.dequantize_unpack
        out.copy_(dq(codes, scale_zero, bits))
        return
    scale_zero = dispatch.last_contiguous(scale_zero, 1)
    G = D if key_block else D // scale_zero.shape[-2]
    block_t = 16 if dispatch.interpret() else max(16, 4096 // D)
    dispatch.kernels().dequant[(B * H, -(-T // block_t))](
        codes, scale_zero, out, T, H, *codes.stride(), *scale_zero.stride()[:4], *out.stride()[:3],
        D=D, G=G, BITS=bits, KEY_BLOCK=key_block, BLOCK_T=block_t, num_warps=4,
    )  # fmt: skip
