"""Run the quantize/pack kernel on one shape a few times, for a profiler (`ncu`, `nsys`) to attach to.

Usage (GPU machine, repository root):
    ncu -k regex:_quantize_pack --launch-skip 3 --launch-count 1 --section WarpStateStats --section SchedulerStats \
        --section Occupancy --section SpeedOfLight \
        python3 -m benchmarks.experiments.profile_quantize --rows 1048576 --d 128
"""

from __future__ import annotations

import argparse

import torch

from oscar_zoo.format import layout
from oscar_zoo.runtime import ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8 * 131072)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--dispatch", action="store_true", help="no host bound on the clips: the per-row dispatch build")
    args = ap.parse_args()
    x = torch.randn(1, 8, args.rows // 8, args.d, device="cuda", dtype=torch.bfloat16)
    clip = torch.full((8, 1), layout.DEFAULT_K_CLIP, device="cuda")
    for _ in range(args.iters):
        ops.quantize_pack(x, clip, min_ratio=None if args.dispatch else float(clip.min()))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
