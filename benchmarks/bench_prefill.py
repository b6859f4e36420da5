"""Time to first token: a long prompt prefilled through OscarCache vs BF16 caches.

A random-weight model of a real architecture (Qwen3-8B shapes on the GPU, a demo-sized Llama on CPU) runs a prompt of
random token ids in chunks of `--chunk` tokens, as `generate()` runs a prompt, and the first generated token is read
(its argmax, on the host). OSCAR files each chunk into its tiers (the chunk attends to its own exact K/V and to the
earlier tokens through the tiers, then rotation, clip and quantize/pack into the INT2 history); "dynamic" is
transformers' DynamicCache (BF16, grows by concatenation), "prealloc" a BF16 cache written in place (bf16_caches.py);
both run transformers' "sdpa" attention (a later chunk: an explicit causal mask over repeated K/V). "bf16graph" is the
BF16 cache of the decode benchmarks with the runtime's own prefill attention, the one OscarCache's chunks take
(`attention.dense_attention`: a later chunk through SDPA's lower-right causal flash kernel): the like-for-like BF16 row.
"oscar-fp32rot" (asked for by name) is OSCAR with a chunk's rotations in float32: the A/B row of
`rotate_op.rotate_chunk`.
Per row: ms to the first token, prompt tokens/s, the peak memory above the model, and the cache's own bytes after the
prompt. With OSCAR, "peak − tiers" is what the prefill held beyond its tiers: the rule to check is that it stays within
one chunk's BF16 K/V per layer plus the chunk's activations. One warm-up row per kind and batch size (two chunks: the
later-chunk path too) runs first so that kernel compilation is not timed. `--repeats N` times each row N times, the
kinds taking turns within each repeat (so that a drift of the machine reaches every kind alike), and reports the
median with the spread. Details go to $OUT/bench_prefill_<model>.json when OUT is set.

    python -m benchmarks.bench_prefill [--contexts 8192 32768 100000] [--batches 1] [--chunk 8192] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from unittest import mock

import torch

from oscar_zoo.format import reference
from oscar_zoo.runtime import rotate_op

from .bench_generate import GB, _sync, build_model, cache_kwarg, fresh_peak, kv_bytes, make_cache, use_attention

KINDS = ("oscar", "dynamic", "prealloc", "bf16graph")
AB_KINDS = ("oscar-fp32rot",)  # asked for by name: OSCAR with a chunk's rotations in float32


@torch.inference_mode()
def first_token(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """The prompt ids [B, T] through `cache` in chunks; the first generated token [B] on the host (the prefill's end,
    as generate() reads it)."""
    kw = cache_kwarg(model)
    for start in range(0, ids.shape[1], chunk):
        logits = model(input_ids=ids[:, start : start + chunk], use_cache=True, logits_to_keep=1, **{kw: cache}).logits
    return logits[:, -1].argmax(-1).cpu()


def run_row(model, kind: str, B: int, T: int, chunk: int) -> dict:
    """One prefill of B prompts of T tokens through a fresh cache of `kind`."""
    if kind == "oscar-fp32rot":  # OSCAR with a chunk's rotations in float32, as before `rotate_op.rotate_chunk`
        float32 = lambda x, M, mean_rot=None: reference.rotate_centred(x, M, mean_rot)  # noqa: E731
        with mock.patch.object(rotate_op, "rotate_chunk", float32):
            return {**run_row(model, "oscar", B, T, chunk), "kind": kind}
    dev = next(model.parameters()).device
    use_attention(model, kind)
    base = fresh_peak(dev)
    ids = torch.randint(0, model.config.vocab_size, (B, T), device=dev, generator=torch.Generator(dev).manual_seed(3))
    cache = make_cache(kind, model, T + 64)
    _sync(dev)
    t0 = time.perf_counter()
    token = first_token(model, cache, ids, chunk)
    seconds = time.perf_counter() - t0  # ends at the host read of the first token
    row = dict(kind=kind, batch=B, context=T, chunk=chunk, ms=seconds * 1e3, tokens_per_s=B * T / seconds,
               kv_bytes=kv_bytes(cache), first_token=token.tolist())
    if dev.type == "cuda":
        row["peak_over_model_bytes"] = torch.cuda.max_memory_allocated() - base
        row["peak_beyond_cache_bytes"] = row["peak_over_model_bytes"] - row["kv_bytes"]
    del cache
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="qwen3-8b (GPU default) or demo (CPU default)")
    ap.add_argument("--layers", type=int, default=None, help="shrink the model to N layers")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 100_000])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--extra", nargs="*", default=["32768:8"], help="more rows as context:batch")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS + AB_KINDS)
    ap.add_argument("--key-bits", type=float, default=2.7, help="OSCAR: mean history key bits (calibrate's default)")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk in tokens (generate()'s whole prompt: a "
                                                            "value ≥ the context)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per row (median reported), kinds in turn")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = args.model or ("qwen3-8b" if dev.type == "cuda" else "demo")
    model = build_model(name, args.layers, dev)
    model._oscar_mean_key_bits = args.key_bits
    combos = [(T, B) for T in args.contexts for B in args.batches]
    combos += [tuple(int(x) for x in e.split(":")) for e in args.extra]
    result = dict(model=name, layers=model.config.num_hidden_layers, chunk=args.chunk, key_bits=args.key_bits,
                  torch=torch.__version__,
                  device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", rows=[])
    for kind in args.kinds:  # compile every kernel the rows use (Triton, cuBLAS heuristics) before timing: each
        for B in sorted({B for _, B in combos}):  # batch size is a specialisation of its own
            run_row(model, kind, B, args.chunk + 512, args.chunk)
    for T, B in combos:
        runs: dict[str, list[dict]] = {kind: [] for kind in args.kinds}
        for _ in range(args.repeats):
            for kind in args.kinds:
                if runs[kind] and "ms" not in runs[kind][-1]:
                    continue  # out of memory once: not again
                try:
                    row = run_row(model, kind, B, T, args.chunk)
                except torch.OutOfMemoryError as e:
                    row = dict(kind=kind, batch=B, context=T, status="OOM", note=str(e).splitlines()[0][:160])
                runs[kind].append(row)
                print(f"ctx {T} batch {B} {kind}: " + (f"{row['ms']:.1f} ms" if "ms" in row else row["status"]),
                      flush=True)
        for kind in args.kinds:
            result["rows"].append(median_row(runs[kind]))
            if os.environ.get("OUT"):
                with open(os.path.join(os.environ["OUT"], f"bench_prefill_{name}.json"), "w") as f:
                    json.dump(result, f, indent=2)
    print_table(result)
    return result


def median_row(rows: list[dict]) -> dict:
    """One row of a kind's timed runs: the median run's time (the lower middle of an even count), every run's ms, and
    the largest peak; an out-of-memory run stands for the row."""
    if any("ms" not in r for r in rows):
        return next(r for r in rows if "ms" not in r)
    ms = statistics.median_low(r["ms"] for r in rows)
    row = dict(rows[-1], ms=ms, tokens_per_s=rows[-1]["batch"] * rows[-1]["context"] / (ms / 1e3),
               ms_runs=[r["ms"] for r in rows])
    if "peak_over_model_bytes" in row:
        row["peak_over_model_bytes"] = max(r["peak_over_model_bytes"] for r in rows)
        row["peak_beyond_cache_bytes"] = row["peak_over_model_bytes"] - row["kv_bytes"]
    return row


def print_table(result: dict) -> None:
    print(f"\n{result['model']} ({result['layers']} layers), {result['device']}, prefill chunk {result['chunk']}")
    print("| context | batch | cache | ms to first token (median) | runs: min–max ms | prompt tok/s | vs fastest BF16 "
          "| cache GB | peak GB over model | peak beyond the cache GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    best = {}
    for r in result["rows"]:
        if "ms" in r and not r["kind"].startswith("oscar"):
            best[(r["context"], r["batch"])] = min(best.get((r["context"], r["batch"]), float("inf")), r["ms"])
    for r in result["rows"]:
        if "ms" not in r:
            print(f"| {r['context']} | {r['batch']} | {r['kind']} | {r['status']} | | | | | | |")
            continue
        b = best.get((r["context"], r["batch"]))
        ratio = f"{r['ms'] / b:.3f}× the time" if b else ""
        peak = r.get("peak_over_model_bytes")
        beyond = r.get("peak_beyond_cache_bytes")
        spread = r.get("ms_runs", [r["ms"]])
        print(f"| {r['context']} | {r['batch']} | {r['kind']} | {r['ms']:.1f} | {min(spread):.1f}–{max(spread):.1f} | "
              f"{r['tokens_per_s']:.0f} | {ratio} | "
              f"{r['kv_bytes'] / GB:.3f} | {'' if peak is None else f'{peak / GB:.2f}'} | "
              f"{'' if beyond is None else f'{beyond / GB:.2f}'} |")


if __name__ == "__main__":
    main()
