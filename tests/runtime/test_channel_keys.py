"""Keys per channel over token blocks (docs/format.md §6d): the reference codec against constructions with known
answers, and OscarCache's tiers, demotion schedule and static step with per-channel keys."""

from __future__ import annotations

import pytest
import torch

from oscar_zoo.format import layout, reference
from oscar_zoo.runtime import ops
from oscar_zoo.runtime.attention import enable_oscar
from oscar_zoo.runtime.cache import OscarCache, OscarLayer
from oscar_zoo.runtime.graph import decode_graphs

from .test_cache import _kv, _rotations, rotated_as_fed
from .test_static_step import _decode_logits, _general_path_only, _llama

B, H, D = 2, 3, 64


# ------------------------------------------------------------------------------------------------ the reference


def test_known_codes_per_channel_and_block():
    """A channel whose block holds lo, lo + r/3, lo + 2r/3, lo + r codes to 0, 1, 2, 3 and dequantizes to those values
    (float16-exact scale and zero: lo = −1.5, r = 3 → scale 1, zero 1.5); each block and channel has its own pair: the
    same values ×100 in channel 1 and shifted in block 1 code the same, and the pairs sit at [block, channel]."""
    base = torch.tensor([-1.5, -0.5, 0.5, 1.5], dtype=torch.float64).repeat(4)  # 16 tokens = one block of 16
    x = torch.zeros(32, 2, dtype=torch.float64)
    x[:16, 0], x[:16, 1] = base, base * 100
    x[16:, 0], x[16:, 1] = base + 10, base * 100 + 100
    codes, sz = reference.quantize_channel(x, 16)
    assert sz.shape == (2, 2, 2) and codes.shape == (32, 2)
    assert torch.equal(codes[:, 0], torch.tensor([0, 1, 2, 3] * 8, dtype=torch.uint8))
    assert torch.equal(codes[:, 1], codes[:, 0])
    assert sz[0, 0].tolist() == [1.0, 1.5] and sz[0, 1].tolist() == [100.0, 1.5]
    assert sz[1, 0].tolist() == [1.0, -8.5] and sz[1, 1].tolist() == [100.0, 0.5]  # block 1: lo = 8.5 and −50
    assert torch.equal(reference.dequantize_channel(codes, sz).double(), x)


def test_an_outlier_key_costs_only_its_own_block_and_channel():
    """A token with a ×50 value in one channel: that (block, channel) gets a coarse step, every other block and channel
    keeps its own fine one (errors ≤ half a step of its own range); the outlier itself is reconstructed within half
    its step, and exactly at its block's max (code 3 is the range's top)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(H, 256, D, generator=g, dtype=torch.float64)
    x[1, 70, 5] = 50.0  # block 1 (tokens 64..127), channel 5
    x_hat = reference.dequantize_channel(*reference.quantize_channel(x.float(), 64)).double()
    blocks = x.reshape(H, 4, 64, D)
    step = (blocks.amax(2) - blocks.amin(2)) / 3  # [H, 4, D]
    err = (x_hat - x).abs().reshape(H, 4, 64, D).amax(2)
    assert (err <= step / 2 * (1 + 2e-3) + 1e-6).all()
    assert step[1, 1, 5] > 10 * step[1, 1, 4] and step[1, 0, 5] < 3 and step[1, 2, 5] < 3
    assert abs(x_hat[1, 70, 5] - 50.0) < 50 * 2e-3


@pytest.mark.parametrize("bits", [2, 3])
def test_pack_round_trip_and_partial_last_block(bits):
    """quantize_pack_channel_ref unpacks to quantize_channel's codes; fake_quant_channel codes a partial last block over
    its own tokens (a whole-block prefix equals the blocks coded alone)."""
    x = torch.randn(2, 200, D, generator=torch.Generator().manual_seed(1))
    packed, sz = reference.quantize_pack_channel_ref(x[:, :192], 64, bits)
    codes, sz2 = reference.quantize_channel(x[:, :192], 64, bits)
    assert packed.shape[-1] == layout.packed_dim(D, bits) and torch.equal(sz, sz2)
    assert torch.equal(reference.unpack_codes(packed, bits), codes)
    fq = reference.fake_quant_channel(x, 64, bits)
    assert torch.equal(fq[:, :192], reference.dequantize_unpack_channel(packed, sz, bits))
    assert torch.equal(fq[:, 192:], reference.dequantize_channel(*reference.quantize_channel(x[:, 192:], 8, bits)))
    with pytest.raises(ValueError, match="whole blocks"):
        reference.quantize_channel(x, 64)


def test_bits_per_element_count_the_blocks_pairs():
    """One float16 pair per channel and block: 32/block bits per history element for the keys (values per row)."""
    hist = 32768 - 320
    keys = layout.bits_per_element(32768, 64, key_block=64)
    assert keys == pytest.approx((hist * (2 + 0.5) + 320 * 16) / 32768)
    assert layout.bits_per_element(32768, 128, key_block=128) == pytest.approx((hist * 2.25 + 320 * 16) / 32768)
    assert layout.kv_bits_per_element(32768, 64, key_bits=[3] * 7 + [2] * 3, key_block=64) == pytest.approx(
        (hist * (2.7 + 0.5 + 2.5) / 2 + 320 * 16) / 32768)
    assert [layout.default_key_block(d) for d in (32, 64, 128, 256)] == [64, 64, 128, 256]


# ----------------------------------------------------------------------------------------------------- the cache


def _channel_cache(key_block: int = 64, key_bits: int = 2, **kw):
    Mk, Mv = _rotations(1, H, 0), _rotations(1, H, 100)
    cache = OscarCache.from_tensors(Mk, Mv, 1.0, torch.full((1, H), 0.92), key_block=key_block, key_bits=[key_bits],
                                    **kw)
    return cache, Mk, Mv


@pytest.mark.parametrize("key_bits", [2, 3])
def test_tiers_hold_whole_key_blocks(key_bits):
    """A 450-token prefill and 150 decode steps: the history is whole 64-token blocks from the sink's end (keys coded
    per channel over each block, bit-exact with the reference; values per row with their clip), the recent tier holds
    256..319 tokens and a block is demoted exactly when it reaches 320."""
    T_prompt, steps = 450, 150
    cache, Mk, Mv = _channel_cache(key_bits=key_bits)
    k, v = _kv(T_prompt + steps)
    cache.update(k[:, :, :T_prompt], v[:, :, :T_prompt], 0)
    layer = cache.layers[0]
    assert (layer.n_sink, layer.n_hist, layer.n_recent) == (64, 128, 258)  # 386 past the sink: 2 blocks + 258
    seen = []
    for t in range(T_prompt, T_prompt + steps):
        cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
        seen.append((layer.n_hist, layer.n_recent))
    assert seen[60] == (128, 319) and seen[61] == (192, 256) and seen[-1] == (256, 256 + 149 - 61 - 64)
    rk, rv = rotated_as_fed(k, Mk[0], T_prompt), rotated_as_fed(v, Mv[0], T_prompt)
    lo, hi = 64, 64 + layer.n_hist
    codes_k, sz_k = reference.quantize_pack_channel_ref(rk[:, :, lo:hi], 64, key_bits)
    codes_v, sz_v = reference.quantize_pack_ref(rv[:, :, lo:hi], torch.full((H, 1), 0.92))
    assert layer.sz_k.shape[2:] == (layer.hist_k.shape[2] // 64, D, 2)
    assert torch.equal(reference.read_history_rows(layer.hist_k, layer.n_hist, key_bits), codes_k)  # (in pairs)
    assert torch.equal(layer.sz_k[:, :, : layer.n_hist // 64], sz_k)
    assert torch.equal(layer.hist_v[:, :, : layer.n_hist], codes_v)
    assert torch.equal(layer.sz_v[:, :, : layer.n_hist], sz_v)
    assert torch.equal(layer.recent_k[:, :, : layer.n_recent], rk[:, :, hi:])
    k_dense, _ = layer.dense_kv()
    assert torch.equal(k_dense[:, :, lo:hi], reference.dequantize_channel(*reference.quantize_channel(
        rk[:, :, lo:hi], 64, key_bits)))


def test_history_growth_keeps_the_block_pairs():
    """Growing the history (past HISTORY_CHUNK tokens) copies the live block pairs: the same tiers as a cache that
    reserved its history up front."""
    k, v = _kv(1400)
    grown, _, _ = _channel_cache()
    reserved, _, _ = _channel_cache()
    reserved.update(k[:, :, :1], v[:, :, :1], 0)
    reserved.reserve(1400)
    reserved.update(k[:, :, 1:1400], v[:, :, 1:1400], 0)
    grown.update(k[:, :, :600], v[:, :, :600], 0)
    grown.update(k[:, :, 600:1400], v[:, :, 600:1400], 0)
    a, b = grown.layers[0], reserved.layers[0]
    assert a.n_hist == b.n_hist == 1024 and (a.hist_k.shape[2], b.hist_k.shape[2]) == (1024, 1280)
    assert torch.equal(a.history()[0], b.history()[0])


def test_settings_that_cannot_hold_whole_blocks_are_refused():
    Mk = _rotations(1, H)
    for kw, match in (({"key_block": 48}, "key_block must be"), ({"key_block": 64, "flush": 8}, "flush = key_block"),
                      ({"key_block": 64, "group_size": 16}, "values per row"), ({"key_block": 64, "pin": 8}, "pin 0")):
        with pytest.raises(ValueError, match=match):
            OscarCache.from_tensors(Mk, Mk, 0.96, 0.92, **kw)
    assert OscarCache.from_tensors(Mk, Mk, 0.96, 0.92, key_block=128).quant_settings["flush"] == 128


@pytest.mark.parametrize(("backend", "B", "tiers", "key_block", "steps"),
                         [("reference", 2, (64, 256), 64, 140), ("interpreter", 1, (16, 32), 16, 13)])
def test_static_step_equals_general_path(backend, B, tiers, key_block, steps, monkeypatch, fewest_programs):
    """Per-channel keys through a real model (SmolLM2's attention shape, random weights): the static decode step
    (device-indexed writes, one block demoted in place every key_block steps) gives bit-identical logits and tiers to
    the general filing path, through the reference ops or the Triton kernels (interpreter: the decode and the channel
    quantize kernels with the cache's real tensors), and both follow the float64-checked reference codec."""
    sink, recent = tiers
    prompt = sink + recent + key_block + 5  # one block in the history after the prefill
    if backend == "interpreter":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    launches = []
    real = ops.launch_decode
    monkeypatch.setattr(ops, "launch_decode", lambda *a, **k: launches.append(k.get("s_hist", 0)) or real(*a, **k))
    model = enable_oscar(_llama(layers=1))
    ids = torch.randint(0, 512, (B, prompt + steps), generator=torch.Generator().manual_seed(0))

    def run():
        cache = OscarCache.from_tensors(_rotations(1, 3), _rotations(1, 3, seed=50), 1.0, 1.0, sink=sink, recent=recent,
                           key_block=key_block, key_bits=[3])
        return _decode_logits(model, cache, ids, prompt), cache.layers[0]

    writes = []
    real_write = OscarLayer.write_token
    monkeypatch.setattr(OscarLayer, "write_token", lambda self, *a: writes.append(1) or real_write(self, *a))
    static, a = run()
    assert len(writes) == steps and (len(launches) == steps) == (backend == "interpreter")
    with monkeypatch.context() as m:
        _general_path_only(m)
        general, b = run()
    assert torch.equal(static, general)
    demoted = (5 + steps) // key_block
    assert (a.n_hist, a.n_recent) == (b.n_hist, b.n_recent) == (key_block * (1 + demoted),
                                                                recent + 5 + steps - key_block * demoted)
    for name in ("hist_k", "hist_v", "sz_v"):
        assert torch.equal(getattr(a, name)[:, :, : a.n_hist], getattr(b, name)[:, :, : a.n_hist]), name
    assert torch.equal(a.sz_k[:, :, : a.n_hist // key_block], b.sz_k[:, :, : a.n_hist // key_block])
    assert torch.isfinite(static).all()


@pytest.mark.gpu
@pytest.mark.parametrize(("B", "key_bits"), [(1, 2), (4, 3)])
def test_generate_replays_captured_steps_equal_to_eager(B, key_bits):
    """generate() on a GPU with per-channel keys (Qwen3-8B's attention shape, head_dim 128, 128-token blocks):
    260 greedy tokens from a 500-token prompt (two block demotions inside captured steps, each a channel quantize and
    a block of pairs) equal the eager path's, logits included, and most steps were replays."""
    from .test_static_step import _qwen3

    model = enable_oscar(_qwen3("cuda"), compile=False)
    cfg = model.config
    L, H, Dh = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    ids = torch.randint(0, cfg.vocab_size, (B, 500), generator=torch.Generator().manual_seed(0)).cuda()
    runs = {}
    for mode in ("eager", "graph"):
        cache = OscarCache.from_tensors(_qwen3_rotations(L, H, Dh), _qwen3_rotations(L, H, Dh, 50), 1.0, 1.0,
                                        key_block=128, key_bits=[key_bits] * L)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=260, do_sample=False,
                             disable_compile=mode == "eager", output_logits=True, return_dict_in_generate=True,
                             past_key_values=cache)
        runs[mode] = (out.sequences, torch.stack(out.logits, 1).float(), cache.layers[0].n_hist)
    assert decode_graphs(model).replays >= 250
    assert torch.equal(runs["graph"][0], runs["eager"][0]) and torch.equal(runs["graph"][1], runs["eager"][1])
    assert runs["graph"][2] == runs["eager"][2] == 128 + 2 * 128  # 500 − 320 → 1 block; +259 steps → 2 more


def _qwen3_rotations(L: int, H: int, Dh: int, seed: int = 0) -> torch.Tensor:
    mats = [reference.random_orthogonal(Dh, seed=seed + i) for i in range(L * H)]
    return torch.stack(mats).float().reshape(L, H, Dh, Dh)
