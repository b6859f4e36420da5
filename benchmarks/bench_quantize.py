"""GPU benchmark: fused clip → INT2 quantize → pack (`ops.quantize_pack`) vs its PyTorch reference.

Rows: prefill-sized history writes (1 × 8 KV heads × T tokens, d = 128 and 3 KV heads d = 64) and the decode-time
demotion (batch 32 × 8 heads × 8 tokens). Bytes = bf16 rows read + packed codes and fp16 scale/zero written; bandwidth
as a fraction of a same-run device copy. Times are CUDA-graph replays over four rotating inputs
(`bench_decode.time_rotating`: one call per graph, and one call's share of a 16-call graph); eager launches are
host-bound below ≈ 150 µs, as is the PyTorch reference (eager). Clips are per-head tensors passed with their host bound
(`min_ratio`), as the cache passes them; `--both-builds` also times them without the bound (the per-row dispatch build).
`--bits 2 3` also times 3-bit rows (the keys of the layers calibration gives 3 bits: docs/format.md §6b; unclipped, as
calibration writes them).
Usage: python -m benchmarks.bench_quantize [--both-builds] [--bits 2 3]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os

import torch
import triton

from oscar_zoo.format import layout, reference
from oscar_zoo.runtime import ops

from .bench_decode import IN_GRAPH, copy_bandwidth, time_rotating

ROWS = [  # (B, H_kv, T, D)
    (1, 8, 32768, 128),
    (1, 8, 131072, 128),
    (8, 8, 16384, 128),
    (1, 3, 131072, 64),
    (32, 8, 8, 128),  # demotion step
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--both-builds", action="store_true",
                    help="time the per-row dispatch (a ratio tensor without its host bound) besides the bound's build")
    ap.add_argument("--bits", type=int, nargs="+", default=[layout.BITS], choices=layout.KEY_BITS,
                    help="code widths to time (default 2)")
    ap.add_argument("--key-block", type=int, default=0, choices=(0, *layout.KEY_BLOCKS),
                    help="also time keys per channel over blocks of this many tokens (`ops.quantize_pack_channel`, "
                         "docs/format.md §6d; a demotion is one block)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for (B, H, T, D), bits in itertools.product(ROWS, args.bits):
        xs = [torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]
        clip = torch.full((H, 1), layout.DEFAULT_K_CLIP if bits == 2 else 1.0, device="cuda")
        codes_ref, sz_ref = reference.quantize_pack_ref(xs[0], clip, bits=bits)
        it = itertools.count()
        ms_ref = triton.testing.do_bench(lambda: reference.quantize_pack_ref(xs[next(it) % 4], clip, bits=bits),
                                         warmup=5, rep=50)  # fmt: skip
        nbytes = B * H * T * (2 * D + layout.bytes_per_token(D, D, bits))
        # the cache passes its per-head clips with their host bound (min_ratio); without it, the per-row dispatch
        for bound in (None, float(clip.min())) if args.both_builds else (float(clip.min()),):
            codes, sz = ops.quantize_pack(xs[0], clip, min_ratio=bound, bits=bits)
            exact = torch.equal(codes, codes_ref) and torch.equal(sz.view(torch.int16), sz_ref.view(torch.int16))
            calls = [functools.partial(ops.quantize_pack, x, clip, min_ratio=bound, bits=bits) for x in xs]
            eager, ms, in_graph = time_rotating(calls)
            build = ops.max_m_build(D, bound)
            r = dict(B=B, H_kv=H, T=T, D=D, bits=bits, build=f"top-{build}" if build else "dispatch",
                     kernel_us=ms * 1e3, in_graph_us=in_graph * 1e3, eager_us=eager * 1e3, torch_ref_us=ms_ref * 1e3,
                     bytes=nbytes, bw_frac=nbytes / (ms * 1e-3) / copy_bw, bit_exact=exact)  # fmt: skip
            rows.append(r)
            print(r, flush=True)
        del xs
    for (B, H, T, D), bits in itertools.product(ROWS if args.key_block else [], args.bits):
        T = max(T // args.key_block, 1) * args.key_block  # the demotion row: one block
        xs = [torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]
        codes_ref, sz_ref = reference.quantize_pack_channel_ref(xs[0], args.key_block, bits)
        it = itertools.count()
        ms_ref = triton.testing.do_bench(
            lambda: reference.quantize_pack_channel_ref(xs[next(it) % 4], args.key_block, bits), warmup=5, rep=50)
        nbytes = B * H * T * (2 * D + layout.packed_dim(D, bits)) + B * H * (T // args.key_block) * D * 4
        codes, sz = ops.quantize_pack_channel(xs[0], args.key_block, bits)
        exact = torch.equal(codes, codes_ref) and torch.equal(sz.view(torch.int16), sz_ref.view(torch.int16))
        calls = [functools.partial(ops.quantize_pack_channel, x, args.key_block, bits) for x in xs]
        eager, ms, in_graph = time_rotating(calls)
        r = dict(B=B, H_kv=H, T=T, D=D, bits=bits, build=f"channel/{args.key_block}", kernel_us=ms * 1e3,
                 in_graph_us=in_graph * 1e3, eager_us=eager * 1e3, torch_ref_us=ms_ref * 1e3, bytes=nbytes,
                 bw_frac=nbytes / (ms * 1e-3) / copy_bw, bit_exact=exact)
        rows.append(r)
        print(r, flush=True)
        del xs
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_quantize.json"), "w") as f:
            json.dump(dict(copy_Bps=copy_bw, rows=rows), f, indent=2)
    print("\nCUDA-graph replays, one call per graph (the % of copy bandwidth is of this column); one call's share of a"
          f" graph of {IN_GRAPH}; eager launches (host-bound below ≈ 150 µs)")
    print("| B | H_kv | T | d | bits | build | µs | in-graph µs | eager µs | torch ref µs | MB | % copy bw "
          "| bit-exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['H_kv']} | {r['T']} | {r['D']} | {r['bits']} | {r['build']} | {r['kernel_us']:.1f} | "
              f"{r['in_graph_us']:.1f} | {r['eager_us']:.1f} | {r['torch_ref_us']:.1f} | {r['bytes'] / 1e6:.1f} | "
              f"{r['bw_frac']:.0%} | {r['bit_exact']} |")  # fmt: skip


if __name__ == "__main__":
    main()
