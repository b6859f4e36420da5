"""`verify --needle`'s retrieval grid on a GPU: its wall time, and large samples of it over several haystacks and
needles.

Runs `evaluation.needle.run_needle` — the code `verify --needle` runs — with the demo model's shape and tokenizer,
artifact folders and a haystack as filler. `--weights` loads model.safetensors from `--model-dir` (the converted demo
model, `$OSCAR_ZOO_CACHE/models/SmolLM2-135M-Instruct-bf16`); without it the model has the same config but random
weights: the time is the same work — every prompt is prefilled and answered with the same number of greedy steps
whatever the weights say — but the accuracies then mean nothing. Needs torch, triton and transformers only; no
`datasets` (the texts are read as files from `--texts`).

Haystacks (`--haystacks`, evaluation/haystacks.py: `plays` — the ten evaluation plays, verify's filler; `poems` —
the corpus's non-dramatic verse; `docs` — standard-library docstrings) and needles (`--needles`, evaluation/needle.py:
`passkey`, verify's; `name`; `code`) are fixed registries; every (haystack, needle) pair is a cell family, run on its
own prompts. `--texts DIR` holds every haystack's files: `--write-texts DIR` writes them here (the plays and poems
copied from the installed corpus, the docstrings from this interpreter, whose text a GPU machine's other Python would
not reproduce) and prints each haystack's characters and sha256, which every run records too.

Default: the grid `verify --needle` (or `--quick`) runs on the plays with the passkey, its wall time. With more than
one family, or `--lengths`, `--depths`, `--trials`, `--seeds`: that grid once per (seed, family, artifact) — every
family and artifact on a seed's prompts before the next seed, starting no run after `--time-budget` seconds — then
per family, artifact, method and length, pooled over the seeds (then each haystack over its needles and each needle
over its haystacks): BF16's and the method's accuracy with 95 % Wilson intervals, the paired difference with its
95 % interval (evaluation/stats.py: Newcombe's, for the same prompts) and the discordant prompts (only BF16 / only
the method answers, with a sign test). Each run's JSON (the family, the haystack's sha256, every prompt's key, every
method's answer and whether it is right) goes to $OUT, and the table's rows to $OUT/bench_needle_summary.json.

    python -m benchmarks.bench_needle --write-texts .cache/needle/texts
    python -m benchmarks.bench_needle --model-dir DIR --artifacts DIR --texts DIR [--weights] [--quick]
    python -m benchmarks.bench_needle --model-dir DIR --weights --texts DIR --artifacts default=A k2=B \
        --haystacks plays,poems,docs --needles passkey,name,code \
        --lengths 1024,2048,4096 --depths 0.1,0.3,0.5,0.7,0.9 --trials 20 --seeds 10 11 --baselines none --batch 20
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from oscar_zoo.artifacts import load_artifacts
from oscar_zoo.evaluation.haystacks import DEFAULT_HAYSTACK, HAYSTACKS, describe, filler, haystack_named, write_texts
from oscar_zoo.evaluation.needle import (
    DEFAULT_DEPTHS,
    NEEDLES,
    PASSKEY,
    QUICK_DEPTHS,
    NeedleSettings,
    check_filler,
    check_lengths,
    default_lengths,
    needle_named,
    run_needle,
)
from oscar_zoo.evaluation.stats import paired_difference, wilson
from oscar_zoo.models import arch_info


def _names(spec: str, known: dict, what: str) -> list[str]:
    """A comma-separated list of registry names, in the order given; SystemExit naming the known ones otherwise."""
    names = [s for s in spec.split(",") if s]
    unknown = [s for s in names if s not in known]
    if unknown or not names:
        raise SystemExit(f"--{what} {spec}: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
    return list(dict.fromkeys(names))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def summarize(runs: list[dict]) -> list[dict]:
    """Per (haystack, needle, artifact), each method other than BF16 and each length (then all lengths), pooled over
    the runs' seeds: BF16's and the method's accuracy with Wilson 95 % intervals, the paired difference with its 95 %
    interval and the discordant prompts. With several needles, each haystack again pooled over its needles (needle
    "all"); with several haystacks, each needle pooled over its haystacks (haystack "all")."""
    families = list(dict.fromkeys((r["haystack"]["name"], r["needle"]["name"], r["artifact"]) for r in runs))
    haystacks = list(dict.fromkeys(h for h, _, _ in families))
    needles = list(dict.fromkeys(n for _, n, _ in families))
    artifacts = list(dict.fromkeys(a for _, _, a in families))
    groups = list(families)
    if len(needles) > 1:
        groups += [(h, "all", a) for a in artifacts for h in haystacks]
    if len(haystacks) > 1:
        groups += [("all", n, a) for a in artifacts for n in needles]
    rows = []
    for haystack, needle, artifact in groups:
        mine = [r for r in runs if r["artifact"] == artifact and haystack in (r["haystack"]["name"], "all")
                and needle in (r["needle"]["name"], "all")]
        for method in (m for m in mine[0]["right"] if m != "bf16"):
            for length in [*mine[0]["lengths"], "all"]:
                pairs = [(bf, me) for r in mine for (n, _), bf, me in zip(r["prompts"], r["right"]["bf16"],
                                                                         r["right"][method]) if length in (n, "all")]
                d = paired_difference([bf for bf, _ in pairs], [me for _, me in pairs])
                k_ref, k_it = sum(bf for bf, _ in pairs), sum(me for _, me in pairs)
                rows.append(dict(haystack=haystack, needle=needle, artifact=artifact, method=method, length=length,
                                 seeds=len({r["seed"] for r in mine}), prompts=d.n, bf16=d.ref,
                                 bf16_wilson=wilson(k_ref, d.n), it=d.it, it_wilson=wilson(k_it, d.n), diff=d.diff,
                                 diff_ci=(d.lo, d.hi), bf16_only=d.ref_only, it_only=d.it_only, p_sign=d.p_sign))
    return rows


def table(rows: list[dict]) -> list[str]:
    """The summary as a markdown table, a row per (haystack, needle, artifact, method, length)."""
    lines = ["| haystack | needle | artifact | method | length | prompts | BF16 % [95 %] | method % [95 %] | "
             "difference [95 %] | BF16 only / method only (sign p) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        (bl, bh), (il, ih), (dl, dh) = r["bf16_wilson"], r["it_wilson"], r["diff_ci"]
        lines.append(f"| {r['haystack']} | {r['needle']} | {r['artifact']} | {r['method']} | {r['length']} | "
                     f"{r['prompts']} | {_pct(r['bf16'])} [{_pct(bl)}, {_pct(bh)}] | {_pct(r['it'])} [{_pct(il)}, "
                     f"{_pct(ih)}] | {100 * r['diff']:+.1f} [{100 * dl:+.1f}, {100 * dh:+.1f}] | {r['bf16_only']} / "
                     f"{r['it_only']} (p = {r['p_sign']:.3f}) |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write-texts", metavar="DIR", help="write every haystack's files to DIR (for --texts) and stop")
    ap.add_argument("--model-dir", help="config.json and tokenizer files of the demo model")
    ap.add_argument("--weights", action="store_true", help="load model.safetensors from --model-dir")
    ap.add_argument("--artifacts", nargs="+", help="artifact folders, DIR or NAME=DIR")
    ap.add_argument("--texts", help="folder of the haystacks' files (--write-texts writes it)")
    ap.add_argument("--haystacks", default=DEFAULT_HAYSTACK, help=f"comma-separated, of {', '.join(HAYSTACKS)}")
    ap.add_argument("--needles", default=PASSKEY.name, help=f"comma-separated, of {', '.join(NEEDLES)}")
    ap.add_argument("--quick", action="store_true", help="the --needle-quick grid")
    ap.add_argument("--baselines", default="naive,hadamard", help="verify's default needle baselines; none for none")
    ap.add_argument("--lengths", help="comma-separated prompt lengths (default: verify's)")
    ap.add_argument("--depths", help="comma-separated needle depths (default: verify's)")
    ap.add_argument("--trials", type=int, help="prompts per (length, depth) (default: verify's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="one grid per seed, family and artifact")
    ap.add_argument("--batch", type=int, default=1, help="prompts of one length per batch (verify --needle-batch)")
    ap.add_argument("--protocol", default="follow-up", help="verify --needle-protocol: follow-up or prompt")
    ap.add_argument("--time-budget", type=float, default=math.inf, help="start no further run after this many s")
    args = ap.parse_args()
    if args.write_texts:
        print(json.dumps(write_texts(args.write_texts), indent=2))
        return
    if not (args.model_dir and args.artifacts and args.texts):
        ap.error("--model-dir, --artifacts and --texts are required (unless --write-texts)")
    haystacks = [haystack_named(h) for h in _names(args.haystacks, HAYSTACKS, "haystacks")]
    needles = [needle_named(n) for n in _names(args.needles, NEEDLES, "needles")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    config = AutoConfig.from_pretrained(args.model_dir)
    base = NeedleSettings(lengths=(), depths=QUICK_DEPTHS if args.quick else DEFAULT_DEPTHS,  # as verify's
                          trials=1 if args.quick else 2, min_relative_accuracy=0.0, batch=args.batch,
                          protocol=args.protocol)
    if args.depths:
        base.depths = tuple(float(x) for x in args.depths.split(","))
    if args.trials:
        base.trials = args.trials
    families = []  # (haystack description, its filler, the needle, its settings), every check before the model loads
    texts = {h.name: h.text(args.texts) for h in haystacks}
    fillers = {h.name: filler(tok, texts[h.name]) for h in haystacks}
    for h in haystacks:
        for fact in needles:
            settings = dataclasses.replace(base, needle=fact.name, new_tokens=None)
            settings.lengths = (tuple(int(x) for x in args.lengths.split(",")) if args.lengths else
                                default_lengths(config.max_position_embeddings - settings.new_tokens, args.quick))
            check_lengths(settings, getattr(config, "max_position_embeddings", None))
            check_filler(tok, fillers[h.name], settings)
            families.append((describe(h, texts[h.name]), fillers[h.name], fact, settings))
    if args.weights:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to(device).eval()
    loaded = SimpleNamespace(model=model, tokenizer=tok, info=arch_info(config))
    baselines = tuple(b for b in args.baselines.split(",") if b and b != "none")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    runs, t_start = [], time.perf_counter()
    named = [spec.rpartition("=")[::2] for spec in args.artifacts]
    artifacts = [(name or Path(folder).name, *load_artifacts(Path(folder))) for name, folder in named]
    for seed in args.seeds:  # every family and artifact on a seed's prompts before the next seed (a budget cuts evenly)
        for hay, fill, fact, settings in families:
            for name, manifest, rotations in artifacts:
                if time.perf_counter() - t_start > args.time_budget:
                    break
                settings.seed = seed
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                report = run_needle(loaded, manifest, rotations, fill, settings, baselines)
                wall = time.perf_counter() - t0
                per_length = len(settings.depths) * settings.trials
                prompts = [(settings.lengths[i // per_length], key) for i, key in enumerate(report.keys)]
                methods = {("bf16" if m.kind == "reference" else m.name): m for m in report.methods}
                run = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", weights=args.weights,
                           haystack=hay, needle=dict(name=fact.name, sentence=report.needle, question=report.question),
                           artifact=name, seed=seed, batch=args.batch, protocol=args.protocol,
                           lengths=list(settings.lengths), depths=list(settings.depths), trials=settings.trials,
                           new_tokens=settings.new_tokens, wall_seconds=wall,
                           overall={n: m.overall for n, m in methods.items()}, prompts=prompts,
                           answers={n: m.answers for n, m in methods.items()},
                           right={n: [fact.is_right(a, key) for a, (_, key) in zip(m.answers, prompts)]
                                  for n, m in methods.items()})  # fmt: skip
                runs.append(run)
                if out:
                    (out / f"bench_needle_{hay['name']}_{fact.name}_{name}_{seed}.json").write_text(json.dumps(run))
                print(json.dumps(dict(haystack=hay["name"], needle=fact.name) |
                                 {k: run[k] for k in ("artifact", "seed", "wall_seconds", "overall")}), flush=True)
    grid = args.lengths or args.depths or args.trials or len(args.seeds) > 1 or len(args.artifacts) > 1
    if grid or len(families) > 1:
        rows = summarize(runs)
        print("\n".join(table(rows)))
        if out:
            used = {r["haystack"]["name"]: r["haystack"] for r in runs}
            (out / "bench_needle_summary.json").write_text(json.dumps(dict(haystacks=used, rows=rows), indent=1))
    else:
        run = runs[0]
        result = dict(device=run["device"], weights=args.weights, quick=args.quick, haystack=run["haystack"],
                      needle=run["needle"]["name"], lengths=run["lengths"], depths=run["depths"],
                      trials=run["trials"], methods=list(run["overall"]), wall_seconds=run["wall_seconds"],
                      overall=run["overall"])
        if out:
            (out / f"bench_needle{'_quick' if args.quick else ''}.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result))


if __name__ == "__main__":
    main()
