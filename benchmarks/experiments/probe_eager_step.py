"""Where an eager (uncaptured) OSCAR decode step's time goes: per-step wall time, Triton cache entries added per step,
and a cProfile of the timed steps. A diagnostic for the eager rows of bench_generate.py (`--no-graph`).

    python3 -m benchmarks.experiments.probe_eager_step --layers 4 --context 100000 --batch 1 --key-bits 2.7 \
        --key-block 128 --steps 40
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch

from .. import bench_generate as bg


def triton_cache_entries() -> int:
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return len(os.listdir(root)) if os.path.isdir(root) else 0


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=100_000)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--key-bits", type=float, default=2.7)
    ap.add_argument("--key-block", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profile-top", type=int, default=25)
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = bg.build_model(args.model, args.layers, dev)
    model._oscar_mean_key_bits, model._oscar_key_block, model._bench_compile = args.key_bits, args.key_block, False
    bg.use_attention(model, "oscar")
    for B in args.batch:
        cache = bg.make_cache("oscar", model, args.context + args.steps + 300)
        bg.fold_once(model, cache)
        bg.fill_kv(cache, model, B, args.context, reserve=args.steps + 300)
        tokens = torch.randint(0, model.config.vocab_size, (B, 1), device=dev)
        kw = bg.cache_kwarg(model)
        times, added = [], []
        prof = cProfile.Profile()
        for _ in range(args.steps):
            n0 = triton_cache_entries()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prof.enable()
            logits = model(input_ids=tokens, use_cache=True, logits_to_keep=1, **{kw: cache}).logits
            tokens = logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            prof.disable()
            times.append((time.perf_counter() - t0) * 1e3)
            added.append(triton_cache_entries() - n0)
        print(f"batch {B}, {args.layers} layers, context {args.context}, key bits {args.key_bits}, "
              f"key block {args.key_block}")  # fmt: skip
        print("step ms: " + " ".join(f"{t:.0f}" for t in times))
        print("triton cache entries added: " + " ".join(str(a) for a in added))
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.profile_top)
        print(s.getvalue())
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
        print(s.getvalue())
        del cache


if __name__ == "__main__":
    main()
