"""Step times of one `generate()` with OscarCache in a fresh process: what a user sees on a new GPU machine.

Each run is its own process with an empty Triton cache (and inductor cache), so every kernel the generation needs is
built inside it. A random-weight model of real shapes gets a prompt of `--context` random tokens through its own
prefill, then `--steps` greedy tokens through `model.generate` — eager (`--path eager`: generate's
`disable_compile=True`) or as CUDA-graph replays with compiled layers (`--path graph`, generate()'s default on a GPU).
A logits processor stamps each step (after a device sync); the Triton cache is listed at each step, so a build that
lands mid-generation shows where.

    python -m benchmarks.bench_first_steps --path eager --context 100000 --steps 2000
    python -m benchmarks.bench_first_steps --path graph --context 100000 --steps 2000

Prints one line per run (prefill, first step, median / p90 / p99 / max of the later steps, the slowest step's index,
how many later steps took over twice the median, Triton builds after the first step) and, with --json FILE, writes
every step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def _entries(root: str) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def run(model: str, layers: int, context: int, batch: int, steps: int, key_bits: float, key_block: int,
        path: str) -> dict:
    """One generation; returns the per-step times (ms; step 0 is the prefill) and Triton cache files per step."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from oscar_zoo.runtime.graph import decode_graphs

    from . import bench_generate as bg

    dev = torch.device("cuda")
    lm = bg.build_model(model, layers, dev)
    lm._oscar_mean_key_bits, lm._oscar_key_block, lm._bench_compile = key_bits, key_block, path == "graph"
    bg.use_attention(lm, "oscar")
    cache = bg.make_cache("oscar", lm, context + steps)
    triton_dir = os.environ["TRITON_CACHE_DIR"]
    stamps, files, captures, replays = [], [], [], []
    graphs = decode_graphs(lm)

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            files.append(_entries(triton_dir))
            captures.append(graphs.captures)
            replays.append(graphs.replays)
            return scores

    ids = torch.randint(0, lm.config.vocab_size, (batch, context), device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=steps,
                    min_new_tokens=steps, do_sample=False, logits_processor=LogitsProcessorList([Stamp()]),
                    disable_compile=path == "eager", pad_token_id=0)
    times = [(b - a) * 1e3 for a, b in zip([t0] + stamps[:-1], stamps)]
    return {"model": model, "layers": layers, "context": context, "batch": batch, "steps": steps,
            "key_bits": key_bits, "key_block": key_block, "path": path, "device": torch.cuda.get_device_name(),
            "times_ms": times, "triton_files": files, "captures": captures,
            "replays": replays}


def summary(r: dict) -> dict:
    """prefill (ms), the first decode step, and over the later ones: median, p99, max, where the max fell, the
    Triton cache files added after the first decode step; on the graph path the steps that did not only replay (each
    kind's first step, run eagerly, and its capture, at the start and again after the history grew past its reserve)
    apart: which they were and the slowest of them, and the slowest steady step (eager path: every later step; graph
    path: the plain replays)."""
    later = r["times_ms"][2:]
    ordered = sorted(later)
    slowest = max(range(len(later)), key=later.__getitem__) + 2 if later else None
    files, reps, caps = r["triton_files"], r["replays"], r["captures"]
    graph = r["path"] == "graph"  # (a capturing step replays its new graph at once: it counts as a capture)
    transitions = [i for i in range(2, len(reps)) if graph and (reps[i] == reps[i - 1] or caps[i] > caps[i - 1])]
    steady = [t for i, t in enumerate(later, start=2) if i not in transitions]
    return {"prefill_ms": r["times_ms"][0], "first_step_ms": r["times_ms"][1] if len(r["times_ms"]) > 1 else None,
            "median_ms": statistics.median(later) if later else None,
            "steady_median_ms": statistics.median(steady) if steady else None,
            "p90_ms": ordered[min(len(ordered) - 1, int(0.90 * len(ordered)))] if later else None,
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if later else None,
            "over_twice_median": sum(t > 2 * statistics.median(later) for t in later) if later else None,
            "max_ms": ordered[-1] if later else None, "slowest_step": slowest,
            "builds_after_first_step": files[-1] - files[1] if len(files) > 1 else 0,
            "transition_steps": transitions,
            "max_transition_ms": max((r["times_ms"][i] for i in transitions), default=None),
            "max_steady_ms": max(steady) if steady else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--key-bits", type=float, default=2.7)
    ap.add_argument("--key-block", type=int, default=128)
    ap.add_argument("--path", choices=("eager", "graph"), default="graph")
    ap.add_argument("--json", help="write every step time here")
    args = ap.parse_args(argv)
    # a fresh process builds everything: empty Triton and inductor caches unless the caller chose them
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    r = run(args.model, args.layers, args.context, args.batch, args.steps, args.key_bits, args.key_block, args.path)
    r["summary"] = s = summary(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f)
    print(f"{r['device']} {args.model} {args.layers} layers, context {args.context}, batch {args.batch}, "
          f"{args.path}: prefill {s['prefill_ms']:.0f} ms, first step {s['first_step_ms']:.0f} ms, later steps "
          f"median {s['median_ms']:.2f} / p90 {s['p90_ms']:.2f} / p99 {s['p99_ms']:.2f} / max {s['max_ms']:.1f} ms "
          f"(step {s['slowest_step']}; {s['over_twice_median']} over twice the median), Triton builds after the first "
          f"step: {s['builds_after_first_step']}"
          + (f"; steps that did not replay: {s['transition_steps']} (slowest {s['max_transition_ms']:.1f} ms), the "
             f"replays median {s['steady_median_ms']:.2f} / max {s['max_steady_ms']:.1f} ms"
             if s["transition_steps"] else ""))
    return r


if __name__ == "__main__":
    sys.exit(main() and 0)
