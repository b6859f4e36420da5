"""The fused quantize/pack kernel (`ops.quantize_pack`) against `reference.quantize_pack_ref`: bit for bit without a
rotation (the demotion path), within a documented tolerance with one (rotation summation order differs). 2-bit codes
throughout; 3-bit codes (`bits=3`: the quartered low bits, then the third bits' plane) in their own section and where a
test takes `bits`."""

import pytest
import torch

from oscar_zoo.format import layout, reference
from oscar_zoo.runtime import ops


def _rows(B, H, T, D, dtype, device, seed):
    """Fresh random rows with the cases that break quantizers: outliers, constant rows, an all-zero row, ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g) * torch.rand(B, H, T, 1, generator=g).mul(3).add(0.05)
    if T > 2:
        x[:, :, 1, 3] = 40.0  # one outlier
        x[:, :, 1, D // 2] = -25.0
        x[:, :, 2] = 0.731  # constant row (range floor)
    if T > 4:
        x[0, 0, 4] = 0.0  # all-zero row
        x[:, :, 3, : D // 2] = x[:, :, 3, D // 2 :]  # every |x| tied in pairs
    return x.to(dtype).to(device)


def _assert_bit_exact(x, ratio, group_size=0, bits=2):
    codes, sz = ops.quantize_pack(x, ratio, group_size, bits=bits)
    codes_ref, sz_ref = reference.quantize_pack_ref(
        x.cpu(), ratio if not torch.is_tensor(ratio) else ratio.cpu(), group_size, bits=bits
    )
    assert codes.dtype == torch.uint8 and sz.dtype == torch.float16
    assert codes.shape == codes_ref.shape and sz.shape == sz_ref.shape
    assert codes.shape[-1] == layout.packed_dim(x.shape[-1], bits)
    assert torch.equal(codes.cpu(), codes_ref)
    assert torch.equal(sz.cpu().view(torch.int16), sz_ref.view(torch.int16))  # bit for bit, incl. signed zeros


@pytest.mark.parametrize("T", [1, 7, 8, 9, 1025])
def test_bit_exact_token_counts(device, T):
    x = _rows(1, 2, T, 64, torch.bfloat16, device, seed=T)
    _assert_bit_exact(x, 0.96)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bit_exact_dtypes_and_head_dims(device, D, dtype):
    x = _rows(2, 3, 9, D, dtype, device, seed=D)
    _assert_bit_exact(x, 0.92)


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0, "per-head"])
def test_bit_exact_clip_ratios(device, ratio):
    x = _rows(1, 3, 9, 64, torch.bfloat16, device, seed=7)
    if ratio == "per-head":
        ratio = torch.tensor([[0.96], [0.0], [0.9]], device=device)
    _assert_bit_exact(x, ratio)


@pytest.mark.parametrize("group_size", [16, 32])
def test_bit_exact_groups(device, group_size):
    x = _rows(2, 2, 9, 64, torch.bfloat16, device, seed=group_size)
    _assert_bit_exact(x, 0.96, group_size)


def test_three_dim_rows(device):
    x = _rows(1, 3, 8, 64, torch.bfloat16, device, seed=3)[0]  # [H, T, D]
    _assert_bit_exact(x, torch.tensor([[0.96], [0.92], [0.8]], device=device))


@pytest.mark.parametrize("bits", [2, 3])
def test_rotation_within_tolerance(device, bits):
    """With a rotation the kernel's x·M (fp32 dot, then rounded to x's dtype) can differ from torch's matmul in the
    last bit, which moves a code only at a rounding boundary. Tolerance: ≤ 1 % of codes differ, by one level; scale and
    zero agree to float16 rounding (observed: 0 codes differ on CPU, 2 and 3 bits)."""
    H, D = 2, 64
    x = _rows(1, H, 33, D, torch.bfloat16, device, seed=5)
    Q, _ = torch.linalg.qr(torch.randn(H, D, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    M = Q.float().to(device)
    codes, sz = ops.quantize_pack(x, 0.96, rotation=M, bits=bits)
    codes_ref, sz_ref = reference.quantize_pack_ref(x.cpu(), 0.96, rotation=M.cpu(), bits=bits)
    assert codes.shape == codes_ref.shape
    q, q_ref = reference.unpack_codes(codes.cpu(), bits).int(), reference.unpack_codes(codes_ref, bits).int()
    assert (q - q_ref).abs().max() <= 1
    assert (q != q_ref).float().mean() <= 0.01
    torch.testing.assert_close(sz.cpu().float(), sz_ref.float(), rtol=2e-2, atol=1e-3)


def test_bad_inputs_raise():
    x = torch.randn(1, 2, 4, 64)
    with pytest.raises(ValueError, match="group_size"):
        ops.quantize_pack(x, 0.96, group_size=48)
    with pytest.raises(ValueError, match="rotation"):
        ops.quantize_pack(x, 0.96, rotation=torch.eye(32))
    with pytest.raises(ValueError, match="bit"):
        ops.quantize_pack(x, 0.96, bits=4)
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.quantize_pack(torch.randn(1, 2, 4, 20), 0.96, bits=3)


# ------------------------------------------------------------------ one row per thread, tiles of 128 flattened rows


@pytest.mark.parametrize("D, group_size", [(128, 0), (128, 32), (64, 0), (64, 16)])
@pytest.mark.parametrize("ratio", [0.96, 0.92, "per-head"])
# tile (128 rows) ± 1; tiles across heads
@pytest.mark.parametrize("H, T", [(1, 1), (1, 127), (1, 128), (1, 129), (3, 43)])
def test_bit_exact_runtime_shapes(device, D, group_size, ratio, H, T):
    """The shapes the runtime uses: d = 128 / 64, G = D and G < D, per-head [H, 1] clip tensors (0.96, 0.92 and 0.8,
    i.e. the top-8, top-16 and general clip paths in one launch) and float clips, row counts around the tile."""
    x = _rows(1, H, T, D, torch.bfloat16, device, seed=D + T + H)
    if ratio == "per-head":
        ratio = torch.tensor([[0.96], [0.92], [0.8]][:H], device=device)
    _assert_bit_exact(x, ratio, group_size)


def test_bit_exact_demotion_step(device):
    """The decode-time demotion: B 32 × H 8 × 8 tokens, a strided view of the recent tier, per-head clip tensor."""
    B, H, F, D = 32, 8, 8, 128
    tier = _rows(B, H, 24, D, torch.bfloat16, device, seed=11)
    clip = torch.tensor([0.96, 0.92, 0.96, 0.9, 0.95, 0.92, 1.0, 0.0], device=device).reshape(H, 1)
    _assert_bit_exact(tier[:, :, :F], clip)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("m_max", [8, 9, 16, 17])  # each top-k build's largest m, and one more (the next build)
def test_bit_exact_with_a_host_bound_on_the_ratios(device, D, m_max):
    """A ratio tensor with its host bound (`min_ratio`, what the cache passes): the bound picks the top-8 / top-16
    build or the dispatch. Its smallest ratio clips exactly m_max values, so a build chosen one value too small fails;
    a head with ratio 0 (no clip) and one with ratio 1 (m = 1) share the launch."""
    bound = (D - m_max) / D
    ratio = torch.tensor([[bound], [0.0], [1.0], [bound + 1 / D]], device=device)
    x = _rows(1, 4, 129, D, torch.bfloat16, device, seed=D + m_max)
    codes, sz = ops.quantize_pack(x, ratio, min_ratio=bound)
    codes_ref, sz_ref = reference.quantize_pack_ref(x.cpu(), ratio.cpu())
    assert torch.equal(codes.cpu(), codes_ref)
    assert torch.equal(sz.cpu().view(torch.int16), sz_ref.view(torch.int16))
    # the build it was meant to run
    assert ops.max_m_build(D, bound) == (8 if m_max <= 8 else 16 if m_max <= 16 else 0)


@pytest.mark.parametrize("D, bits", [(64, 2), (128, 2), (128, 3)])
def test_rotation_per_head_clip_within_tolerance(device, D, bits):
    """Rotation given (per-head [H, D, D], per-head clips): same tolerance as test_rotation_within_tolerance."""
    H = 2
    x = _rows(1, H, 37, D, torch.bfloat16, device, seed=D)
    Q, _ = torch.linalg.qr(torch.randn(H, D, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    M, clip = Q.float().to(device), torch.tensor([[0.96], [0.92]], device=device)
    codes, sz = ops.quantize_pack(x, clip, rotation=M, bits=bits)
    codes_ref, sz_ref = reference.quantize_pack_ref(x.cpu(), clip.cpu(), rotation=M.cpu(), bits=bits)
    assert codes.shape == codes_ref.shape
    q, q_ref = reference.unpack_codes(codes.cpu(), bits).int(), reference.unpack_codes(codes_ref, bits).int()
    assert (q - q_ref).abs().max() <= 1
    assert (q != q_ref).float().mean() <= 0.01
    torch.testing.assert_close(sz.cpu().float(), sz_ref.float(), rtol=2e-2, atol=1e-3)


def test_ratio_tensor_not_broadcasting_raises(device):
    with pytest.raises(ValueError, match="broadcast"):
        ops.quantize_pack(torch.randn(1, 2, 4, 64, device=device), torch.full((3, 1), 0.96, device=device))


# ------------------------------------------------------------------ codes at their rounding boundaries


def _every_value(dtype) -> torch.Tensor:
    """Every finite value of a 16-bit float dtype, as float32, ascending."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    return every[torch.isfinite(every)].sort().values


def _codes_in_row(ends: torch.Tensor, v: torch.Tensor, bits=2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.quantize`'s codes of values v [N] (within ends) in a row whose min and max are ends = (a, b), and
    that row's float32 scale and zero: each value sits in a row [a, b, v, v], which has the same min and max."""
    rows = torch.stack([ends[0].expand(v.shape), ends[1].expand(v.shape), v, v], dim=1)
    codes, sz = reference.quantize(rows, 0, bits)
    return codes[:, 2].float(), sz[0, 0, 0].float(), sz[0, 0, 1].float()


def _boundary_rows(dtype, n_rows, D, seed, bits=2):
    """Rows whose codes sit on their boundaries. Each row fixes its min and max (ranges from 2^-10 to 2^9, groups of
    one sign or both), so `reference.quantize` fixes its scale and zero; the rest of the row is every value of
    `dtype` in [min, max] at which the reference's code changes, the value just below each, and fill. The boundaries
    are found from the reference's codes of every value of the dtype in the range (16-bit) or by bisection over the
    float32 bit patterns (float32)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_rows):
        a, b = sorted((torch.randn(2, generator=g) * 2.0 ** torch.randint(-10, 10, (2,), generator=g).float()).tolist())
        if a == b:
            b = a + 1.0
        ends = torch.tensor([a, b]).to(dtype).float()
        if dtype == torch.float32:  # bisection over the ordered bit patterns between the ends, per code step
            keys = []
            c_lo, c_hi = _codes_in_row(ends, ends, bits)[0].tolist()
            for i in range(1, 2**bits):
                if not (c_lo < i <= c_hi):
                    continue
                lo_k, hi_k = _ordered_key(ends[0]), _ordered_key(ends[1])
                while hi_k - lo_k > 1:
                    mid = (lo_k + hi_k) // 2
                    below = _codes_in_row(ends, _from_key(mid).reshape(1), bits)[0].item() < i
                    lo_k, hi_k = (mid, hi_k) if below else (lo_k, mid)
                keys += [lo_k, hi_k]
            found = torch.tensor([_from_key(k).item() for k in keys]) if keys else torch.empty(0)
        else:
            every = _every_value(dtype)
            every = every[(every >= ends[0]) & (every <= ends[1])]
            c = _codes_in_row(ends, every, bits)[0]
            step = (c[1:] != c[:-1]).nonzero().flatten()
            found = torch.cat([every[step], every[step + 1]])
        fill = ends[0] + (ends[1] - ends[0]) * torch.rand(D, generator=g)
        row = torch.cat([ends, found[: D - 2], fill])[:D]
        rows.append(row[torch.randperm(D, generator=g)])
    return torch.stack(rows).to(dtype)


def _ordered_key(v: torch.Tensor) -> int:
    """float32 → an integer that orders like the value (the sign-magnitude bits folded)."""
    b = int(v.reshape(1).view(torch.int32).item())
    return b if b >= 0 else -(b & 0x7FFFFFFF)


def _from_key(k: int) -> torch.Tensor:
    b = k if k >= 0 else (-k) | -(2**31)
    return torch.tensor([b], dtype=torch.int32).view(torch.float32)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bit_exact_at_code_boundaries(device, dtype):
    """Every value at which a code changes, and the one below it, for 96 rows of different scales and zeros: the
    kernel's thresholds agree with the reference there (random rows rarely land on a boundary). With float32 rows this
    catches a threshold one float32 off (checked by editing: a wrong tie flag, RN instead of the round-up); a 16-bit
    value rarely sits within a float32 step of a boundary, so those rows mostly check the search itself. No clip
    (ratio 0) keeps each row's min and max, then a clip that cuts into every row."""
    x = _boundary_rows(dtype, 96, 64, seed=17).reshape(2, 3, 16, 64).to(device)
    _assert_bit_exact(x, 0.0)
    _assert_bit_exact(x, 0.9)


# row ends (min, max) whose scale and zero make a few values' codes depend on the quotient's last bit: x·RN(1/s)
# instead of RN(x/s) changes them (found by a search over random ends; about 1 in 2,000 has such a value)
FRAGILE_ENDS = {
    torch.bfloat16: [(-0.73828125, -0.000171661376953125), (-336.0, 0.0021209716796875),
                     (-42.0, -0.0004825592041015625), (-90.0, 0.000583648681640625),
                     (-180.0, -0.0001583099365234375), (-756.0, 0.00098419189453125)],
    torch.float16: [(-5.6484375, -0.0007410049438476562), (-22.59375, 0.003429412841796875),
                    (-315.75, 0.0106048583984375), (-17.765625, 0.00457000732421875),
                    (-83.625, 0.005428314208984375), (-93.75, 0.01030731201171875)],
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bit_exact_where_the_quotient_last_bit_decides(device, dtype):
    """Rows holding the values whose code an inexact quotient would change (checked here for every row): a kernel that
    divided as x·RN(1/s), or placed a threshold by that quotient, fails (an earlier division rule without its
    correction step did: checked by editing)."""
    D = 64
    every = _every_value(dtype)
    rows = []
    for a, b in FRAGILE_ENDS[dtype]:
        ends = torch.tensor([a, b])
        vals = every[(every >= a) & (every <= b)]
        codes, s, z = _codes_in_row(ends, vals)
        fragile = vals[torch.floor(vals * (1 / s) + z + 0.5).clamp(0, 3) != codes]  # the uncorrected quotient's codes
        assert 1 <= fragile.numel() <= D - 2
        fill = torch.linspace(a, b, D - 2 - fragile.numel())
        rows.append(torch.cat([ends, fragile, fill]))
    _assert_bit_exact(torch.stack(rows).reshape(1, 1, -1, D).to(dtype).to(device), 0.0)


def test_bit_exact_clip_paths_in_every_dtype(device):
    """The clip paths (per-head 0.96 / 0.92 / 0.8), both group sizes and all three dtypes."""
    for D, dtype in ((128, torch.bfloat16), (64, torch.float16), (64, torch.float32)):
        x = _rows(1, 3, 43, D, dtype, device, seed=D + 1)
        _assert_bit_exact(x, torch.tensor([[0.96], [0.92], [0.8]], device=device))
        _assert_bit_exact(x, 0.96, 16)


def test_threshold_constants_match_the_rounding_thresholds():
    """ROUND_HALF_ULPS / ROUND_TIES_UP (the view of ROUND_THRESHOLDS the thresholds in x's units take): half the
    float32 gap below each C_i, and whether C_i's significand is even (a sum exactly halfway rounds to it)."""
    from oscar_zoo.runtime.kernels.quantize_pack import ROUND_HALF_ULPS, ROUND_THRESHOLDS, ROUND_TIES_UP

    c = torch.tensor(ROUND_THRESHOLDS, dtype=torch.float32)
    below = (c.view(torch.int32) - 1).view(torch.float32)
    assert torch.equal((c.double() - below.double()) / 2, torch.tensor(ROUND_HALF_ULPS, dtype=torch.float64))
    assert [bool(b % 2 == 0) for b in c.view(torch.int32).tolist()] == list(ROUND_TIES_UP)


# ------------------------------------------------------------------ the kernel's rounding thresholds, exhaustively


@pytest.mark.parametrize("bits", [2, 3])
def test_round_thresholds_equal_floor_of_u_plus_half(bits):
    """code = #{i ≤ L : u ≥ C_i} equals clamp(⌊float32(u + ½)⌋, 0, L), L = 2^bits − 1, for every float32 u near the
    thresholds."""
    from oscar_zoo.runtime.kernels.quantize_pack import ROUND_THRESHOLDS

    levels = 2**bits - 1
    assert len(ROUND_THRESHOLDS) == 7
    c = torch.tensor(ROUND_THRESHOLDS[:levels], dtype=torch.float32)
    near = torch.cat([c, torch.arange(levels + 1, dtype=torch.float32), torch.tensor([-0.5, levels + 0.5])])
    pattern = near.view(torch.int32)[:, None] + torch.arange(-4096, 4097, dtype=torch.int32)[None, :]
    u = torch.cat([pattern.flatten().view(torch.float32), torch.linspace(-10, 10, 100_001)])
    u = u[torch.isfinite(u)]  # (the bit patterns below +0.0 are NaNs)
    want = torch.floor(u + 0.5).clamp(0, levels)
    got = (u[:, None] >= c[None, :]).sum(1).float()
    assert torch.equal(got, want)


# ------------------------------------------------------------------ 3-bit codes: levels 0..7, the third bits as a plane


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_three_bit_bit_exact(device, D, dtype):
    """bits=3 against the reference, bit for bit: per-head clip tensors (0.96 / 0.92 / 0.8: the top-8, top-16 and
    general clip paths in one launch; then 1.0, i.e. τ = max|x|, and 0 = off beside a clip), float clips (0.96, 1.0,
    0 = off), one group per row and groups of 32, on `_rows` (outliers, a constant row at the range floor, whose 3-bit
    scale is a float16 subnormal, an all-zero row, ties)."""
    x = _rows(2, 3, 9, D, dtype, device, seed=D + 3)
    ratios = (torch.tensor([[0.96], [0.92], [0.8]], device=device), torch.tensor([[1.0], [0.0], [0.9]], device=device),
              0.96, 1.0, 0.0)  # fmt: skip
    for ratio in ratios:
        for group_size in (0, 32):
            _assert_bit_exact(x, ratio, group_size, bits=3)


def test_three_bit_across_tiles(device):
    """Rows across program tiles (128 rows each) and heads, leading dims folded: the plane's store is masked and placed
    like the low bits' (the output buffers start as garbage, so an unwritten or misplaced byte shows)."""
    _assert_bit_exact(_rows(1, 1, 129, 64, torch.bfloat16, device, seed=129), 0.96, bits=3)
    _assert_bit_exact(_rows(1, 3, 43, 128, torch.bfloat16, device, seed=43)[0], torch.tensor([[0.96], [0.92], [0.8]],
                      device=device), 16, bits=3)  # fmt: skip


def _neighbours(v: torch.Tensor) -> torch.Tensor:
    """The values of v's dtype next to each value of v on either side (the bit patterns ± 1; ±0: ± the least
    subnormal)."""
    b = v.view(torch.int32 if v.dtype == torch.float32 else torch.int16)
    least = torch.ones_like(b).view(v.dtype)
    return torch.cat([torch.where(v == 0, least, (b + 1).view(v.dtype)),
                      torch.where(v == 0, -least, (b - 1).view(v.dtype))])


def _midpoint_rows(dtype, bits, D, seed):
    """Rows of known scale s = 2^e and zero z (integers and two short fractions): min −z·s and max (L − z)·s
    (L = 2^bits − 1) make the reference's
    scale range/L = s and its zero −min/s = z exactly. The rest of each row: x = (j/2 − z)·s for j = 0..2L, where
    u = x/s + z is exactly every level and every midpoint (u = i − ½, where ⌊u + ½⌋ steps to i), the values whose
    quotient q = x/s (exact: s is a power of two) makes q + z a tie of the float32 rounding at a threshold C_i (q + z
    halfway between C_i and the float32 below it; representable in x's dtype when z lifts q into a higher binade:
    float32 rows only; C_1's tie needs a fractional z), the neighbours of each in x's dtype within [min, max], and fill.
    Zeros of both signs and all-positive and all-negative rows (z < 0, z > L) included."""
    from oscar_zoo.runtime.kernels.quantize_pack import ROUND_THRESHOLDS

    c = torch.tensor(ROUND_THRESHOLDS, dtype=torch.float32)
    ties = ((c.double() + torch.nextafter(c, torch.tensor(-1.0)).double()) / 2)[:2**bits - 1]
    g = torch.Generator().manual_seed(seed)
    L = 2**bits - 1
    rows = []
    for e in (-8, -1, 4):
        for z in (0, 1, 3, L, -5, L + 6, 100, 0.375, 2.75):
            s = 2.0**e
            lo, hi = -z * s, (L - z) * s
            exact = ((torch.arange(2 * L + 1, dtype=torch.float64) / 2 - z) * s).to(dtype)
            tie = (ties - z) * s
            tie = tie[tie.to(dtype).double() == tie].to(dtype)
            vals = torch.cat([exact, tie, _neighbours(torch.cat([exact, tie]))])
            vals = vals[(vals.double() >= lo) & (vals.double() <= hi)]
            fill = (lo + (hi - lo) * torch.rand(D - vals.numel(), generator=g, dtype=torch.float64)).to(dtype)
            row = torch.cat([vals, fill])
            assert row.numel() == D and row.double().min() == lo and row.double().max() == hi
            rows.append(row[torch.randperm(D, generator=g)])
    return torch.stack(rows)


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bit_exact_at_rounding_midpoints(device, bits, dtype):
    """Values exactly on every level and every rounding midpoint of rows with a known scale and zero (`_midpoint_rows`),
    the float32 ties of q + z at each threshold, and their neighbours: the kernel's thresholds C_1..C_L sit where the
    reference's ⌊u + ½⌋ steps, ties included (a wrong ROUND_TIES_UP or ROUND_HALF_ULPS entry fails the float32 rows:
    checked by editing each). No clip (0) and a clip at max|x| (1.0) keep each row's min and max."""
    x = _midpoint_rows(dtype, bits, 128, seed=bits).reshape(1, 3, 9, 128).to(device)
    _, sz_ref = reference.quantize_pack_ref(x.cpu(), 0.0, bits=bits)
    scales = 2.0 ** torch.tensor([-8.0, -1.0, 4.0])
    assert torch.equal(sz_ref[..., 0, 0].float(), scales.reshape(1, 3, 1).expand(1, 3, 9))
    _assert_bit_exact(x, 0.0, bits=bits)
    _assert_bit_exact(x, 1.0, bits=bits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_three_bit_at_code_boundaries(device, dtype):
    """`test_bit_exact_at_code_boundaries` for 3-bit codes: every value at which one of the seven codes changes and the
    one below it, for 32 rows of different scales and zeros; no clip, then a clip that cuts into every row."""
    x = _boundary_rows(dtype, 32, 64, seed=19, bits=3).reshape(1, 2, 16, 64).to(device)
    _assert_bit_exact(x, 0.0, bits=3)
    _assert_bit_exact(x, 0.9, bits=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_bit_known_answer(device, dtype):
    """Two D = 64 rows of exact values x = (c − 3)/2 for hand-picked codes c: min −1.5 and max 2 give scale 3.5/7 = 0.5
    and zero 1.5/0.5 = 3, and u = x/s + z = c exactly. Row 0 has c = d // 8 (0..7 in runs of 8), row 1 c = d % 8.
    Low bits, byte b of 16 holding dims b, b+16, b+32, b+48 in bits 0/2/4/6: row 0's c & 3 are 0,2,0,2 for b < 8
    (0b10_00_10_00 = 0x88), 1,3,1,3 after (0xDD); row 1's are b % 4 four times (0x00, 0x55, 0xAA, 0xFF). Plane, byte
    16 + j holding the third bits of dims j, j+8, …, j+56 in bits 0..7: row 0's codes there are 0..7 (bits 4..7 set:
    0xF0); row 1's are all j (0x00 for j < 4, 0xFF after). The reference takes the rows in float64 too."""
    d = torch.arange(64)
    c = torch.stack([d // 8, d % 8])
    x = (c.double() - 3) / 2
    want = torch.tensor([[0x88] * 8 + [0xDD] * 8 + [0xF0] * 8,
                         [0x00, 0x55, 0xAA, 0xFF] * 4 + [0x00] * 4 + [0xFF] * 4], dtype=torch.uint8)  # fmt: skip
    want_sz = torch.tensor([0.5, 3.0], dtype=torch.float16).expand(2, 1, 2)
    assert torch.equal(reference.unpack_codes(want, 3), c.to(torch.uint8))
    for ratio in (0.0, 1.0):
        for xs in (x, x.to(dtype)):
            codes_ref, sz_ref = reference.quantize_pack_ref(xs, ratio, bits=3)
            assert torch.equal(codes_ref, want) and torch.equal(sz_ref, want_sz)
        codes, sz = ops.quantize_pack(x.to(dtype).to(device), ratio, bits=3)
        assert torch.equal(codes.cpu(), want) and torch.equal(sz.cpu(), want_sz)


# ------------------------------------------------------------------ GPU only: one launch, capturable


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3])
def test_demotion_is_one_capturable_launch(bits):
    """The demotion step (per-head clip tensor on the device) records into a CUDA graph and replays bit-exactly."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    B, H, F, D = 32, 8, 8, 128
    tier = _rows(B, H, 24, D, torch.bfloat16, "cuda", seed=5)
    clip = torch.tensor([0.96, 0.92, 0.96, 0.9, 0.95, 0.92, 1.0, 0.8], device="cuda").reshape(H, 1)
    x = tier[:, :, :F]
    ops.quantize_pack(x, clip, bits=bits)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        codes, sz = ops.quantize_pack(x, clip, bits=bits)
    tier.copy_(_rows(B, H, 24, D, torch.bfloat16, "cuda", seed=6))
    g.replay()
    torch.cuda.synchronize()
    codes_ref, sz_ref = reference.quantize_pack_ref(x.cpu(), clip.cpu(), bits=bits)
    assert codes.shape == codes_ref.shape
    assert torch.equal(codes.cpu(), codes_ref) and torch.equal(sz.cpu().view(torch.int16), sz_ref.view(torch.int16))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.quantize_pack(x, clip, bits=bits)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [e.name for e in kernels]
