"""Pool `verify --needle --json` reports (or benchmarks/bench_needle.py's per-run JSON): per method and length, BF16's
and the method's accuracy over every prompt of the given reports, the paired difference with a 95 % interval
(Newcombe's method 10, from Wilson intervals), and the prompts only BF16 / only the method answers with a two-sided sign
test on them. `--against NAME=REPORT` pairs each method of each report (its artifact, and any baselines) with another
report's artifact on the same prompts (same seed and grid: the keys must match).

    python -m benchmarks.needle_pool seed200.json seed201.json seed202.json
    python -m benchmarks.needle_pool default201.json --against b32k3=b32k3_201.json
"""

from __future__ import annotations

import argparse
import collections
import json

from oscar_zoo.evaluation.needle import answer_is_right
from oscar_zoo.evaluation.stats import paired_difference


def outcomes(path: str) -> tuple[list[int], list[str], dict[str, list[bool]]]:
    """(each prompt's length, its passkey, per method whether it answered) of one report, in its prompts' order: a
    `verify --json` report, or a run of benchmarks/bench_needle.py (its `prompts` and `right`)."""
    report = json.load(open(path))
    if "needle" not in report:
        return [n for n, _ in report["prompts"]], [k for _, k in report["prompts"]], report["right"]
    needle = report["needle"]
    keys = needle["keys"]
    if not keys:
        raise SystemExit(f"{path}: a report without its prompts' keys (written before `needle.keys` existed)")
    per_length = len(needle["depths"]) * needle["trials"]
    lengths = [needle["lengths"][i // per_length] for i in range(len(keys))]
    right = {("bf16" if m["kind"] == "reference" else m["name"]): [answer_is_right(a, k) for a, k in
                                                                   zip(m["answers"], keys)] for m in needle["methods"]}
    return lengths, keys, right


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+")
    p.add_argument("--against", default=None, help="NAME=REPORT,…: one per report, the same prompts, another artifact")
    a = p.parse_args()
    cells = collections.defaultdict(lambda: ([], []))  # (method, length) -> (reference's outcomes, the method's)
    others = [spec.split("=", 1) for spec in a.against.split(",")] if a.against else None
    if others and len(others) != len(a.reports):
        raise SystemExit("--against needs one NAME=REPORT per report")
    for i, path in enumerate(a.reports):
        lengths, keys, right = outcomes(path)
        pairs = [(n, right["bf16"], r) for n, r in right.items() if n != "bf16"]
        if others:
            name, other = others[i]
            o_lengths, o_keys, o_right = outcomes(other)
            if o_keys != keys:
                raise SystemExit(f"{other}: other prompts than {path}'s")
            pairs += [(f"{name} vs {n}", r, o_right["oscar"]) for n, r in right.items() if n != "bf16"]
        for name, ref, it in pairs:
            for length, r, o in zip(lengths, ref, it):
                cells[(name, length)][0].append(r)
                cells[(name, length)][1].append(o)
    print("| method | length | prompts | reference % | it % | difference [95 %] | reference only / it only (sign p) |")
    print("|---|---|---|---|---|---|---|")
    for (name, length), (ref, it) in sorted(cells.items()):
        d = paired_difference(ref, it)
        print(f"| {name} | {length} | {d.n} | {100 * d.ref:.1f} | {100 * d.it:.1f} | {100 * d.diff:+.1f} "
              f"[{100 * d.lo:+.1f}, {100 * d.hi:+.1f}] | {d.ref_only} / {d.it_only} (p = {d.p_sign:.3f}) |")


if __name__ == "__main__":
    main()
