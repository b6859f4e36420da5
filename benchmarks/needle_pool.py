"""Pool `verify --needle --json` reports (or benchmarks/bench_needle.py's per-run JSON): per method and length, BF16's
and the method's accuracy over every prompt of the given reports, the paired difference with a 95 % interval
(Newcombe's method 10, from Wilson intervals), and the prompts only BF16 / only the method answers with a two-sided sign
test on them. `--against NAME=REPORT` pairs the artifact of each report with another report's artifact on the same
prompts (same seed and grid: the keys must match).

    PYTHONPATH=. python benchmarks/needle_pool.py seed200.json seed201.json seed202.json
    PYTHONPATH=. python benchmarks/needle_pool.py default201.json --against b32k3=b32k3_201.json

(Run from the repository root; the script's folder is on the path, so `needle_mechanism.wilson` imports.)
"""

from __future__ import annotations

import argparse
import collections
import json
import math

from needle_mechanism import wilson
from oscar_zoo.evaluation.needle import answer_is_right


def newcombe(both: int, ref_only: int, it_only: int, neither: int) -> tuple[float, float, float]:
    """The paired difference p_it − p_ref and its 95 % interval (Newcombe 1998, method 10)."""
    n = both + ref_only + it_only + neither
    p1, p2 = (both + ref_only) / n, (both + it_only) / n
    (l1, u1), (l2, u2) = wilson(both + ref_only, n), wilson(both + it_only, n)
    den = (both + ref_only) * (it_only + neither) * (both + it_only) * (ref_only + neither)
    phi = (both * neither - ref_only * it_only) / math.sqrt(den) if den else 0.0
    d = p2 - p1
    lo = math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    hi = math.sqrt(max(0.0, (u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2))
    return d, d - lo, d + hi


def sign_test(a: int, b: int) -> float:
    """Two-sided exact sign test of a against b discordant pairs."""
    n = a + b
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(a, b) + 1)) / 2**n) if n else 1.0


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
    cells = collections.defaultdict(collections.Counter)  # (method, length) -> Counter of (reference ok, it ok)
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
                cells[(name, length)][(r, o)] += 1
    print("| method | length | prompts | reference % | it % | difference [95 %] | reference only / it only (sign p) |")
    print("|---|---|---|---|---|---|---|")
    for (name, length), c in sorted(cells.items()):
        both, ref_only, it_only, neither = c[(True, True)], c[(True, False)], c[(False, True)], c[(False, False)]
        n = both + ref_only + it_only + neither
        d, lo, hi = newcombe(both, ref_only, it_only, neither)
        print(f"| {name} | {length} | {n} | {100 * (both + ref_only) / n:.1f} | {100 * (both + it_only) / n:.1f} | "
              f"{100 * d:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] | {ref_only} / {it_only} "
              f"(p = {sign_test(ref_only, it_only):.3f}) |")


if __name__ == "__main__":
    main()
