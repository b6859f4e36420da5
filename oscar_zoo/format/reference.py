"""Pure-PyTorch reference of every runtime op: the single source of OSCAR's quantization math.

Rotation factors (Hadamard, bit-reversal permutation, M = U·H·P), per-row clipping, asymmetric INT2 quantization with
float16 scale/zero, quartered packing, fake-quant through the three tiers, and dense references of tiered decode
attention and the lse merge. Vectorised, fp32 math (float64 for the rotation factors). Kernels are tested against
these functions; calibration, evaluation and the cache import them instead of re-implementing anything.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import layout

# ---------------------------------------------------------------------------------------------- rotation factors


def hadamard(d: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """Normalised Sylvester Hadamard matrix of size d (a power of two): entries ±1/√d, orthogonal, symmetric."""
    if not layout.is_power_of_two(d):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {d}")
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < d:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return (H / math.sqrt(d)).to(dtype)


def random_orthogonal(d: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> Tensor:
    """A fixed seeded random orthogonal matrix (QR of a Gaussian, sign-fixed): the mixing used when d is not 2^k."""
    g = torch.Generator().manual_seed(seed)
    Q, R = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (Q * torch.sign(torch.diagonal(R))).to(dtype)


def mixing_matrix(d: int) -> tuple[Tensor, str]:
    """The H factor for head dim d and its name for the manifest: Sylvester when d = 2^k, else seeded orthogonal."""
    if layout.is_power_of_two(d):
        return hadamard(d), "sylvester"
    return random_orthogonal(d, seed=0), "random-orthogonal-seed0"


def bit_reversal(d: int) -> Tensor:
    """br[i] = i with its log2(d) bits reversed (d a power of two); br(br(i)) = i."""
    if not layout.is_power_of_two(d):
        raise ValueError(f"bit reversal needs a power-of-two size, got {d}")
    bits = layout.log2_int(d)
    i = torch.arange(d)
    out = torch.zeros(d, dtype=torch.long)
    for b in range(bits):
        out |= ((i >> b) & 1) << (bits - 1 - b)
    return out


def eigen_permutation(d: int) -> Tensor:
    """Column permutation P of M = U·H·P for eigh's ascending order: perm[j] = d − 1 − bitrev(j) (identity if d≠2^k)."""
    if not layout.is_power_of_two(d):
        return torch.arange(d)
    return d - 1 - bit_reversal(d)


def compose_rotation(U: Tensor) -> Tensor:
    """M = U·H·P for eigenvectors U [..., d, d] (columns in ascending eigenvalue order), float64."""
    d = U.shape[-1]
    H, _ = mixing_matrix(d)
    return (U.to(torch.float64) @ H)[..., eigen_permutation(d)]


def rotation_from_target(C: Tensor) -> tuple[Tensor, Tensor]:
    """Rotation M = U·H·P and ascending eigenvalues of a target C [..., d, d] (symmetrised, float64 eigh)."""
    C = C.to(torch.float64)
    evals, U = torch.linalg.eigh((C + C.transpose(-1, -2)) / 2)
    return compose_rotation(U), evals


def rotate(x: Tensor, M: Tensor) -> Tensor:
    """x·M per KV head: x [..., H, T, D], M [H, D, D] (or [D, D]); fp32 math, result in x's dtype."""
    if M.dim() == 3 and M.shape[0] > 1:
        return torch.einsum("...htd,hde->...hte", x.float(), M.float()).to(x.dtype)
    return (x.float() @ M.float().reshape(M.shape[-2:])).to(x.dtype)


# ------------------------------------------------------------------------------------------------------ centring


def rotate_mean(mean: Tensor | None, M: Tensor) -> Tensor | None:
    """μ·M per head (docs/format.md §6a): mean [H, D] in the model's (unrotated) basis, M [H, D, D] or [1, D, D] →
    fp32 [H, D], the offset the centred codec removes from rotated rows (float64 product). None stays None."""
    if mean is None:
        return None
    return torch.einsum("hd,hde->he", mean.double(), M.double().expand(mean.shape[0], -1, -1)).float()


def rotate_centred(x: Tensor, M: Tensor | None, mean_rot: Tensor | None) -> Tensor:
    """The centred codec's input rows, x·M − μ·M per KV head, rounded once to x's dtype: x [..., H, T, D], M [H, D, D]
    or [1, D, D] (None: x is rotated already), mean_rot [H, D] from `rotate_mean` (None: no centring, i.e. `rotate`).
    Every tier of a centred cache holds these rows; softmax is shift-invariant per query, so logits need no
    correction, and the attention output gets `mean_rot` of the values back (`add_value_mean`)."""
    if mean_rot is None:
        return x if M is None else rotate(x, M)
    xr = x.float() if M is None else rotate(x.float(), M)
    return (xr - mean_rot.float().unsqueeze(-2)).to(x.dtype)


def rotate_rows_ref(x: Tensor, M: Tensor | None, mean_rot: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """One row per (batch, head), the decode step's form of `rotate_centred`: x [B, H, D] → x·M − μ·M in fp32, rounded
    once to `out_dtype`. M [H_M, D, D] (or [D, D]; None: x is rotated already) and mean_rot [H_μ, D] (None: uncentred)
    serve H / H_M and H / H_μ consecutive heads each (the GQA convention: query head j uses KV head j // g). The same
    float32 products as `rotate_centred` of those rows."""
    H = x.shape[1]
    if M is not None and M.dim() == 3 and M.shape[0] not in (1, H):
        M = M.repeat_interleave(H // M.shape[0], dim=0)
    if mean_rot is not None and mean_rot.shape[0] not in (1, H):
        mean_rot = mean_rot.repeat_interleave(H // mean_rot.shape[0], dim=0)
    return rotate_centred(x.float().unsqueeze(2), M, mean_rot)[:, :, 0].to(out_dtype)


def add_value_mean(o: Tensor, v_mean_rot_q: Tensor | None) -> Tensor:
    """Attention output of centred values back to the uncentred one, in M_V space: o [B, H_q, n, D] + μ_V·M_V of each
    query head's KV head (`v_mean_rot_q` [H_q, D] or [1, D]; None: o as is). Exact because the attention weights of a
    query sum to 1. fp32; adds in place when o is fp32 already."""
    if v_mean_rot_q is None:
        return o
    o = o.float()
    return o.add_(v_mean_rot_q.float().unsqueeze(-2))


# ------------------------------------------------------------------------------------------------------ clipping


def clip_index(ratio: float | Tensor, d: int) -> Tensor:
    """k = ⌊r·d⌋ clamped to [0, d−1]; the clip threshold is the k-th smallest |x| of the row. −1 means no clip (r ≤ 0).
    A tolerance of 1e-6 makes ratios stored as float32 (0.96 → 0.95999998) give the same k as their decimal value."""
    r = torch.as_tensor(ratio, dtype=torch.float64)
    k = torch.floor(r * d + 1e-6).clamp(0, d - 1).long()
    return torch.where(r > 0, k, torch.full_like(k, -1))


def clip_rows(x: Tensor, ratio: float | Tensor) -> Tensor:
    """Symmetric per-row clamp to ±τ, τ = sort(|x|)[⌊r·D⌋]; `ratio` broadcasts to x.shape[:-1]; r ≤ 0 disables."""
    x = x.float()
    D = x.shape[-1]
    k = clip_index(ratio, D)
    host = k.device.type == "cpu"
    k = k.expand(x.shape[:-1])  # a ratio that does not broadcast to the rows fails here, on every path
    # Two uniform cases skip the sort when the ratios are on the host (no device sync): no row clipped (τ = ∞), or
    # every row's τ its largest |x| (r ≥ (D−1)/D: amax is sort's last entry, NaN included). Same τ, same clamp.
    if host and bool((k < 0).all()):
        tau = torch.full((*x.shape[:-1], 1), math.inf, dtype=x.dtype, device=x.device)
    elif host and bool((k == D - 1).all()):
        tau = x.abs().amax(-1, keepdim=True)
    else:
        k = k.to(x.device)
        tau = torch.sort(x.abs(), dim=-1).values.gather(-1, k.clamp(min=0).unsqueeze(-1))
        tau = torch.where(k.unsqueeze(-1) < 0, torch.full_like(tau, math.inf), tau)
    return torch.minimum(torch.maximum(x, -tau), tau)


# ---------------------------------------------------------------------------------------------------- INT2 codec


def quantize(x: Tensor, group_size: int = 0, bits: int = layout.BITS) -> tuple[Tensor, Tensor]:
    """Asymmetric min-max quantization to `bits` bits (2: INT2, levels 0..3; 3: levels 0..7) per group of G along the
    last dim.

    Returns codes uint8 [..., D] in {0..2^bits − 1} and scale_zero float16 [..., D/G, 2]. Codes are computed with the
    stored (float16-rounded) scale and zero, so dequantization reproduces exactly what was rounded:
    q = clamp(⌊x/s + z + ½⌋)."""
    levels = 2 ** layout.check_bits(bits) - 1
    D = x.shape[-1]
    G = layout.resolve_group_size(D, group_size)
    xg = x.float().reshape(*x.shape[:-1], D // G, G)
    lo, hi = xg.amin(-1), xg.amax(-1)
    amax = torch.maximum(lo.abs(), hi.abs())
    rng = torch.maximum(hi - lo, amax * layout.RANGE_REL_FLOOR).clamp(min=layout.RANGE_ABS_FLOOR)
    scale = (rng / levels).to(layout.SCALE_DTYPE)
    zero = (-lo / scale.float()).to(layout.SCALE_DTYPE)
    s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    q = torch.floor(xg / s + z + 0.5).clamp(0, levels)
    return q.to(layout.CODE_DTYPE).reshape(x.shape), torch.stack([scale, zero], -1)


def dequantize(codes: Tensor, scale_zero: Tensor) -> Tensor:
    """x̂ = (q − zero)·scale in fp32; codes [..., D], scale_zero [..., D/G, 2]."""
    D, n_groups = codes.shape[-1], scale_zero.shape[-2]
    q = codes.float().reshape(*codes.shape[:-1], n_groups, D // n_groups)
    s, z = scale_zero[..., 0:1].float(), scale_zero[..., 1:2].float()
    return ((q - z) * s).reshape(codes.shape)


def pack_codes(codes: Tensor, bits: int = layout.BITS) -> Tensor:
    """[..., D] codes → [..., packed_dim(D, bits)] bytes. The low two bits are quartered: byte b holds dims b, b+D/4,
    b+D/2, b+3D/4 in bits 0/2/4/6 (the whole row for INT2). 3-bit codes append a bit plane of their third bits: byte
    D/4 + j holds dims j, j+D/8, …, j+7D/8 in bits 0..7 (so quarter k of the row is bits 2k and 2k+1 of those bytes)."""
    D = codes.shape[-1]
    c = codes.to(torch.uint8)
    quarters = (c & layout.LEVELS).reshape(*codes.shape[:-1], layout.CODES_PER_BYTE, D // layout.CODES_PER_BYTE)
    out = torch.zeros(quarters.shape[:-2] + quarters.shape[-1:], dtype=torch.uint8, device=codes.device)
    for i in range(layout.CODES_PER_BYTE):
        out |= quarters[..., i, :] << (layout.BITS * i)
    if layout.check_bits(bits) == 2:
        return out
    eighths = (c >> layout.BITS).reshape(*codes.shape[:-1], 8, D // 8)
    plane = torch.zeros(eighths.shape[:-2] + eighths.shape[-1:], dtype=torch.uint8, device=codes.device)
    for i in range(8):
        plane |= eighths[..., i, :] << i
    return torch.cat([out, plane], dim=-1)


def unpack_codes(packed: Tensor, bits: int = layout.BITS) -> Tensor:
    """Inverse of `pack_codes`: [..., packed_dim(D, bits)] bytes → [..., D] codes."""
    n = packed.shape[-1] if layout.check_bits(bits) == 2 else packed.shape[-1] * 2 // 3  # D/4 bytes of low bits
    low = packed[..., :n]
    codes = torch.cat([(low >> (layout.BITS * i)) & layout.LEVELS for i in range(layout.CODES_PER_BYTE)], dim=-1)
    if bits == 2:
        return codes
    plane = packed[..., n:]
    return codes | (torch.cat([(plane >> i) & 1 for i in range(8)], dim=-1) << layout.BITS)


def pair_offsets(width: int, device) -> Tensor:
    """Where the bytes of a pair of packed 3-bit rows sit in the history's pair order (docs/format.md §6b): [2, width]
    offsets into the pair's 2·width bytes, row e's low-bit bytes at e·D/4 + j, its plane bytes at D/2 + e·D/8 + j."""
    d4 = width * 2 // 3
    d8 = width - d4
    j = torch.arange(width, device=device)
    return torch.stack([torch.where(j < d4, e * d4 + j, 2 * d4 + e * d8 + j - d4) for e in (0, 1)])


def store_pairs(packed: Tensor, bits: int = layout.BITS) -> Tensor:
    """Packed rows [..., T, packed_dim(D, bits)] (`pack_codes`, T even) in the history's order (docs/format.md §6b):
    3-bit rows in pairs, the two rows' low-bit bytes then their two planes; 2-bit rows as they are."""
    if layout.check_bits(bits) == 2:
        return packed
    *lead, T, W = packed.shape
    if T % 2:
        raise ValueError(f"3-bit key rows are stored in pairs: expected an even number of rows, got {T}")
    out = torch.empty_like(packed).reshape(*lead, T // 2, 2 * W)
    out[..., pair_offsets(W, packed.device).flatten()] = packed.reshape(*lead, T // 2, 2 * W)
    return out.reshape(packed.shape)


def load_pairs(stored: Tensor, bits: int = layout.BITS) -> Tensor:
    """Inverse of `store_pairs`: the history's rows [..., T, packed_dim(D, bits)] (T even) as `pack_codes` rows."""
    if layout.check_bits(bits) == 2:
        return stored
    *lead, T, W = stored.shape
    if T % 2:
        raise ValueError(f"3-bit key rows are stored in pairs: expected an even number of rows, got {T}")
    pairs = stored.reshape(*lead, T // 2, 2 * W)
    return pairs[..., pair_offsets(W, stored.device).flatten()].reshape(stored.shape)


def read_history_rows(hist: Tensor, n: int, bits: int = layout.BITS) -> Tensor:
    """The first `n` rows of a history [..., T_cap, W] (T_cap even) as `pack_codes` rows [..., n, W]."""
    return load_pairs(hist[..., : n + n % 2, :], bits)[..., :n, :]


def write_history_rows(hist: Tensor, rows: Tensor, packed: Tensor, bits: int = layout.BITS,
                       offsets: Tensor | None = None) -> None:
    """Write `pack_codes` rows packed [B, H, m, W] into a history [B, H, T_cap, W] (contiguous rows) at rows `rows`
    ([m] int64, on hist's device, any parity: a 3-bit row's bytes are its own within its pair), in place. `offsets`:
    `pair_offsets(W, hist.device)`, made once by a caller that writes often (a captured step)."""
    if layout.check_bits(bits) == 2:
        hist.index_copy_(2, rows, packed)
        return
    B, H, T, W = hist.shape
    offsets = pair_offsets(W, hist.device) if offsets is None else offsets
    hist.view(B, H, T // 2, 2 * W)[:, :, (rows // 2)[:, None], offsets[rows % 2]] = packed


def quantize_pack_ref(
    x: Tensor, clip_ratio: float | Tensor, group_size: int = 0, rotation: Tensor | None = None,
    bits: int = layout.BITS,
) -> tuple[Tensor, Tensor]:
    """Rotate (optional, rounded to x's dtype) → clip → quantize → pack. Returns packed uint8
    [..., packed_dim(D, bits)], float16 scale_zero [..., D/G, 2]. This is the twin of the fused quantize/pack kernel
    used for prefill and demotion."""
    if rotation is not None:
        x = rotate(x, rotation)
    codes, scale_zero = quantize(clip_rows(x, clip_ratio), group_size, bits)
    return pack_codes(codes, bits), scale_zero


def dequantize_unpack(packed: Tensor, scale_zero: Tensor, bits: int = layout.BITS) -> Tensor:
    """Packed rows back to fp32 values [..., D]."""
    return dequantize(unpack_codes(packed, bits), scale_zero)


# ------------------------------------------------------------------------- keys per channel over token blocks
# docs/format.md §6d: a layer's history keys may be coded per channel over blocks of `block` consecutive history
# tokens (a float16 scale/zero pair per channel and block, min-max, unclipped), the codes packed per token exactly as
# a row's (`pack_codes`). Blocks start at the first history token; the history always holds whole blocks.


def quantize_channel(x: Tensor, block: int, bits: int = layout.BITS) -> tuple[Tensor, Tensor]:
    """Keys x [..., T, D] (T a multiple of `block`) quantized per channel over each block of `block` tokens: codes
    uint8 [..., T, D] and scale_zero float16 [..., T/block, D, 2] (`quantize`'s rule along the tokens, no clip)."""
    T, D = x.shape[-2:]
    if block <= 0 or T % block:
        raise ValueError(f"{T} tokens are not whole blocks of {block}")
    xb = x.float().reshape(*x.shape[:-2], T // block, block, D).transpose(-1, -2)  # [..., T/block, D, block]
    codes, scale_zero = quantize(xb, 0, bits)  # [..., T/block, D, block], [..., T/block, D, 1, 2]
    return codes.transpose(-1, -2).reshape(x.shape), scale_zero.squeeze(-2)


def dequantize_channel(codes: Tensor, scale_zero: Tensor) -> Tensor:
    """x̂[t, c] = (q[t, c] − zero[t // block, c])·scale[t // block, c] in fp32; codes [..., T, D], scale_zero
    [..., T/block, D, 2]."""
    T, nb = codes.shape[-2], scale_zero.shape[-3]
    block = T // nb if nb else 1
    s = scale_zero[..., 0].float().repeat_interleave(block, dim=-2)
    z = scale_zero[..., 1].float().repeat_interleave(block, dim=-2)
    return (codes.float() - z) * s


def quantize_pack_channel_ref(x: Tensor, block: int, bits: int = layout.BITS) -> tuple[Tensor, Tensor]:
    """`quantize_channel` with the codes packed per token (`pack_codes`): packed uint8 [..., T, packed_dim(D, bits)],
    scale_zero float16 [..., T/block, D, 2]. The twin of the channel quantize/pack kernel."""
    codes, scale_zero = quantize_channel(x, block, bits)
    return pack_codes(codes, bits), scale_zero


def dequantize_unpack_channel(packed: Tensor, scale_zero: Tensor, bits: int = layout.BITS) -> Tensor:
    """Packed per-channel-coded keys back to fp32 [..., T, D]."""
    return dequantize_channel(unpack_codes(packed, bits), scale_zero)


def fake_quant_channel(x: Tensor, block: int, bits: int = layout.BITS) -> Tensor:
    """Keys x [..., T, D] through the per-channel codec, fp32; a last partial block (fewer than `block` tokens) is
    coded over the tokens it has (teacher forcing codes whole sequences; the runtime's history never holds one)."""
    T = x.shape[-2]
    n = T // block * block
    parts = [dequantize_channel(*quantize_channel(x[..., :n, :], block, bits))] if n else []
    if n < T:
        parts.append(dequantize_channel(*quantize_channel(x[..., n:, :], T - n, bits)))
    return torch.cat(parts, dim=-2)


def fake_quant(x: Tensor, clip_ratio: float | Tensor, group_size: int = 0, bits: int = layout.BITS) -> Tensor:
    """clip → quantize → dequantize, fp32: what attention reads from a history row."""
    codes, scale_zero = quantize(clip_rows(x, clip_ratio), group_size, bits)
    return dequantize(codes, scale_zero)


# ------------------------------------------------------------------------------ Lloyd-Max levels (measured only)
# The codebook variant of docs/format.md §6: the same float16 scale and zero per group (the two stored scalars), the
# four reconstruction levels non-uniform, in code units (the uniform codebook is 0, 1, 2, 3). Measured in
# benchmarks/QUALITY.md through fake quantization; no artifact stores levels and the runtime decodes uniform codes only.
UNIFORM_LEVELS = (0.0, 1.0, 2.0, 3.0)


def code_units(x: Tensor, group_size: int = 0) -> Tensor:
    """x [..., D] in the uniform codec's code units, u = x/scale + zero (float16 scale/zero of `quantize`), fp32
    [..., D/G, G]: the values four levels are fitted to and chosen among."""
    D = x.shape[-1]
    G = layout.resolve_group_size(D, group_size)
    _, scale_zero = quantize(x, group_size)
    s, z = scale_zero[..., 0:1].float(), scale_zero[..., 1:2].float()
    return x.float().reshape(*x.shape[:-1], D // G, G) / s + z


def fake_quant_levels(x: Tensor, clip_ratio: float | Tensor, levels: Tensor, group_size: int = 0) -> Tensor:
    """clip → the nearest of four levels ℓ [..., 4] (ascending, code units, broadcast to x.shape[:-1]) → dequantize,
    fp32: x̂ = (ℓ_q − zero)·scale with the uniform codec's scale and zero. ℓ = 0, 1, 2, 3 gives `fake_quant` exactly
    (the comparison u + ½ ≥ t + ½ is the uniform rounding ⌊u + ½⌋ at the thresholds t = ½, 3/2, 5/2)."""
    x = clip_rows(x, clip_ratio)
    D = x.shape[-1]
    G = layout.resolve_group_size(D, group_size)
    _, scale_zero = quantize(x, group_size)
    s, z = scale_zero[..., 0:1].float(), scale_zero[..., 1:2].float()  # [..., D/G, 1]
    u = x.float().reshape(*x.shape[:-1], D // G, G) / s + z
    lv = levels.float().expand(*x.shape[:-1], layout.LEVELS + 1).unsqueeze(-2)  # [..., 1, 4]
    t = (lv[..., :-1] + lv[..., 1:]) / 2  # [..., 1, 3] thresholds
    q = ((u + 0.5).unsqueeze(-1) >= (t + 0.5).unsqueeze(-2)).sum(-1)  # [..., D/G, G] codes 0..3
    chosen = torch.gather(lv.expand(*u.shape[:-1], layout.LEVELS + 1), -1, q)
    return ((chosen - z) * s).reshape(x.shape)


def fit_levels(u: Tensor, iterations: int = 50) -> Tensor:
    """Lloyd-Max: four levels (float64, ascending, code units) minimising the mean squared error of samples u [N] in
    [0, 3], from the uniform ones: thresholds at midpoints, each level the mean of its cell (an empty cell keeps its
    level)."""
    u = u.double().flatten()
    levels = torch.tensor(UNIFORM_LEVELS, dtype=torch.float64)
    for _ in range(iterations):
        cells = (u[:, None] >= ((levels[:-1] + levels[1:]) / 2)[None]).sum(-1)
        sums = torch.zeros(4, dtype=torch.float64).index_add_(0, cells, u)
        counts = torch.bincount(cells, minlength=4).double()
        levels = torch.where(counts > 0, sums / counts.clamp(min=1), levels)
    return levels


def fake_quant_tiers(
    x: Tensor,
    clip_ratio: float | Tensor,
    group_size: int = 0,
    sink: int = layout.SINK,
    recent: int = layout.RECENT,
    bits: int = layout.BITS,
) -> Tensor:
    """A cached K or V [..., T, D] as the three tiers present it: positions < sink and the last `recent` positions
    exact, the history in between fake-quantized (`bits`-bit codes). Returns x's dtype. `clip_ratio` broadcasts to
    x.shape[:-2]."""
    T = x.shape[-2]
    lo, hi = min(sink, T), max(min(sink, T), T - recent)
    if hi <= lo:
        return x.clone()
    ratio = torch.as_tensor(clip_ratio, dtype=torch.float64)
    ratio = ratio.reshape(ratio.shape + (1,)) if ratio.dim() else ratio  # per-row ratio over the token dim
    out = x.clone()
    out[..., lo:hi, :] = fake_quant(x[..., lo:hi, :], ratio, group_size, bits).to(x.dtype)
    return out


# --------------------------------------------------------------------------------------------------- attention


def _expand_kv(t: Tensor, n_q_heads: int) -> Tensor:
    """[B, H_kv, ...] → [B, H_q, ...] with the contiguous GQA convention (query head j reads KV head j // g)."""
    return t.repeat_interleave(n_q_heads // t.shape[1], dim=1)


def attention_partial_ref(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, sm_scale: float,
                          softcap: float | None = None, logit_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One decode step over one tier: q [B, H_q, D], k/v [B, H_kv, T, D], first lengths[b] tokens valid. `softcap`:
    each logit x becomes softcap·tanh((x + logit_bias)/softcap), logit_bias [B, H_q] (None: 0).

    Returns the normalised partial output o fp32 [B, H_q, D] and lse fp32 [B, H_q] (natural log of Σ exp(logits));
    an empty tier gives o = 0 and lse = −inf."""
    H_q, T = q.shape[1], k.shape[2]
    kx, vx = _expand_kv(k.float(), H_q), _expand_kv(v.float(), H_q)
    logits = torch.einsum("bhd,bhtd->bht", q.float(), kx) * sm_scale
    if softcap is not None:
        if logit_bias is not None:
            logits = logits + logit_bias.float()[..., None]
        logits = torch.tanh(logits / softcap) * softcap
    valid = torch.arange(T, device=q.device)[None, :] < lengths.to(q.device)[:, None]  # [B, T]
    logits = logits.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("bht,bhtd->bhd", p, vx), lse


def merge_partials_ref(o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Exact softmax merge of partials: o [..., S, D], lse [..., S] → o [..., D], lse [...]. Empty partials (lse = −inf)
    contribute nothing; if all are empty the output is 0 with lse −inf."""
    total = torch.logsumexp(lse.float(), dim=-1)
    w = torch.exp(lse.float() - torch.where(torch.isinf(total), 0.0, total)[..., None])
    return (w[..., None] * o.float()).sum(-2), total


def tiered_decode_attention_ref(
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
    key_bits: int = layout.BITS,
    key_block: int = 0,
    softcap: float | None = None,
    logit_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Decode attention over the three tiers laid out as in `layout` (history dequantized densely), merged by lse.

    q [B, H_q, D] is already rotated by M_K; the output is in M_V space (un-rotate with M_Vᵀ). `codes_k` holds
    `key_bits`-bit codes ([..., packed_dim(D, key_bits)]). `key_block` > 0: the history keys are coded per channel over
    blocks of that many tokens (§6d), scale_zero_k [B, H_kv, T_cap / key_block, D, 2] (`dequantize_unpack_channel`).
    `softcap`, `logit_bias`: a logit softcap after a per-query shift (`attention_partial_ref`).
    Returns o [B, H_q, D] and lse [B, H_q], fp32."""
    if key_block > 0:
        hist_k = dequantize_unpack_channel(codes_k, scale_zero_k, key_bits)
    else:
        hist_k = dequantize_unpack(codes_k, scale_zero_k, key_bits)
    hist_v = dequantize_unpack(codes_v, scale_zero_v)
    parts = [attention_partial_ref(q, k, v, n, sm_scale, softcap, logit_bias)
             for k, v, n in ((sink_k, sink_v, sink_len), (hist_k, hist_v, hist_len), (recent_k, recent_v, recent_len))]
    o = torch.stack([p[0] for p in parts], dim=-2)
    lse = torch.stack([p[1] for p in parts], dim=-1)
    return merge_partials_ref(o, lse)


def full_precision_mask(T: int, sink: int = layout.SINK, recent: int = layout.RECENT, device=None) -> Tensor:
    """Teacher-forcing windows [T, T] bool: query i reads key j (j ≤ i) at full precision
    iff j < sink or j > i − recent, exactly as a cache that holds the sink and the last `recent` positions in BF16
    presents them."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    return (j < sink) | (j > i - recent)


def windowed_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_hat: Tensor,
    v_hat: Tensor,
    sm_scale: float,
    sink: int = layout.SINK,
    recent: int = layout.RECENT,
) -> Tensor:
    """Causal attention of a teacher-forced sequence through the tier windows: for query i, key/value j come from
    (k, v) when `full_precision_mask` says so and from the quantized (k_hat, v_hat) otherwise.

    q [B, H_q, T, D]; k, v, k_hat, v_hat [B, H_kv, T, D]. Returns fp32 [B, H_q, T, D]."""
    H_q, T = q.shape[1], q.shape[2]
    qf = q.float()
    full = full_precision_mask(T, sink, recent, q.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    kf, kq = _expand_kv(k.float(), H_q), _expand_kv(k_hat.float(), H_q)
    logits = torch.where(full, qf @ kf.transpose(-1, -2), qf @ kq.transpose(-1, -2)) * sm_scale
    p = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1)
    vf, vq = _expand_kv(v.float(), H_q), _expand_kv(v_hat.float(), H_q)
    return (p * full) @ vf + (p * ~full) @ vq


def pin_scores(q: Tensor, cand_k: Tensor, keys: Tensor, scale: float, pool: int = layout.PIN_POOL,
               softcap: float | None = None) -> Tensor:
    """How much a prompt's last queries attend to each candidate history token (docs/format.md §6c): q [B, H_q, W, D]
    (the last W queries, rotated like the keys), cand_k [B, H_kv, c, D] the candidates' keys, keys [B, H_kv, T, D]
    every key those queries attend over (the softmax's normaliser; causality among the last W tokens is ignored), all
    as the attention sees them (with a logit softcap, uncentred keys).
    Returns [B, H_kv, c]: the softmax weight w each candidate gets, summed over the W queries and the query heads of its
    KV head, plus the largest w among its `pool` neighbouring candidates (so a needle's neighbours come with it, after
    the needle itself)."""
    B, H_q, W, D = q.shape
    H_kv, c = cand_k.shape[1], cand_k.shape[2]
    qf = q.float().reshape(B, H_kv, (H_q // H_kv) * W, D)  # query head j belongs to KV head j // (H_q / H_kv)

    def logits(k: Tensor) -> Tensor:  # as the attention computes them (a logit softcap included)
        x = qf @ k.float().transpose(-1, -2) * scale
        return x if softcap is None else torch.tanh(x / softcap) * softcap

    lse = torch.logsumexp(logits(keys), dim=-1, keepdim=True)
    weight = torch.exp(logits(cand_k) - lse).sum(2)  # [B, H_kv, c]
    pooled = torch.nn.functional.max_pool1d(weight.reshape(B * H_kv, 1, c), pool, 1, pool // 2)
    return weight + pooled.reshape(B, H_kv, c)
