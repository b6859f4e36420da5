"""GPU benchmark: calibration throughput on a random-weight model of real shapes (default Qwen3-8B: 36 layers, 32/8
heads, d=128, hidden 4096, intermediate 12288, vocab 151936, bf16), against a plain forward over the same tokens.

Rows: the plain prefill forward (the decoder stack, as calibration runs it); each capture pass of `accumulate()` (pass
1: key + softmax targets; pass 2: weighted value target) with the library's float64 einsum products and its background
checkpoints, and with checkpoints off; the same pass 1 with the products formed in token chunks (float64, or fp32); the
whole `calibrate()` (passes, held-out capture, eigendecomposition, clip search). Also the float32-product error against
float64 on captured q, and the memory plan's activation estimate against the measured peak. Details go to
$OUT/bench_calibrate.json when OUT is set.
Usage: python -m benchmarks.bench_calibrate [--tokens 32768] [--seq-len 2048] [--batch-size 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time

import torch

from oscar_zoo.calibration import memory, targets
from oscar_zoo.calibration.calibration_passes import AccumulatorStore, CalibrationSettings, accumulate, calibrate
from oscar_zoo.calibration.capture import capturing, forward_batches
from oscar_zoo.calibration.targets import group_heads
from oscar_zoo.models import LoadedModel, arch_info, model_identity
from oscar_zoo.texts import TokenSequences

DEVICE = os.environ.get("BENCH_DEVICE", "cuda")  # `cpu` only to smoke-test this script with tiny sizes
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                tie_word_embeddings=False)


def build_model(layers: int):
    """Random bf16 Qwen3 built directly on the GPU (meta-free: parameters are created and initialised there)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**{**QWEN3_8B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval(), config


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


# Ways of forming Σ w x xᵀ per head [H, N, D] → [H, D, D] float64, for comparison with targets.second_moment.
def product_chunks(x, w=None, n=1024, dtype=torch.float64):
    """Products of n-token chunks in `dtype` (more output tiles for the GPU), summed in float64. With float32 (TF32 off)
    bf16·bf16 products are exact, only the within-chunk sums round."""
    H, N, D = x.shape
    S = -(-N // n)
    xc = x.new_zeros(H, S * n, D, dtype=dtype)
    xc[:, :N] = x
    xc = xc.view(H * S, n, D)
    xw = xc
    if w is not None:
        wc = w.new_zeros(H, S * n, dtype=dtype)
        wc[:, :N] = w
        xw = xc * wc.view(H * S, n, 1)
    return torch.bmm(xw.transpose(1, 2), xc).view(H, S, D, D).to(torch.float64).sum(1)


def product_float64_chunks(x, w=None, n=1024):
    return product_chunks(x, w, n, torch.float64)


def product_fp32_chunks(x, w=None, n=1024):
    return product_chunks(x, w, n, torch.float32)


def product_error(model, ids, batch_size: int, n_kv: int) -> dict:
    """Relative error of the fp32-chunk and float64-chunk products against the library's float64 einsum, captured q."""
    grabbed = {}

    def observe(layer, q, k, v, out, scaling):
        if layer in (0, model.config.num_hidden_layers // 2) and layer not in grabbed:
            grabbed[layer] = group_heads(q, n_kv).clone()

    with capturing(model, observe):
        forward_batches(model, ids[:batch_size], batch_size)
    out = {}
    for layer, x in grabbed.items():
        ref = targets.second_moment(x)
        for name, fn in (("fp32_chunks", product_fp32_chunks), ("float64_chunks", product_float64_chunks)):
            err = ((fn(x) - ref).norm() / ref.norm()).item()
            ev_ref, ev = torch.linalg.eigvalsh(ref), torch.linalg.eigvalsh(fn(x))
            rel_eigenvalue = ((ev - ev_ref).abs() / ev_ref.abs().max()).max().item()
            out[f"layer{layer}.{name}"] = {"rel_frobenius": err, "max_rel_eigenvalue": rel_eigenvalue}
    return out


def micro(x) -> dict:
    """ms per product of one q-shaped batch, for each way."""
    out = {}
    for name, fn in (("einsum64", targets.second_moment), ("float64_chunks", product_float64_chunks),
                     ("fp32_chunks", product_fp32_chunks)):
        fn(x)
        out[name] = min(timed(lambda: fn(x)) for _ in range(5)) * 1e3
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--heldout", type=int, default=1)
    args = ap.parse_args()
    import transformers

    cuda = DEVICE == "cuda"
    env = {"device": torch.cuda.get_device_name() if cuda else DEVICE, "torch": torch.__version__,
           "transformers": transformers.__version__,
           **{m: importlib.util.find_spec(m) is not None for m in ("datasets", "accelerate", "triton")}}
    print(env, flush=True)
    t0 = time.perf_counter()
    model, config = build_model(args.layers)
    info = arch_info(config)
    weights = torch.cuda.memory_allocated() if cuda else 0
    peak = (lambda: torch.cuda.max_memory_allocated() - weights) if cuda else (lambda: 0)
    reset = torch.cuda.reset_peak_memory_stats if cuda else (lambda: None)
    print(f"model built in {time.perf_counter() - t0:.1f} s, {weights / 2**30:.1f} GiB", flush=True)
    T, bs = args.seq_len, args.batch_size
    N = args.tokens // T
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (N + args.heldout, T), generator=g)
    seqs = TokenSequences(ids[:N], ids[N:], "random", False)
    loaded = LoadedModel(model, None, info, model_identity("random-qwen3-8b", None, config), "random")
    tokens = N * T
    results: dict = {"env": env, "tokens": tokens, "seq_len": T, "batch_size": bs, "layers": args.layers}

    forward_batches(model, seqs.input_ids[:bs], bs)  # warm-up
    reset()
    fwd = min(timed(lambda: forward_batches(model, seqs.input_ids, bs)) for _ in range(2))
    fwd_peak = peak()
    results["forward_s"] = fwd

    def passes(settings, save=True) -> dict[str, float]:
        """Seconds per pass of accumulate() (fresh store), from its progress callbacks."""
        marks: dict[str, list[float]] = {}

        def progress(desc, done, total, rate="", run_left=None):
            sync()
            marks.setdefault(desc, []).append(time.perf_counter())

        with tempfile.TemporaryDirectory() as folder:
            store = AccumulatorStore(folder)
            if not save:
                store.save = lambda name, tensors, **state: None
            accumulate(loaded, seqs, settings, store, progress)
        return {desc: m[-1] - m[0] for desc, m in marks.items()}

    settings = CalibrationSettings(batch_size=bs)
    passes(settings)  # warm-up of the capture path (allocator, cuBLAS handles)
    reset()
    lib = passes(settings)
    cap_peak = peak()
    lib_nosave = passes(settings, save=False)
    results["library"], results["library_no_checkpoints"] = lib, lib_nosave

    variants = {}
    original = targets.second_moment
    for name, fn in (("float64_chunks", product_float64_chunks), ("fp32_chunks", product_fp32_chunks)):
        targets.second_moment = fn
        try:
            variants[name] = passes(settings, save=False)["pass 1/2: key target"]
        finally:
            targets.second_moment = original
    results["pass1_variants_no_checkpoints"] = variants

    with tempfile.TemporaryDirectory() as folder:
        full = timed(lambda: calibrate(loaded, seqs, settings, store_dir=folder))
    results["calibrate_s"] = full

    results["product_error"] = product_error(model, seqs.input_ids, bs, info.num_kv_heads)
    x = torch.randn(info.num_kv_heads, bs * T * info.group, info.head_dim, device=DEVICE, dtype=torch.bfloat16)
    results["product_ms"] = micro(x)
    plan = memory.plan(config, info, dtype=torch.bfloat16, device=torch.device(DEVICE), batch_size=bs, seq_len=T,
                       heldout_tokens=args.heldout * T)
    gpu = plan.needs[0]
    results["memory"] = {"plan_weights": gpu.weights, "measured_weights": weights, "plan_activations": gpu.activations,
                         "measured_forward_peak": fwd_peak, "measured_capture_peak": cap_peak,
                         "plan_accumulators": gpu.accumulators}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_calibrate.json"), "w") as f:
            json.dump(results, f, indent=2)

    p1, p2 = lib["pass 1/2: key target"], lib["pass 2/2: value target"]
    n1, n2 = lib_nosave["pass 1/2: key target"], lib_nosave["pass 2/2: value target"]
    print(json.dumps(results["product_error"]), flush=True)
    print(f"product ms per q batch [{x.shape[0]}, {x.shape[1]}, {x.shape[2]}]: {results['product_ms']}")
    G = 2**30
    print(f"memory: plan weights {gpu.weights / G:.2f} GiB (measured {weights / G:.2f}); plan activations "
          f"{gpu.activations / G:.2f} GiB vs measured peak above weights: forward {fwd_peak / G:.2f}, "
          f"capture {cap_peak / G:.2f}")
    print(f"\nrandom Qwen3-8B shapes ({args.layers} layers), bf16, {tokens} tokens = {N}×{T}, batch {bs}, "
          f"{env['device']}")
    print("| stage | s | × forward | tokens/s |")
    print("|---|---|---|---|")
    rows = [("plain forward", fwd), ("pass 1 (key + softmax), library", p1), ("pass 2 (weighted value), library", p2),
            ("pass 1, no checkpoints", n1), ("pass 2, no checkpoints", n2),
            ("pass 1, float64 1024-token chunk products, no ckpt", variants["float64_chunks"]),
            ("pass 1, fp32 chunk products, no ckpt", variants["fp32_chunks"]),
            ("full calibrate (passes + held-out + eigh + clip search)", full)]
    for name, s in rows:
        print(f"| {name} | {s:.3f} | {s / fwd:.2f} | {tokens / s:,.0f} |")


if __name__ == "__main__":
    main()
