"""The fused quantize/pack kernel (`ops.quantize_pack`) against `reference.quantize_pack_ref`: bit for bit without a
rotation (the demotion path), within a documented tolerance with one (rotation summation order differs)."""

import pytest
import torch

from oscar_zoo.runtime import ops, reference


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


def _assert_bit_exact(x, ratio, group_size=0):
    codes, sz = ops.quantize_pack(x, ratio, group_size)
    codes_ref, sz_ref = reference.quantize_pack_ref(x.cpu(), ratio if not torch.is_tensor(ratio) else ratio.cpu(), group_size)
    assert codes.dtype == torch.uint8 and sz.dtype == torch.float16
    assert codes.shape == codes_ref.shape and sz.shape == sz_ref.shape
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


def test_rotation_within_tolerance(device):
    """With a rotation the kernel's x·M (fp32 dot, then rounded to x's dtype) can differ from torch's matmul in the
    last bit, which moves a code only at a rounding boundary. Tolerance: ≤ 1 % of codes differ, by one level; scale and
    zero agree to float16 rounding (observed: 0 codes differ on CPU)."""
    H, D = 2, 64
    x = _rows(1, H, 33, D, torch.bfloat16, device, seed=5)
    Q, _ = torch.linalg.qr(torch.randn(H, D, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    M = Q.float().to(device)
    codes, sz = ops.quantize_pack(x, 0.96, rotation=M)
    codes_ref, sz_ref = reference.quantize_pack_ref(x.cpu(), 0.96, rotation=M.cpu())
    q, q_ref = reference.unpack_codes(codes.cpu()).int(), reference.unpack_codes(codes_ref).int()
    assert (q - q_ref).abs().max() <= 1
    assert (q != q_ref).float().mean() <= 0.01
    torch.testing.assert_close(sz.cpu().float(), sz_ref.float(), rtol=2e-2, atol=1e-3)


def test_bad_inputs_raise():
    x = torch.randn(1, 2, 4, 64)
    with pytest.raises(ValueError, match="group_size"):
        ops.quantize_pack(x, 0.96, group_size=48)
    with pytest.raises(ValueError, match="rotation"):
        ops.quantize_pack(x, 0.96, rotation=torch.eye(32))


# ------------------------------------------------------------------ one row per thread, tiles of 128 flattened rows


@pytest.mark.parametrize("D, group_size", [(128, 0), (128, 32), (64, 0), (64, 16)])
@pytest.mark.parametrize("ratio", [0.96, 0.92, "per-head"])
@pytest.mark.parametrize("H, T", [(1, 1), (1, 127), (1, 128), (1, 129), (3, 43)])  # tile (128 rows) ± 1; tiles across heads
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
    assert ops._max_m_build(D, bound) == (8 if m_max <= 8 else 16 if m_max <= 16 else 0)  # the build it was meant to run


@pytest.mark.parametrize("D", [64, 128])
def test_rotation_per_head_clip_within_tolerance(device, D):
    """Rotation given (per-head [H, D, D], per-head clips): same tolerance as test_rotation_within_tolerance."""
    H = 2
    x = _rows(1, H, 37, D, torch.bfloat16, device, seed=D)
    Q, _ = torch.linalg.qr(torch.randn(H, D, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    M, clip = Q.float().to(device), torch.tensor([[0.96], [0.92]], device=device)
    codes, sz = ops.quantize_pack(x, clip, rotation=M)
    codes_ref, sz_ref = reference.quantize_pack_ref(x.cpu(), clip.cpu(), rotation=M.cpu())
    q, q_ref = reference.unpack_codes(codes.cpu()).int(), reference.unpack_codes(codes_ref).int()
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


def _codes_in_row(ends: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.quantize`'s codes of values v [N] (within ends) in a row whose min and max are ends = (a, b), and
    that row's float32 scale and zero: each value sits in a row [a, b, v, v], which has the same min and max."""
    rows = torch.stack([ends[0].expand(v.shape), ends[1].expand(v.shape), v, v], dim=1)
    codes, sz = reference.quantize(rows, 0)
    return codes[:, 2].float(), sz[0, 0, 0].float(), sz[0, 0, 1].float()


def _boundary_rows(dtype, n_rows, D, seed):
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
            c_lo, c_hi = _codes_in_row(ends, ends)[0].tolist()
            for i in (1, 2, 3):
                if not (c_lo < i <= c_hi):
                    continue
                lo_k, hi_k = _ordered_key(ends[0]), _ordered_key(ends[1])
                while hi_k - lo_k > 1:
                    mid = (lo_k + hi_k) // 2
                    below = _codes_in_row(ends, _from_key(mid).reshape(1))[0].item() < i
                    lo_k, hi_k = (mid, hi_k) if below else (lo_k, mid)
                keys += [lo_k, hi_k]
            found = torch.tensor([_from_key(k).item() for k in keys]) if keys else torch.empty(0)
        else:
            every = _every_value(dtype)
            every = every[(every >= ends[0]) & (every <= ends[1])]
            c = _codes_in_row(ends, every)[0]
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
    torch.bfloat16: [(-0.73828125, -0.000171661376953125), (-336.0, 0.0021209716796875), (-42.0, -0.0004825592041015625),
                     (-90.0, 0.000583648681640625), (-180.0, -0.0001583099365234375), (-756.0, 0.00098419189453125)],
    torch.float16: [(-5.6484375, -0.0007410049438476562), (-22.59375, 0.003429412841796875), (-315.75, 0.0106048583984375),
                    (-17.765625, 0.00457000732421875), (-83.625, 0.005428314208984375), (-93.75, 0.01030731201171875)],
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


def test_round_thresholds_equal_floor_of_u_plus_half():
    """code = #{i : u ≥ C_i} equals clamp(⌊float32(u + ½)⌋, 0, 3) for every float32 u near the thresholds."""
    from oscar_zoo.runtime.kernels.quantize_pack import ROUND_THRESHOLDS

    c = torch.tensor(ROUND_THRESHOLDS, dtype=torch.float32)
    near = torch.cat([c, torch.tensor([0.0, 1.0, 2.0, 3.0, -0.5, 3.5])])
    bits = near.view(torch.int32)[:, None] + torch.arange(-4096, 4097, dtype=torch.int32)[None, :]
    u = torch.cat([bits.flatten().view(torch.float32), torch.linspace(-10, 10, 100_001)])
    u = u[torch.isfinite(u)]  # (the bit patterns below +0.0 are NaNs)
    want = torch.floor(u + 0.5).clamp(0, 3)
    got = (u[:, None] >= c[None, :]).sum(1).float()
    assert torch.equal(got, want)


# ------------------------------------------------------------------ GPU only: one launch, capturable


@pytest.mark.gpu
def test_demotion_is_one_capturable_launch():
    """The demotion step (per-head clip tensor on the device) records into a CUDA graph and replays bit-exactly."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    B, H, F, D = 32, 8, 8, 128
    tier = _rows(B, H, 24, D, torch.bfloat16, "cuda", seed=5)
    clip = torch.tensor([0.96, 0.92, 0.96, 0.9, 0.95, 0.92, 1.0, 0.8], device="cuda").reshape(H, 1)
    x = tier[:, :, :F]
    ops.quantize_pack(x, clip)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        codes, sz = ops.quantize_pack(x, clip)
    tier.copy_(_rows(B, H, 24, D, torch.bfloat16, "cuda", seed=6))
    g.replay()
    torch.cuda.synchronize()
    codes_ref, sz_ref = reference.quantize_pack_ref(x.cpu(), clip.cpu())
    assert torch.equal(codes.cpu(), codes_ref) and torch.equal(sz.cpu().view(torch.int16), sz_ref.view(torch.int16))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.quantize_pack(x, clip)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [e.name for e in kernels]
