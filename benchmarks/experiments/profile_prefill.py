"""Where a later prefill chunk's time goes: torch.profiler over one chunk of a long prompt, OSCAR against the
like-for-like BF16 cache ("bf16graph": the same prefill attention, `attention.dense_attention`), on a random-weight
model of real shapes (Qwen3-8B on the GPU, a few layers: every layer does the same work). The earlier chunks run
unprofiled; the table lists the ops with the most device time in the profiled chunk (self time, ms) for each kind, after
the wall time of every chunk (synchronised); the full tables go to $OUT/profile_prefill_<kind>.txt when OUT is set.

    python -m benchmarks.experiments.profile_prefill [--layers 4] [--batch 8] [--context 32768] [--chunk 8192]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ..bench_generate import build_model, cache_kwarg, make_cache, use_attention


@torch.inference_mode()
def profile_chunk(model, kind: str, B: int, T: int, chunk: int, top: int) -> tuple[list[float], float, list]:
    """Prefill T − chunk tokens of B random prompts, then profile the last chunk: (the wall ms of every chunk, the last
    one profiled; its self device ms, kernels and the ops that launch them both counted; the `top` ops by self device
    time as (name, ms))."""
    dev = next(model.parameters()).device
    use_attention(model, kind)
    ids = torch.randint(0, model.config.vocab_size, (B, T), device=dev, generator=torch.Generator(dev).manual_seed(3))
    cache, kw = make_cache(kind, model, T + 64), cache_kwarg(model)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    walls = []
    for start in range(0, T - chunk, chunk):
        sync()
        t0 = time.perf_counter()
        model(input_ids=ids[:, start : min(start + chunk, T - chunk)], use_cache=True, logits_to_keep=1,
              **{kw: cache})  # fmt: skip
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        model(input_ids=ids[:, T - chunk :], use_cache=True, logits_to_keep=1, **{kw: cache})
        sync()
    walls.append((time.perf_counter() - t0) * 1e3)
    events = prof.key_averages()
    attr = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    rows = sorted(((e.key, getattr(e, attr) / 1e3) for e in events), key=lambda r: -r[1])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"profile_prefill_{kind}.txt"), "w") as f:
            f.write(events.table(sort_by=attr, row_limit=80))
    return walls, sum(ms for _, ms in rows), rows[:top]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--key-bits", type=float, default=2.7)
    ap.add_argument("--kinds", nargs="+", default=["oscar", "bf16graph"])
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model("qwen3-8b" if dev.type == "cuda" else "demo", args.layers, dev)
    model._oscar_mean_key_bits = args.key_bits
    for kind in args.kinds:
        profile_chunk(model, kind, args.batch, 2 * args.chunk, args.chunk, 1)  # warm-up: compile what the rows use
        walls, total, rows = profile_chunk(model, kind, args.batch, args.context, args.chunk, args.top)
        print(
            f"\n{kind}: batch {args.batch}, the chunk at {args.context - args.chunk}..{args.context}, "
            f"{args.layers} layers: {total:.1f} ms of self device time (ops and kernels both counted); wall ms per "
            f"chunk: " + ", ".join(f"{w:.1f}" for w in walls)
        )
        print("| op | ms |\n|---|---|")
        for name, ms in rows:
            print(f"| {name[:90]} | {ms:.2f} |")


if __name__ == "__main__":
    main()
