"""The decode kernel's tile settings at head_dim 128 against each key codec (2- and 3-bit keys, per row and per
channel over 128-token blocks), on the rows of the bandwidth targets and a GQA group of 8; OSCAR only (SDPA's times
are in `bench_decode --floor`). `python3 -m benchmarks.experiments.tile_codecs [BITS,BLOCK …]` (GPU); JSON to
$OUT/tile_codecs.json when OUT is set. Each setting is first checked against the reference (`history_error`)."""

import dataclasses
import json
import os
import sys

import torch

from oscar_zoo.runtime import config, ops

from .. import bench_decode as bd

C = config.DecodeConfig
# the settings in force; 128-token two-warp tiles (a key block's operands loaded once per tile) with 2 and 3 stages
CANDIDATES = [C(64, 1, 3, 8, None), C(128, 2, 2, 4, None), C(128, 2, 3, 5, None)]
ROWS = [((32, 8, 128), 8, 32768), ((32, 8, 128), 8, 100_000), ((32, 8, 128), 1, 100_000), ((64, 8, 128), 8, 32768)]


def main(codecs):
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = bd.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    base, out = config.current(), []
    for bits, block in codecs:
        for cfg in CANDIDATES:
            with config.use(dataclasses.replace(base, decode_128=cfg)):
                err = bd.history_error(32, 8, 128, gen, bits, block)
                for (H_q, H_kv, D), B, L in ROWS:
                    caches = [bd.int2_cache(B, H_kv, D, L, gen, bits, block) for _ in range(3)]
                    q = torch.randn(B, H_q, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                    calls = [lambda c=c: ops.tiered_decode_attention(q, **c, sm_scale=D**-0.5, key_block=block)
                             for c in caches]  # fmt: skip
                    ms = bd.time_rotating(calls)[1]
                    frac = bd.int2_bytes(B, H_q, H_kv, D, L, bits, block) / (ms * 1e-3) / bw
                    out.append(dict(bits=bits, block=block, setting=dataclasses.asdict(cfg), H_q=H_q, H_kv=H_kv, B=B,
                                    L=L, us=ms * 1e3, bw_frac=frac, error=err))
                    print(f"{bits}-bit keys, block {block}, {cfg}: {H_q}/{H_kv} B={B} L={L}: {ms * 1e3:.1f} us "
                          f"({frac:.0%}), err {err:.1e}", flush=True)
                    del caches, calls
                    torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tile_codecs.json"), "w") as f:
            json.dump(dict(copy_bw=bw, rows=out), f, indent=1)
    print("\nkeys | tile, warps, stages, programs/SM | " + " | ".join(f"{h}/{k}, B={b}, {n // 1000}K"
                                                             for (h, k, _), b, n in ROWS))  # fmt: skip
    for bits, block in codecs:
        for cfg in CANDIDATES:
            rs = [r for r in out if (r["bits"], r["block"], r["setting"]) == (bits, block, dataclasses.asdict(cfg))]
            cells = " | ".join(f"{r['us']:.1f} µs ({r['bw_frac']:.0%})" for r in rs)
            setting = f"{cfg.block_n}, {cfg.warps}, {cfg.stages}, {cfg.programs_per_sm}"
            print(f"{bits}-bit, block {block} | {setting} | {cells}")


if __name__ == "__main__":
    main([tuple(map(int, c.split(","))) for c in sys.argv[1:]] or [(2, 0), (2, 128), (3, 0), (3, 128)])
