"""Data-parallel calibration scaling: the library's `calibrate(..., dp=...)` on a random-weight model of real shapes,
run as N ranks under torchrun (N = 1 or 2; also runnable plainly as one process), and a device-mapped mode for a model
spread over every visible GPU.

Every rank builds the same random model from `--seed` (default Qwen3-8B shapes: 36 layers, 32/8 heads, d = 128, hidden
4096, intermediate 12288, vocab 151936; bf16 on the GPU, float32 with `--device cpu`) and the same random token ids
(`--tokens` split into `--seq-len` sequences, plus `--heldout` held-out sequences), warms the capture path up on one
batch, then times one `calibrate()` end to end (both capture passes, all-reduces, held-out capture, eigendecomposition
and clip search on rank 0) with a fresh accumulator store. Rank 0 writes to `--out` (default $OUT, else the current
folder):

  scaling_<tag>.json         wall time, tokens/s, world size, per-phase seconds (rank 0), device, shapes, peak memory
  scaling_<tag>.safetensors  the rotations, eigenvalues and clips, plus the reduced float64 targets and their float64
                             eigenvalues (`--no-targets` leaves the targets out)

<tag> is `w<world size>` (or `devmap`), unless `--tag` names it. GPU ranks use NCCL (NCCL_NVLS_ENABLE=0 unless set);
CPU ranks use gloo. For bit-identical activations between a 1-rank and an N-rank run, make the sequences per rank a
multiple of `--batch-size` (then every rank batches exactly the sequences one process would).

Usage (repo root):
  torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_calibrate_scaling --tokens 65536 --tag w2
  python -m benchmarks.bench_calibrate_scaling --tokens 65536 --tag w1            # one GPU, no process group
  python -m benchmarks.bench_calibrate_scaling --compare OUT/scaling_w1.safetensors OUT/scaling_w2.safetensors
  python -m benchmarks.bench_calibrate_scaling --device-map auto --shape qwen3-32b --tokens 32768   # all GPUs
  # tiny CPU check: --device cpu --layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --head-dim 16 ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936},
    "qwen3-32b": {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936},
}
TENSORS = ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "k_clip", "v_clip")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="model shapes (default qwen3-8b; qwen3-32b with --device-map)")
    ap.add_argument("--layers", type=int, help="number of decoder layers (default: the shape's)")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--tokens", type=int, default=65536, help="calibration tokens (all ranks together)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--heldout", type=int, default=1, help="held-out sequences for the clip search")
    ap.add_argument("--clip", default="search", choices=["search", "fixed"])
    ap.add_argument("--key-block", type=int, default=0,
                    help="calibrate's --key-block (default 0: keys per row, so the clip search runs, the work timed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per process on cpu")
    ap.add_argument("--device-map", choices=["none", "auto"], default="none",
                    help="auto: one process, the layers split evenly over every visible GPU")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up capture runs on one batch before timing")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else .)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--no-targets", action="store_true", help="leave the float64 targets out of the safetensors")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two scaling_*.safetensors and exit")
    ap.add_argument("--predict", nargs=2, metavar=("ONE", "TWO"),
                    help="predict N-GPU wall times from a 1-GPU and a 2-GPU scaling_*.json and exit")
    ap.add_argument("--gpus", type=int, nargs="+", default=[4, 8], help="N for --predict")
    args = ap.parse_args(argv)
    if args.shape is None:
        args.shape = "qwen3-32b" if args.device_map == "auto" else "qwen3-8b"
    return args


def model_config(args):
    from transformers import Qwen3Config

    shape = dict(SHAPES[args.shape])
    for flag, key in (("layers", "num_hidden_layers"), ("hidden", "hidden_size"),
                      ("intermediate", "intermediate_size"), ("heads", "num_attention_heads"),
                      ("kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"), ("vocab", "vocab_size")):
        if getattr(args, flag) is not None:
            shape[key] = getattr(args, flag)
    return Qwen3Config(**shape, max_position_embeddings=max(40960, args.seq_len), tie_word_embeddings=False)


def build_model(config, device: str, dtype: torch.dtype, seed: int):
    """Random model built directly on `device` (every rank: the same weights from the same seed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)  # seeds the CPU and every CUDA generator alike
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def build_device_mapped(config, devices: list, dtype: torch.dtype, seed: int):
    """Random model spread over `devices` (ints: GPUs; "cpu" for a host check) without ever holding it whole in one
    place: the module tree is built on the meta device, the layers are split evenly over the devices (embeddings and
    RoPE on the first, final norm and lm_head on the last), each module is materialised on its own device and
    initialised there (normal(0, initializer_range) for matrices, ones for norms), then accelerate's hooks move the
    activations between devices."""
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    L = config.num_hidden_layers
    device_map = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    device_map.update({f"model.layers.{i}": devices[i * len(devices) // L] for i in range(L)})
    device_map.update({"model.norm": devices[-1], "lm_head": devices[-1]})
    for index, (name, where) in enumerate(device_map.items()):
        dev = torch.device("cuda", where) if isinstance(where, int) else torch.device(where)
        if name == "model.rotary_emb":  # its inv_freq is a computed, non-persistent buffer: build it anew there
            with dev:
                model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
            continue
        module = model.get_submodule(name).to_empty(device=dev)
        gen = torch.Generator(dev).manual_seed(seed * 100_003 + index)
        with torch.no_grad():
            for p in module.parameters():
                if p.dim() == 1:  # RMSNorm weights (q_norm, k_norm, layer norms, final norm)
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, config.initializer_range, generator=gen)
    dispatch_model(model, device_map=device_map)
    return model.eval(), device_map


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args) -> dict | None:
    from oscar_zoo.calibration import calibration_passes as pipeline, distributed
    from oscar_zoo.calibration.calibration_passes import (
        AccumulatorStore,
        CalibrationSettings,
        accumulate,
        calibrate,
    )
    from oscar_zoo.models import LoadedModel, arch_info, model_identity
    from oscar_zoo.texts import TokenSequences

    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        sys.exit("--device cuda: no GPU visible (use --device cpu for the CPU check)")
    if on_gpu:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device machines need it off)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))

    dp = distributed.from_env(args.device)  # None for one process (plain run, or torchrun with one rank)
    if dp is not None and args.device_map == "auto":
        sys.exit("--device-map auto is one process over every GPU: run it without torchrun")
    rank, world = (dp.rank, dp.world) if dp else (0, 1)
    device = distributed.rank_device(dp, args.device) if dp else ("cuda:0" if on_gpu else "cpu")
    barrier = dp.barrier if dp else (lambda: None)

    config = model_config(args)
    t0 = time.perf_counter()
    device_map = None
    if args.device_map == "auto":
        devices = list(range(torch.cuda.device_count())) if on_gpu else ["cpu", "cpu"]
        model, device_map = build_device_mapped(config, devices, dtype, args.seed)
    else:
        model = build_model(config, device, dtype, args.seed)
    sync(device)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    info = arch_info(config)

    T, N = args.seq_len, args.tokens // args.seq_len
    if N < world:
        sys.exit(f"--tokens {args.tokens} gives {N} sequences of {T}: fewer than {world} ranks")
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, config.vocab_size, (N + args.heldout, T), generator=g)
    seqs = TokenSequences(ids[:N], ids[N:], "random", False)
    loaded = LoadedModel(model, None, info, model_identity(f"random-{args.shape}", None, config), "random")
    settings = CalibrationSettings(batch_size=args.batch_size, clip=args.clip, seed=args.seed, key_block=args.key_block)
    if rank == 0:
        print(f"world {world}, {args.shape}-based shapes: {config.num_hidden_layers} layers, "
              f"hidden {config.hidden_size}, heads {config.num_attention_heads}/{config.num_key_value_heads}"
              f"×{config.head_dim}, {params / 1e9:.2f} B params {str(dtype).removeprefix('torch.')}, built in "
              f"{build_s:.1f} s on {device if not device_map else 'a device map'}; "
              f"{N} × {T} tokens, batch {args.batch_size}", flush=True)

    noop = lambda *a, **k: None
    with tempfile.TemporaryDirectory() as folder:
        warm = TokenSequences(ids[: args.batch_size], ids[N:], "random", False)
        for i in range(args.warmup):  # forward, capture, float64 products (no collectives)
            accumulate(loaded, warm, settings, AccumulatorStore(Path(folder) / f"warm{i}"), noop)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()

    marks: dict[str, list[float]] = {}

    def progress(desc, done, total, rate="", run_left=None):
        sync(device)
        marks.setdefault(desc, []).append(time.perf_counter())

    with tempfile.TemporaryDirectory() as folder:
        barrier()
        sync(device)
        reduced: dict = {}

        def spy(*a, **k):  # keep the reduced float64 targets calibrate() computes (it returns only rotations)
            out = accumulate(*a, **k)
            reduced["key"], reduced["value"] = out[0], out[1]
            return out

        pipeline.accumulate = spy
        t0 = time.perf_counter()
        try:
            result = calibrate(loaded, seqs, settings, progress=progress, store_dir=folder, dp=dp)
        finally:
            pipeline.accumulate = accumulate
        sync(device)
        barrier()  # the other ranks wait for rank 0's eigendecomposition and clip search
        wall = time.perf_counter() - t0

    peak = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None
    if dp is not None:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, {"rank": rank, "peak_gib": peak, "phases": {
            d: m[-1] - m[0] for d, m in marks.items()}})
    else:
        gathered = None
    if rank != 0:
        return None

    phases = {d: round(m[-1] - m[0], 4) for d, m in marks.items()}
    tokens = N * T
    capture = phases.get("pass 1/2: key target", 0.0) + phases.get("pass 2/2: value target", 0.0)
    report = {
        "mode": "device-map" if device_map else "data-parallel",
        "world_size": world, "tokens": tokens, "sequences": N, "seq_len": T, "batch_size": args.batch_size,
        "heldout_sequences": args.heldout, "clip": args.clip, "seed": args.seed, "shape": args.shape,
        "config": {k: getattr(config, k) for k in SHAPES["qwen3-8b"]}, "params": params,
        "dtype": str(dtype).removeprefix("torch."), "backend": torch.distributed.get_backend() if dp else None,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu", "gpus_visible": torch.cuda.device_count(),
        "device_map": {k: str(v) for k, v in device_map.items()} if device_map else None,
        "build_s": round(build_s, 3), "wall_s": round(wall, 4), "tokens_per_s": round(tokens / wall, 1),
        "phases_rank0_s": phases,
        "capture_tokens_per_s": round(tokens / capture, 1) if capture else None,
        "peak_gib_rank0": peak, "ranks": gathered,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    out = Path(args.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or ("devmap" if device_map else f"w{world}")
    from oscar_zoo.artifacts import save_tensors

    tensors = {name: getattr(result.rotations, name) for name in TENSORS}
    if not args.no_targets:
        for name in ("key", "value"):
            target = reduced[name].mean().cpu()  # float64 [L, H, D, D], the sums over all ranks / their weights
            tensors[f"{name}_target"] = target
            tensors[f"{name}_eigenvalues64"] = torch.linalg.eigvalsh(target)
    save_tensors(out / f"scaling_{tag}.safetensors", tensors)
    (out / f"scaling_{tag}.json").write_text(json.dumps(report, indent=2))
    report["files"] = [str(out / f"scaling_{tag}.json"), str(out / f"scaling_{tag}.safetensors")]
    return report


def compare(a: str, b: str) -> dict:
    """Max abs difference of every tensor the two files share (relative: over the max |A|)."""
    from oscar_zoo.format.io import load_tensors

    ta, tb = load_tensors(Path(a)), load_tensors(Path(b))
    rows = {}
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name].double(), tb[name].double()
        if x.shape != y.shape:
            rows[name] = {"error": f"shapes {tuple(x.shape)} vs {tuple(y.shape)}"}
            continue
        diff = (x - y).abs().max().item() if x.numel() else 0.0
        scale = x.abs().max().item() if x.numel() else 0.0
        rows[name] = {"dtype": str(ta[name].dtype).removeprefix("torch."), "max_abs_diff": diff,
                      "max_rel_diff": diff / scale if scale else diff}
    print(f"compare {a} vs {b}")
    print("| tensor | dtype | max abs diff | / max abs |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | — | {r['error']} | — |")
        else:
            print(f"| {name} | {r['dtype']} | {r['max_abs_diff']:.3e} | {r['max_rel_diff']:.3e} |")
    return rows


CAPTURE = ("pass 1/2: key target", "pass 2/2: value target")  # data parallel: split by sequences
PER_LAYER = ("rotations", "clip search", "key noise")  # split by layers, round-robin ("key noise": --clip fixed)


def _search_s(phases: dict) -> float:
    """The per-layer stage after the rotations: the clip search, or (--clip fixed) the key noise alone."""
    return phases.get("clip search", phases.get("key noise", 0))


def predict(one: dict, two: dict, gpus: list[int]) -> list[dict]:
    """N-GPU wall time from measured 1- and 2-GPU runs of the same problem. Per phase (rank 0's times):
    capture passes scale as 1/N at the parallel efficiency measured at N = 2; the eigendecompositions and the clip
    search as the largest layer share, ⌈L/N⌉/L; the held-out capture (a full forward on every rank) and the rest
    of the wall time (start-up, collectives, file writes: wall − Σ phases) stay as measured at N = 2."""
    if one["world_size"] != 1 or two["world_size"] != 2:
        raise SystemExit(f"--predict needs a 1-process and a 2-process report, got worlds {one['world_size']} and "
                         f"{two['world_size']}")
    L = one["config"]["num_hidden_layers"]
    p1, p2 = one["phases_rank0_s"], two["phases_rank0_s"]
    cap1, cap2 = sum(p1.get(k, 0.0) for k in CAPTURE), sum(p2.get(k, 0.0) for k in CAPTURE)
    efficiency = cap1 / (2 * cap2) if cap2 else 1.0
    layer1 = sum(p1.get(k, 0.0) for k in PER_LAYER)
    fixed = p2.get("held-out capture", 0.0) + max(0.0, two["wall_s"] - sum(p2.values()))
    rows = []
    for n in gpus:
        wall = cap1 / (n * efficiency) + layer1 * -(-L // n) / L + fixed
        rows.append({"gpus": n, "wall_s": round(wall, 4), "speedup": round(one["wall_s"] / wall, 3),
                     "capture_s": round(cap1 / (n * efficiency), 4), "per_layer_s": round(layer1 * -(-L // n) / L, 4),
                     "fixed_s": round(fixed, 4), "capture_efficiency": round(efficiency, 4)})
    print(f"prediction from 1 GPU ({one['wall_s']:.3f} s) and 2 GPUs ({two['wall_s']:.3f} s), {L} layers:")
    print("| GPUs | wall s | speedup | capture s | per-layer s | fixed s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gpus']} | {r['wall_s']:.3f} | {r['speedup']:.2f}x | {r['capture_s']:.3f} | "
              f"{r['per_layer_s']:.3f} | {r['fixed_s']:.3f} |")
    return rows


def table(report: dict) -> None:
    p = report["phases_rank0_s"]
    print(f"\n{report['mode']}, {report['shape']} shapes ({report['config']['num_hidden_layers']} layers), "
          f"{report['dtype']}, {report['tokens']} tokens = {report['sequences']}×{report['seq_len']}, batch "
          f"{report['batch_size']}, {report['device']}")
    print("| world | wall s | tokens/s | pass 1 s | held-out s | pass 2 s | rotations s | clip search (or key noise) s "
          "| capture tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    cap = report["capture_tokens_per_s"]
    print(f"| {report['world_size']} | {report['wall_s']:.3f} | {report['tokens_per_s']:,.0f} | "
          f"{p.get('pass 1/2: key target', 0):.3f} | {p.get('held-out capture', 0):.3f} | "
          f"{p.get('pass 2/2: value target', 0):.3f} | {p.get('rotations', 0):.3f} | {_search_s(p):.3f} | "
          f"{f'{cap:,.0f}' if cap else '—'} |")
    if report.get("ranks"):
        names = ("pass 1/2: key target", "held-out capture", "pass 2/2: value target", "rotations")
        print("| rank | pass 1 s | held-out s | pass 2 s | rotations s | clip search (or key noise) s |")
        print("|---|---|---|---|---|---|")
        for r in report["ranks"]:
            print(f"| {r['rank']} | " + " | ".join(f"{r['phases'].get(n, 0):.3f}" for n in names)
                  + f" | {_search_s(r['phases']):.3f} |")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.predict:
        one, two = (json.loads(Path(f).read_text()) for f in args.predict)
        rows = predict(one, two, args.gpus)
        out = args.out or os.environ.get("OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "scaling_predict.json").write_text(json.dumps(rows, indent=2))
        return
    if args.compare:
        rows = compare(*args.compare)
        out = args.out or os.environ.get("OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "scaling_compare.json").write_text(json.dumps(rows, indent=2))
        return
    from oscar_zoo.calibration import distributed

    report, finished = None, False
    try:
        report = run(args)
        finished = True
    finally:
        distributed.shutdown(finished)
    if report is not None:
        print(f"wrote {', '.join(report['files'])}")
        table(report)


if __name__ == "__main__":
    main()
