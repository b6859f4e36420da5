"""The needle grid the way a user's prompt meets the cache: context and question as ONE prompt, prefilled through
each cache with the `oscar` attention (the prompt's own exact K/V, then the tiers), the answer decoded greedily
through the tiers — the path of `model.generate(prompt, past_key_values=cache)`. `verify --needle` instead files the
context first and reads the question through the INT2 tiers (a harder protocol: its first answer token already reads
INT2). Same prompts as `verify --needle` (`build_prompt`, the evaluation plays as filler, `--seed`); accuracy per
length with 95 % Wilson intervals, for BF16 and the artifact at each `--pins` value.

    .venv/bin/python -m benchmarks.experiments.needle_prompt --artifacts artifacts/demo --pins 0 32 --trials 4
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from transformers import DynamicCache

from oscar_zoo.evaluation.needle import answer_is_right, build_prompt
from oscar_zoo.evaluation.stats import wilson
from oscar_zoo.models import load_model
from oscar_zoo.runtime.attention import enable_oscar
from oscar_zoo.runtime.cache import OscarCache
from oscar_zoo.texts import EVALUATION_PLAYS, load_texts


@torch.inference_mode()
def answer(model, tok, ids: torch.Tensor, cache, new_tokens: int = 7) -> str:
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    out = []
    for _ in range(new_tokens):
        token = logits.argmax(-1, keepdim=True)
        out.append(int(token))
        logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
    return tok.decode(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", default="artifacts/demo")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pins", type=int, nargs="+", default=[0, 32])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    loaded = load_model("demo", device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    enable_oscar(model)
    texts, _ = load_texts(None, plays=EVALUATION_PLAYS)
    filler = tok("\n\n".join(texts), add_special_tokens=False).input_ids
    lengths = [int(x) for x in a.lengths.split(",")]
    names = ["bf16"] + [f"pin {n}" for n in a.pins]
    right = {n: {L: 0 for L in lengths} for n in names}
    count = {L: 0 for L in lengths}
    rng = random.Random(a.seed)
    t0 = time.time()
    for L in lengths:
        for depth in (float(x) for x in a.depths.split(",")):
            for _ in range(a.trials):
                pr = build_prompt(tok, filler, L, depth, rng)
                ids = torch.tensor([pr.context + pr.question])
                count[L] += 1
                right["bf16"][L] += answer_is_right(answer(model, tok, ids, DynamicCache()), pr.key)
                for n in a.pins:
                    cache = OscarCache.from_folder(a.artifacts, pin=n)
                    right[f"pin {n}"][L] += answer_is_right(answer(model, tok, ids, cache), pr.key)
            print(f"{L} depth {depth}: {time.time() - t0:.0f} s", flush=True)
    rows = []
    for n in names:
        ks = [right[n][L] for L in lengths]
        lo, hi = wilson(sum(ks), sum(count.values()))
        cells = " ".join(f"{100 * k / count[L]:5.1f}" for L, k in zip(lengths, ks))
        print(f"{n:8s} {cells}  all {100 * sum(ks) / sum(count.values()):5.1f} [{100 * lo:.0f}, {100 * hi:.0f}]")
        rows.append({"method": n, "right": ks, "n": [count[L] for L in lengths]})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"lengths": lengths, "rows": rows, "wall_s": round(time.time() - t0, 1)}, f, indent=1)


if __name__ == "__main__":
    main()
