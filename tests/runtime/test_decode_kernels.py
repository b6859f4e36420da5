"""INT2 and BF16 split-K decode kernels (`ops.tiered_decode_attention`, `ops.decode_int2_partial`,
`ops.decode_bf16_partial`) against `reference.tiered_decode_attention_ref` on the same dequantized cache.

Tolerance rule (docs/format.md §9): the kernel's max error vs a float64 computation of the same attention is at most 2×
that of a plain bf16 PyTorch run of the same math (plus 1e-5 absolute, for cases where bf16 happens to be exact, e.g. a
single token). Every case also checks that the rule is tight enough to matter: dropping the one token at a tile or split
boundary moves the float64 answer by more than the tolerance."""

import dataclasses
import math

import pytest
import torch

from oscar_zoo.format import layout, reference
from oscar_zoo.runtime import config, ops

SINK_CAP, RECENT_CAP = layout.SINK, layout.RECENT + layout.FLUSH


def _tier_lengths(L: int) -> tuple[int, int, int]:
    """Sink / history / recent lengths of a context of L tokens, as the cache lays them out (8-token flushes)."""
    sink = min(L, layout.SINK)
    rest = L - sink
    hist = max(0, rest - layout.RECENT) // layout.FLUSH * layout.FLUSH
    return sink, hist, rest - hist


def _cache(contexts, H_kv, D, device, seed, hist_cap=None, group_size=0, lengths=None, key_ramp=None,
           v_token_major=True, key_bits=2):
    """A random three-tier cache for per-batch contexts (or explicit per-batch (sink, history, recent) `lengths`);
    memory past each length holds garbage (NaN for the kernel, finite for the reference, whose masked einsum would
    turn 0·NaN into NaN). `key_ramp` = (first, last) scales the history keys linearly over the token axis.
    V's codes are token-major as the cache stores them (`layout.history_codes`) unless `v_token_major` is False.
    `key_bits` = 3: the history keys are 3-bit codes ([..., 3D/8] bytes, `reference.pack_codes`), stored in pairs as
    the cache stores them (`reference.store_pairs`; T_cap even)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths or [_tier_lengths(L) for L in contexts], dtype=torch.int32)  # [B, 3]
    B = lens.shape[0]
    T_cap = hist_cap or max(8, int(lens[:, 1].max()) + 5)
    T_cap += T_cap % 2
    scale = torch.rand(B, H_kv, 1, 1, generator=g) + 0.5

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    sink_k, sink_v = (rand(B, H_kv, SINK_CAP, D) * scale).bfloat16(), rand(B, H_kv, SINK_CAP, D).bfloat16()
    rec_k, rec_v = (rand(B, H_kv, RECENT_CAP, D) * scale).bfloat16(), rand(B, H_kv, RECENT_CAP, D).bfloat16()
    hist_k = rand(B, H_kv, T_cap, D) * scale
    if key_ramp is not None:
        hist_k = hist_k * torch.linspace(*key_ramp, T_cap)[:, None]
    ck, szk = reference.quantize_pack_ref(hist_k, 0.96, group_size, bits=key_bits)
    ck = reference.store_pairs(ck, key_bits)
    cv, szv = reference.quantize_pack_ref(rand(B, H_kv, T_cap, D), 0.92, group_size)
    if v_token_major:
        cv = layout.history_codes(B, H_kv, T_cap, D, "cpu", tokens_contiguous=True).copy_(cv)
    clean = dict(sink_k=sink_k, sink_v=sink_v, sink_len=lens[:, 0], codes_k=ck, scale_zero_k=szk, codes_v=cv,
                 scale_zero_v=szv, hist_len=lens[:, 1], recent_k=rec_k, recent_v=rec_v,
                 recent_len=lens[:, 2])  # fmt: skip
    dirty = {k: v.clone() for k, v in clean.items()}
    for b in range(B):
        s, h, r = (int(x) for x in lens[b])
        dirty["sink_k"][b, :, s:] = float("nan")
        dirty["sink_v"][b, :, s:] = float("nan")
        dirty["recent_k"][b, :, r:] = float("nan")
        dirty["recent_v"][b, :, r:] = float("nan")
        dirty["scale_zero_k"][b, :, h:] = float("nan")
        dirty["scale_zero_v"][b, :, h:] = float("nan")
    return clean, {k: v.to(device) for k, v in dirty.items()}


def _attention(q, c, sm_scale, dtype, tiers=("sink", "hist", "recent"), drop=None, softcap=None, bias=None,
               key_block=0, capped=("sink", "hist", "recent")):
    """Attention over the union of `tiers` in `dtype`: float64 (the reference) or bfloat16 (a plain bf16 PyTorch run,
    the history dequantized then rounded, every operation in bf16). `drop` = (tier, index) removes that token from
    every sequence that has it. `softcap`: every logit of the tiers in `capped` becomes
    softcap·tanh((x + bias)/softcap), bias [B, H_q]. `key_block` > 0: the history keys are coded per channel over
    blocks of that many tokens. Returns float64 o [B, H_q, D] and lse [B, H_q] (−inf and 0 where empty)."""
    H_q = q.shape[1]
    ks, vs, valid, caps = [], [], [], []
    for t in tiers:
        if t == "hist":
            dq = reference.dequantize_unpack_channel if key_block else reference.dequantize_unpack
            k = dq(_key_rows(c), c["scale_zero_k"], _key_bits(c))
            v = reference.dequantize_unpack(c["codes_v"], c["scale_zero_v"])
        else:
            k, v = c[f"{t}_k"].float(), c[f"{t}_v"].float()
        ok = torch.arange(k.shape[2])[None, :] < c[f"{t}_len"].long()[:, None]
        if drop is not None and drop[0] == t:
            ok[:, drop[1]] = False
        ks.append(k), vs.append(v), valid.append(ok), caps.append(torch.full((k.shape[2],), t in capped))
    k, v, ok, cap = torch.cat(ks, 2).to(dtype), torch.cat(vs, 2).to(dtype), torch.cat(valid, 1), torch.cat(caps)
    kx, vx = k.repeat_interleave(H_q // k.shape[1], 1), v.repeat_interleave(H_q // k.shape[1], 1)
    logits = torch.einsum("bhd,bhtd->bht", q.cpu().to(dtype), kx) * sm_scale
    if softcap is not None:
        logits = torch.where(cap, torch.tanh((logits + bias.to(dtype)[..., None]) / softcap) * softcap, logits)
    logits = logits.masked_fill(~ok[:, None, :], -math.inf)
    lse = torch.logsumexp(logits, -1)
    p = torch.softmax(logits, -1).nan_to_num(0.0)
    return torch.einsum("bht,bhtd->bhd", p, vx).double(), lse.double()


def _key_bits(c) -> int:
    """The bits of a cache's history keys, from their packed width (D/4 bytes: 2, 3D/8: 3)."""
    D = c["sink_k"].shape[-1]
    return 3 if c["codes_k"].shape[-1] == layout.packed_dim(D, 3) else 2


def _key_rows(c):
    """A cache's history keys as `reference.pack_codes` rows (3-bit keys are stored in pairs)."""
    return reference.load_pairs(c["codes_k"], _key_bits(c))


def _check_rule(o, lse, q, clean, sm_scale, tiers=("sink", "hist", "recent"), boundary=None):
    """The 2×-bf16 rule against float64, and (given `boundary` = (tier, index)) that dropping that token breaks it."""
    o_ref, lse_ref = _attention(q, clean, sm_scale, torch.float64, tiers)
    o_bf, lse_bf = _attention(q, clean, sm_scale, torch.bfloat16, tiers)
    o, lse = o.cpu().double(), lse.cpu().double()
    assert torch.isfinite(o).all()
    empty = torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(lse), empty)
    fin = ~empty
    tol = 2 * (o_bf - o_ref).abs().max() + 1e-5
    err = (o - o_ref).abs().max()
    assert err <= tol, f"o error {err:.3g} vs tolerance {tol:.3g}"
    ltol = 2 * (lse_bf - lse_ref)[fin].abs().max() + 1e-5
    lerr = (lse - lse_ref)[fin].abs().max()
    assert lerr <= ltol, f"lse error {lerr:.3g} vs tolerance {ltol:.3g}"
    assert (o[empty] == 0).all()
    if boundary is not None:  # the tolerance is tight enough to see one token dropped at a tile/split boundary
        o_drop, _ = _attention(q, clean, sm_scale, torch.float64, tiers, drop=boundary)
        assert (o_drop - o_ref).abs().max() > tol, f"dropping {boundary} hides under the tolerance {tol:.3g}"


def _check_against_reference(q, clean, dirty, sm_scale, boundary=None):
    o, lse = ops.tiered_decode_attention(q, **{k: v for k, v in dirty.items()}, sm_scale=sm_scale)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32 and o.shape == q.shape
    _check_rule(o, lse, q, clean, sm_scale, boundary=boundary)


def _query(B, H_q, D, device, seed):
    return torch.randn(B, H_q, D, generator=torch.Generator().manual_seed(seed)).bfloat16().to(device)


@pytest.mark.parametrize("per_head", [True, False])
def test_merge_epilogue_adds_the_value_mean_and_rounds_once(device, per_head):
    """The decode step's epilogue in the merge: μ_V·M_V of each query head's row (per query head, or one shared) is
    added in float32 and the output rounded once to bf16: exactly the float32 output plus the mean, rounded to
    nearest even, and within the 2×-bf16 rule (plus half an ulp) of float64."""
    H_kv, group, D = 2, 3, 64
    clean, dirty = _cache([700, 400], H_kv, D, device, seed=5)
    q = _query(2, H_kv * group, D, device, 5)
    mean = torch.randn(H_kv * group if per_head else 1, D, generator=torch.Generator().manual_seed(6))
    o32, _ = ops.tiered_decode_attention(q, **dirty, sm_scale=0.125)
    o16, lse = ops.tiered_decode_attention(q, **dirty, sm_scale=0.125, v_mean=mean.to(device), out_dtype=torch.bfloat16)
    assert o16.dtype == torch.bfloat16 and o16.shape == q.shape
    assert torch.equal(o16.cpu(), (o32.cpu() + mean).bfloat16())
    o_ref, _ = _attention(q, clean, 0.125, torch.float64)
    o_bf, _ = _attention(q, clean, 0.125, torch.bfloat16)
    want = o_ref + mean.double()
    tol = 2 * (o_bf - o_ref).abs().max() + 1e-5 + 2.0**-9 * want.abs()
    assert ((o16.cpu().double() - want).abs() <= tol).all()


@pytest.mark.parametrize("L", [1, 63, 64, 320, 321, 327, 328, 700])
def test_tier_boundaries(device, L):
    H_kv, group, D = 2, 3, 64
    clean, dirty = _cache([L], H_kv, D, device, seed=L)
    _check_against_reference(_query(1, H_kv * group, D, device, L), clean, dirty, D**-0.5)


# history lengths around the interpreter's 16-token tiles and the split boundaries (8 splits), one history token, an
# empty recent tier; the token dropped in the sensitivity check sits on the first tile boundary
@pytest.mark.parametrize("hist", [1, 15, 16, 17, 31, 32, 33, 129])
def test_history_tile_boundaries(device, hist):
    H_kv, group, D = 2, 4, 64
    clean, dirty = _cache(None, H_kv, D, device, seed=hist, lengths=[(64, hist, 0), (3, hist // 2 + 1, 7)])
    q = _query(2, H_kv * group, D, device, hist)
    _check_against_reference(q, clean, dirty, D**-0.5, boundary=("hist", min(hist - 1, 16)))


@pytest.mark.parametrize("D, group_size", [(64, 0), (128, 0), (64, 16)])
def test_value_codes_in_either_layout(device, D, group_size):
    """The cache stores V's codes token-major; dims-major codes (a caller's own contiguous tensor) take the same
    kernel with other strides. Both give the reference's answer, and the layouts really differ."""
    token, _ = _cache(None, 2, D, device, seed=D, lengths=[(64, 45, 3)], group_size=group_size)
    dims, dirty = _cache(None, 2, D, device, seed=D, lengths=[(64, 45, 3)], group_size=group_size, v_token_major=False)
    assert token["codes_v"].stride(2) == 1 and dims["codes_v"].stride(3) == 1
    assert torch.equal(token["codes_v"], dims["codes_v"])
    _check_against_reference(_query(1, 8, D, device, D), dims, dirty, D**-0.5, boundary=("hist", 16))


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 5, 8, 32])
def test_gqa_groups(device, group, D):
    """GQA groups from multi-head to 32 query heads per KV head (3 KV heads): the group is the score dot's column side,
    padded to a power of two (3 → 4, 5 → 8), and 32 runs two warps per program on a GPU (`ops._warps`). A padded
    column that leaked into an output row would fail the reference check on the GPU, where programs run in any order
    (under the in-order interpreter the next head's program could overwrite it)."""
    H_kv = 3
    clean, dirty = _cache([500], H_kv, D, device, seed=group)
    # one dropped token moves the D = 128 answer by less than its (coarser) bf16-derived tolerance: the boundary
    # check runs at D = 64, the accuracy rule at both
    _check_against_reference(_query(1, H_kv * group, D, device, group), clean, dirty, D**-0.5,
                             boundary=("hist", 16) if D == 64 else None)  # fmt: skip


@pytest.mark.parametrize("D, slack, group_size",
                         [(64, 8.0, 0), (128, 8.0, 0), (64, 8.0, 32), (64, 0.0, 0), (128, 0.0, 0)])
def test_growing_scores_rescale(device, monkeypatch, D, slack, group_size):
    """The online softmax's rescale under a maximum that keeps growing, with `DecodeConfig.rescale_slack` = 8 (a stale
    running maximum in the INT2 loop until a head's grows by more than 8 in log2 units; the default) and 0 (rescale
    whenever it grows): history keys whose scale ramps from 0.1 to 4 over the tokens make the maximum grow in small
    steps over many tiles (kept stale with slack) and in steps above the slack (rescaled), and make the history's last
    tokens dominate the softmax; a running sum (l, Σp·s, Σp·s·z, an accumulator) left unrescaled, or a maximum never
    stored, breaks the rule by far (checked by editing each out). No dropped-token check: logits this large make the
    bf16 run, and so the tolerance, coarse."""
    H_kv, group = 2, 4
    clean, dirty = _cache([1100, 700], H_kv, D, device, seed=D, group_size=group_size, key_ramp=(0.1, 4.0))
    q = _query(2, H_kv * group, D, device, D)
    with config.use(config.current().with_decode(rescale_slack=slack)):
        _check_against_reference(q, clean, dirty, D**-0.5)


def test_head_dim_128_ragged_batch(device):
    """Ragged batch: one sequence with an empty history, one with only a sink, one long; D = 128."""
    H_kv, group, D = 2, 4, 128
    clean, dirty = _cache([330, 40, 600], H_kv, D, device, seed=128)
    _check_against_reference(_query(3, H_kv * group, D, device, 3), clean, dirty, D**-0.5)


@pytest.mark.parametrize("key_block", [0, 64], ids=["keys-per-row", "keys-per-channel"])
def test_ragged_batch_takes_waves_of_splits(device, key_block, monkeypatch):
    """A padded batch's step (`ragged=True`: the rows' lengths differ) splits the history into up to
    `RuntimeConfig.ragged_waves` times the splits of a uniform batch, capped by the tiles (one program per SM, so that
    the cap lies above the uniform count on a GPU too: under the interpreter 1 → 10 splits, on a 132-SM GPU 22 → 32
    with keys per row), and still answers within the rule of float64: histories of 1,024, 0 and 576 tokens (a row
    with none, one past several splits) in one launch."""
    H_kv, group, D = 2, 4, 128
    lengths = [(64, 1024, 9), (5, 0, 0), (64, 576, 17)]
    splits = []
    real = ops.launch_decode
    monkeypatch.setattr(ops, "launch_decode", lambda *a, **k: splits.append(k["s_hist"]) or real(*a, **k))
    if key_block:
        clean, dirty = _channel_cache(lengths, H_kv, D, device, 21, key_block)
        q = _channel_query(3, H_kv * group, D, device, 21)
    else:
        clean, dirty = _cache(None, H_kv, D, device, seed=21, lengths=lengths, hist_cap=4096)
        q = _query(3, H_kv * group, D, device, 21)
    T_cap = dirty["codes_k"].shape[2]
    with config.use(config.current().with_decode(programs_per_sm=1)):
        for ragged in (False, True):
            o, lse = ops.tiered_decode_attention(q, **dirty, sm_scale=D**-0.5, key_block=key_block, ragged=ragged)
            if key_block:
                _check_channel(o, lse, q, clean, D**-0.5, key_block, device)
            else:
                _check_rule(o, lse, q, clean, D**-0.5)
        waves = config.current().ragged_waves
        uniform = ops.int2_splits(3, H_kv, group, D, T_cap, q.device)
        assert splits == [uniform, ops.int2_splits(3, H_kv, group, D, T_cap, q.device, waves=waves)]
    # (keys per channel: the cache holds one block more than its longest history, whose tiles cap a GPU's count)
    assert waves > 1 and (splits[1] > splits[0] or (key_block and device.type != "cpu"))


def test_group_size_below_head_dim(device):
    H_kv, group, D = 2, 2, 64
    clean, dirty = _cache([400, 350], H_kv, D, device, seed=32, group_size=32)
    _check_against_reference(_query(2, H_kv * group, D, device, 4), clean, dirty, D**-0.5)


@pytest.mark.parametrize("width, offset", [(3, 0), (4, 1)], ids=["odd-strides", "misaligned"])
def test_scale_zero_odd_views(device, width, offset):
    """The kernel reads each (scale, zero) float16 pair as one 32-bit word, so `ops` copies views it cannot read that
    way: pairs `width` float16 apart (odd: the halved token stride would be wrong) or starting `offset` float16 into
    the buffer (2 bytes off: a misaligned 32-bit load, which faults on a GPU; the CPU interpreter reads it anyway)."""
    H_kv, group, D = 2, 2, 64
    clean, dirty = _cache([400, 350], H_kv, D, device, seed=33)
    for name in ("scale_zero_k", "scale_zero_v"):
        sz = dirty[name]
        padded = torch.full((*sz.shape[:-1], width), float("nan"), dtype=sz.dtype, device=sz.device)
        padded[..., offset : offset + 2] = sz
        dirty[name] = padded[..., offset : offset + 2]
        assert dirty[name].stride(-2) == width and dirty[name].data_ptr() % 4 == 2 * offset
    _check_against_reference(_query(2, H_kv * group, D, device, 5), clean, dirty, D**-0.5, boundary=("hist", 16))


def test_all_empty_rows_give_zero(device):
    clean, dirty = _cache([0, 5], 1, 64, device, seed=0)
    o, lse = ops.tiered_decode_attention(_query(2, 2, 64, device, 0), **dirty, sm_scale=0.125)
    assert torch.equal(o[0].cpu(), torch.zeros(2, 64)) and torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    assert torch.isfinite(lse[1]).all()


def test_int2_empty_splits(device):
    """More splits than populated blocks: the empty ones write o = 0, lse = −inf; the merge still equals the
    reference."""
    H_kv, group, D = 2, 3, 64
    clean, dirty = _cache([64 + 256 + 24, 64 + 256 + 8], H_kv, D, device, seed=9)
    q = _query(2, H_kv * group, D, device, 9)
    args = [dirty[k] for k in ("codes_k", "scale_zero_k", "codes_v", "scale_zero_v", "hist_len")]
    o, lse = ops.decode_int2_partial(q, *args, sm_scale=D**-0.5, num_splits=8)
    assert o.shape == (2, H_kv * group, 8, D) and lse.shape == (2, H_kv * group, 8)
    o, lse = o.cpu(), lse.cpu()
    empty = torch.isinf(lse)
    assert empty[:, :, -1].all() and (~empty[:, :, 0]).all()  # tail splits are empty, the first is not
    assert (o[empty] == 0).all() and torch.isfinite(o).all()
    _check_rule(*reference.merge_partials_ref(o, lse), q, clean, D**-0.5, tiers=("hist",), boundary=("hist", 15))


def test_bf16_partial_matches_reference(device):
    H_kv, group, D = 2, 4, 64
    clean, dirty = _cache([200, 64 + 256 + 5], H_kv, D, device, seed=2)
    q = _query(2, H_kv * group, D, device, 2)
    names = ("sink_k", "sink_v", "sink_len", "recent_k", "recent_v", "recent_len")
    o, lse = ops.decode_bf16_partial(q, *[dirty[k] for k in names], sm_scale=D**-0.5)
    _check_rule(*reference.merge_partials_ref(o.cpu(), lse.cpu()), q, clean, D**-0.5, tiers=("sink", "recent"),
                boundary=("recent", 16))  # fmt: skip
    # with a logit softcap (the benchmarks' BF16 graph of Gemma2): float64 with the cap over the two tiers
    o, lse = ops.decode_bf16_partial(q, *[dirty[k] for k in names], sm_scale=4 * D**-0.5, softcap=1.5)
    o = reference.merge_partials_ref(o.cpu(), lse.cpu())[0].double()
    cap = dict(tiers=("sink", "recent"), softcap=1.5, bias=torch.zeros(2, H_kv * group))
    ref, bf = (_attention(q, clean, 4 * D**-0.5, dt, **cap)[0] for dt in (torch.float64, torch.bfloat16))
    tol = 2 * (bf - ref).abs().max() + 1e-5
    assert (o - ref).abs().max() <= tol
    assert (_attention(q, clean, 4 * D**-0.5, torch.float64, tiers=("sink", "recent"))[0] - ref).abs().max() > tol


def test_bad_inputs_raise():
    clean, _ = _cache([400], 2, 64, "cpu", seed=1)
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="codes_k"):
        ops.tiered_decode_attention(q, **{**clean, "codes_k": clean["codes_k"].int()}, sm_scale=0.125)
    with pytest.raises(ValueError, match="KV heads"):
        ops.tiered_decode_attention(torch.randn(1, 3, 64), **clean, sm_scale=0.125)
    with pytest.raises(ValueError, match="hist_len"):
        ops.tiered_decode_attention(q, **{**clean, "hist_len": clean["hist_len"].float()}, sm_scale=0.125)
    with pytest.raises(ValueError, match="scale_zero_v"):
        ops.tiered_decode_attention(q, **{**clean, "scale_zero_v": clean["scale_zero_v"][:, :, :3]}, sm_scale=0.125)
    # keys are D/4 (2-bit) or 3D/8 (3-bit) bytes wide, values D/4 only
    for width in (8, 20, 32):
        with pytest.raises(ValueError, match=r"codes_k must end in 16 \(2-bit keys\) or 24 \(3-bit keys\)"):
            ops.tiered_decode_attention(q, **{**clean, "codes_k": clean["codes_k"][..., :1].expand(-1, -1, -1, width)},
                                        sm_scale=0.125)  # fmt: skip
    wide = torch.zeros(*clean["codes_v"].shape[:3], 24, dtype=torch.uint8)
    with pytest.raises(ValueError, match="codes_v"):
        ops.tiered_decode_attention(q, **{**clean, "codes_k": wide, "codes_v": wide}, sm_scale=0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("key_bits", [2, 3])
@pytest.mark.parametrize("L", [4096, 40000])
def test_long_contexts_cuda(L, key_bits):
    H_kv, group, D = 8, 4, 128
    clean, dirty = _cache([L, L // 3], H_kv, D, "cuda", seed=L, key_bits=key_bits)
    _check_against_reference(_query(2, H_kv * group, D, "cuda", L), clean, dirty, D**-0.5)


@pytest.mark.parametrize("D, group, key_bits", [(64, 4, 2), (128, 4, 2), (256, 4, 2), (128, 8, 2), (64, 4, 3),
                                                (128, 8, 3)])  # fmt: skip
def test_scores_keep_the_documented_q_precision(device, D, group, key_bits):
    """One history token per batch row, so each head's lse is its score, against float64 with float32 queries.
    With a group of 4 the score dots are integer at every D (two tokens per row), with a group of 8 from D = 128 (one
    token per row); int8 codes against q's int8 high and low parts (`kernels/decode.py`): each element of q is exact
    to 1 / (2·127·Q_LO) of its head's largest |q| (Q_LO = min(128, 8192 / D); min(128, 4096 / D) for 3-bit keys,
    whose codes reach 7). The bound is the worst case of that rounding (plus float32 slack); keeping only q's high int8
    part breaks it (computed here, and checked by editing the low part out). One token per row also leaves each pair's
    second token out of range (masked)."""
    B, H_kv = 32, 2
    g = torch.Generator().manual_seed(D + group)
    keys = torch.randn(B, H_kv, 8, D, generator=g) * (torch.rand(B, H_kv, 1, 1, generator=g) + 0.5)
    ck, szk = reference.quantize_pack_ref(keys, 0.96, 0, bits=key_bits)
    cv, szv = reference.quantize_pack_ref(torch.randn(B, H_kv, 8, D, generator=g), 0.92, 0)
    q = torch.randn(B, H_kv * group, D, generator=g) * (1 + 7 * (torch.rand(B, H_kv * group, D, generator=g) > 0.95))
    ones = torch.ones(B, dtype=torch.int32)
    _, lse = ops.decode_int2_partial(q.to(device), reference.store_pairs(ck, key_bits).to(device), szk.to(device),
                                     cv.to(device), szv.to(device), ones.to(device), D**-0.5, num_splits=1)
    k_hat = reference.dequantize_unpack(ck, szk, key_bits).double()[:, :, 0].repeat_interleave(group, 1)  # [B, H_q, D]
    qd = q.double()
    want = (qd * k_hat).sum(-1) * D**-0.5
    per_elem = qd.abs().amax(-1, keepdim=True) / (2 * 127 * min(128, (8192 if key_bits == 2 else 4096) // D))
    bound = (per_elem * k_hat.abs()).sum(-1) * D**-0.5
    s_k = szk[:, :, 0, 0, 0].double().repeat_interleave(group, 1)  # the float32 sums run over codes biased by ≤ 128
    slack = 1e-6 * D**-0.5 * qd.abs().sum(-1) * (k_hat.abs().amax(-1) + 128 * s_k)
    err = (lse[..., 0].cpu().double() - want).abs()
    assert (err <= bound + slack).all(), f"max error / bound {(err / (bound + slack)).max():.3g}"
    # tight enough to matter: the scores of a q kept to 8 bits of each head's range (one int8 part) break it
    step = qd.abs().amax(-1, keepdim=True) / 127
    coarse = ((qd / step).round() * step * k_hat).sum(-1) * D**-0.5
    assert ((coarse - want).abs() > bound + slack).any()


# 3-bit keys (docs/format.md §6b): each path of the score dot — integer (GQA groups of 4 at D = 64 and 128, two tokens
# per row; a group of 8 at D = 128), bfloat16 (groups of 1 and 2, a group of 8 at D = 64) and per-group scales (G < D)
# — with masked last tiles (histories no multiple of the interpreter's 16-token tile), through the tiered call. `pad`
# widens each stored key row (0xFF bytes): the rows are then no contiguous pairs, and `ops` copies them.
@pytest.mark.parametrize("D, group, group_size, lengths, pad", [
    (64, 4, 0, [(64, 45, 3), (5, 17, 0)], 0),
    (64, 4, 0, [(64, 29, 0)], 8),
    (128, 4, 0, [(64, 37, 9)], 0),
    (128, 8, 0, [(64, 33, 2)], 0),
    (64, 1, 0, [(64, 45, 3), (0, 29, 1)], 3),
    (64, 2, 0, [(64, 21, 5)], 0),
    (64, 8, 0, [(64, 39, 0)], 0),
    (64, 2, 16, [(64, 27, 4)], 0),
    (128, 4, 32, [(64, 19, 3)], 0),
], ids=["int8-pair-64", "int8-pair-64-padded", "int8-pair-128", "int8-128", "bf16-g1-odd-stride", "bf16-g2",
        "bf16-g8-64", "G16", "G32-128"])  # fmt: skip
def test_three_bit_keys(device, D, group, group_size, lengths, pad):
    H_kv, seed = 2, D + group + group_size + pad
    clean, dirty = _cache(None, H_kv, D, device, seed=seed, lengths=lengths, group_size=group_size, key_bits=3)
    assert clean["codes_k"].shape[-1] == 3 * D // 8 and clean["codes_v"].shape[-1] == D // 4
    if pad:
        ck = dirty["codes_k"]
        wide = torch.full((*ck.shape[:3], ck.shape[3] + pad), 0xFF, dtype=ck.dtype, device=ck.device)
        wide[..., : ck.shape[3]] = ck
        dirty["codes_k"] = wide[..., : ck.shape[3]]
        assert dirty["codes_k"].stride(2) == 3 * D // 8 + pad
    q = _query(len(lengths), H_kv * group, D, device, seed)
    _check_against_reference(q, clean, dirty, D**-0.5, boundary=("hist", 16) if D == 64 else None)
    # the reference twin (3-bit keys by `key_bits`) passes the same rule
    o_ref, lse_ref = reference.tiered_decode_attention_ref(q.cpu(), **{**clean, "codes_k": _key_rows(clean)},
                                                           sm_scale=D**-0.5, key_bits=3)  # fmt: skip
    _check_rule(o_ref, lse_ref, q, clean, D**-0.5)


@pytest.mark.parametrize("D, group, group_size", [(64, 4, 0), (128, 8, 0), (64, 1, 0), (64, 2, 16)],
                         ids=["int8-pair", "int8", "bf16", "G16"])  # fmt: skip
def test_three_bit_plane_order_known_answer(device, D, group, group_size):
    """Tokens 2d and 2d + 1 of a 2D-token history differ only in the third bit of dim d (codes 3 and 7; scale 1, zero
    0; every other code 0), packed by hand from the format: the low bits quartered, then byte D/4 + j of the plane
    holds the third bit of dim j + i·D/8 in bit i; the history stores them in pairs (`reference.store_pairs`). Token
    2d + 1's value is 3 in dim d, every other value 0; six garbage rows (0xFF codes, NaN scales) follow the history.
    Each query head's q is a permutation of distinct n/128, n integers in [−127, 127] (so the integer path's q parts
    are exact). By hand, in float64: scores 3·q_d and 7·q_d, o[d] = 3·p(2d + 1). A plane read in another bit order
    (bits reversed, bits of consecutive dims, or no third bit) gives an answer far outside the tolerance (2^-8
    relative, the bfloat16 p of a GPU's P·V, plus 2^-12; checked)."""
    T, D4, D8, G = 2 * D, D // 4, D // 8, group_size or D
    ck = torch.full((1, 1, T + 6, 3 * D8), 0xFF, dtype=torch.uint8)
    cv = torch.full((1, 1, T + 6, D4), 0xFF, dtype=torch.uint8)
    ck[:, :, :T], cv[:, :, :T] = 0, 0
    codes = torch.zeros(T, D, dtype=torch.uint8)
    for d in range(D):
        low = 3 << (2 * (d // D4))
        ck[0, 0, 2 * d : 2 * d + 2, d % D4] = low
        ck[0, 0, 2 * d + 1, D4 + d % D8] = 1 << (d // D8)
        cv[0, 0, 2 * d + 1, d % D4] = low
        codes[2 * d, d], codes[2 * d + 1, d] = 3, 7
    assert torch.equal(reference.pack_codes(codes, 3), ck[0, 0, :T])  # the hand packing is the reference's
    sz = torch.full((1, 1, T + 6, D // G, 2), float("nan"), dtype=torch.float16)
    sz[:, :, :T, :, 0], sz[:, :, :T, :, 1] = 1.0, 0.0
    cv = layout.history_codes(1, 1, T + 6, D, "cpu", tokens_contiguous=True).copy_(cv)
    ck = reference.store_pairs(ck, 3)
    n = torch.linspace(-127, 127, D, dtype=torch.float64).round()
    assert n.unique().numel() == D
    g = torch.Generator().manual_seed(D + group)
    qd = torch.stack([n[torch.randperm(D, generator=g)] / 128 for _ in range(group)])[None]  # [1, group, D], exact bf16
    hist_len = torch.tensor([T], dtype=torch.int32)
    o, lse = ops.decode_int2_partial(qd.bfloat16().to(device), ck.to(device), sz.to(device), cv.to(device),
                                     sz.to(device), hist_len.to(device), sm_scale=1.0)  # fmt: skip
    o, lse = reference.merge_partials_ref(o.cpu(), lse.cpu())

    def by_hand(third):  # third[d]: the dim whose q token 2d + 1's third bit meets (None: no third bit)
        s = torch.empty(1, group, T, dtype=torch.float64)
        s[..., 0::2] = 3 * qd
        s[..., 1::2] = 3 * qd + (4 * qd[..., third] if third is not None else 0)
        return 3 * torch.softmax(s, -1)[..., 1::2], torch.logsumexp(s, -1)

    want, want_lse = by_hand(torch.arange(D))
    tol = 2.0**-8 * want.abs() + 2.0**-12  # + the float32 (GPU: tensor-core) sums of the values' +128 bias, undone
    assert ((o.double() - want).abs() <= tol).all(), f"max error {(o.double() - want).abs().max():.3g}"
    assert ((lse.double() - want_lse).abs() <= 1e-5 * want_lse.abs() + 1e-5).all()
    d = torch.arange(D)
    for third in (d // D8 * 0 + d % D8 + (7 - d // D8) * D8, d % D8 * 8 + d // D8, None):  # reversed, consecutive, none
        alt, _ = by_hand(third)
        assert ((alt - want).abs() > 10 * tol).any()


@pytest.mark.parametrize("D, group", [(64, 4), (128, 4), (128, 8), (256, 4)])
def test_three_bit_scores_at_the_integer_bound(device, D, group):
    """The integer score dots' worst case with 3-bit keys: every code 7 against a q whose elements all equal its
    largest |q| (±1), one history token. Σ c·(q_hi·Q_LO + q_lo) = ±7·D·127·Q_LO, below 2^22 only with the 3-bit
    Q_LO = min(128, 4096 / D) (the 2-bit min(128, 8192 / D) doubles it past the float32 trick's range at D ≤ 128)."""
    H_kv = 2
    ck = reference.store_pairs(reference.pack_codes(torch.full((1, H_kv, 2, D), 7, dtype=torch.uint8), 3), 3)
    cv = torch.zeros(1, H_kv, 2, D // 4, dtype=torch.uint8)
    sz = torch.tensor([0.25, 0.0], dtype=torch.float16).expand(1, H_kv, 2, 1, 2).contiguous()
    q = torch.ones(1, H_kv * group, D)
    q[:, 1::2] = -1  # heads of either sign
    _, lse = ops.decode_int2_partial(q.bfloat16().to(device), ck.to(device), sz.to(device), cv.to(device),
                                     sz.to(device), torch.ones(1, dtype=torch.int32, device=device), D**-0.5,
                                     num_splits=1)  # fmt: skip
    want = q.double().sum(-1) * 7 * 0.25 * D**-0.5  # one token: lse is its score
    assert torch.allclose(lse[..., 0].cpu().double(), want, rtol=1e-6, atol=1e-6), (lse[..., 0], want)


# ----------------------------------------------------------------------------- keys per channel over token blocks
# docs/format.md §6d: the history's keys coded per channel over blocks of `key_block` tokens
# (`reference.quantize_pack_channel_ref`), the values per row (G = D, unclipped); the kernel folds each tile's block
# scales into q (`kernels/decode.py`, `_block_q`). Histories of whole blocks (as the cache holds them) that are not
# whole splits, so splits start inside a block; one case has a partial last block (a masked last tile).


def _channel_cache(lengths, H_kv, D, device, seed, key_block, key_bits=2):
    """`_cache`'s sink and recent tiers for per-batch (sink, history, recent) `lengths`, with a history coded per
    channel over blocks of `key_block` tokens, T_cap = whole blocks, one more than the longest history needs. The keys
    are rotated-like (Gaussian channels) with very different ranges: channels 0 and 1 ×20 in every block and about one
    in ten others ×20 in each block (other ones per block), so that a transposed scale index or a wrong block index
    moves the answer far. The kernel's copy has NaN pairs in blocks past each history, NaN value pairs and 0xFF codes
    past it (the clean copy keeps them finite)."""
    lens = torch.tensor(lengths, dtype=torch.int32)
    B = lens.shape[0]
    nb = -(-int(lens[:, 1].max()) // key_block) + 1
    T_cap = nb * key_block
    clean, dirty = _cache(None, H_kv, D, device, seed, hist_cap=8, lengths=[(s, 0, r) for s, _, r in lengths])
    g = torch.Generator().manual_seed(seed)
    wide = 1 + 19 * (torch.rand(B, H_kv, nb, 1, D, generator=g) < 0.1).float()
    wide[..., :2] = 20.0
    keys = (torch.randn(B, H_kv, nb, key_block, D, generator=g) * wide).reshape(B, H_kv, T_cap, D)
    ck, szk = reference.quantize_pack_channel_ref(keys, key_block, key_bits)
    cv, szv = reference.quantize_pack_ref(torch.randn(B, H_kv, T_cap, D, generator=g), 1.0)
    cv = layout.history_codes(B, H_kv, T_cap, D, "cpu", tokens_contiguous=True).copy_(cv)
    hist = dict(codes_k=ck, scale_zero_k=szk, codes_v=cv, scale_zero_v=szv, hist_len=lens[:, 1])
    clean.update(hist)
    hist = {k: v.clone() for k, v in hist.items()}
    for b in range(B):
        h = int(lens[b, 1])
        hist["codes_k"][b, :, h:] = 0xFF
        hist["codes_v"][b, :, h:] = 0xFF
        hist["scale_zero_k"][b, :, -(-h // key_block) :] = float("nan")
        hist["scale_zero_v"][b, :, h:] = float("nan")
    for c in (clean, hist):  # (stored in pairs, as the cache stores them)
        c["codes_k"] = reference.store_pairs(c["codes_k"], key_bits)
    dirty.update({k: v.to(device) for k, v in hist.items()})
    assert dirty["codes_v"].stride(2) == 1 and dirty["scale_zero_k"].shape == (B, H_kv, nb, D, 2)
    return clean, dirty


def _channel_query(B, H_q, D, device, seed):
    """q of a quarter of `_query`'s scale: with the keys' ×20 channels the softmax stays spread over many tokens."""
    return (torch.randn(B, H_q, D, generator=torch.Generator().manual_seed(seed)) / 4).bfloat16().to(device)


def _channel_attention(q, c, sm_scale, key_block, tiers=("sink", "hist", "recent"), scale_zero_k=None, rounded=None):
    """Attention over `tiers` of a `_channel_cache` in float64, the history's keys per channel
    (`reference.dequantize_unpack_channel`; `scale_zero_k` in place of c's: a wrong index): o [B, H_q, D] and lse
    [B, H_q]. `rounded` (a GPU's dot operands, bfloat16) rounds what the kernel rounds before its dots: the history's
    q·s per block and channel (`_block_q`; the scores are then Σ_d a·(code − zero)) and each token's P·V weight (p·s of
    the history's values, p of the BF16 tiers); the normaliser Σp stays exact, as the kernel's."""
    B, H_q, D = q.shape
    H_kv, T_cap = c["codes_k"].shape[1:3]
    group, nb = H_q // H_kv, T_cap // key_block
    szk = c["scale_zero_k"] if scale_zero_k is None else scale_zero_k
    qg = q.cpu().double().reshape(B, H_kv, group, D)
    scores, values, v_scales, valid = [], [], [], []
    for t in tiers:
        if t == "hist":
            if rounded is None:
                k = reference.dequantize_unpack_channel(_key_rows(c), szk, _key_bits(c)).double()
                scores.append(torch.einsum("bhgd,bhtd->bhgt", qg, k))
            else:
                codes = reference.unpack_codes(_key_rows(c), _key_bits(c)).double()
                s, z = szk[..., 0].double(), szk[..., 1].double()  # [B, H_kv, nb, D]
                a = (qg[:, :, :, None] * s[:, :, None]).to(rounded).double()  # [B, H_kv, group, nb, D]
                codes = codes.reshape(B, H_kv, nb, key_block, D) - z[:, :, :, None]
                scores.append(torch.einsum("bhgnd,bhnkd->bhgnk", a, codes).reshape(B, H_kv, group, T_cap))
            values.append(reference.dequantize_unpack(c["codes_v"], c["scale_zero_v"]).double())
            v_scales.append(c["scale_zero_v"][..., 0, 0].double())
        else:
            scores.append(torch.einsum("bhgd,bhtd->bhgt", qg, c[f"{t}_k"].double()))
            values.append(c[f"{t}_v"].double())
            v_scales.append(torch.ones(c[f"{t}_v"].shape[:3], dtype=torch.float64))
        valid.append(torch.arange(values[-1].shape[2])[None, :] < c[f"{t}_len"].long()[:, None])
    s = (torch.cat(scores, -1) * sm_scale).masked_fill(~torch.cat(valid, 1)[:, None, None], -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    if rounded is not None:
        v_scale = torch.cat(v_scales, -1)[:, :, None]
        p = (p * v_scale).to(rounded).double() / v_scale
    o = torch.einsum("bhgt,bhtd->bhgd", p, torch.cat(values, 2))
    return o.reshape(B, H_q, D), lse.reshape(B, H_q)


def _check_channel(o, lse, q, clean, sm_scale, key_block, device, tiers=("sink", "hist", "recent")):
    """o within 2e-3 of max |o| of float64 (lse within 1e-3), plus on a GPU twice the error of its bfloat16 dot
    operands (`_channel_attention`'s `rounded`); and that tolerance sees a wrong scale index: channel c read with
    channel c − 1's pairs, or (a history of two blocks or more) block b with block b − 1's."""
    o_ref, lse_ref = _channel_attention(q, clean, sm_scale, key_block, tiers)
    tol, ltol = 2e-3 * o_ref.abs().max(), 1e-3
    if device.type == "cuda":
        o_bf, lse_bf = _channel_attention(q, clean, sm_scale, key_block, tiers, rounded=torch.bfloat16)
        tol, ltol = tol + 2 * (o_bf - o_ref).abs().max(), ltol + 2 * (lse_bf - lse_ref).abs().max()
    o, lse = o.cpu().double(), lse.cpu().double()
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    err, lerr = (o - o_ref).abs().max(), (lse - lse_ref).abs().max()
    assert err <= tol, f"o error {err:.3g} vs tolerance {tol:.3g}"
    assert lerr <= ltol, f"lse error {lerr:.3g} vs tolerance {ltol:.3g}"
    szk = clean["scale_zero_k"]
    wrong = {"channel": szk.roll(1, 3)}
    if int(clean["hist_len"].max()) >= 2 * key_block:
        wrong["block"] = torch.cat([szk[:, :, :1], szk[:, :, :-1]], 2)
    for name, szk_wrong in wrong.items():
        o_wrong, _ = _channel_attention(q, clean, sm_scale, key_block, tiers, scale_zero_k=szk_wrong)
        assert (o_wrong - o_ref).abs().max() > tol, f"a wrong {name} index hides under the tolerance {tol:.3g}"


@pytest.mark.parametrize("D, group, key_bits, key_block, lengths", [
    (64, 4, 2, 64, [(64, 192, 7), (64, 64, 0)]),
    (64, 1, 3, 64, [(64, 320, 3)]),
    (64, 8, 2, 128, [(64, 256, 5)]),
    (128, 8, 3, 128, [(64, 384, 2), (10, 128, 9)]),
    (128, 4, 2, 64, [(64, 192, 3)]),
    (128, 1, 2, 128, [(64, 128, 0)]),
    (64, 4, 3, 64, [(64, 137, 3), (64, 200, 0)]),
    (128, 3, 2, 64, [(64, 200, 3)]),
    (128, 4, 3, 16, [(64, 176, 2), (64, 48, 0)]),
    (128, 6, 2, 128, [(64, 256, 1)]),
], ids=["64-g4-k2-kb64-ragged", "64-g1-k3-kb64", "64-g8-k2-kb128", "128-g8-k3-kb128-ragged", "128-g4-k2-kb64",
        "128-g1-k2-kb128", "64-g4-k3-kb64-partial-block", "128-g3-k2-kb64-partial-block", "128-g4-k3-kb16-ragged",
        "128-g6-k2-kb128"])  # fmt: skip
def test_channel_keys_tiered(device, D, group, key_bits, key_block, lengths, monkeypatch):
    """`ops.tiered_decode_attention(..., key_block=)` over sink, a channel-coded history and recent tiers against
    float64: head dims 64 and 128, GQA groups 1, 3, 4, 6 and 8, 2- and 3-bit keys, blocks of 16, 64 and 128 tokens
    (16-token tiles under the interpreter), batches with per-batch history lengths; histories of 137 and 200 tokens end
    inside a block (the cache never holds one; the kernel masks its last tile as any). From D = 128 with groups of ≥ 3
    (padded to 4 or 8) the integer dots take `kernels/block_query.py`'s operands, and that prepass runs: groups of 3 and
    6 leave padded heads in its operands, and 11 blocks of 16 tokens give the interpreter's 8 blocks per program two
    programs on a row, one of them starting past block 0."""
    H_kv, seed = 2, D + group + key_bits + key_block
    clean, dirty = _channel_cache(lengths, H_kv, D, device, seed, key_block, key_bits)
    assert clean["codes_k"].shape[-1] == layout.packed_dim(D, key_bits)
    q = _channel_query(len(lengths), H_kv * group, D, device, seed)
    prepasses = []
    real = ops._block_query
    monkeypatch.setattr(ops, "_block_query", lambda *a, **k: prepasses.append(1) or real(*a, **k))
    o, lse = ops.tiered_decode_attention(q, **dirty, sm_scale=D**-0.5, key_block=key_block)
    assert o.shape == q.shape and o.dtype == torch.float32
    assert len(prepasses) == (D >= 128 and group >= 3)
    _check_channel(o, lse, q, clean, D**-0.5, key_block, device)


@pytest.mark.parametrize("num_splits", [None, 5])
def test_channel_keys_partials(device, num_splits):
    """`ops.decode_int2_partial(..., key_block=)` + `merge_partials` over a channel-coded history alone (histories of
    320 and 192 tokens, blocks of 64): the default splits (under the interpreter 2: 160 and 96 tokens, the second
    starting inside a block; on a GPU 3), or 5
    (64 and 48 tokens each, the 192-token row's splits inside blocks and one of them empty)."""
    H_kv, group, D, key_block = 2, 4, 64, 64
    clean, dirty = _channel_cache([(64, 320, 0), (64, 192, 0)], H_kv, D, device, 11, key_block)
    q = _channel_query(2, H_kv * group, D, device, 11)
    args = [dirty[k] for k in ("codes_k", "scale_zero_k", "codes_v", "scale_zero_v", "hist_len")]
    args[-1] = torch.stack([args[-1], -args[-1]], 1)[:, 0]  # lengths as a strided view (`check_lengths` copies it)
    o, lse = ops.decode_int2_partial(q, *args, sm_scale=D**-0.5, num_splits=num_splits, key_block=key_block)
    default = ops.int2_splits(2, H_kv, group, D, args[0].shape[2], q.device)  # 2 interpreted, 3 on a GPU
    assert o.shape[2] == (num_splits or default) and default >= 2
    if num_splits:
        assert torch.isinf(lse[1, :, -1]).all() and (o[1, :, -1] == 0).all()  # 192 = 4 splits of 48: the last empty
    _check_channel(*ops.merge_partials(o, lse), q, clean, D**-0.5, key_block, device, tiers=("hist",))


def test_channel_keys_reference_twins(monkeypatch):
    """Without a kernel (CPU, no interpreter) both ops take their reference twins with `key_block`
    (`reference.tiered_decode_attention_ref`, `ops._int2_partial_ref`): the same answers."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    D, key_block = 64, 64
    clean, _ = _channel_cache([(64, 192, 7), (5, 128, 0)], 2, D, "cpu", 3, key_block, key_bits=3)
    q = _channel_query(2, 6, D, "cpu", 3)
    o, lse = ops.tiered_decode_attention(q, **clean, sm_scale=D**-0.5, key_block=key_block)
    _check_channel(o, lse, q, clean, D**-0.5, key_block, torch.device("cpu"))
    args = [clean[k] for k in ("codes_k", "scale_zero_k", "codes_v", "scale_zero_v", "hist_len")]
    o, lse = ops.decode_int2_partial(q, *args, sm_scale=D**-0.5, key_block=key_block)
    _check_channel(*ops.merge_partials(o, lse), q, clean, D**-0.5, key_block, torch.device("cpu"), tiers=("hist",))


def test_channel_keys_validation(monkeypatch):
    """`key_block` > 0 takes scale_zero_k [B, H_kv, T_cap / key_block, D, 2] and per-row values, whole blocks of a
    block size the format allows; the row layout's pairs are refused with it, and the channel layout's without it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the calls that pass take the reference twins
    D = 64
    clean, _ = _channel_cache([(64, 128, 3)], 2, D, "cpu", 4, 64)  # T_cap = 192: 3 blocks
    q = torch.randn(1, 4, D)
    row_k, row_v = reference.quantize_pack_ref(torch.randn(1, 2, 192, D), 1.0)[1], clean["scale_zero_v"]
    group_v = reference.quantize_pack_ref(torch.randn(1, 2, 192, D), 1.0, 16)[1]

    def call(key_block, **kw):
        return ops.tiered_decode_attention(q, **{**clean, **kw}, sm_scale=0.125, key_block=key_block)

    def partial(key_block, **kw):
        args = {**clean, **kw}
        return ops.decode_int2_partial(q, *[args[k] for k in ("codes_k", "scale_zero_k", "codes_v", "scale_zero_v",
                                                              "hist_len")], sm_scale=0.125, key_block=key_block)

    call(64), partial(64), call(0, scale_zero_k=row_k), partial(0, scale_zero_k=row_k)  # each layout with its own
    for op in (call, partial):
        with pytest.raises(ValueError, match=r"key_block = 64 \(keys per channel\) scale_zero_k must be \[B, H_kv, "
                                             r"T_cap / 64, D, 2\] = \[1, 2, 3, 64, 2\], got \(1, 2, 192, 1, 2\)"):
            op(64, scale_zero_k=row_k)
        with pytest.raises(ValueError, match=r"scale_zero_k \(1, 2, 3, 64, 2\) does not match codes"):
            op(0)
        with pytest.raises(ValueError, match=r"\[1, 2, 6, 64, 2\], got \(1, 2, 3, 64, 2\)"):
            op(32)  # the pairs of 64-token blocks read as 32-token ones
        with pytest.raises(ValueError, match=r"the values are per row \(G = D\)"):
            op(64, scale_zero_v=group_v)
        with pytest.raises(ValueError, match="whole blocks"):
            op(64, codes_k=clean["codes_k"][:, :, :160], codes_v=clean["codes_v"][:, :, :160],
               scale_zero_v=row_v[:, :, :160])  # fmt: skip
        with pytest.raises(ValueError, match="key_block must be"):
            op(48)


@pytest.mark.gpu
@pytest.mark.parametrize("key_bits, key_block", [(2, 128), (3, 64), (2, 64)])
def test_channel_keys_long_contexts_cuda(key_bits, key_block):
    """About 100K history tokens per channel-coded keys (two batch rows of 102,400 and ~34K tokens)."""
    H_kv, group, D = 8, 4, 128
    hist = 100 * 1024
    lengths = [(64, hist, 200), (64, hist // 3 // key_block * key_block, 7)]
    clean, dirty = _channel_cache(lengths, H_kv, D, "cuda", key_bits + key_block, key_block, key_bits)
    q = _channel_query(2, H_kv * group, D, "cuda", key_bits)
    o, lse = ops.tiered_decode_attention(q, **dirty, sm_scale=D**-0.5, key_block=key_block)
    _check_channel(o, lse, q, clean, D**-0.5, key_block, torch.device("cuda"))


# Attention logit softcap (Gemma2): x ↦ cap·tanh((x + b)/cap) inside the decode kernel, b a per-query shift (the
# centred codec's q·μ_K·M_K·scale). Reference: `_attention` in float64 over the dequantized tiers.


@pytest.mark.parametrize("D, group, key_bits, key_block", [
    (128, 4, 2, 0), (64, 1, 2, 0), (128, 8, 3, 0), (128, 4, 2, 64), (64, 4, 3, 32), (256, 2, 3, 32), (128, 2, 2, 0),
], ids=["128-g4-int8", "64-g1-bf16", "128-g8-k3-int8", "128-g4-kb64-blockq", "64-g4-k3-kb32-fold", "256-g2-k3-kb32",
        "128-g2-bf16"])  # fmt: skip
def test_softcap_in_the_kernel(device, D, group, key_bits, key_block):
    """`ops.tiered_decode_attention(..., softcap=, logit_bias=)` against float64 by the 2×-bf16 rule (plus 2e-3 of
    max |o| for the GPU's rounding of q·s with keys per channel), on every score path: the integer dots (rows, and the
    block-query prepass of keys per channel), the bfloat16 dots (groups of 1–2, Gemma2's), q·s folded per tile, 2- and
    3-bit keys, D = 64 to 256. The tolerance sees each way to get it wrong: no cap, no shift (or its sign flipped), the
    BF16 tiers or the history left uncapped, a token dropped at the history's last tile."""
    H_kv, softcap, seed = 2, 2.0, D + group + key_bits + key_block
    lengths = [(64, 96, 5), (20, 0, 0), (64, 40, 131)]
    if key_block:
        clean, dirty = _channel_cache(lengths, H_kv, D, device, seed, key_block, key_bits)
        q = _channel_query(3, H_kv * group, D, device, seed)
    else:
        clean, dirty = _cache(None, H_kv, D, device, seed, lengths=lengths, key_bits=key_bits)
        q = _query(3, H_kv * group, D, device, seed)
    sm_scale = 2.0 * D**-0.5  # logits of a few units: the cap bends them
    bias = (torch.rand(3, H_kv * group, generator=torch.Generator().manual_seed(seed)) * 3 - 1.5).to(device)
    o, lse = ops.tiered_decode_attention(q, **dirty, sm_scale=sm_scale, key_block=key_block, softcap=softcap,
                                         logit_bias=bias)
    o = o.cpu().double()
    bias = bias.cpu()
    def capped(dtype=torch.float64, **kw):
        return _attention(q, clean, sm_scale, dtype, **{"softcap": softcap, "bias": bias, "key_block": key_block,
                                                          **kw})[0]

    ref, bf = capped(), capped(torch.bfloat16)
    tol = 2 * (bf - ref).abs().max() + 1e-5 + (2e-3 * ref.abs().max() if key_block and device.type == "cuda" else 0)
    assert torch.isfinite(o).all() and torch.isfinite(lse.cpu()[:, :]).all()
    err = (o - ref).abs().max()
    assert err <= tol, f"o error {err:.3g} vs tolerance {tol:.3g}"
    wrong = {
        "no cap": capped(softcap=None),
        "no shift": capped(bias=bias * 0),
        "shift negated": capped(bias=-bias),
        "BF16 tiers uncapped": capped(capped=("hist",)),
        "history uncapped": capped(capped=("sink", "recent")),
        "last history token dropped": capped(drop=("hist", 95)),
    }
    for name, o_wrong in wrong.items():
        assert (o_wrong - ref).abs().max() > tol, f"'{name}' hides under the tolerance {tol:.3g}"


def test_softcap_reference_twin_and_bad_values():
    """The CPU fallback (`reference.tiered_decode_attention_ref`) applies the same cap and shift as float64, and bad
    softcaps or shifts are refused."""
    H_kv, group, D = 2, 2, 64
    clean, _ = _cache(None, H_kv, D, "cpu", 5, lengths=[(64, 48, 7)])
    q = _query(1, H_kv * group, D, "cpu", 5)
    bias = torch.tensor([[0.5, -1.0, 1.5, 0.0]])
    o, _ = reference.tiered_decode_attention_ref(q, **clean, sm_scale=0.25, softcap=1.5, logit_bias=bias)
    ref = _attention(q, clean, 0.25, torch.float64, softcap=1.5, bias=bias)[0]
    assert (o.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    assert (_attention(q, clean, 0.25, torch.float64)[0] - ref).abs().max() > 1e-2
    for kwargs, msg in (({"softcap": 0.0}, "softcap must be"), ({"softcap": float("inf")}, "softcap must be"),
                        ({"logit_bias": bias}, "only read with a softcap"),
                        ({"softcap": 1.0, "logit_bias": bias[:, :2]}, "logit_bias must be")):
        with pytest.raises(ValueError, match=msg):
            ops.tiered_decode_attention(q, **clean, sm_scale=0.25, **kwargs)
