"""`verify --needle`'s retrieval grid on a GPU: its wall time, and large samples of it.

Runs `evaluation.needle.run_needle` — the code `verify --needle` runs — with the demo model's shape and tokenizer,
artifact folders and the held-out plays as filler. `--weights` loads model.safetensors from `--model-dir` (the
converted demo model, `$OSCAR_ZOO_CACHE/models/SmolLM2-135M-Instruct-bf16`); without it the model has the same config
but random weights: the time is the same work — every prompt is prefilled and answered with the same number of greedy
steps whatever the weights say — but the accuracies then mean nothing. Needs torch, triton and transformers only; no
`datasets` (the plays are read as files).

Default: the grid `verify --needle` (or `--quick`) runs, its wall time. With `--lengths`, `--depths`, `--trials`,
`--seeds`: that grid once per (seed, artifact), every artifact (`NAME=DIR`, in the order given) on a seed's prompts
before the next seed, starting no run after `--time-budget` seconds: per length, every method's accuracy with its 95 %
Wilson interval and, against BF16 on the same prompts, the prompts only BF16 answers and only the method answers. Each
run's JSON (every prompt's passkey, every method's answer and whether it is right) goes to $OUT.

    python -m benchmarks.bench_needle --model-dir DIR --artifacts DIR --texts DIR [--weights] [--quick]
    python -m benchmarks.bench_needle --model-dir DIR --weights --texts DIR --artifacts default=A k2=B \
        --lengths 1024,2048,4096 --depths 0.1,0.3,0.5,0.7,0.9 --trials 40 --seeds 10 11 --baselines none --batch 20
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from oscar_zoo.artifacts import load_artifacts
from oscar_zoo.evaluation.needle import (
    DEFAULT_DEPTHS,
    QUICK_DEPTHS,
    NeedleSettings,
    answer_is_right,
    default_lengths,
    run_needle,
)
from oscar_zoo.evaluation.stats import wilson
from oscar_zoo.models import arch_info
from oscar_zoo.texts import EVALUATION_PLAYS


def summarize(runs: list[dict], lengths: list[int]) -> list[str]:
    """Per artifact, pooled over its seeds: per length, accuracy [Wilson 95 %] and BF16-only / method-only counts."""
    lines = []
    for name in dict.fromkeys(r["artifact"] for r in runs):
        mine = [r for r in runs if r["artifact"] == name]
        for method in mine[0]["right"]:
            cells = []
            for length in lengths:
                pairs = [(bf, me) for r in mine for (n, _), bf, me in zip(r["prompts"], r["right"]["bf16"],
                                                                         r["right"][method]) if n == length]
                k, n = sum(me for _, me in pairs), len(pairs)
                lo, hi = wilson(k, n)
                only = f" {sum(bf and not me for bf, me in pairs)}/{sum(me and not bf for bf, me in pairs)}"
                cells.append(f"{100 * k / max(n, 1):.1f} [{100 * lo:.0f}, {100 * hi:.0f}]"
                             + ("" if method == "bf16" else only))
            n_all = sum(len(r["prompts"]) for r in mine)
            k_all = sum(sum(r["right"][method]) for r in mine)
            lines.append(f"| {name} | {method} | {len(mine)} seeds, {n_all} prompts | " + " | ".join(cells)
                         + f" | {100 * k_all / n_all:.1f} |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True, help="config.json and tokenizer files of the demo model")
    ap.add_argument("--weights", action="store_true", help="load model.safetensors from --model-dir")
    ap.add_argument("--artifacts", required=True, nargs="+", help="artifact folders, DIR or NAME=DIR")
    ap.add_argument("--texts", required=True, help="folder of the bundled plays (<play>_gut.txt)")
    ap.add_argument("--quick", action="store_true", help="the --needle-quick grid")
    ap.add_argument("--baselines", default="naive,hadamard", help="verify's default needle baselines; none for none")
    ap.add_argument("--lengths", help="comma-separated prompt lengths (default: verify's)")
    ap.add_argument("--depths", help="comma-separated needle depths (default: verify's)")
    ap.add_argument("--trials", type=int, help="prompts per (length, depth) (default: verify's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="one grid per seed and artifact")
    ap.add_argument("--batch", type=int, default=1, help="prompts of one length per batch (verify --needle-batch)")
    ap.add_argument("--protocol", default="follow-up", help="verify --needle-protocol: follow-up or prompt")
    ap.add_argument("--time-budget", type=float, default=math.inf, help="start no further run after this many s")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    config = AutoConfig.from_pretrained(args.model_dir)
    if args.weights:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to(device).eval()
    texts = [(Path(args.texts) / f"{play}_gut.txt").read_text(encoding="utf-8") for play in EVALUATION_PLAYS]
    # as verify's filler (evaluation/verification_run.py, `_filler`)
    filler = tok("\n\n".join(texts), add_special_tokens=False).input_ids
    settings = NeedleSettings(lengths=(), depths=QUICK_DEPTHS if args.quick else DEFAULT_DEPTHS,  # as verify's
                              trials=1 if args.quick else 2, min_relative_accuracy=0.0, batch=args.batch,
                              protocol=args.protocol)
    settings.lengths = default_lengths(config.max_position_embeddings - settings.new_tokens, args.quick)
    if args.lengths:
        settings.lengths = tuple(int(x) for x in args.lengths.split(","))
    if args.depths:
        settings.depths = tuple(float(x) for x in args.depths.split(","))
    if args.trials:
        settings.trials = args.trials
    loaded = SimpleNamespace(model=model, tokenizer=tok, info=arch_info(config))
    baselines = tuple(b for b in args.baselines.split(",") if b and b != "none")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    runs, t_start = [], time.perf_counter()
    named = [spec.rpartition("=")[::2] for spec in args.artifacts]
    artifacts = [(name or Path(folder).name, *load_artifacts(Path(folder))) for name, folder in named]
    for seed in args.seeds:  # every artifact on a seed's prompts before the next seed: paired under a time budget
        for name, manifest, rotations in artifacts:
            if time.perf_counter() - t_start > args.time_budget:
                break
            settings.seed = seed
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            report = run_needle(loaded, manifest, rotations, filler, settings, baselines)
            wall = time.perf_counter() - t0
            per_length = len(settings.depths) * settings.trials
            prompts = [(settings.lengths[i // per_length], key) for i, key in enumerate(report.keys)]
            methods = {("bf16" if m.kind == "reference" else m.name): m for m in report.methods}
            run = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", weights=args.weights,
                       artifact=name, seed=seed, batch=args.batch, lengths=list(settings.lengths),
                       depths=list(settings.depths), trials=settings.trials, wall_seconds=wall,
                       overall={n: m.overall for n, m in methods.items()}, prompts=prompts,
                       answers={n: m.answers for n, m in methods.items()},
                       right={n: [answer_is_right(a, key) for a, (_, key) in zip(m.answers, prompts)]
                              for n, m in methods.items()})  # fmt: skip
            runs.append(run)
            if out:
                (out / f"bench_needle_{name}_{seed}.json").write_text(json.dumps(run))
            print(json.dumps({k: run[k] for k in ("artifact", "seed", "wall_seconds", "overall")}), flush=True)
    if args.lengths or args.depths or args.trials or len(args.seeds) > 1 or len(args.artifacts) > 1:
        print("| artifact | method | prompts | " + " | ".join(f"{n} (BF16 only / it only)" for n in settings.lengths)
              + " | all |")
        print("\n".join(summarize(runs, list(settings.lengths))))
    else:
        run = runs[0]
        result = dict(device=run["device"], weights=args.weights, quick=args.quick, lengths=run["lengths"],
                      depths=run["depths"], trials=run["trials"], methods=list(run["overall"]),
                      wall_seconds=run["wall_seconds"], overall=run["overall"])
        if out:
            (out / f"bench_needle{'_quick' if args.quick else ''}.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result))


if __name__ == "__main__":
    main()
