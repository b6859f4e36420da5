"""Run one decode-attention shape a few times, for a profiler (`ncu`, `nsys`) to attach to.

Usage (GPU machine, repository root):
    ncu -k regex:'_decode_kernel|_merge' --launch-skip 4 --launch-count 2 --set full --import-source yes \
        -o /tmp/decode python3 -m benchmarks.experiments.profile_decode --shape 32/8/128 --batch 1 --context 100000 \
        --key-bits 3 --key-block 128
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from oscar_zoo.format import layout
from oscar_zoo.runtime import config, ops

from ..bench_decode import int2_cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="32/8/128", help="query heads/KV heads/head dim")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=100_000)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--key-bits", type=int, default=layout.BITS, choices=layout.KEY_BITS,
                    help="the history keys' bits (calibrate's default codes most layers' keys at 3)")
    ap.add_argument("--key-block", type=int, default=0, choices=(0, *layout.KEY_BLOCKS),
                    help="keys per channel over blocks of this many tokens (calibrate's default: 128); 0: per row")
    ap.add_argument("--config", help="config.DecodeConfig for every head dim: block_n,warps,stages,programs_per_sm,"
                    "maxnreg (maxnreg 0: none); default: the settings in force")
    args = ap.parse_args()
    cfg = config.current()
    if args.config:
        n, w, st, p, r = (int(x) for x in args.config.split(","))
        decode = config.DecodeConfig(n, w, st, p, r or None)
        cfg = dataclasses.replace(cfg, decode_64=decode, decode_128=decode)
    H_q, H_kv, D = (int(x) for x in args.shape.split("/"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = int2_cache(args.batch, H_kv, D, args.context, gen, args.key_bits, args.key_block)
    q = torch.randn(args.batch, H_q, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    with config.use(cfg):
        for _ in range(args.iters):
            ops.tiered_decode_attention(q, **cache, sm_scale=D**-0.5, key_block=args.key_block)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
