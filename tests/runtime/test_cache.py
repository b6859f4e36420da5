"""OscarCache storage: tier contents and lengths after prefill/decode, demotion, memory accounting, loading."""

from __future__ import annotations

import json

import pytest
import torch

from oscar_zoo.format import layout, reference
from oscar_zoo.runtime.cache import OscarCache

B, H, D = 2, 3, 64


def _rotations(L: int, heads: int = H, seed: int = 0) -> torch.Tensor:
    """Random orthogonal float32 [L, heads, D, D]."""
    mats = [reference.random_orthogonal(D, seed=seed + i) for i in range(L * heads)]
    return torch.stack(mats).float().reshape(L, heads, D, D)


def rotated_as_fed(x: torch.Tensor, M: torch.Tensor, prompt: int) -> torch.Tensor:
    """What the cache stores for x fed as a `prompt` chunk then token by token, rounded to the tier dtype: rotated
    chunk by chunk as the cache does (a GEMM's last bit can depend on the chunk shape), so the checks can be exact."""
    chunks = [x[:, :, :prompt]] + [x[:, :, t : t + 1] for t in range(prompt, x.shape[2])]
    return torch.cat([reference.rotate(c, M) for c in chunks], dim=2).to(layout.TIER_DTYPE)


def _cache(L: int = 1, heads: int = H, **kw):
    """A cache with random rotations and per-head K clips; returns it with (M_K, M_V, k_clip, v_clip)."""
    Mk, Mv = _rotations(L, heads, 0), _rotations(L, heads, 100)
    k_clip = torch.linspace(0.9, 0.97, L * heads).reshape(L, heads)
    v_clip = torch.full((L, heads), 0.92)
    return OscarCache.from_tensors(Mk, Mv, k_clip, v_clip, **kw), Mk, Mv, k_clip, v_clip


def _feed(cache: OscarCache, k: torch.Tensor, v: torch.Tensor, prompt: int, layer: int = 0, on_step=None) -> None:
    """Prefill `prompt` tokens, then decode the rest one token at a time."""
    cache.update(k[:, :, :prompt], v[:, :, :prompt], layer)
    for t in range(prompt, k.shape[2]):
        cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], layer)
        if on_step is not None:
            on_step(cache.layers[layer])


def _kv(T: int, dtype=torch.bfloat16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=g) * 2 + torch.randn(1, H, 1, D, generator=g)  # per-channel offsets
    v = torch.randn(B, H, T, D, generator=g)
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("group_size,dtype,key_bits", [(0, torch.bfloat16, 2), (16, torch.bfloat16, 2),
                                                        (0, torch.float32, 2), (16, torch.float32, 2),
                                                        (0, torch.bfloat16, 3), (16, torch.float32, 3)])
def test_tiers_equal_requantized_rotated_history(group_size, dtype, key_bits):
    """After a 400-token prefill and 37 decode steps (4 demotions), the tiers hold exactly: sink = first 64 rotated
    rows, history = quantize_pack_ref of the rotated rows in between (codes and scale/zero bit-exact; keys with the
    layer's key bits, 3-bit rows 3D/8 bytes wide), recent = the rest, 256..263 of them."""
    T_prompt, steps = 400, 37
    cache, Mk, Mv, k_clip, v_clip = _cache(group_size=group_size, key_bits=[key_bits])
    k, v = _kv(T_prompt + steps, dtype)
    recent_lens = []
    _feed(cache, k, v, T_prompt, on_step=lambda layer: recent_lens.append(layer.n_recent))
    layer = cache.layers[0]

    rk, rv = rotated_as_fed(k, Mk[0], T_prompt), rotated_as_fed(v, Mv[0], T_prompt)
    T = T_prompt + steps
    assert (layer.n_sink, layer.n_sink + layer.n_hist + layer.n_recent) == (64, T)
    assert layout.RECENT <= layer.n_recent < layout.RECENT + layout.FLUSH
    assert all(layout.RECENT <= n < layout.RECENT + layout.FLUSH for n in recent_lens)
    assert (layer.n_hist - (T_prompt - 64 - 256)) % layout.FLUSH == 0  # demotions come 8 at a time
    assert torch.equal(layer.sink_k, rk[:, :, :64]) and torch.equal(layer.sink_v, rv[:, :, :64])
    lo, hi = 64, 64 + layer.n_hist
    codes_k, sz_k = reference.quantize_pack_ref(rk[:, :, lo:hi], k_clip[0].reshape(H, 1), group_size, bits=key_bits)
    codes_v, sz_v = reference.quantize_pack_ref(rv[:, :, lo:hi], v_clip[0].reshape(H, 1), group_size)
    assert codes_k.shape[-1] == layout.packed_dim(D, key_bits) and codes_v.shape[-1] == D // 4
    assert torch.equal(reference.read_history_rows(layer.hist_k, layer.n_hist, key_bits), codes_k)  # (in pairs)
    assert torch.equal(layer.hist_v[:, :, : layer.n_hist], codes_v)
    assert torch.equal(layer.sz_k[:, :, : layer.n_hist], sz_k)
    assert torch.equal(layer.sz_v[:, :, : layer.n_hist], sz_v)
    assert torch.equal(layer.recent_k[:, :, : layer.n_recent], rk[:, :, hi:])
    assert torch.equal(layer.recent_v[:, :, : layer.n_recent], rv[:, :, hi:])
    for name, n in (("sink_len", 64), ("hist_len", layer.n_hist), ("recent_len", layer.n_recent)):
        t = getattr(layer, name)
        assert t.dtype == torch.int32 and t.tolist() == [n] * B


def test_prefill_layout_and_demotion_schedule():
    """Prefill: <64 → sink, last 256 → recent, rest → history; decode demotes 8 when recent reaches 264."""
    cache, *_ = _cache()
    k, v = _kv(330 + 20)
    cache.update(k[:, :, :330], v[:, :, :330], 0)
    layer = cache.layers[0]
    assert (layer.n_sink, layer.n_hist, layer.n_recent) == (64, 10, 256)
    seen = []
    for t in range(330, 350):
        cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
        seen.append((layer.n_hist, layer.n_recent))
    assert seen[6] == (10, 263) and seen[7] == (18, 256) and seen[15] == (26, 256)
    assert cache.get_seq_length() == 350


def test_batch_maps_select_rows_and_keep_the_storage_layout():
    """reorder_cache / batch_select_indices / batch_repeat_interleave (generate's beam and batch maps) move whole
    batch rows of every tier, and V's codes stay token-major (the layout the decode kernel reads)."""
    cache, *_ = _cache()
    k, v = _kv(350)
    _feed(cache, k, v, 340)
    layer = cache.layers[0]
    before = {name: getattr(layer, name).clone() for name in layer._STORAGE if getattr(layer, name) is not None}
    for call, rows in ((lambda: cache.reorder_cache(torch.tensor([1, 0])), [1, 0]),  # rows of the state before each
                       (lambda: cache.batch_repeat_interleave(2), [0, 0, 1, 1]),
                       (lambda: cache.batch_select_indices(torch.tensor([3, 0, 2])), [3, 0, 2])):  # fmt: skip
        call()
        for name, old in before.items():
            assert torch.equal(getattr(layer, name), old[rows]), name
        assert layer.hist_v.stride(2) == 1 and layer.hist_k.stride(3) == 1
        assert layer.hist_len.tolist() == [layer.n_hist] * len(rows)
        before = {name: old[rows] for name, old in before.items()}


def test_short_prompt_fills_sink_before_recent():
    """Positions < 64 always land in the sink, also when they arrive by decode after a short prompt."""
    cache, Mk, *_ = _cache()
    k, v = _kv(70)
    _feed(cache, k, v, 10)
    layer = cache.layers[0]
    assert (layer.n_sink, layer.n_hist, layer.n_recent) == (64, 0, 6)
    rk = rotated_as_fed(k, Mk[0], 10)
    assert torch.equal(layer.sink_k, rk[:, :, :64]) and torch.equal(layer.recent_k[:, :, :6], rk[:, :, 64:])


def test_history_exact_when_head_clips_need_different_kernel_builds(monkeypatch):
    """Heads whose clips need different quantize/pack builds at d = 64 (0.86 clips m = 9 values: the top-16 path; 0.95
    and 1.0 the top-8): the cache's host bound (`Rotation.k_min_clip`) must pick a build that serves every head, so
    the history the kernel writes (Triton interpreter) is the reference's codes. A bound from the largest clip fails
    here; so does a cache that kept the caller's clip tensor, changed after it was built."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    Mk, Mv = _rotations(1), _rotations(1, seed=100)
    k_clip, v_clip = torch.tensor([[0.86, 1.0, 0.95]]), torch.tensor([[1.0, 0.95, 0.86]])
    cache = OscarCache.from_tensors(Mk, Mv, k_clip, v_clip)
    want_k, want_v = k_clip.clone(), v_clip.clone()
    k_clip.fill_(0.5), v_clip.fill_(0.5)  # the caller's tensors, not the cache's
    k, v = _kv(400)
    cache.update(k, v, 0)
    layer = cache.layers[0]
    assert layer.n_hist == 400 - 64 - 256
    for x, M, clip, codes, sz in ((k, Mk, want_k, layer.hist_k, layer.sz_k), (v, Mv, want_v, layer.hist_v, layer.sz_v)):
        rows = reference.rotate(x, M[0]).to(layout.TIER_DTYPE)[:, :, 64 : 64 + layer.n_hist]
        codes_ref, sz_ref = reference.quantize_pack_ref(rows, clip[0].reshape(H, 1))
        assert torch.equal(codes[:, :, : layer.n_hist], codes_ref)
        assert torch.equal(sz[:, :, : layer.n_hist], sz_ref)


def test_second_chunk_demotes_to_recent_window():
    """A second multi-token chunk leaves exactly `recent` tokens in the recent tier; history codes stay exact."""
    cache, Mk, _, k_clip, _ = _cache()
    k, v = _kv(700)
    cache.update(k[:, :, :300], v[:, :, :300], 0)
    cache.update(k[:, :, 300:], v[:, :, 300:], 0)
    layer = cache.layers[0]
    assert (layer.n_sink, layer.n_hist, layer.n_recent) == (64, 380, 256)
    chunks = (k[:, :, :300], k[:, :, 300:])
    rk = torch.cat([reference.rotate(c, Mk[0]) for c in chunks], 2).to(layout.TIER_DTYPE)
    codes, _ = reference.quantize_pack_ref(rk[:, :, 64:444], k_clip[0].reshape(H, 1))
    assert torch.equal(layer.hist_k[:, :, :380], codes)


def test_shared_rotation_and_small_tiers():
    """A per-layer (H = 1) rotation broadcasts over KV heads; sink/recent/flush are overridable."""
    cache, Mk, _, k_clip, _ = _cache(heads=1, sink=8, recent=16, flush=4)
    k, v = _kv(60)
    _feed(cache, k, v, 30)
    layer = cache.layers[0]
    assert layer.n_sink == 8 and 16 <= layer.n_recent < 20 and layer.get_seq_length() == 60
    rk = rotated_as_fed(k, Mk[0], 30)
    codes, _ = reference.quantize_pack_ref(rk[:, :, 8 : 8 + layer.n_hist], k_clip[0].reshape(1, 1))
    assert torch.equal(layer.hist_k[:, :, : layer.n_hist], codes)


def test_unquantized_switch_keeps_history_bf16():
    cache, Mk, *_ = _cache(quantize=False)
    k, v = _kv(420)
    _feed(cache, k, v, 400)
    layer = cache.layers[0]
    rk = rotated_as_fed(k, Mk[0], 400)
    dk, _ = layer.dense_kv(torch.bfloat16)
    assert layer.sz_k is None and torch.equal(dk, rk)


@pytest.mark.parametrize("quantize", [True, False])
def test_memory_accounting_equals_tensor_bytes(quantize):
    """memory_bytes() is the sum of nbytes of every tensor the layers hold; per-token figure derives from it."""
    cache, *_ = _cache(L=2, quantize=quantize)
    k, v = _kv(900)
    for layer_idx in range(2):
        _feed(cache, k, v, 880, layer=layer_idx)
    total = sum(t.nbytes for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor))
    assert cache.memory_bytes() == total
    assert cache.bytes_per_token_per_layer() == pytest.approx(total / (900 * 2))
    if quantize:  # INT2 history: far below BF16 (2·B·H·D·2 bytes per token per layer) at this length already
        layer = cache.layers[0]
        cap = layer.hist_k.shape[2]
        expected = 2 * B * H * ((64 + 264) * D * 2 + cap * (layout.bytes_per_token(D, D))) + 3 * B * 4
        assert layer.memory_bytes() == expected
        assert cache.bytes_per_token_per_layer() < 0.5 * (2 * B * H * D * 2)


def test_from_folder_reads_rotations_and_manifest(tmp_path):
    from safetensors.torch import save_file

    L = 2
    Mk, Mv = _rotations(L), _rotations(L, seed=50)
    save_file(
        {
            "k_rotation": Mk, "v_rotation": Mv,
            "k_eigenvalues": torch.rand(L, H, D), "v_eigenvalues": torch.rand(L, H, D),
            "k_clip": torch.full((L, H), 0.96), "v_clip": torch.full((L, H), 0.92),
            "layer_ids": torch.tensor([1, 3], dtype=torch.int32),
        },
        str(tmp_path / "rotations.safetensors"),
    )  # fmt: skip
    cache = OscarCache.from_folder(tmp_path)  # no manifest: layout defaults
    assert len(cache.layers) == 4 and cache.quant_settings == {"group_size": 0, "sink": layout.SINK,
                                                               "recent": layout.RECENT, "flush": layout.FLUSH, "pin": 0,
                                                               "key_block": 0}
    assert cache.layers[0].rotation is None and torch.equal(cache.layers[3].rotation.k, Mk[1])
    (tmp_path / "manifest.json").write_text(json.dumps({"quant": {"group_size": 32, "sink": 16, "recent": 64}}))
    cache = OscarCache.from_folder(tmp_path, flush=4)
    assert cache.quant_settings == {"group_size": 32, "sink": 16, "recent": 64, "flush": 4, "pin": 0, "key_block": 0}
    (tmp_path / "manifest.json").write_text(json.dumps({"quant": {"key_block": 64, "flush": 64}}))
    assert {layer.key_block for layer in OscarCache.from_folder(tmp_path).layers} == {64}
    assert [cache.layers[i].rotation.k_bits for i in (1, 3)] == [2, 2]  # no key_bits: INT2 keys (schema 1–2)
    (tmp_path / "manifest.json").write_text(json.dumps({"quant": {"group_size": 32, "key_bits": [3, 2]}}))
    cache = OscarCache.from_folder(tmp_path)
    assert [cache.layers[i].rotation.k_bits for i in (1, 3)] == [3, 2]
    for bad in ([3], [2, 4], "3"):
        (tmp_path / "manifest.json").write_text(json.dumps({"quant": {"key_bits": bad}}))
        with pytest.raises(ValueError, match="key_bits"):
            OscarCache.from_folder(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"quant": {"group_size": 32, "sink": 16, "recent": 64}}))
    cache = OscarCache.from_folder(tmp_path, flush=4)
    k, v = _kv(4)
    with pytest.raises(ValueError, match="no OSCAR rotation"):
        cache.update(k, v, 0)


def test_invalid_inputs_raise_clear_errors():
    M = _rotations(1)
    with pytest.raises(ValueError, match=r"\[L, H, D, D\]"):
        OscarCache.from_tensors(M[0], M[0])
    with pytest.raises(ValueError, match="k_clip"):
        OscarCache.from_tensors(M, M, torch.ones(2, 2))
    with pytest.raises(ValueError, match="group_size"):
        OscarCache.from_tensors(M, M, group_size=48)
    cache = OscarCache.from_tensors(M, M)
    k = torch.randn(1, 5, 4, D)  # 5 KV heads, rotation has 3
    with pytest.raises(ValueError, match="another model"):
        cache.update(k, k, 0)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(1)
