"""Wall time of `verify --needle`'s retrieval grid on a GPU (issue 15: the default grid for the demo model in ≤ 2 min).

Runs `evaluation.needle.run_needle` — the code `verify --needle` runs — with the demo model's shape and tokenizer, an
artifact folder and the held-out plays as filler, and prints the grid's wall time and the accuracies. `--weights` is a
folder with the converted demo model (`$OSCAR_ZOO_CACHE/models/SmolLM2-135M-Instruct-bf16`); without it the model has
the same config but random weights (the GPU machine takes at most 64 MiB of carried files, the bf16 weights are
260 MB): the time is the same work — every prompt is prefilled and answered with the same number of greedy steps
whatever the weights say — but the accuracies then mean nothing. Needs pydantic (manifest) besides torch, triton and
transformers; no `datasets` (the plays are read as files).

    PYTHONPATH=. python benchmarks/bench_needle.py --model-dir DIR --artifacts DIR --texts DIR [--weights] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from oscar_zoo.artifacts import load_artifacts
from oscar_zoo.calibration.data import EVALUATION_PLAYS
from oscar_zoo.evaluation.needle import DEFAULT_DEPTHS, QUICK_DEPTHS, NeedleSettings, default_lengths, run_needle
from oscar_zoo.models import arch_info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True, help="config.json and tokenizer files of the demo model")
    ap.add_argument("--weights", action="store_true", help="load model.safetensors from --model-dir")
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--texts", required=True, help="folder of the bundled plays (<play>_gut.txt)")
    ap.add_argument("--quick", action="store_true", help="the --needle-quick grid")
    ap.add_argument("--baselines", default="naive,hadamard", help="verify's default needle baselines")
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
    filler = tok("\n\n".join(texts), add_special_tokens=False).input_ids  # as verify's (evaluation/pipeline.py _filler)
    manifest, rotations = load_artifacts(Path(args.artifacts))
    settings = NeedleSettings(lengths=(), depths=QUICK_DEPTHS if args.quick else DEFAULT_DEPTHS,
                              trials=1 if args.quick else 2)  # as verify --needle[-quick]
    settings.lengths = default_lengths(config.max_position_embeddings - settings.new_tokens, args.quick)
    loaded = SimpleNamespace(model=model, tokenizer=tok, info=arch_info(config))
    baselines = tuple(b for b in args.baselines.split(",") if b)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    report = run_needle(loaded, manifest, rotations, filler, settings, baselines)
    wall = time.perf_counter() - t0
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", weights=args.weights,
                  quick=args.quick, lengths=list(settings.lengths), depths=list(settings.depths),
                  trials=settings.trials, methods=[m.name for m in report.methods], wall_seconds=wall,
                  overall={m.name: m.overall for m in report.methods})  # fmt: skip
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"], f"bench_needle{'_quick' if args.quick else ''}.json")
        out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
