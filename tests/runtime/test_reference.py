"""Properties of the format reference (format/reference.py) against independent float64 / hand-made references."""

import itertools
import math

import pytest
import torch

from oscar_zoo.format import layout, reference as R


def test_hadamard_small_cases_and_orthogonality():
    s = 1 / math.sqrt(2)
    assert torch.allclose(R.hadamard(2), torch.tensor([[s, s], [s, -s]], dtype=torch.float64))
    H4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float64) / 2
    assert torch.equal(R.hadamard(4), H4)
    for d in (8, 64, 128):
        H = R.hadamard(d)
        assert torch.allclose(H @ H.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
        assert torch.all(H.abs() == 1 / math.sqrt(d))
    with pytest.raises(ValueError):
        R.hadamard(12)


def test_bit_reversal_known_cases():
    assert R.bit_reversal(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert R.bit_reversal(2).tolist() == [0, 1]
    br = R.bit_reversal(128)
    assert torch.equal(br[br], torch.arange(128))  # an involution
    assert int(f"{5:07b}"[::-1], 2) == br[5]
    assert R.eigen_permutation(8).tolist() == [7 - b for b in [0, 4, 2, 6, 1, 5, 3, 7]]


def test_composed_rotation_is_orthogonal_and_sorts_energy_by_bitreversal():
    torch.manual_seed(0)
    A = torch.randn(3, 64, 64, dtype=torch.float64)
    C = A @ A.transpose(-1, -2)
    M, evals = R.rotation_from_target(C)
    eye = torch.eye(64, dtype=torch.float64)
    assert (M.transpose(-1, -2) @ M - eye).abs().max() < 1e-12
    assert (M.float().transpose(-1, -2) @ M.float() - eye.float()).abs().max() < 1e-6
    assert torch.all(evals[:, 1:] >= evals[:, :-1])
    # H equalises the diagonal importance: diag(Mᵀ C M) = tr(C)/d for every coordinate.
    diag = torch.diagonal(M.transpose(-1, -2) @ C @ M, dim1=-2, dim2=-1)
    assert torch.allclose(diag, (torch.diagonal(C, dim1=-2, dim2=-1).sum(-1) / 64)[:, None].expand_as(diag))
    # Non-power-of-two head dims use a seeded orthogonal mixing.
    M80 = R.compose_rotation(torch.linalg.eigh(torch.eye(80, dtype=torch.float64))[1])
    assert (M80.T @ M80 - torch.eye(80, dtype=torch.float64)).abs().max() < 1e-10
    assert R.mixing_matrix(80)[1] == "random-orthogonal-seed0"


@pytest.mark.parametrize("D", [8, 64, 128])
def test_pack_unpack_round_trip_every_code(D):
    codes = torch.tensor(list(itertools.product(range(4), repeat=4)), dtype=torch.uint8)  # all 256 4-tuples
    codes = codes.repeat(1, D // 4)[:, :D]
    packed = R.pack_codes(codes)
    assert packed.shape == (256, D // 4) and packed.dtype == torch.uint8
    assert torch.equal(R.unpack_codes(packed), codes)
    # Quartered layout by hand: byte b holds dims b, b+D/4, b+D/2, b+3D/4 at bits 0/2/4/6.
    c = torch.randint(0, 4, (D,), dtype=torch.uint8)
    q = D // 4
    expected = [int(c[b]) | int(c[b + q]) << 2 | int(c[b + 2 * q]) << 4 | int(c[b + 3 * q]) << 6 for b in range(q)]
    assert R.pack_codes(c).tolist() == expected


@pytest.mark.parametrize("G", [0, 32])
def test_dequant_error_within_half_a_step(G):
    torch.manual_seed(1)
    x = torch.randn(500, 64) * torch.logspace(-2, 2, 500)[:, None]
    x[::7, 3] *= 40  # outliers
    codes, sz = R.quantize(x, G)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 3
    assert sz.dtype == torch.float16
    xh = R.dequantize(codes, sz)
    groups = 64 // (G or 64)
    scale = sz[..., 0].float().repeat_interleave(64 // groups, dim=-1)
    zero = sz[..., 1].float().repeat_interleave(64 // groups, dim=-1)
    # exact arithmetic gives ≤ scale/2; the float16-rounded zero adds at most |zero|·2^-11 steps
    bound = scale / 2 * (1 + 1e-5) + zero.abs() * scale * 2.0**-11
    assert torch.all((xh - x).abs() <= bound)


def test_quantize_matches_float64_formula():
    torch.manual_seed(2)
    x = torch.randn(64, 64) * 3
    codes, sz = R.quantize(x)
    xd = x.double()
    lo, hi = xd.min(-1, keepdim=True).values, xd.max(-1, keepdim=True).values
    scale = ((hi - lo) / 3).to(torch.float16).double()
    zero = (-lo / scale).to(torch.float16).double()
    q = torch.floor(xd / scale + zero + 0.5).clamp(0, 3)
    assert (q.to(torch.uint8) != codes).float().mean() < 1e-3  # fp32 vs fp64 rounding at exact .5 boundaries only


def test_constant_and_zero_rows_stay_finite():
    x = torch.stack([torch.full((64,), 5.0), torch.zeros(64), torch.full((64,), -1e-3)])
    codes, sz = R.quantize(x)
    xh = R.dequantize(codes, sz)
    assert torch.isfinite(sz.float()).all() and torch.isfinite(xh).all()
    assert torch.allclose(xh, x, rtol=2e-3, atol=1e-4)


def test_clip_threshold_is_the_kth_smallest_magnitude():
    torch.manual_seed(3)
    x = torch.randn(10, 128)
    clipped = R.clip_rows(x, 0.96)
    k = math.floor(0.96 * 128)  # 122: the 5 largest magnitudes are clamped
    for row, out in zip(x, clipped):
        tau = row.abs().sort().values[k]
        assert torch.equal(out, row.clamp(-tau, tau))
        assert int((out.abs() < row.abs()).sum()) == 127 - k
    assert torch.equal(R.clip_rows(x, 0.0), x)  # r ≤ 0 disables
    per_head = torch.tensor([[0.5], [0.0]])  # broadcast over [H=2, T=5]
    y = R.clip_rows(x.reshape(2, 5, 128), per_head)
    assert torch.equal(y[1], x.reshape(2, 5, 128)[1]) and not torch.equal(y[0], x.reshape(2, 5, 128)[0])


def test_fake_quant_tiers_keep_sink_and_recent_exact():
    torch.manual_seed(4)
    x = torch.randn(2, 3, 700, 64, dtype=torch.bfloat16)
    ratios = torch.tensor([0.9, 0.96, 1.0])
    y = R.fake_quant_tiers(x, ratios)
    assert torch.equal(y[..., :64, :], x[..., :64, :])
    assert torch.equal(y[..., 700 - 256 :, :], x[..., 700 - 256 :, :])
    middle = slice(64, 700 - 256)
    assert not torch.equal(y[..., middle, :], x[..., middle, :])
    for h in range(3):
        expected = R.fake_quant(x[:, h, middle].float(), float(ratios[h])).to(torch.bfloat16)
        assert torch.equal(y[:, h, middle], expected)
    short = torch.randn(1, 1, 300, 64)
    assert torch.equal(R.fake_quant_tiers(short, 0.96), short)  # shorter than sink + recent: nothing quantized


def _dense_attention_f64(q, k, v, n, sm_scale):
    """float64 loops over heads: softmax(q·kᵀ)·v for the first n keys; GQA group by integer division."""
    H_q, H_kv = q.shape[0], k.shape[0]
    out = torch.zeros(H_q, q.shape[-1], dtype=torch.float64)
    lse = torch.zeros(H_q, dtype=torch.float64)
    for h in range(H_q):
        kv = h // (H_q // H_kv)
        logits = (k[kv, :n].double() @ q[h].double()) * sm_scale
        lse[h] = torch.logsumexp(logits, 0)
        out[h] = torch.softmax(logits, 0) @ v[kv, :n].double()
    return out, lse


def test_tiered_decode_attention_matches_dense_float64_and_merge_is_split_invariant():
    torch.manual_seed(5)
    B, H_q, H_kv, D = 2, 6, 2, 64
    q = torch.randn(B, H_q, D)
    sink = torch.randn(B, H_kv, 64, D, dtype=torch.bfloat16), torch.randn(B, H_kv, 64, D, dtype=torch.bfloat16)
    hist = torch.randn(B, H_kv, 40, D), torch.randn(B, H_kv, 40, D)
    recent = torch.randn(B, H_kv, 264, D, dtype=torch.bfloat16), torch.randn(B, H_kv, 264, D, dtype=torch.bfloat16)
    lens = torch.tensor([64, 10]), torch.tensor([40, 0]), torch.tensor([256, 263])
    packed = [R.quantize_pack_ref(t, 0.96) for t in hist]
    o, lse = R.tiered_decode_attention_ref(q, *sink, lens[0], *packed[0], *packed[1], lens[1], *recent, lens[2], 0.125)
    for b in range(B):
        hk, hv = (R.dequantize_unpack(*p)[b] for p in packed)
        k = torch.cat([sink[0][b, :, : lens[0][b]].float(), hk[:, : lens[1][b]],
                       recent[0][b, :, : lens[2][b]].float()], 1)
        v = torch.cat([sink[1][b, :, : lens[0][b]].float(), hv[:, : lens[1][b]],
                       recent[1][b, :, : lens[2][b]].float()], 1)
        ref_o, ref_lse = _dense_attention_f64(q[b], k, v, k.shape[1], 0.125)
        assert torch.allclose(o[b].double(), ref_o, atol=1e-5)
        assert torch.allclose(lse[b].double(), ref_lse, atol=1e-5)
    # split the recent tier in 3 arbitrary chunks, shuffle them with the others: same result
    parts = [R.attention_partial_ref(q, *sink, lens[0], 0.125)]
    for lo, hi in ((0, 100), (100, 101), (101, 264)):
        n = (lens[2] - lo).clamp(0, hi - lo)
        parts.append(R.attention_partial_ref(q, recent[0][:, :, lo:hi], recent[1][:, :, lo:hi], n, 0.125))
    hk, hv = (R.dequantize_unpack(*p) for p in packed)
    parts.append(R.attention_partial_ref(q, hk, hv, lens[1], 0.125))
    order = [3, 0, 4, 2, 1]
    o2, lse2 = R.merge_partials_ref(torch.stack([parts[i][0] for i in order], -2),
                                    torch.stack([parts[i][1] for i in order], -1))
    assert torch.allclose(o2, o, atol=1e-5) and torch.allclose(lse2, lse, atol=1e-5)


def test_empty_partials_merge_to_zero():
    o, lse = R.merge_partials_ref(torch.randn(2, 3, 4), torch.full((2, 3), -math.inf))
    assert torch.equal(o, torch.zeros(2, 4)) and torch.all(torch.isinf(lse))


def test_windowed_attention_masks_exactly_the_tier_windows():
    T, sink, recent = 12, 2, 3
    full = R.full_precision_mask(T, sink, recent)
    for i in range(T):
        for j in range(i + 1):
            assert bool(full[i, j]) == (j < sink or j >= i - recent + 1)
    torch.manual_seed(6)
    q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    same = R.windowed_attention_ref(q, k, v, k, v, 0.3, sink, recent)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True, scale=0.3)
    assert torch.allclose(same, ref, atol=1e-5)


def test_bits_per_element_matches_the_paper():
    assert layout.bits_per_element(131072, 128) == pytest.approx(2.2836, abs=1e-4)
    assert layout.bits_per_element(32768, 128) == pytest.approx(2.3843, abs=1e-4)
    assert layout.bits_per_element(100, 128) == 16.0
    assert layout.bytes_per_token(128, 128) == 36  # 32 code bytes + fp16 scale + fp16 zero (72 B for K and V)


# ------------------------------------------------------------------------------------- 3-bit keys (docs/format.md §6b)


@pytest.mark.parametrize("D", [8, 64, 128])
def test_three_bit_packing_by_hand(D):
    """Low two bits quartered as INT2, then the third bit of dims j, j+D/8, …, j+7D/8 in bits 0..7 of byte D/4 + j."""
    torch.manual_seed(3)
    c = torch.randint(0, 8, (5, D), dtype=torch.uint8)
    packed = R.pack_codes(c, 3)
    assert packed.shape == (5, layout.packed_dim(D, 3)) == (5, 3 * D // 8)
    q, e = D // 4, D // 8
    for r in range(5):
        row = [int(v) for v in c[r]]
        low = [(row[b] & 3) | (row[b + q] & 3) << 2 | (row[b + 2 * q] & 3) << 4 | (row[b + 3 * q] & 3) << 6
               for b in range(q)]
        plane = [sum(((row[j + m * e] >> 2) & 1) << m for m in range(8)) for j in range(e)]
        assert packed[r].tolist() == low + plane
    assert torch.equal(R.unpack_codes(packed, 3), c)
    # the low bytes are exactly the INT2 packing of the low bits: a 2-bit reader of the first D/4 bytes sees c & 3
    assert torch.equal(packed[:, :q], R.pack_codes(c & 3))


@pytest.mark.parametrize("D", [8, 64, 128])
def test_three_bit_history_pairs_by_hand(D):
    """The history stores 3-bit rows in pairs (docs/format.md §6b): rows 2p and 2p + 1 as their low-bit bytes (D/4
    each) then their planes (D/8 each), listed here by hand; 2-bit rows as they are. Writing rows one run at a time, at
    any parity (a prompt's history, then demotions of 8 from an odd row), gives the same bytes, and never touches the
    other row of a pair (a row written over garbage reads back exact)."""
    torch.manual_seed(D)
    T, q, e = 10, D // 4, D // 8
    rows = R.pack_codes(torch.randint(0, 8, (1, 2, T, D), dtype=torch.uint8), 3)
    stored = R.store_pairs(rows, 3)
    for p in range(T // 2):
        a, b = rows[0, 1, 2 * p].tolist(), rows[0, 1, 2 * p + 1].tolist()
        assert stored[0, 1, 2 * p : 2 * p + 2].flatten().tolist() == a[:q] + b[:q] + a[q:] + b[q:]
    assert torch.equal(R.load_pairs(stored, 3), rows)
    two = R.pack_codes(torch.randint(0, 4, (1, 2, T, D), dtype=torch.uint8))
    assert torch.equal(R.store_pairs(two, 2), two) and torch.equal(R.load_pairs(two, 2), two)
    hist = torch.full((1, 2, T + 2, 3 * e), 0xA5, dtype=torch.uint8)  # garbage past the rows
    for lo, hi in ((0, 3), (3, 4), (4, 9), (9, 10)):
        R.write_history_rows(hist, torch.arange(lo, hi), rows[:, :, lo:hi], 3)
        assert torch.equal(R.read_history_rows(hist, hi, 3), rows[:, :, :hi])
    assert torch.equal(hist[:, :, :T], stored) and (hist[:, :, T:] == 0xA5).all()
    with pytest.raises(ValueError, match="pairs"):
        R.store_pairs(rows[:, :, :3], 3)


def test_three_bit_quantize_known_answer_float64():
    """Levels 0..7 with scale = range/7: a row spanning [−1, 6] in unit steps is coded exactly (scale 1, zero 1), and
    every code of random rows equals the float64 formula with the float16-rounded scale and zero."""
    x = torch.tensor([[-1.0, 0, 1, 2, 3, 4, 5, 6]])
    codes, sz = R.quantize(x, 0, bits=3)
    assert codes.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert sz.float().tolist() == [[[1.0, 1.0]]]
    assert torch.equal(R.dequantize(codes, sz), x)
    torch.manual_seed(4)
    x = torch.randn(256, 64) * 2
    codes, sz = R.quantize(x, 0, bits=3)
    xd = x.double()
    lo, hi = xd.min(-1, keepdim=True).values, xd.max(-1, keepdim=True).values
    scale = ((hi - lo) / 7).to(torch.float16).double()
    zero = (-lo / scale).to(torch.float16).double()
    q = torch.floor(xd / scale + zero + 0.5).clamp(0, 7)
    assert int(codes.max()) == 7 and (q.to(torch.uint8) != codes).float().mean() < 1e-3
    # the third bit buys precision: the error bound is half a step of range/7 (vs range/3 for INT2)
    err3 = (R.fake_quant(x, 0.0, bits=3) - x).abs().amax(-1)
    err2 = (R.fake_quant(x, 0.0) - x).abs().amax(-1)
    bound = (hi - lo).squeeze(-1).float() / 14 * (1 + 2e-3) + 1e-6
    assert torch.all(err3 <= bound) and err3.mean() < 0.5 * err2.mean()


def test_two_bit_budget_is_todays_codec_bit_for_bit():
    """bits=2 everywhere (the default) is the INT2 codec: same codes, scales and bytes as the plain calls."""
    torch.manual_seed(5)
    x = torch.randn(3, 40, 64, dtype=torch.bfloat16)
    for clip in (0.9, 1.0, 0.0):
        a = R.quantize_pack_ref(x, clip, 0, bits=2)
        b = R.quantize_pack_ref(x, clip)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[0].shape[-1] == 16
    with pytest.raises(ValueError, match="2 or 3"):
        R.quantize(x, 0, bits=4)


def test_tiered_decode_reads_three_bit_keys():
    """The tiered reference with 3-bit keys equals dense float64 attention over the dequantized 3-bit history."""
    torch.manual_seed(6)
    B, Hq, Hkv, D, T = 1, 4, 2, 64, 50
    q = torch.randn(B, Hq, D)
    k, v = torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    ck, szk = R.quantize_pack_ref(k, 0.0, bits=3)
    cv, szv = R.quantize_pack_ref(v, 0.0)
    empty = torch.zeros(B, Hkv, 0, D)
    zero, n = torch.zeros(B, dtype=torch.int32), torch.full((B,), T, dtype=torch.int32)
    o, _ = R.tiered_decode_attention_ref(q, empty, empty, zero, ck, szk, cv, szv, n, empty, empty, zero, 0.125,
                                         key_bits=3)
    kd = R.dequantize(R.unpack_codes(ck, 3), szk).double().repeat_interleave(2, 1)
    vd = R.dequantize(R.unpack_codes(cv), szv).double().repeat_interleave(2, 1)
    p = torch.softmax(torch.einsum("bhd,bhtd->bht", q.double(), kd) * 0.125, -1)
    assert torch.allclose(o.double(), torch.einsum("bht,bhtd->bhd", p, vd), atol=1e-5)
    # and the 3-bit history is closer to the exact keys than INT2 would be
    assert (kd[:, ::2] - k.double()).abs().mean() < 0.5 * (R.fake_quant(k, 0.0) - k).abs().mean()


def test_bits_per_element_with_three_bit_keys():
    """Keys at a mean of 2.7 bits add 0.7/2 bits per element in the history, windows unchanged."""
    base = layout.bits_per_element(32768, 64)
    hist = (32768 - 320) / 32768
    mean_2_7 = [3] * 7 + [2] * 3  # per-layer key bits whose mean is 2.7
    assert layout.kv_bits_per_element(32768, 64, key_bits=mean_2_7) == pytest.approx(base + 0.35 * hist, abs=1e-12)
    assert layout.kv_bits_per_element(32768, 64) == base
    assert layout.bytes_per_token(128, 128, bits=3) == 48 + 4
