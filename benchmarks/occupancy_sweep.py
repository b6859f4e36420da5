"""Register caps against resident programs for the decode kernel (ops.DecodeConfig), per head dim, on the rows where
occupancy decides: `PYTHONPATH=.:benchmarks python3 benchmarks/occupancy_sweep.py` (GPU). A cap lower than the
compiler's own count lets more one-warp programs share an SM (65,536 registers) at the price of spills."""

import torch

import bench_decode as bd
from oscar_zoo.runtime import ops

C = ops.DecodeConfig
CANDIDATES = {128: [C(32, 1, 3, 8, None), C(32, 1, 3, 10, 192), C(32, 1, 3, 12, 168)],
              64: [C(64, 1, 3, 12, 168), C(64, 1, 3, 14, 144), C(64, 1, 3, 16, 128)]}  # fmt: skip
ROWS = {128: [((32, 8, 128), 1, 100_000), ((32, 8, 128), 32, 32768), ((32, 8, 128), 1, 4096)],
        64: [((9, 3, 64), 1, 100_000), ((9, 3, 64), 8, 32768), ((9, 3, 64), 1, 32768)]}  # fmt: skip


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = bd.copy_bandwidth()
    default, out = dict(ops.DECODE_CONFIGS), []
    try:
        for D, configs in CANDIDATES.items():
            for cfg in configs:
                ops.DECODE_CONFIGS[D] = cfg
                bd._bench_rows(ROWS[D], str(cfg), {}, gen, bw, out)
    finally:
        ops.DECODE_CONFIGS.update(default)


if __name__ == "__main__":
    main()
