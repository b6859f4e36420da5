"""Decode of a padded batch (prompts of different lengths) with OscarCache: does a step cost what its tokens cost?

One random-weight model (Qwen3-8B shapes on the GPU, as `bench_generate`), the OSCAR cache with calibrate's codec
(--key-bits 2.7, keys per channel over 128-token blocks), greedy decode steps through the path generate() takes (CUDA
graph replays of compiled layers). Rows, each a fresh cache filled with random rotated K/V (`bench_generate.fill_kv`'s
filing path; a ragged cache row by row through its rows' views, as a left-padded prompt files them):

- equal:  B sequences of the longest length, the batch's rows sharing their lengths;
- padded-equal: the same, filed as a padded batch (every row its own lengths: the ragged path at no raggedness);
- mixed:  the given lengths (default 8 from 8K to 100K), padded on the left;
- equal-mean: B sequences of the mixed lengths' mean (the same total tokens as mixed).

A step of "mixed" should cost about what "equal-mean" costs (time proportional to the tokens read), not what "equal"
costs (B × the longest); "padded-equal" against "equal" is the ragged path's own overhead.

`--kernels` adds each row's costliest kernels per step (torch.profiler over replayed steps); `--programs-per-sm N`
sets the decode kernel's split target for every row, and padded rows take `--ragged-waves` (default
`RuntimeConfig.ragged_waves`) times it: `--ragged-waves 1 --programs-per-sm 8, 16, 32, 64` is the sweep behind it.

Usage: python -m benchmarks.bench_padded [--lengths 8192 ... 100000] [--layers N] [--steps 64] [--kernels]
    [--programs-per-sm N] [--ragged-waves N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from oscar_zoo.runtime import config
from oscar_zoo.runtime.cache import OscarCache

from .bench_generate import build_model, cache_kwarg, decode, fill_kv, kernel_times, make_cache, use_attention


@torch.inference_mode()
def fill_padded(cache: OscarCache, model, lengths: list[int], reserve: int, chunk: int = 8192) -> None:
    """Every layer split into rows (left padding: row b has max(lengths) − lengths[b] padding positions) and row b
    filled with lengths[b] random rotated tokens through its view."""
    cfg = model.config
    H_kv, D = cfg.num_key_value_heads, cfg.head_dim
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(1)
    T = max(lengths)
    k = torch.randn(1, H_kv, chunk, D, device=dev, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(1, H_kv, chunk, D, device=dev, generator=gen, dtype=torch.bfloat16)
    for layer in cache.layers:
        layer.lazy_initialization(k.expand(len(lengths), -1, -1, -1), v.expand(len(lengths), -1, -1, -1))
        layer.make_rows([T - n for n in lengths])
        layer.reserve(T + reserve)
        for row, n in zip(layer.rows, lengths):
            for start in range(0, n, chunk):
                m = min(chunk, n - start)
                row.file_rotated(k[:, :, :m], v[:, :, :m])


def run(model, lengths: list[int], padded: bool, steps: int, warmup: int, kernels: bool = False) -> dict:
    use_attention(model, "oscar")
    cache = make_cache("oscar", model, max(lengths) + warmup + steps + 1)
    extra = warmup + steps + 256
    if padded:
        fill_padded(cache, model, lengths, extra)
    else:
        fill_kv(cache, model, len(lengths), lengths[0], reserve=extra)
    dev = next(model.parameters()).device
    tokens = torch.randint(0, model.config.vocab_size, (len(lengths), 1), device=dev)
    decode(model, cache, tokens, warmup, graph=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    decode(model, cache, tokens, steps, graph=True)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / steps
    row = dict(batch=len(lengths), tokens=sum(lengths), longest=max(lengths), ms_per_step=ms,
               tokens_per_s=len(lengths) * 1e3 / ms)
    if kernels:  # the replayed step's kernels (torch.profiler), costliest first: ms per step and launches per step
        row["kernels"] = [(name, round(t, 4), n) for name, t, n in kernel_times(model, cache, tokens, 8, True)[2][:8]]
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192 + i * 13114 for i in range(7)] + [100_000])
    ap.add_argument("--layers", type=int, default=None, help="shrink the model to N layers")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=272, help="untimed steps first: every row's demotion phase once "
                    "(captures), 2 × 128 + 16")
    ap.add_argument("--key-bits", type=float, default=2.7)
    ap.add_argument("--key-block", type=int, default=128)
    ap.add_argument("--kernels", action="store_true", help="also each row's costliest kernels (torch.profiler)")
    ap.add_argument("--programs-per-sm", type=int, default=None,
                    help="the decode kernel's split target (RuntimeConfig.decode_*.programs_per_sm) for every row")
    ap.add_argument("--ragged-waves", type=int, default=None,
                    help="RuntimeConfig.ragged_waves for the padded rows (1: the equal-length split count)")
    args = ap.parse_args(argv)
    cfg = config.current()
    if args.programs_per_sm:
        cfg = cfg.with_decode(programs_per_sm=args.programs_per_sm)
    if args.ragged_waves:
        cfg = dataclasses.replace(cfg, ragged_waves=args.ragged_waves)
    with config.use(cfg):
        return _main(args)


def _main(args) -> dict:
    model = build_model("qwen3-8b", args.layers, torch.device("cuda"))
    model._oscar_mean_key_bits, model._oscar_key_block, model._oscar_pin = args.key_bits, args.key_block, 0
    cache_kwarg(model)
    lengths, B = args.lengths, len(args.lengths)
    mean = round(sum(lengths) / B)
    plan = [("equal", [max(lengths)] * B, False), ("padded-equal", [max(lengths)] * B, True),
            ("mixed", lengths, True), ("equal-mean", [mean] * B, False)]
    result = dict(device=torch.cuda.get_device_name(), layers=model.config.num_hidden_layers, lengths=lengths,
                  key_bits=args.key_bits, key_block=args.key_block, steps=args.steps,
                  programs_per_sm=config.current().decode_128.programs_per_sm,
                  ragged_waves=config.current().ragged_waves, rows=[])
    for name, row_lengths, padded in plan:
        t0 = time.perf_counter()
        row = dict(name=name, padded=padded, **run(model, row_lengths, padded, args.steps, args.warmup, args.kernels))
        row["wall_s"] = time.perf_counter() - t0
        result["rows"].append(row)
        print(f"{name}: {row['ms_per_step']:.2f} ms/step ({row['tokens']} tokens)", flush=True)
        for kname, t, n in row.get("kernels", []):
            print(f"    {t:8.4f} ms  ×{n:<5g} {kname[:90]}", flush=True)
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"bench_padded_{result['programs_per_sm']}.json"), "w") as f:
            json.dump(result, f, indent=2)
    print(f"\n| row | batch | tokens | longest | ms/step | tok/s |\n|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['name']} | {r['batch']} | {r['tokens']} | {r['longest']} | {r['ms_per_step']:.2f} | "
              f"{r['tokens_per_s']:.0f} |")
    return result


if __name__ == "__main__":
    main()
