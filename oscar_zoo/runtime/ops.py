"""Host wrappers of the runtime ops: validate inputs, then run the Triton kernel (CUDA tensors, or CPU tensors under
TRITON_INTERPRET=1) or fall back to the pure-PyTorch reference. Signatures equal their `reference` twins.

Triton is imported lazily (inside `_kernels()`), so importing this module needs only torch. No op reads a length back
to the host: split counts come from shapes and the SM count, so decode is CUDA-graph friendly.

This module holds the dispatch, the buffers and the decode-attention ops; quantize/pack (`quantize_pack`,
`quantize_pack_channel`) live in `quantize_ops.py` and are reached as `ops.quantize_pack` too (`__getattr__` below).
Both modules read the dispatch and the knobs as attributes of this module, so a test or benchmark that sets one here
(`_alloc`, `_kernels`, `QUANT_*`) changes both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch
from torch import Tensor

from ..format import layout, reference
from .checks import check, codes_key_bits, validate_bf16, validate_int2

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch settings of the decode kernel for one head dim."""

    block_n: int  # INT2 history tokens per tile (the MMA rows of the score dot)
    warps: int
    stages: int  # software-pipeline depth of the history loop
    programs_per_sm: int  # split-K: at most this many INT2 (batch, KV head, split) programs per SM (resident at once)
    maxnreg: int | None  # register cap (None: the compiler's choice)
    # online softmax: 0 rescales the running sums whenever a maximum grows; s > 0 keeps a stale maximum until one grows
    # by more than s (log2 units), so most tiles skip the rescale (the partial sums stay ≤ 2^s times larger)
    rescale_slack: float = 8.0


# Chosen on an H200 with `bench_decode.py --sweep` (rescale_slack with `--sweep-variants`); the measurements behind
# each setting, d = 128's 64-token tile included, are in benchmarks/RESULTS.md. programs_per_sm must not
# exceed what fits an SM (registers, shared memory); tests/runtime/test_kernel_compiles.py checks it for GQA and
# multi-head shapes at d = 64, 128 and 256. Larger head dims use the d = 128 settings.
DECODE_CONFIGS = {64: DecodeConfig(64, 1, 3, 12, 168), 128: DecodeConfig(64, 1, 3, 8, None)}
DECODE_BLOCK_NB = 32  # BF16 sink/recent tokens per tile (not pipelined: 320 tokens in all)
DECODE_MIN_TILES = 2  # INT2 history tiles per split at least (short contexts: fewer, longer splits, fewer partials)
MERGE_PROGRAMS = 512  # the merge splits head dims until it has about this many programs
MERGE_TILE = 8192  # [splits × dims] elements a merge program loads per step (more splits take more dependent steps)
INT2_ASM_UNPACK = os.environ.get("OSCAR_INT2_ASM", "1") == "1"  # GPU: PTX byte-permute unpack (0 = plain Triton)
QUANT_ASM = os.environ.get("OSCAR_QUANT_ASM", "1") == "1"  # GPU: sort |x| as bf16x2/f16x2 pairs (0 = float32)
DECODE_PDL = os.environ.get("OSCAR_PDL", "1") == "1"  # GPU ≥ sm_90: launch the merge (and decode) early, see _pdl
# keys per channel on the integer score path: each block's q·s as int8 operands first (kernels/block_query.py); 0 = the
# bfloat16 dots with q·s folded per tile
BLOCK_QUERY = os.environ.get("OSCAR_BLOCK_QUERY", "1") == "1"
QUANT_WARPS = 4  # quantize/pack: one row per thread, 32·QUANT_WARPS rows per program (benchmarks/quantize_sass.py)
QUANT_CHANNEL_CHUNK = 16  # keys per channel: tokens a thread holds at once (blocks of more take two passes)
# The interpreter runs a build of its own (a block's tile as one load, one pass: nested jit calls dominate its time);
# tests set this to run the GPU's build (per-token loads joined in registers, chunks of QUANT_CHANNEL_CHUNK) on the CPU
QUANT_CHANNEL_INTERPRET_GPU_BUILD = False


# ------------------------------------------------------------------------------------------------------- dispatch


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_kernel(t: Tensor) -> bool:
    """Kernels run on CUDA tensors, and on CPU tensors when TRITON_INTERPRET=1; everything else uses the reference."""
    if not _triton_available():
        return False
    return t.is_cuda or (t.device.type == "cpu" and _interpret())


def _kernels():
    from .kernels import block_query, decode, dequant, merge, quantize_channel, quantize_pack, rotate

    return quantize_pack, decode, merge, rotate, quantize_channel, block_query, dequant


def _dot_dtype():
    """bf16 tensor-core dots on the GPU; fp32 under the interpreter (its bf16 arithmetic is wrong)."""
    import triton.language as tl

    return tl.float32 if _interpret() else tl.bfloat16


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _pdl(t: Tensor) -> bool:
    """Programmatic dependent launch (sm_90+): the decode and merge kernels are launched before the kernel ahead of
    them ends and wait for it on the device (`griddepcontrol.wait` before their first load), which hides a launch gap
    per kernel; CUDA graphs keep the dependency."""
    if not (DECODE_PDL and t.is_cuda) or _interpret() or torch.version.hip is not None:
        return False
    return _capability_major(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= 9


def decode_config(D: int) -> DecodeConfig:
    return DECODE_CONFIGS[64 if D <= 64 else 128]


def _programs_target(device: torch.device, D: int) -> int:
    if device.type != "cuda":
        return 8  # interpreter: a few splits suffice to exercise the split logic
    index = device.index if device.index is not None else torch.cuda.current_device()
    return decode_config(D).programs_per_sm * _sm_count(index)


def _group_block(group: int) -> int:
    """Query heads per program padded to a power of two (the column side of the score dot)."""
    return triton_next_pow2(group)


def _warps(group: int, D: int) -> int:
    """Warps per program: the head dim's setting, and one more warp per 16 query heads of a large GQA group (in one
    warp, a group of 64 keeps its [64, D] fp32 accumulator in that warp's registers and spills 5 KB per thread)."""
    return max(decode_config(D).warps, _group_block(group) // 16)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# -------------------------------------------------------------------------------------------------------- buffers


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer a kernel writes (tests replace this to poison outputs before the kernels run)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _last_contiguous(t: Tensor, inner: int) -> Tensor:
    """The kernels index the innermost `inner` dims densely; copy only if they are not."""
    expected = 1
    for d in range(1, inner + 1):
        if t.shape[-d] > 1 and t.stride(-d) != expected:
            return t.contiguous()
        expected *= t.shape[-d]
    return t


def _pairs_as_words(sz: Tensor) -> Tensor:
    """scale/zero [B, H, T, NG, 2] float16 whose (scale, zero) pairs the decode kernel may read as one 32-bit word each:
    4-byte aligned with even outer strides (a copy only for odd views)."""
    if sz.data_ptr() % 4 or any(st % 2 for n, st in zip(sz.shape[:-1], sz.stride()[:-1]) if n > 1):
        return sz.contiguous()
    return sz


# ------------------------------------------------------------------------------------------------- decode attention


def _block_n(device: torch.device, D: int | None, G: int | None = None) -> int:
    """Tokens per tile: of the INT2 history for head dim D (scale groups of G dims), of the BF16 tiers for D = None."""
    if device.type != "cuda":
        return 16  # interpreter: small tiles, many of them
    return gpu_block_n(D, G)


def gpu_block_n(D: int | None, G: int | None = None) -> int:
    if not D:
        return DECODE_BLOCK_NB
    # per-group scales (G < D) dequantize every element before its dot: more live registers, and 64-token tiles at
    # d = 128 spill (tests/runtime/test_kernel_compiles.py), so those tiles stay at 32 tokens
    n = decode_config(D).block_n
    return min(n, 32) if G is not None and G < D else n


def _int2_splits(B: int, H_kv: int, group: int, D: int, T_cap: int, device: torch.device,
                 num_splits: int | None) -> int:
    if num_splits is not None:
        check(int(num_splits) >= 1, lambda: f"num_splits must be ≥ 1, got {num_splits}")
        return int(num_splits)
    programs = B * H_kv
    # rounded down: the INT2 programs of one launch fit the SMs at once (the few short BF16-tier programs of the same
    # grid come on top); rounding up left a second wave whenever B · KV heads does not divide the target. Programs
    # with more warps (large GQA groups) count for as many one-warp slots.
    by_programs = max(1, _programs_target(device, D) * decode_config(D).warps // _warps(group, D) // programs)
    by_tokens = -(-T_cap // (DECODE_MIN_TILES * _block_n(device, D)))  # at least DECODE_MIN_TILES tiles per split
    return max(1, min(by_programs, by_tokens))


def _bf16_splits(T_cap: int, device: torch.device) -> int:
    return max(1, -(-T_cap // _block_n(device, None)))


def _kernel_head_dim_ok(D: int) -> bool:
    return layout.is_power_of_two(D) and D >= 64


@functools.lru_cache(maxsize=None)
def _dummy(device: torch.device, dtype: torch.dtype, n: int = 16) -> Tensor:
    """A placeholder for a tier a launch does not read (its split count is 0): n zeros, made once, never written."""
    return torch.zeros(n, dtype=dtype, device=device)


def _strides(t: Tensor, n: int) -> tuple[int, ...]:
    return tuple(t.stride())[:n] if t.dim() > 1 else (0,) * n


def _launch_decode(q, o, lse, sm_scale, sink=None, hist=None, recent=None, s_sink=0, s_hist=0, s_recent=0,
                   key_block=0, softcap=None, logit_bias=None):
    """The one decode launch: `s_sink` splits over sink = (k, v, len), `s_hist` over hist = (codes_k, sz_k, codes_v,
    sz_v, len), `s_recent` over recent = (k, v, len), into o [B, H_q, S, D] / lse [B, H_q, S] (S = the sum).
    An absent tier gets 0 splits and placeholders. codes_k's width says its keys' bits (`codes_key_bits`).
    `key_block` > 0: the history keys are per channel over blocks of that many tokens (sz_k [B, H_kv, T_cap /
    key_block, D, 2], read as float16 per block; tiles of at most key_block tokens: a tile lies in one block).
    `softcap`: every logit becomes softcap·tanh((logit + logit_bias)/softcap), `logit_bias` [B, H_q] or None (0)."""
    decode = _kernels()[1]
    B, H_q, D = q.shape
    dev = q.device
    q = _last_contiguous(q, 1)
    any_bf16 = sink or recent
    sink = tuple(_last_contiguous(t, 1) for t in sink[:2]) + (sink[2],) if sink else None
    recent = tuple(_last_contiguous(t, 1) for t in recent[:2]) + (recent[2],) if recent else None
    if hist:
        ck, szk, cv, szv, hlen = hist
        ck = _last_contiguous(ck, 1)
        cv = cv if 1 in cv.stride()[2:] else cv.contiguous()  # token-major (the cache's) or dims-major
        szk = _last_contiguous(szk, 2) if key_block else _pairs_as_words(_last_contiguous(szk, 2))
        szv = _pairs_as_words(_last_contiguous(szv, 2))
        H_kv, G, key_bits = ck.shape[1], D if key_block else D // szk.shape[-2], codes_key_bits(ck, D)
        if key_bits == 3 and any(st % 8 for n, st in zip(ck.shape[:3], ck.stride()[:3]) if n > 1):
            ck = ck.contiguous()  # the kernel reads 3-bit rows (3D/8 bytes) with strides that are multiples of 8
    else:
        ck = cv = _dummy(dev, layout.CODE_DTYPE)
        szk = szv = _dummy(dev, layout.SCALE_DTYPE)
        hlen, H_kv, G, key_bits = any_bf16[2], any_bf16[0].shape[1], D, layout.BITS
    if not any_bf16:  # placeholders made only when a tier is absent (never inside a captured decode step)
        sink = (_dummy(dev, torch.bfloat16), _dummy(dev, torch.bfloat16), hlen)
    sink, recent = sink or recent, recent or sink
    group = H_q // H_kv
    cfg, pdl = decode_config(D), _pdl(q)
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
                      DOT_DTYPE=_dot_dtype(), USE_ASM=q.is_cuda and INT2_ASM_UNPACK, STAGES=cfg.stages,
                      SLACK=cfg.rescale_slack, PDL=pdl, KEY_BITS=key_bits, KEY_BLOCK=key_block,
                      BLOCK_Q=block_q, SOFTCAP=0.0 if softcap is None else float(softcap) * LOG2E)  # fmt: skip
    decode._decode_kernel[grid](*pointers, *sizes, *strides, **constexprs, num_warps=_warps(group, D),
                                maxnreg=cfg.maxnreg, launch_pdl=pdl)


def block_query(GP: int, D: int) -> bool:
    """Whether keys per channel take the integer score dots (`kernels/decode.py`, INT8_SHAPE) with the block operands
    of `kernels/block_query.py`: GQA groups padded to 4 (two tokens per score row) or ≥ 8, from D = 128. At D = 64 the
    operands (2·GP·D bytes a block) cost more than the integer dots save (benchmarks/RESULTS.md): q·s is folded per
    tile there, as for groups of 1–2."""
    return BLOCK_QUERY and D >= 128 and (GP == 4 or GP >= 8)


def _block_query(q: Tensor, szk: Tensor, hlen: Tensor, key_block: int, key_bits: int, qk_scale: float,
                 H_kv: int) -> tuple[Tensor, Tensor]:
    """Keys per channel: every history block's q·s as the decode kernel's int8 operands and its (w, bias)
    (`kernels/block_query.py`): qb [B, H_kv, NB, 2, GP, D] int8, qf [B, H_kv, NB, 2, GP] float32, NB = szk's blocks.
    Blocks past a row's history are left unwritten (the decode reads none)."""
    B, H_q, D = q.shape
    NB = szk.shape[2]
    GP = _group_block(H_q // H_kv)
    qb = _alloc((B, H_kv, NB, 2, GP, D), torch.int8, q.device)
    qf = _alloc((B, H_kv, NB, 2, GP), torch.float32, q.device)
    q_lo = min(128, (4096 if key_bits == 3 else 8192) // D)  # the decode kernel's Q_LO
    pdl = _pdl(q)
    # blocks per program: one until the grid is ≈ 16 one-warp programs per SM, then up to 8 (a power of two; the
    # interpreter takes 8 for any but the smallest grids)
    resident = 16 * _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device()) \
        if q.is_cuda else 1
    bpp = 1
    while bpp < 8 and NB * B * H_kv >= 2 * bpp * resident:
        bpp *= 2
    _kernels()[5]._block_query_kernel[(-(-NB // bpp), B * H_kv)](
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
    2-bit keys, [..., 3D/8] 3-bit keys (`layout.packed_dim`); values are 2-bit. `key_block` > 0: the keys are coded
    per channel over blocks of that many history tokens (docs/format.md §6d): scale_zero_k [B, H_kv, T_cap /
    key_block, D, 2] (T_cap = codes_k.shape[2], whole blocks), values per row (scale_zero_v [B, H_kv, T_cap, 1, 2])."""
    H_kv, G, hist_len, key_bits = validate_int2(q, codes_k, scale_zero_k, codes_v, scale_zero_v, hist_len, key_block)
    B, H_q, D = q.shape
    S = _int2_splits(B, H_kv, H_q // H_kv, D, codes_k.shape[2], q.device, num_splits)
    if not (_use_kernel(q) and _kernel_head_dim_ok(D)):
        return _int2_partial_ref(q, codes_k, scale_zero_k, codes_v, scale_zero_v, hist_len, sm_scale, S, key_bits,
                                 key_block)  # fmt: skip
    o = _alloc((B, H_q, S, D), torch.float32, q.device)
    lse = _alloc((B, H_q, S), torch.float32, q.device)
    _launch_decode(q, o, lse, sm_scale, hist=(codes_k, scale_zero_k, codes_v, scale_zero_v, hist_len), s_hist=S,
                   key_block=key_block)  # fmt: skip
    return o, lse


def _int2_partial_ref(q, codes_k, sz_k, codes_v, sz_v, hist_len, sm_scale, S, key_bits=layout.BITS, key_block=0):
    """Reference fallback of `decode_int2_partial`: the whole history as split 0, the other splits empty."""
    B, H_q, D = q.shape
    dequant_k = reference.dequantize_unpack_channel if key_block else reference.dequantize_unpack
    k, v = dequant_k(codes_k, sz_k, key_bits), reference.dequantize_unpack(codes_v, sz_v)
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
    if not (_use_kernel(q) and _kernel_head_dim_ok(D)):
        parts = [
            reference.attention_partial_ref(q, sink_k, sink_v, sink_len, sm_scale, softcap),
            reference.attention_partial_ref(q, recent_k, recent_v, recent_len, sm_scale, softcap),
        ]
        return torch.stack([p[0] for p in parts], 2), torch.stack([p[1] for p in parts], 2)
    s_sink, s_recent = _bf16_splits(sink_k.shape[2], q.device), _bf16_splits(recent_k.shape[2], q.device)
    if num_splits is not None:
        check(int(num_splits) >= 1, lambda: f"num_splits must be ≥ 1, got {num_splits}")
        s_recent = int(num_splits)
    o = _alloc((B, H_q, s_sink + s_recent, D), torch.float32, q.device)
    lse = _alloc((B, H_q, s_sink + s_recent), torch.float32, q.device)
    _launch_decode(q, o, lse, sm_scale, sink=(sink_k, sink_v, sink_len), recent=(recent_k, recent_v, recent_len),
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
    if not (_use_kernel(o) and layout.is_power_of_two(D) and S > 0):
        return reference.merge_partials_ref(o, lse)
    lead = o.shape[:-2]
    o3 = o.float().reshape(-1, S, D)
    o3 = _last_contiguous(o3, 1)
    l2 = lse.float().reshape(-1, S)
    l2 = _last_contiguous(l2, 1)
    N = o3.shape[0]
    out = _alloc((N, D), torch.float32, o.device)
    out_lse = _alloc((N,), torch.float32, o.device)
    if N:
        _launch_merge(o3, l2, out, out_lse)
    return out.reshape(*lead, D), out_lse.reshape(lead)


def _launch_merge(o3: Tensor, l2: Tensor, out: Tensor, out_lse: Tensor, mean: Tensor | None = None,
                  H_q: int = 1) -> None:
    """Merge [N, S, D] partials into out [N, D] (its dtype: float32, or the model's, rounded once) and out_lse [N];
    `mean` [H_mu, D] float32 is added to row n (query head n % H_q, served by head (n % H_q) // (H_q / H_mu))."""
    merge = _kernels()[2]
    N, S, D = o3.shape
    # split D (slices of ≥ 16 floats) until there are ~MERGE_PROGRAMS programs; tiles of ~MERGE_TILE elements, sized
    # by the batch shape alone (not by S, which grows with the history: one build serves a whole generation)
    parts = max(1, min(D // 16, triton_next_pow2(-(-MERGE_PROGRAMS // N))))
    block_d, pdl = D // parts, _pdl(o3)
    merge._merge_kernel[(N, parts)](
        o3, l2, out, out_lse, mean if mean is not None else out_lse,
        S, H_q, H_q // (mean.shape[0] if mean is not None else 1),
        o3.stride(0), o3.stride(1), l2.stride(0), out.stride(0), mean.stride(0) if mean is not None else 0,
        BLOCK_D=block_d, BLOCK_S=max(16, MERGE_TILE // block_d), PDL=pdl,
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
) -> tuple[Tensor, Tensor]:
    """Decode attention over sink / INT2 history / recent tiers (layout as in `layout`; the history's keys 2- or 3-bit
    by codes_k's width, `layout.packed_dim`), exact softmax over their union. q [B, H_q, D] already rotated by M_K.
    Returns o [B, H_q, D] (in M_V space) and lse fp32 [B, H_q].
    Two launches: the split-K decode kernel over all three tiers, then the merge; lengths are read on the device (no
    host sync). The merge also finishes the output: `v_mean` [H_q, D] or [1, D] (the centred codec's μ_V·M_V per query
    head, `reference.add_value_mean`) is added in float32, and o is rounded once to `out_dtype`.
    `key_block` > 0: the history keys are coded per channel over blocks of that many tokens (docs/format.md §6d),
    scale_zero_k [B, H_kv, T_cap / key_block, D, 2], values per row (scale_zero_v [B, H_kv, T_cap, 1, 2]); the kernel
    folds each block's channel scales into q once per tile (`kernels/decode.py`).
    `softcap` (Gemma2's attention logit softcap): every logit x = q·k·sm_scale becomes softcap·tanh((x + b)/softcap),
    b = `logit_bias` [B, H_q] per query (the centred codec's q·μ_K·M_K·sm_scale, which the cap does not ignore; None:
    0), inside the decode kernel: the step stays two launches and capturable."""
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
    if not (_use_kernel(q) and _kernel_head_dim_ok(D)):
        o, lse = reference.tiered_decode_attention_ref(
            q, sink_k, sink_v, sink_len, codes_k, scale_zero_k, codes_v, scale_zero_v, hist_len,
            recent_k, recent_v, recent_len, sm_scale, key_bits=key_bits, key_block=key_block, softcap=softcap,
            logit_bias=logit_bias,
        )  # fmt: skip
        return reference.add_value_mean(o.unsqueeze(2), v_mean)[:, :, 0].to(out_dtype), lse
    s_hist = _int2_splits(B, H_kv, H_q // H_kv, D, codes_k.shape[2], q.device, None)
    s_sink, s_recent = _bf16_splits(sink_k.shape[2], q.device), _bf16_splits(recent_k.shape[2], q.device)
    S = s_sink + s_hist + s_recent
    o_part = _alloc((B, H_q, S, D), torch.float32, q.device)
    lse_part = _alloc((B, H_q, S), torch.float32, q.device)
    _launch_decode(q, o_part, lse_part, sm_scale, sink=(sink_k, sink_v, sink_len_i),
                   hist=(codes_k, scale_zero_k, codes_v, scale_zero_v, hist_len_i),
                   recent=(recent_k, recent_v, recent_len_i), s_sink=s_sink, s_hist=s_hist, s_recent=s_recent,
                   key_block=key_block, softcap=softcap, logit_bias=logit_bias)
    out = _alloc((B * H_q, D), out_dtype, q.device)
    out_lse = _alloc((B * H_q,), torch.float32, q.device)
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
    if not (_use_kernel(codes) and _kernel_head_dim_ok(D)):
        dq = reference.dequantize_unpack_channel if key_block else reference.dequantize_unpack
        out.copy_(dq(codes, scale_zero, bits))
        return
    scale_zero = _last_contiguous(scale_zero, 1)
    G = D if key_block else D // scale_zero.shape[-2]
    block_t = 16 if _interpret() else max(16, 4096 // D)
    _kernels()[6]._dequant_kernel[(B * H, -(-T // block_t))](
        codes, scale_zero, out, T, H, *codes.stride(), *scale_zero.stride()[:4], *out.stride()[:3],
        D=D, G=G, BITS=bits, KEY_BLOCK=key_block, BLOCK_T=block_t, num_warps=4,
    )  # fmt: skip


def __getattr__(name: str):
    """`ops.quantize_pack`, `ops.quantize_pack_channel` and `ops._max_m_build` from `quantize_ops` (imported on first
    use: it imports this module)."""
    if name in ("quantize_pack", "quantize_pack_channel", "_max_m_build"):
        from . import quantize_ops

        return getattr(quantize_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
