"""End-to-end long-context decode with OscarCache vs BF16 caches: KV bytes, peak memory, decode tokens/s.

A random-weight model of a real architecture (Qwen3-8B shapes on the GPU, a demo-sized Llama on CPU) gets its cache
filled to a context, then runs greedy decode steps through `model.forward` (the step `generate` takes, without its
host-side bookkeeping) with each cache: OscarCache (INT2 history, random orthogonal rotations, clip 0.96/0.92),
transformers' DynamicCache and StaticCache (eager, and "static-compiled": the forward compiled whole as transformers
documents, `static_forward`), "prealloc" (a BF16 cache written in place and read as an exact-length
view), and "bf16graph" (a BF16 cache of fixed capacity with a device-side length, read at its exact length by the
runtime's split-K BF16 kernel: the fastest BF16 decode that can be captured), and transformers' QuantizedCache
("hf-quanto-int2", "hf-hqq-int2", "-int4": the cache users pick today, its defaults; eager, timed over one
128-step residual cycle; `benchmarks/peer_caches.py`). With --graph (the GPU default), OSCAR
and bf16graph decode as CUDA-graph replays through `oscar_zoo.runtime.graph.DecodeGraphs` (the path generate() takes),
and each row also reports the sum of its kernels' device times (torch.profiler over eager steps) beside the step. Fill
modes: "model" runs a chunked prefill of random token ids; "kv" writes random K/V straight into each layer (OscarCache
through its own filing path: rotate-free `_append`, which quantizes the history as prefill does) — decode cost does not
depend on the values, and a 100K prefill is not what is measured. Details go to $OUT/bench_generate_<model>.json when
OUT is set.

Usage: python -m benchmarks.bench_generate [--layers 8] [--contexts 8192 32768] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import time

import torch
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma2Config,
    LlamaConfig,
    QuantizedCache,
    Qwen3Config,
    StaticCache,
)
from transformers.cache_utils import Cache

from oscar_zoo.format import layout
from oscar_zoo.runtime.attention import enable_oscar, fold_value_rotation, model_binding
from oscar_zoo.runtime.cache import OscarCache
from oscar_zoo.runtime.graph import decode_graphs, install

from . import peer_caches
from .bf16_caches import GraphBF16Cache, PreallocLayer, bf16_split_attention, check_bf16graph
from .generate_tables import BF16_KINDS, GB, print_tables
from .phase_timing import PhaseTimer, patched, phase_targets

PEER_KINDS = peer_caches.PEER_KINDS

KINDS = ("oscar", "dynamic", "static", "static-compiled", "prealloc", "bf16graph") + PEER_KINDS
GRAPH_KINDS = ("oscar", "bf16graph")  # caches with a static (capturable) decode step


# ------------------------------------------------------------------------------------------------------- models


def model_config(name: str, layers: int | None = None):
    """"qwen3-8b": Qwen3-8B shapes (36 layers, 32 q / 8 kv heads, d=128); "smollm2": SmolLM2-135M's shapes (30 layers,
    9 q / 3 kv heads, d=64; the context limit raised so long rows run); "gemma2-2b": Gemma2-2B's shapes (26 layers,
    8 q / 4 kv heads, d=256, attention logit softcap 50, every other layer a 4,096-token sliding window: contexts up
    to 4,096 only); "demo": a small SmolLM2-sized Llama slice."""
    if name == "qwen3-8b":
        return Qwen3Config(
            vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers or 36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
            rope_theta=1e6, tie_word_embeddings=False,
        )  # fmt: skip
    if name == "smollm2":
        return LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers or 30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=262144,
            rope_theta=100000.0, tie_word_embeddings=True,
        )  # fmt: skip
    if name == "gemma2-2b":
        return Gemma2Config(
            vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=layers or 26,
            num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
            query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
        )  # fmt: skip
    if name == "demo":
        return LlamaConfig(
            vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers or 2,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=65536,
        )  # fmt: skip
    raise ValueError(f"unknown model {name!r}: use qwen3-8b, smollm2, gemma2-2b or demo")


def build_model(name: str, layers: int | None, device: torch.device, dtype=torch.bfloat16) -> torch.nn.Module:
    """Random weights initialised directly on `device` (no CPU copy), eval mode, sdpa attention (eager for a logit
    softcap, which transformers' sdpa refuses)."""
    cfg = model_config(name, layers)
    torch.manual_seed(0)
    attn = "eager" if getattr(cfg, "attn_logit_softcapping", None) else "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    return model.eval()


def cache_kwarg(model) -> str:
    """The forward's cache argument: `cache` in newer transformers 5.x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# ------------------------------------------------------------------------------------------------------- caches



def oscar_rotations(L: int, H_kv: int, D: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random orthogonal per-head rotations M_K, M_V float32 [L, H_kv, D, D] (sign-fixed QR of Gaussians)."""
    g = torch.Generator().manual_seed(seed)
    Q, R = torch.linalg.qr(torch.randn(2, L, H_kv, D, D, generator=g, dtype=torch.float64))
    Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)  # [2, L, H, D, D]
    return Q[0].float(), Q[1].float()


def oscar_key_bits(model) -> list[int]:
    """Each layer's history key bits for OSCAR rows: `--key-bits b` gives the first round((b − 2)·L) layers 3-bit keys
    (calibrate's --key-bits picks the loudest layers; which ones does not change the cost), the rest 2."""
    L = model.config.num_hidden_layers
    n3 = round((getattr(model, "_oscar_mean_key_bits", layout.BITS) - layout.BITS) * L)
    return [3] * n3 + [layout.BITS] * (L - n3)


def make_cache(kind: str, model, capacity: int) -> Cache:
    """A fresh cache of `kind` for one batch; `capacity` is the total tokens it must hold (static/prealloc size)."""
    cfg = model.config
    L, H_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if kind == "oscar":
        Mk, Mv = oscar_rotations(L, H_kv, D)
        return OscarCache.from_tensors(Mk, Mv, layout.DEFAULT_K_CLIP, layout.DEFAULT_V_CLIP,
                                       key_bits=oscar_key_bits(model), pin=getattr(model, "_oscar_pin", 0),
                                       key_block=getattr(model, "_oscar_key_block", 0))
    if kind == "dynamic":
        return DynamicCache(config=cfg)
    if kind in ("static", "static-compiled"):
        cache = StaticCache(config=cfg, max_cache_len=capacity)
        cache.bench_compiled = kind == "static-compiled"  # decode() runs static_forward(model) over it
        return cache
    if kind == "prealloc":
        return Cache(layers=[PreallocLayer(capacity) for _ in range(L)])
    if kind == "bf16graph":
        return GraphBF16Cache(capacity, L)
    if kind in PEER_KINDS:
        return peer_caches.make_peer_cache(kind, cfg)
    raise ValueError(f"unknown cache kind {kind!r}: use one of {KINDS}")


def use_attention(model, kind: str) -> None:
    """OscarCache needs attn_implementation "oscar"; the BF16 caches run transformers' own "sdpa" ("eager" for a
    logit softcap, which its sdpa refuses)."""
    compile_layers = getattr(model, "_bench_compile", True)  # --compile: graph rows replay inductor-compiled layers
    if kind == "oscar":
        enable_oscar(model, compile=compile_layers)
    elif kind == "bf16graph":
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register("bf16graph", bf16_split_attention)
        AttentionMaskInterface.register("bf16graph", lambda *a, **kw: None)
        model.set_attn_implementation("bf16graph")
        model_binding(model)  # the compiled steps' state (binding.OscarBinding), as enable_oscar makes it
        install(model, compile=compile_layers)
    else:
        model.set_attn_implementation("eager" if getattr(model.config, "attn_logit_softcapping", None) else "sdpa")


def fold_once(model, cache: OscarCache) -> None:
    """Fold the value rotation into v_proj/o_proj once per model: the benchmark's rotations are the same for every
    OSCAR cache (seed 0), so later caches share the folded weights."""
    if not getattr(model, "_oscar_folded", False):
        fold_value_rotation(model, cache)
        model._oscar_folded = True


def kv_bytes(cache: Cache) -> int:
    """Bytes allocated by the cache's per-token storage (K/V tiers, INT2 codes, scale/zero, lengths), capacity
    included; the OSCAR rotations are fixed per model and counted apart (`rotation_bytes`)."""
    if isinstance(cache, OscarCache):
        return cache.memory_bytes()
    if isinstance(cache, QuantizedCache):
        return peer_caches.peer_kv_bytes(cache)
    total = 0
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            total += layer.keys.nbytes + layer.values.nbytes + (layer.length.nbytes if hasattr(layer, "length") else 0)
    return total


def rotation_bytes(cache: Cache) -> int:
    if not isinstance(cache, OscarCache):
        return 0
    return sum(sum(t.nbytes for t in vars(layer.rotation).values() if isinstance(t, torch.Tensor))  # no means uncentred
               for layer in cache.layers if layer.rotation)


def expected_kv_bytes(kind: str, B: int, T: int, L: int, H_kv: int, D: int, capacity: int, G: int | None = None,
                      key_bits: list[int] | None = None, pin: int = 0, key_block: int = 0) -> int:
    """What `kv_bytes` should report for a cache of `kind` holding T tokens (OSCAR: T > sink + recent, history of
    `capacity` rows allocated, each layer's keys at `key_bits` (default 2); BF16 static/prealloc: `capacity` rows;
    dynamic: exactly T rows; QuantizedCache: `capacity` is the filled length, the rest decode steps)."""
    if kind in PEER_KINDS:
        return peer_caches.expected_peer_kv_bytes(kind, B, T, L, H_kv, D, filled=capacity)
    if kind == "oscar":
        G = G or D
        bf16 = (layout.SINK + pin + layout.RECENT + (key_block or layout.FLUSH)) * D * 2  # sink (+ pinned) + recent
        # K's codes and pairs (per channel: one pair per channel and block of key_block tokens, docs/format.md §6d)
        k_rows = (lambda kb: capacity * layout.packed_dim(D, kb) + capacity // key_block * D * 4) if key_block else (
            lambda kb: capacity * layout.bytes_per_token(D, G, kb))
        per_layer = [
            2 * B * H_kv * bf16 + 3 * B * 4  # + int32 [B] lengths of 3 tiers
            + B * H_kv * (k_rows(kb) + capacity * layout.bytes_per_token(D, G))  # K, V codes and pairs
            for kb in key_bits or [layout.BITS] * L
        ]
        return sum(per_layer)
    rows = T if kind == "dynamic" else capacity
    lengths = B * 4 if kind == "bf16graph" else 0  # its int32 [B] device length
    return L * (2 * B * H_kv * rows * D * 2 + lengths)


# --------------------------------------------------------------------------------------------- fill and decode


@torch.inference_mode()
def prefill(model, cache: Cache, ids: Tensor, chunk: int) -> Tensor:
    """Run the prompt ids [B, T] through the model in chunks; returns the next greedy tokens [B, 1]."""
    kw = cache_kwarg(model)
    for start in range(0, ids.shape[1], chunk):
        logits = model(input_ids=ids[:, start : start + chunk], use_cache=True, logits_to_keep=1, **{kw: cache}).logits
    return logits[:, -1].argmax(-1, keepdim=True)


@torch.inference_mode()
def fill_kv(cache: Cache, model, B: int, T: int, reserve: int, chunk: int = 8192) -> None:
    """Write T random (already rotated) K/V tokens into every layer without running the model. OscarCache: the
    filing path of a prefill (`OscarLayer.file_rotated`: sink, recent, INT2 history via ops.quantize_pack), history
    capacity reserved for T + `reserve` tokens up front so decode timing excludes regrowth. BF16 caches: one update
    per layer."""
    cfg = model.config
    H_kv, D = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(1)
    for idx in range(cfg.num_hidden_layers):
        if isinstance(cache, OscarCache):
            layer = cache.layers[idx]
            k = torch.randn(B, H_kv, min(chunk, T), D, device=dev, generator=gen, dtype=torch.bfloat16)
            v = torch.randn(B, H_kv, min(chunk, T), D, device=dev, generator=gen, dtype=torch.bfloat16)
            layer.lazy_initialization(k, v)
            layer.reserve(T + reserve)
            for start in range(0, T, chunk):
                n = min(chunk, T - start)
                layer.file_rotated(k[:, :, :n], v[:, :, :n])
                if layer.staged is not None:  # what a prompt chunk's attention does: pin (any choice costs the same)
                    layer.pin_tokens(lambda cand: cand.float().square().sum(-1))
        else:
            k = torch.randn(B, H_kv, T, D, device=dev, generator=gen, dtype=torch.bfloat16)
            v = torch.randn(B, H_kv, T, D, device=dev, generator=gen, dtype=torch.bfloat16)
            cache.update(k, v, idx, {"cache_position": torch.arange(T, device=dev)})
        del k, v


@torch.inference_mode()
def decode(model, cache: Cache, tokens: Tensor, steps: int, graph: bool = False) -> Tensor:
    """`steps` greedy decode steps from tokens [B, 1]; returns the generated ids [B, steps]. No host syncs. With
    `graph`, each step goes through the model's DecodeGraphs (as generate() on a GPU does): replays once captured."""
    kw = cache_kwarg(model)
    forward = decode_graphs(model) if graph else static_forward(model) if getattr(cache, "bench_compiled", 0) else model
    out = []
    for _ in range(steps):
        logits = forward(input_ids=tokens, use_cache=True, logits_to_keep=1, **{kw: cache}).logits
        tokens = logits[:, -1].argmax(-1, keepdim=True)
        out.append(tokens)
    return torch.cat(out, dim=1)


def static_forward(model):
    """What transformers documents for a fast BF16 decode: a StaticCache and the model's forward compiled whole by
    `torch.compile(mode="reduce-overhead", fullgraph=True)` (inductor, its CUDA graphs on a GPU); once per model."""
    forward = model.__dict__.get("_bench_static_forward")
    if forward is None:
        forward = model._bench_static_forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    return forward


def kernel_times(
    model, cache: Cache, tokens: Tensor, steps: int, graph: bool = False
) -> tuple[float | None, int, list, list]:
    """Kernels of `steps` decode steps (torch.profiler; eager, or graph replays): the sum of their device times per
    step (eager: what the step would cost with no host overhead and no gaps between kernels), kernels per step, and
    every kernel as (name, ms per step, launches per step), costliest first, and the first 200 kernels in launch order
    as (name, µs)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync(tokens.device)
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        decode(model, cache, tokens, steps, graph)
        _sync(tokens.device)
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in kernels)
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)
    top = [(e.key[:120], e.self_device_time_total / 1e3 / steps, e.count / steps) for e in top]
    # the first kernels of the profile in launch order (the first step's embedding and first layers), for attribution
    order = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    first = [(e.name[:120], round(e.time_range.elapsed_us(), 2)) for e in order[:200]]
    return (total_us / 1e3 / steps if total_us else None), sum(e.count for e in kernels) // steps, top, first


# ------------------------------------------------------------------------------------------------------ one row


def fresh_peak(device: torch.device) -> int | None:
    """Free what earlier rows left and restart the peak-memory count; the bytes allocated now (None off a GPU)."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_row(model, kind: str, B: int, T: int, steps: int, warmup: int, fill: str, chunk: int, phases: bool,
            graph: bool = False, fold: bool = False) -> dict:
    """Fill a fresh cache of `kind` to T tokens for batch B, decode warmup + steps, and measure. `graph` (OSCAR and
    bf16graph only): the steps are CUDA-graph replays, and the row adds the kernels' summed device time per step.
    `fold` (OSCAR): the value rotation folded into v_proj/o_proj (once per model; later caches share the rotations).
    A QuantizedCache peer is timed over at least one residual cycle (128 steps, one of which re-quantizes the whole
    history), so its flush is amortised as in a long generation."""
    graph = graph and kind in GRAPH_KINDS
    fold = fold and kind == "oscar"
    phases = phases and kind != "static-compiled"  # one compiled graph: no phases to time apart
    if kind in PEER_KINDS:
        steps = max(steps, peer_caches.RESIDUAL)
    flush = (getattr(model, "_oscar_key_block", 0) if kind == "oscar" else 0) or layout.FLUSH  # tokens per demotion
    if graph:  # each step kind (plain, demoting) runs once eagerly, then is captured: both before the timed steps
        warmup = max(warmup, 2 * flush + 2)
    elif kind == "oscar":  # a demotion before the timed steps: its kernels' first-use compile (seconds) is not timed
        warmup = max(warmup, flush + 2)
    dev = next(model.parameters()).device
    cfg = model.config
    L, H_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    extra = warmup + steps + 6 * flush  # decode steps: warmup, timed, phase-timed, kernel-timed (2×)
    capacity = T + extra + 1
    row = dict(kind=kind, batch=B, context=T, steps=steps, warmup=warmup, fill=fill, layers=L, graph=graph, fold=fold)
    if kind in PEER_KINDS:
        row["graph_note"] = peer_caches.EAGER_NOTE
    use_attention(model, kind)
    base = fresh_peak(dev)
    cache = make_cache(kind, model, capacity)
    if fold:
        fold_once(model, cache)
    t0 = time.perf_counter()
    if fill == "model":
        ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev, generator=torch.Generator(dev).manual_seed(2))
        tokens = prefill(model, cache, ids, chunk)
    else:
        fill_kv(cache, model, B, T, reserve=extra + layout.FLUSH)
        tokens = torch.randint(0, cfg.vocab_size, (B, 1), device=dev)
    _sync(dev)
    row["fill_s"] = time.perf_counter() - t0
    if dev.type == "cuda":
        row["kv_allocated_by_fill"] = torch.cuda.memory_allocated() - base
        row["allocated_bytes_per_token_per_layer"] = row["kv_allocated_by_fill"] / (B * T * L)
    if kind == "bf16graph":
        row["max_abs_vs_sdpa"] = check_bf16graph(model, cache)
    decode(model, cache, tokens, warmup, graph)
    _sync(dev)
    t0 = time.perf_counter()
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    out = decode(model, cache, tokens, steps, graph)
    cpu_s = time.perf_counter() - t0  # host time to enqueue the steps (≈ wall time when the step is host-bound)
    if dev.type == "cuda":
        end.record()
        torch.cuda.synchronize()
        wall_s = start.elapsed_time(end) / 1e3
    else:
        wall_s = cpu_s
    tokens_now = int(cache.get_seq_length())  # T + warmup + steps (StaticCache: a device tensor)
    kvb = kv_bytes(cache)
    row.update(
        ms_per_step=wall_s / steps * 1e3, host_ms_per_step=cpu_s / steps * 1e3, tokens_per_s=B * steps / wall_s,
        kv_bytes=kvb, rotation_bytes=rotation_bytes(cache), bytes_per_token_per_layer=kvb / (B * tokens_now * L),
        expected_kv_bytes=expected_kv_bytes(kind, B, tokens_now, L, H_kv, D, T if kind in PEER_KINDS
                                            else _capacity(cache, capacity), key_bits=oscar_key_bits(model),
                                            pin=getattr(model, "_oscar_pin", 0),
                                            key_block=getattr(model, "_oscar_key_block", 0)),
        generated=out.shape[1], status="ok",
    )  # fmt: skip
    if dev.type == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated()
        row["peak_over_model_bytes"] = row["peak_bytes"] - base
    if graph:
        row["replays"] = decode_graphs(model).replays
        kernel_ms, kernel_count, top, first = kernel_times(model, cache, tokens, layout.FLUSH)
        row.update(kernel_ms_per_step=kernel_ms, kernels_per_step=kernel_count, top_kernels=top, first_kernels=first)
        kernel_ms, kernel_count, top, _ = kernel_times(model, cache, tokens, layout.FLUSH, graph=True)
        row.update(graph_kernel_ms_per_step=kernel_ms, graph_kernels_per_step=kernel_count, graph_top_kernels=top)
    if phases:
        timer = PhaseTimer(dev)
        with patched(phase_targets(timer, kind)):
            _sync(dev)
            t0 = time.perf_counter()
            decode(model, cache, tokens, layout.FLUSH)
            _sync(dev)
            total = (time.perf_counter() - t0) * 1e3 / layout.FLUSH
        parts = {k: v / layout.FLUSH for k, v in timer.totals_ms().items()}
        parts["rest of the model"] = max(total - sum(parts.values()), 0.0)
        row["phases_ms_per_step"] = parts
        row["phases_step_ms"] = total  # with the timing events in place (slightly slower than ms_per_step)
    if graph:
        decode_graphs(model).reset()  # free the graphs' pool before the next row measures its memory
    del cache, out
    return row


def _capacity(cache: Cache, capacity: int) -> int:
    if isinstance(cache, OscarCache):
        return cache.layers[0].hist_k.shape[2]
    return capacity


def floor_ms(kind: str, B: int, T: int, cfg, weight_bytes: int, bandwidth: float, key_bits: list[int],
             pin: int = 0, key_block: int = 0) -> float:
    """Bandwidth floor of one decode step: the weights plus the KV bytes attention must read, at `bandwidth` B/s
    (OSCAR: each layer's history keys at `key_bits`)."""
    L, H_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if kind == "oscar":
        full = min(T, layout.SINK + layout.RECENT + pin)
        pairs = 4 * D / key_block - 4 if key_block else 0  # per-channel keys: a block's pairs per token, not a row's
        kv = sum(B * H_kv * ((T - full) * (layout.bytes_per_token(D, D, kb) + layout.bytes_per_token(D, D) + pairs)
                             + 2 * full * D * 2) for kb in key_bits)  # fmt: skip
    else:
        kv = L * 2 * B * H_kv * T * D * 2
    return (weight_bytes + kv) / bandwidth * 1e3


def safe_row(model, kind, B, T, args, phases=False, free_bytes=None) -> dict:
    """run_row, reporting a predicted or actual out-of-memory as a row instead of failing."""
    cfg = model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    need = expected_kv_bytes(kind, B, T, cfg.num_hidden_layers, cfg.num_key_value_heads, D, T + 64,
                             key_bits=oscar_key_bits(model), pin=args.pin, key_block=args.key_block)
    if free_bytes is not None and need > free_bytes:
        return dict(kind=kind, batch=B, context=T, status="does not fit",
                    note=f"needs {need / GB:.1f} GB of KV, {free_bytes / GB:.1f} GB free")  # fmt: skip
    try:
        row = run_row(model, kind, B, T, args.steps, args.warmup, args.fill, args.chunk, phases, args.graph, args.fold)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        if kind in PEER_KINDS:  # the bytes it stores, read once: what an ideal kernel over its format would read
            row["floor_ms"] = (weights + row["kv_bytes"]) / (args.bandwidth_tbs * 1e12) * 1e3
        else:
            row["floor_ms"] = floor_ms(kind, B, T, cfg, weights, args.bandwidth_tbs * 1e12, oscar_key_bits(model),
                                       args.pin, args.key_block)
        return row
    except torch.OutOfMemoryError as e:
        gc.collect()
        torch.cuda.empty_cache()
        return dict(kind=kind, batch=B, context=T, status="OOM", note=str(e).splitlines()[0][:160])
    except peer_caches.PeerUnavailable as e:
        return dict(kind=kind, batch=B, context=T, status="not installed", note=str(e))
    except Exception as e:  # a peer backend failing on this machine (e.g. its extension does not build): say so
        if kind not in PEER_KINDS:
            raise
        return dict(kind=kind, batch=B, context=T, status="failed",
                    note=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")


# ---------------------------------------------------------------------------------------------------------- main


def throughput_ratio(per_kind: dict[str, dict]) -> str | None:
    """The KV-budget rows of one context: OSCAR's tokens/s over the fastest timed BF16 kind's ("3.97x"), or None where
    OSCAR or every BF16 kind went untimed (a batch that does not fit the card)."""
    timed = {k: e["tokens_per_s"] for k, e in per_kind.items() if e.get("status") == "ok"}
    bf = [t for k, t in timed.items() if k in BF16_KINDS]
    return f"{timed['oscar'] / max(bf):.2f}x" if "oscar" in timed and bf else None


def max_batch(bytes_per_token_per_layer: float, T: int, L: int, budget: float) -> int:
    """Sequences of T tokens whose KV (measured bytes per cached token per layer) fit in `budget` bytes."""
    return int(budget // (bytes_per_token_per_layer * T * L))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="qwen3-8b (GPU default), smollm2, gemma2-2b or demo (CPU default)")
    ap.add_argument("--layers", type=int, default=None, help="shrink the model to N layers")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 100_000, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--kinds", nargs="+", default=None, choices=KINDS,
                    help="default: oscar bf16graph with --graph, else oscar prealloc dynamic; hf-*: transformers' "
                         "QuantizedCache (extra `peers`)")
    ap.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                    help="decode OSCAR and bf16graph as CUDA-graph replays (default: on a GPU)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="graph rows: the decoder layers compiled by inductor around the cache's custom op (both OSCAR "
                         "and bf16graph; --no-compile captures the eager layers)")
    ap.add_argument("--fold", action=argparse.BooleanOptionalAction, default=True,
                    help="fold OSCAR's value rotation into v_proj/o_proj (the served configuration)")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.27, help="HBM bandwidth for the floor column (TB/s)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=8, help="untimed decode steps first (OSCAR: at least one demotion)")
    ap.add_argument("--fill", choices=["kv", "model"], default="kv")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (fill=model)")
    ap.add_argument("--budget-gb", type=float, default=100.0, help="KV memory budget for the max-batch rows")
    ap.add_argument("--budget-contexts", type=int, nargs="*", default=[100_000])
    ap.add_argument("--phases", nargs="*", default=["100000:1"], help="context:batch rows with a phase breakdown")
    ap.add_argument("--key-bits", type=float, default=float(layout.BITS),
                    help="OSCAR rows: mean history key bits, 2–3 (round((b − 2)·L) layers get 3-bit keys; calibrate's "
                         "--key-bits; default 2)")
    ap.add_argument("--pin", type=int, default=0, help="OSCAR rows: history tokens per KV head pinned in BF16 "
                    "(calibrate's --pin; default 0)")
    ap.add_argument("--key-block", type=int, default=0, choices=(0, *layout.KEY_BLOCKS),
                    help="OSCAR rows: history keys per channel over blocks of this many tokens (calibrate's "
                         "--key-block; default 0: per row)")
    ap.add_argument("--extra", nargs="*", default=[], help="more rows as kind:context:batch (e.g. static:32768:1)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.graph = dev.type == "cuda" if args.graph is None else args.graph
    args.kinds = args.kinds or (["oscar", "bf16graph"] if args.graph else ["oscar", "prealloc", "dynamic"])
    name = args.model or ("qwen3-8b" if dev.type == "cuda" else "demo")
    model = build_model(name, args.layers, dev)
    if not layout.BITS <= args.key_bits <= 3:
        ap.error(f"--key-bits must be between {layout.BITS} and 3, got {args.key_bits}")
    model._oscar_mean_key_bits = args.key_bits
    model._oscar_pin = args.pin
    model._oscar_key_block = args.key_block
    model._bench_compile = args.compile
    L = model.config.num_hidden_layers
    phase_rows = {tuple(int(x) for x in p.split(":")) for p in args.phases}
    result = dict(model=name, layers=L, key_bits=oscar_key_bits(model), pin=args.pin, key_block=args.key_block,
                  device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__,
                  steps=args.steps, warmup=args.warmup, fill=args.fill, rows=[], graph=args.graph,
                  compile=args.compile, budget_gb=args.budget_gb, budget=[])  # fmt: skip
    if dev.type == "cuda":
        result["model_bytes"] = torch.cuda.memory_allocated()
    print(f"{name}: {L} layers, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params on {result['device']}",
          flush=True)  # fmt: skip

    def free():
        if dev.type != "cuda":
            return None
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0] - 2 * GB  # headroom for activations and the transient copies

    def save():
        if os.environ.get("OUT"):
            tag = "" if args.compile or not args.graph else "_uncompiled"
            with open(os.path.join(os.environ["OUT"], f"bench_generate_{name}{tag}.json"), "w") as f:
                json.dump(result, f, indent=2, default=str)

    combos = [(kind, T, B) for T in args.contexts for B in args.batches for kind in args.kinds]
    combos += [(k, int(T), int(B)) for k, T, B in (e.split(":") for e in args.extra)]
    for kind, T, B in combos:
        r = safe_row(model, kind, B, T, args, phases=(T, B) in phase_rows, free_bytes=free())
        result["rows"].append(r)
        msg = f"{r['ms_per_step']:.2f} ms/step" if r["status"] == "ok" else f"{r['status']} {r.get('note', '')}"
        print(f"ctx {T} batch {B} {kind}: {msg}", flush=True)
        save()
    for T in args.budget_contexts:
        per_kind = {}
        for kind in args.kinds:
            ok = [r for r in result["rows"] if r["kind"] == kind and r["context"] == T and r["status"] == "ok"]
            if not ok:  # measure bytes per token at batch 1 first
                ok = [safe_row(model, kind, 1, T, args, free_bytes=free())]
                ok = [r for r in ok if r["status"] == "ok"]
            if not ok:
                continue
            bpt = max(ok, key=lambda r: r["batch"])["bytes_per_token_per_layer"]
            n = max_batch(bpt, T, L, args.budget_gb * GB)
            entry = dict(context=T, kind=kind, max_batch=n, bytes_per_token_per_layer=bpt)
            if n >= 1:
                r = next((r for r in ok if r["batch"] == n), None)
                r = r or safe_row(model, kind, n, T, args, free_bytes=free())
                entry.update(status=r["status"], ms_per_step=r.get("ms_per_step", math.nan),
                             tokens_per_s=r.get("tokens_per_s", math.nan), peak_bytes=r.get("peak_bytes"))  # fmt: skip
            per_kind[kind] = entry
            result["budget"].append(entry)
            timed = entry.get("status", "no batch fits")
            timed = f"{entry['tokens_per_s']:.0f} tok/s" if timed == "ok" else timed
            print(f"budget ctx {T} {kind}: batch {n}, {timed}", flush=True)
        ratio = throughput_ratio(per_kind)
        if ratio:
            per_kind["oscar"]["ratio"] = ratio
    graphs = decode_graphs(model)
    if graphs is not None and graphs.compiled is not None:
        result["compile_s"] = graphs.compiled.compile_seconds
    save()
    print_tables(result)
    return result


if __name__ == "__main__":
    main()
