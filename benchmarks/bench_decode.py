"""GPU benchmark: OSCAR tiered INT2 decode attention (`ops.tiered_decode_attention`) vs same-run BF16 SDPA.

Each row: one decode step of one layer, median of `triton.testing.do_bench`, rotating among several cache buffers so L2
never serves a repeat; bytes moved = what the op must read (packed codes + fp16 scale/zero + BF16 tiers + q) plus its
partial (o, lse) traffic; bandwidth as a fraction of a same-run measured device copy. Details go to
$OUT/bench_decode.json when OUT is set. Usage: python -m benchmarks.bench_decode [--quick] [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton

from oscar_zoo.format import layout
from oscar_zoo.runtime import config, ops

SHAPES = [(32, 8, 128), (9, 3, 64)]  # (H_q, H_kv, D): Llama-3-8B/Qwen3-8B class, SmolLM2-135M
BATCHES = [1, 8, 32]
CONTEXTS = [4096, 16384, 32768, 65536, 100_000, 131072]
MEM_BUDGET = 90e9  # bytes of cache buffers per row (all rotations, both formats)


def copy_bandwidth() -> float:
    """Same-run device copy bandwidth (bytes read + written per second) over a 4 GiB buffer."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    del src, dst
    return 2 * (1 << 31) / (ms * 1e-3)


IN_GRAPH = 16  # calls per graph for the in-graph time (a decode step's graph holds every layer's attention)


def time_rotating(calls) -> tuple[float, float, float]:
    """Median ms of one call, rotating over `calls` (one per cache buffer): eager launches, CUDA-graph replays of one
    call each (the way a decode step is served: host launch overhead removed for both OSCAR and SDPA), and one call
    inside a graph of IN_GRAPH calls over the buffers in turn (replay time / IN_GRAPH: a layer's share of a captured
    step, without the graph launch that a whole step pays once)."""
    it = itertools.count()
    eager = triton.testing.do_bench(lambda: calls[next(it) % len(calls)](), warmup=25, rep=200)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for c in calls:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            c()
        graphs.append(g)
    graph = triton.testing.do_bench(lambda: graphs[next(it) % len(graphs)].replay(), warmup=25, rep=200)
    many = torch.cuda.CUDAGraph()
    with torch.cuda.graph(many):
        for i in range(IN_GRAPH):
            calls[i % len(calls)]()
    in_graph = triton.testing.do_bench(many.replay, warmup=25, rep=200) / IN_GRAPH
    del graphs, many
    return eager, graph, in_graph


def graph_floor_us() -> float:
    """What a CUDA-graph replay of one tiny kernel takes, timed like the rows' one-call-per-graph column: the part of
    that column no kernel change can remove."""
    x = torch.zeros(1, device="cuda")
    return time_rotating([lambda: x.add_(1)])[1] * 1e3


def int2_cache(B, H_kv, D, L, gen, key_bits=layout.BITS, key_block=0):
    """A fresh random three-tier cache of L tokens (random codes and scale/zero: timing does not depend on values);
    history keys coded with `key_bits` bits (docs/format.md §6b), values with 2; key_block > 0: keys per channel over
    blocks of that many tokens (§6d: whole blocks in the history, the rest in the recent tier); per row, the history
    holds whole demotions of FLUSH tokens, as the cache's (3-bit keys are stored in pairs: an even count)."""
    sink = layout.SINK
    hist = L - sink - layout.RECENT
    hist -= hist % (key_block or layout.FLUSH)
    recent = L - sink - hist
    dev = "cuda"
    c = dict(
        sink_k=torch.randn(B, H_kv, sink, D, device=dev, dtype=torch.bfloat16, generator=gen),
        sink_v=torch.randn(B, H_kv, sink, D, device=dev, dtype=torch.bfloat16, generator=gen),
        sink_len=torch.full((B,), sink, dtype=torch.int32, device=dev),
        codes_k=torch.randint(0, 256, (B, H_kv, hist, layout.packed_dim(D, key_bits)), dtype=torch.uint8, device=dev,
                              generator=gen),
        scale_zero_k=(torch.rand(B, H_kv, hist // key_block, D, 2, device=dev, generator=gen) if key_block else
                      torch.rand(B, H_kv, hist, 1, 2, device=dev, generator=gen)).mul(2).to(torch.float16),
        codes_v=torch.randint(0, 256, (B, H_kv, D // 4, hist), dtype=torch.uint8, device=dev,
                              generator=gen).transpose(2, 3),
        # (token-major, as the cache stores V's codes: layout.history_codes)
        scale_zero_v=torch.rand(B, H_kv, hist, 1, 2, device=dev, generator=gen).mul(2).to(torch.float16),
        hist_len=torch.full((B,), hist, dtype=torch.int32, device=dev),
        recent_k=torch.randn(B, H_kv, layout.RECENT + (key_block or layout.FLUSH), D, device=dev, dtype=torch.bfloat16,
                             generator=gen),
        recent_v=torch.randn(B, H_kv, layout.RECENT + (key_block or layout.FLUSH), D, device=dev, dtype=torch.bfloat16,
                             generator=gen),
        recent_len=torch.full((B,), recent, dtype=torch.int32, device=dev),
    )
    return c


def int2_bytes(B, H_q, H_kv, D, L, key_bits=layout.BITS, key_block=0) -> int:
    hist = L - layout.SINK - layout.RECENT
    hist -= hist % (key_block or layout.FLUSH)  # (as `int2_cache`)
    # a token's K and V history rows (per-channel keys: one pair per channel and block, 4·D / key_block bytes a token)
    row = layout.bytes_per_token(D, D, key_bits) + layout.bytes_per_token(D, D)
    row += (4 * D // key_block - 4) if key_block else 0
    cache = B * H_kv * (hist * row + 2 * (L - hist) * D * 2)
    cuda = torch.device("cuda")
    S = (ops.int2_splits(B, H_kv, H_q // H_kv, D, hist, cuda) + ops.bf16_splits(layout.SINK, cuda)
         + ops.bf16_splits(layout.RECENT + layout.FLUSH, cuda))  # the splits tiered_decode_attention launches
    partials = 2 * B * H_q * S * (D + 1) * 4  # written once, read once by the merge
    return cache + partials + B * H_q * D * 2


def bench_row(H_q, H_kv, D, B, L, gen, copy_bw, key_bits=layout.BITS, key_block=0):
    bf16_bytes = 2 * B * H_kv * L * D * 2
    int2_b = int2_bytes(B, H_q, H_kv, D, L, key_bits, key_block)
    n_buf = int(max(2, min(4, MEM_BUDGET // (bf16_bytes + int2_b))))
    if bf16_bytes * 1 + int2_b * 2 > MEM_BUDGET:
        return None
    sm_scale = D**-0.5
    q = torch.randn(B, H_q, D, device="cuda", dtype=torch.bfloat16, generator=gen)

    # OSCAR
    caches = [int2_cache(B, H_kv, D, L, gen, key_bits, key_block) for _ in range(n_buf)]
    calls = [lambda c=c: ops.tiered_decode_attention(q, **c, sm_scale=sm_scale, key_block=key_block)
             for c in caches]
    eager_int2, ms_int2, in_graph_int2 = time_rotating(calls)
    del caches, calls

    # same-run BF16 baseline
    n_bf = int(max(1, min(4, (MEM_BUDGET - int2_b) // bf16_bytes)))
    kv = [
        (
            torch.randn(B, H_kv, L, D, device="cuda", dtype=torch.bfloat16, generator=gen),
            torch.randn(B, H_kv, L, D, device="cuda", dtype=torch.bfloat16, generator=gen),
        )
        for _ in range(n_bf)
    ]
    q4 = q.unsqueeze(2)
    calls = [lambda k=k, v=v: F.scaled_dot_product_attention(q4, k, v, scale=sm_scale, enable_gqa=True) for k, v in kv]
    eager_sdpa, ms_sdpa, in_graph_sdpa = time_rotating(calls)
    del kv, calls
    torch.cuda.empty_cache()
    bw = int2_b / (ms_int2 * 1e-3)
    return dict(
        H_q=H_q, H_kv=H_kv, D=D, batch=B, context=L, key_bits=key_bits, key_block=key_block, oscar_us=ms_int2 * 1e3,
        sdpa_us=ms_sdpa * 1e3,
        speedup=ms_sdpa / ms_int2, oscar_bytes=int2_b, bf16_bytes=bf16_bytes, oscar_GBps=bw / 1e9,
        oscar_bw_frac=bw / copy_bw, sdpa_bw_frac=bf16_bytes / (ms_sdpa * 1e-3) / copy_bw,
        floor_us=int2_b / copy_bw * 1e6, buffers=n_buf, oscar_eager_us=eager_int2 * 1e3,
        sdpa_eager_us=eager_sdpa * 1e3, eager_speedup=eager_sdpa / eager_int2,
        oscar_in_graph_us=in_graph_int2 * 1e3, sdpa_in_graph_us=in_graph_sdpa * 1e3,
        in_graph_speedup=in_graph_sdpa / in_graph_int2,
    )  # fmt: skip


C = config.DecodeConfig
# RuntimeConfig.decode_128 / decode_64 candidates (tile tokens, warps, stages, programs per SM, register cap), each
# tried on its own head dim's rows. programs per SM is what an SM holds at once (registers and shared memory, from
# `python -m benchmarks.experiments.kernel_sass --shape 32,8,128 --key-bits 3 --key-block 128 --block-n … --warps …`):
# 64-token one-warp programs (the settings in force) against two- and four-warp programs, 128-token tiles (a key block's
# q·s operands loaded once per tile, not twice) and register caps that let more warps in
SWEEP = {
    128: [C(64, 1, 3, 8, None), C(128, 2, 3, 5, None), C(64, 2, 3, 6, None), C(64, 2, 3, 8, 128),
          C(128, 2, 2, 4, None), C(128, 4, 3, 3, None)],
    64: [C(64, 1, 3, 12, 168), C(64, 2, 3, 6, None), C(64, 2, 3, 8, 128), C(128, 2, 3, 4, None)],
}
SWEEP_ROWS = [((32, 8, 128), 1, 100_000), ((32, 8, 128), 32, 32768), ((32, 8, 128), 1, 4096), ((9, 3, 64), 1, 100_000),
              ((9, 3, 64), 8, 32768)]  # fmt: skip


def _bench_rows(rows, label: str, setting: dict, gen, copy_bw, out: list, key_bits=layout.BITS, key_block=0) -> None:
    """Time `rows` under the setting in force, tagging each result with `setting` and printing it after `label`."""
    for (H_q, H_kv, D), B, L in rows:
        r = bench_row(H_q, H_kv, D, B, L, gen, copy_bw, key_bits, key_block)
        if r is None:
            continue
        r.update(setting)
        out.append(r)
        print(f"{label} {H_q}/{H_kv} d={D} B={B} L={L}: {r['oscar_us']:.1f} us, sdpa {r['sdpa_us']:.1f} us "
              f"({r['speedup']:.2f}x), {r['oscar_bw_frac']:.0%} of copy bandwidth", flush=True)  # fmt: skip


def history_error(H_q, H_kv, D, gen, key_bits, key_block, B=2, L=4480) -> float:
    """The INT2 history's attention by the kernel under the settings in force, against the reference's float
    dequantization and softmax (`ops._int2_partial_ref`): the largest |difference| over the largest |o|. A launch
    setting that breaks the kernel gives O(1); the bfloat16 dots give ≈ 1e-2 or less."""
    c = int2_cache(B, H_kv, D, L, gen, key_bits, key_block)
    q = torch.randn(B, H_q, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    hist = (c["codes_k"], c["scale_zero_k"], c["codes_v"], c["scale_zero_v"], c["hist_len"])
    o, lse = ops.decode_int2_partial(q, *hist, sm_scale=D**-0.5, key_block=key_block)
    o_ref, lse_ref = ops._int2_partial_ref(q, *hist, D**-0.5, 1, key_bits, key_block)
    o, o_ref = ops.merge_partials(o, lse)[0], ops.merge_partials(o_ref, lse_ref)[0]
    return ((o - o_ref).abs().max() / o_ref.abs().max()).item()


def sweep(gen, copy_bw, rows=SWEEP_ROWS, key_bits=layout.BITS, key_block=0):
    """Try launch settings of the decode kernel on `rows` with these keys: each head dim's candidates on its rows,
    each first checked against the reference (`history_error`, printed as "err")."""
    out, base = [], config.current()
    for D, candidates in SWEEP.items():
        dim_rows = [r for r in rows if r[0][2] == D]
        for cfg in candidates:
            with config.use(dataclasses.replace(base, **{f"decode_{D}": cfg})):
                (H_q, H_kv, _), _, _ = dim_rows[0]
                err = history_error(H_q, H_kv, D, gen, key_bits, key_block)
                _bench_rows(dim_rows, f"sweep {cfg} err {err:.1e}", dataclasses.asdict(cfg) | dict(error=err), gen,
                            copy_bw, out, key_bits, key_block)  # fmt: skip
    return out


TILES_ROWS = [((9, 3, 64), 1, 4096), ((9, 3, 64), 1, 16384), ((9, 3, 64), 1, 32768), ((9, 3, 64), 1, 100_000),
              ((32, 8, 128), 1, 4096), ((32, 8, 128), 1, 32768), ((32, 8, 128), 1, 100_000), ((9, 3, 64), 8, 4096)]


def sweep_tiles(gen, copy_bw, values=(2, 4, 8, 16)):
    """Try `RuntimeConfig.decode_min_tiles` (history tiles per split at least; it sets the split count at short
    contexts) on short-context rows, mostly batch 1."""
    out, base = [], config.current()
    for tiles in values:
        with config.use(dataclasses.replace(base, decode_min_tiles=tiles)):
            _bench_rows(TILES_ROWS, f"tiles {tiles}", dict(min_tiles=tiles), gen, copy_bw, out)
    return out


QUICK_ROWS = [((32, 8, 128), 1, 4096), ((32, 8, 128), 1, 100_000), ((32, 8, 128), 32, 32768),
              ((9, 3, 64), 1, 4096), ((9, 3, 64), 1, 32768), ((9, 3, 64), 1, 100_000), ((9, 3, 64), 8, 32768)]
# the rows the kernel's bandwidth targets name: batch 8 at 32K and 100K and batch 1 at 100K, both head dims
FLOOR_ROWS = [(shape, B, L) for shape in SHAPES for B, L in ((8, 32768), (8, 100_000), (1, 100_000))]


def sweep_variants(gen, copy_bw, slacks=(0.0, 8.0)):
    """Programmatic dependent launch off/on × `DecodeConfig.rescale_slack` values (both head dims), on the headline
    rows; each variant's rows in one pass, the variants interleaved twice so drift shows."""
    out, base = [], config.current()
    for rep in range(2):
        for pdl in (False, True):
            for slack in slacks:
                with config.use(dataclasses.replace(base, pdl=pdl).with_decode(rescale_slack=slack)):
                    setting = dict(pdl=pdl, rescale_slack=slack, rep=rep)
                    _bench_rows(QUICK_ROWS, f"variant pdl={pdl} slack={slack}", setting, gen, copy_bw, out)
    return out


def sweep_merge(gen, copy_bw, values):
    """Try `RuntimeConfig.merge_tile` (elements per merge step: how many splits one step takes) on the headline rows,
    the values interleaved twice so drift shows."""
    out, base = [], config.current()
    for rep in range(2):
        for tile in values:
            with config.use(dataclasses.replace(base, merge_tile=tile)):
                _bench_rows(QUICK_ROWS, f"merge tile {tile}", dict(merge_tile=tile, rep=rep), gen, copy_bw, out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="headline rows only")
    ap.add_argument("--floor", action="store_true", help="the bandwidth-target rows only: batch 8 at 32K and 100K, "
                    "batch 1 at 100K, both head dims")
    ap.add_argument("--sweep", action="store_true", help="try launch settings first (with --floor: on those rows, with "
                    "the first --key-bits and --key-block)")
    ap.add_argument("--sweep-tiles", type=int, nargs="*", metavar="N",
                    help="try these RuntimeConfig.decode_min_tiles values (default 2 4 8 16) on short-context rows, "
                         "then stop")
    ap.add_argument("--sweep-variants", action="store_true",
                    help="programmatic dependent launch off/on × rescale slack 0/8 on the headline rows, then stop")
    ap.add_argument("--sweep-merge", type=int, nargs="+", metavar="N",
                    help="try these RuntimeConfig.merge_tile values on the headline rows, then stop")
    ap.add_argument("--key-bits", type=int, nargs="+", default=[layout.BITS], choices=layout.KEY_BITS,
                    help="time each row with history keys of these bit widths (docs/format.md §6b; default 2)")
    ap.add_argument("--key-block", type=int, nargs="+", default=[0], choices=(0, *layout.KEY_BLOCKS),
                    help="time each row with keys per row (0, the default) and/or per channel over blocks of these "
                         "many tokens (docs/format.md §6d)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth()
    floor = graph_floor_us()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {copy_bw / 1e12:.2f} TB/s, a one-kernel graph "
          f"replay {floor:.1f} us", flush=True)  # fmt: skip
    result = dict(device=torch.cuda.get_device_name(), copy_Bps=copy_bw, graph_floor_us=floor, torch=torch.__version__,
                  triton=triton.__version__, rows=[])  # fmt: skip
    if args.sweep_tiles is not None:
        result["sweep_tiles"] = sweep_tiles(gen, copy_bw, args.sweep_tiles or (2, 4, 8, 16))
    if args.sweep:  # on the --floor rows with the first --key-bits and --key-block, if given
        result["sweep"] = sweep(gen, copy_bw, FLOOR_ROWS if args.floor else SWEEP_ROWS, args.key_bits[0],
                                args.key_block[0])
    if args.sweep_variants:
        result["sweep_variants"] = sweep_variants(gen, copy_bw)
    if args.sweep_merge:
        result["sweep_merge"] = sweep_merge(gen, copy_bw, args.sweep_merge)
    combos = [(s, B, L) for s in SHAPES for B in BATCHES for L in CONTEXTS]
    if args.quick:
        combos = QUICK_ROWS
    if args.floor:
        combos = FLOOR_ROWS
    if args.sweep_tiles is not None or args.sweep_variants or args.sweep_merge:
        combos = []
    for ((H_q, H_kv, D), B, L), kb, blk in itertools.product(combos, args.key_bits, args.key_block):
        r = bench_row(H_q, H_kv, D, B, L, gen, copy_bw, kb, blk)
        if r is None:
            print(f"skip {H_q}/{H_kv} d={D} B={B} L={L}: does not fit", flush=True)
            continue
        result["rows"].append(r)
        print(f"{H_q}/{H_kv} d={D} B={B} L={L} K{kb} block {blk}: oscar {r['oscar_us']:.1f} us, "
              f"sdpa {r['sdpa_us']:.1f} us; "
              f"in a graph of {IN_GRAPH}: {r['oscar_in_graph_us']:.1f} / {r['sdpa_in_graph_us']:.1f} us", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_decode.json"), "w") as f:
            json.dump(result, f, indent=2)
    if not result["rows"]:
        return
    print(f"\nCUDA-graph replays, one call per graph; then one call in a graph of {IN_GRAPH} (OSCAR, SDPA, speedup); "
          "eager launches in the last two columns")
    print("| heads q/kv | d | batch | context | K bits | K block | OSCAR µs | SDPA µs | speedup | OSCAR MB | GB/s "
          "| % copy bw | floor µs | in-graph OSCAR µs | in-graph SDPA µs | in-graph speedup | eager OSCAR µs "
          "| eager SDPA µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['H_q']}/{r['H_kv']} | {r['D']} | {r['batch']} | {r['context']} | {r['key_bits']} | "
              f"{r['key_block'] or 'row'} | "
              f"{r['oscar_us']:.1f} | {r['sdpa_us']:.1f} | {r['speedup']:.2f}x | {r['oscar_bytes'] / 1e6:.1f} | "
              f"{r['oscar_GBps']:.0f} | "
              f"{r['oscar_bw_frac']:.0%} | {r['floor_us']:.1f} | {r['oscar_in_graph_us']:.1f} | "
              f"{r['sdpa_in_graph_us']:.1f} | {r['in_graph_speedup']:.2f}x | {r['oscar_eager_us']:.1f} | "
              f"{r['sdpa_eager_us']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
