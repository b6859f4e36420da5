"""benchmarks/bench_generate.py on CPU: its prefill + decode loop is `generate` (same tokens), every cache kind runs
through `run_row`, and its memory accounting equals the bytes the cache's tensors actually hold."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_generate as bg
from oscar_zoo.runtime.cache import OscarCache

B, T = 2, 344  # 344 > sink 64 + recent 256: the history tier is populated


@pytest.fixture(scope="module")
def model():
    return bg.build_model("demo", 2, torch.device("cpu"))  # bf16, as on the GPU


def _storage_bytes(cache) -> int:
    """Independent count: every tensor attribute of every layer (OSCAR, bf16graph) or its K/V (transformers' caches
    and prealloc), by storage."""
    seen, total = set(), 0
    for layer in cache.layers:
        own = isinstance(cache, (OscarCache, bg.GraphBF16Cache))  # caches whose every tensor is per-token storage
        for t in vars(layer).values() if own else (layer.keys, layer.values):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def test_prefill_and_decode_reproduce_generate(model):
    """The benchmark's loop (one-chunk prefill, then decode steps) gives the tokens `generate` gives, OscarCache."""
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    bg.use_attention(model, "oscar")
    cache = bg.make_cache("oscar", model, T + 16)
    first = bg.prefill(model, cache, ids, chunk=T)
    got = torch.cat([first, bg.decode(model, cache, first, 9)], dim=1)
    kw = {bg.cache_kwarg(model): bg.make_cache("oscar", model, T + 16)}
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, **kw)
    assert torch.equal(got, expected[:, T:])
    assert cache.get_seq_length() == T + 9  # crossed one demotion


@pytest.mark.parametrize("kind", bg.KINDS)
def test_run_row_and_memory_accounting(model, kind):
    """Every cache kind through run_row (chunked model prefill for OSCAR, K/V fill for the rest), decode steps across
    a demotion; kv_bytes == the bytes its tensors hold == the analytic expected_kv_bytes."""
    fill = "model" if kind == "oscar" else "kv"
    row = bg.run_row(model, kind, B, T, steps=2, warmup=8, fill=fill, chunk=256, phases=kind == "oscar")
    assert row["status"] == "ok" and row["generated"] == 2
    assert row["kv_bytes"] == row["expected_kv_bytes"]
    if kind == "oscar":
        assert {"attention kernels", "rotation", "cache write + demotion"} <= set(row["phases_ms_per_step"])

    cache = bg.make_cache(kind, model, T + 20)
    bg.use_attention(model, kind)
    bg.fill_kv(cache, model, B, T, reserve=20)
    bg.decode(model, cache, torch.zeros(B, 1, dtype=torch.long), 9)  # 9 steps: one demotion of 8 tokens
    cfg = model.config
    cap = cache.layers[0].hist_k.shape[2] if kind == "oscar" else T + 20
    expected = bg.expected_kv_bytes(kind, B, T + 9, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cap)
    assert bg.kv_bytes(cache) == _storage_bytes(cache) == expected
    if kind == "oscar":
        assert cache.layers[0].n_hist == T + 9 - 64 - 257  # recent holds 256 + 1 after the demotion


def test_max_batch_uses_measured_bytes():
    assert bg.max_batch(4096.0, 100_000, 36, 100e9) == 6
    assert bg.max_batch(590.0, 100_000, 36, 100e9) == 47
