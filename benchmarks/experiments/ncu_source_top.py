"""The SASS instructions of one profiled kernel that take the most of each memory and issue counter, from the CSV that
`ncu --import REPORT --page source --print-source sass --csv` prints for a report taken with
`--set full --import-source yes`: L2 sectors requested and their excess over a coalesced access, shared-memory
wavefronts, instructions and warp-stall samples. Usage: python -m benchmarks.experiments.ncu_source_top FILE.csv [N]
"""

from __future__ import annotations

import csv
import sys

COUNTERS = ("L2 Theoretical Sectors Global", "Excessive", "L1 Wavefronts Shared", "Instructions Executed",
            "Warp Stall Sampling (All")  # fmt: skip


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
    with open(path, newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if "Source" in r or "# Source" in r), None)
    if head is None or not any(c in n for n in rows[head] for c in COUNTERS):
        print(f"{path}: no per-line counters in this view (Triton's kernels correlate with their SASS, not always with "
              "their Python source)")
        return
    names, data = rows[head], [r for r in rows[head + 1 :] if len(r) == len(rows[head])]
    source = next(i for i, n in enumerate(names) if n in ("Source", "# Source"))
    for col, name in enumerate(names):
        if not any(c in name for c in COUNTERS):
            continue
        total = sum(_number(r[col]) for r in data)
        if not total:
            continue
        print(f"\n== {name}: {total:,.0f}")
        for r in sorted(data, key=lambda r: -_number(r[col]))[:top]:
            print(f"{_number(r[col]):>14,.0f} {_number(r[col]) / total:6.1%}  {r[source].strip()[:140]}")


if __name__ == "__main__":
    main()
