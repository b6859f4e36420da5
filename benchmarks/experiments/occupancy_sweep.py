"""Register caps against resident programs for the decode kernel (config.DecodeConfig), per head dim, on the rows where
occupancy decides: `python3 -m benchmarks.experiments.occupancy_sweep` (GPU). A cap lower than the
compiler's own count lets more one-warp programs share an SM (65,536 registers) at the price of spills."""

import dataclasses

import torch

from oscar_zoo.runtime import config

from .. import bench_decode as bd

C = config.DecodeConfig
CANDIDATES = {128: [C(32, 1, 3, 8, None), C(32, 1, 3, 10, 192), C(32, 1, 3, 12, 168)],
              64: [C(64, 1, 3, 12, 168), C(64, 1, 3, 14, 144), C(64, 1, 3, 16, 128)]}  # fmt: skip
ROWS = {128: [((32, 8, 128), 1, 100_000), ((32, 8, 128), 32, 32768), ((32, 8, 128), 1, 4096)],
        64: [((9, 3, 64), 1, 100_000), ((9, 3, 64), 8, 32768), ((9, 3, 64), 1, 32768)]}  # fmt: skip


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = bd.copy_bandwidth()
    base, out = config.current(), []
    for D, configs in CANDIDATES.items():
        for cfg in configs:
            with config.use(dataclasses.replace(base, **{f"decode_{D}": cfg})):
                bd._bench_rows(ROWS[D], str(cfg), {}, gen, bw, out)


if __name__ == "__main__":
    main()
