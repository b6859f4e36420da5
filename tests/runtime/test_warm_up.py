"""`attention.warm_up`: every kernel a generation launches is run before its first decode step, on a scratch layer.

On CPU (the Triton interpreter) the rehearsal is checked for what it runs and what it leaves alone; on the GPU a fresh
process with an empty Triton cache generates across several demotions of each kind and must build nothing after its
first decode step (`benchmarks/bench_first_steps.py`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oscar_zoo.runtime import attention, ops
from oscar_zoo.runtime.cache import OscarCache

ROOT = Path(__file__).resolve().parents[2]


def _orthogonal(L: int, H: int, D: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(L, H, D, D, generator=g, dtype=torch.float64))[0].float()


@pytest.fixture
def spy(monkeypatch):
    """Counts of the quantize launches (per key bits / values), the channel quantizer and the tiered decode."""
    calls = {"rows": [], "channel": [], "decode": 0}
    real_rows, real_channel, real_decode = ops.quantize_pack, ops.quantize_pack_channel, ops.tiered_decode_attention

    def rows(x, *a, bits=2, **k):
        calls["rows"].append((x.shape[-2], bits))
        return real_rows(x, *a, bits=bits, **k)

    def channel(x, block, bits=2):
        calls["channel"].append((x.shape[-2], bits))
        return real_channel(x, block, bits)

    def decode(*a, **k):
        calls["decode"] += 1
        return real_decode(*a, **k)

    monkeypatch.setattr(ops, "quantize_pack", rows)
    monkeypatch.setattr(ops, "quantize_pack_channel", channel)
    monkeypatch.setattr(attention.ops, "tiered_decode_attention", decode)
    return calls


@pytest.mark.parametrize("key_block", [0, 16], ids=["rows", "channel"])
def test_rehearses_each_build_across_two_demotions_and_leaves_the_cache_alone(device, spy, key_block, fewest_programs):
    """Two layers of different key bits: each is rehearsed once (its prompt's history, then ≥ 2 demotions of
    `flush` rows — a whole key block each with keys per channel — and a decode at every step); the cache's own layers
    stay empty; a second call, or a second cache of the same builds, runs nothing."""
    L, H, D, B, H_q = 2, 2, 64, 1, 4
    M = _orthogonal(L, H, D, 0)
    flush = key_block or 4
    make = lambda: OscarCache.from_tensors(M, M.flip(-1), 0.9, 0.9, key_bits=[2, 3], sink=4, recent=8,  # noqa: E731
                              flush=flush, key_block=key_block)
    cache, rehearsed = make(), set()  # the builds one model's binding has rehearsed (`OscarBinding.rehearsed`)
    query = torch.randn(B, H_q, 5, D, device=device)
    attention.warm_up(cache, query, H, D**-0.5, rehearsed=rehearsed)
    assert cache.kernels_ready and not any(layer.is_initialized for layer in cache.layers)
    demoted = spy["channel"] if key_block else [c for c in spy["rows"] if c[0] == flush]
    for bits in (2, 3):  # each layer's key bits: the demotions of whole `flush`-row groups, at least two
        assert sum(1 for rows, b in demoted if rows == flush and b == bits) >= 2, (bits, spy)
    assert spy["decode"] >= 2 * (flush + 2)  # both layers: a decode at each step until two demotions, and one after
    counts = (len(spy["rows"]), len(spy["channel"]), spy["decode"])
    attention.warm_up(cache, query, H, D**-0.5, rehearsed=rehearsed)
    attention.warm_up(make(), query, H, D**-0.5, rehearsed=rehearsed)
    assert (len(spy["rows"]), len(spy["channel"]), spy["decode"]) == counts


def test_a_generation_on_cpu_never_rehearses(monkeypatch):
    """The interpreter and the reference build nothing that a stall could come from: `oscar_attention` calls warm_up
    only for CUDA queries."""
    called = []
    monkeypatch.setattr(attention, "warm_up", lambda *a, **k: called.append(1))
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    model = attention.enable_oscar(LlamaForCausalLM(cfg).eval())
    cache = OscarCache.from_tensors(_orthogonal(2, 2, 16, 1), _orthogonal(2, 2, 16, 2), 0.9, 0.9, sink=2, recent=4,
                                    flush=2)
    ids = torch.randint(0, 64, (1, 12))
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=4,
                   do_sample=False, pad_token_id=0)
    assert called == [] and not cache.kernels_ready


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["eager", "graph"])
@pytest.mark.parametrize("shape", [("smollm2", 2, 0, 2.0), ("qwen3-8b", 2, 128, 2.5)],
                         ids=["rows-d64", "channel-d128"])
def test_fresh_process_builds_nothing_after_the_first_decode_step(tmp_path, path, shape):
    """A new process, empty Triton and inductor caches: a generate() across ≥ 2 demotions of each kind (rows every 8
    steps at d = 64; 128-token key blocks at d = 128, one 3-bit and one 2-bit layer) builds no Triton kernel after
    its first decode step, and no later step stalls: the slowest is at most 5 × the median — on the graph path, of
    the steps that replay; the few that do not (the first static step, and again the one after the history grows past
    its reserve: an eager run that captures both step kinds, milliseconds, no build) are bounded apart, at 25 × the
    median. A build costs ≥ 100 ms, 20–100 × these steps. The 2 × target is the benchmark's, measured alone on the GPU
    (benchmarks/bench_first_steps.py, benchmarks/RESULTS.md); under the GPU suite's parallel workers a neighbour's
    kernels delay single steps by up to 2.5 × the median (seen on an H100 with eight workers)."""
    model, layers, key_block, key_bits = shape
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind"),
           "PYTHONPATH": str(ROOT)}
    out = tmp_path / "steps.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_first_steps", "--model", model, "--layers", str(layers),
           "--context", "1500", "--steps", "400", "--key-bits", str(key_bits), "--key-block", str(key_block),
           "--path", path, "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    s = json.loads(out.read_text())["summary"]
    assert s["builds_after_first_step"] == 0, (s, done.stdout)
    assert s["max_steady_ms"] <= 5 * s["steady_median_ms"], (s, done.stdout)
    assert (s["max_transition_ms"] or 0) <= 25 * s["steady_median_ms"], (s, done.stdout)
    if path == "graph":  # each step that did not replay ran eagerly and captured both step kinds, ahead of their turn
        caps = json.loads(out.read_text())["captures"]
        assert caps[1] == 2 and all(caps[i] - caps[i - 1] == 2 for i in s["transition_steps"]), (caps, s)
