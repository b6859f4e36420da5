"""benchmarks/bench_needle.py's summary: per (haystack, needle, artifact), method and length, pooled over seeds, BF16's
and the method's accuracy with Wilson intervals, the paired difference and the discordant prompts, each row naming its
haystack and needle; with several needles or haystacks, each haystack and each needle pooled over the other."""

from __future__ import annotations

import pytest

from oscar_zoo.evaluation.stats import paired_difference, wilson

bench_needle = pytest.importorskip("benchmarks.bench_needle")


def _run(haystack: str, needle: str, seed: int, bf16: list[bool], oscar: list[bool]) -> dict:
    lengths = [1024, 2048]
    half = len(bf16) // 2
    prompts = [(lengths[i // half], f"{seed}{i}") for i in range(len(bf16))]
    return dict(haystack=dict(name=haystack), needle=dict(name=needle), artifact="default", seed=seed,
                lengths=lengths, prompts=prompts, right=dict(bf16=bf16, oscar=oscar))


def test_the_summary_pairs_each_family_over_its_seeds():
    a = _run("poems", "code", 1, [True, True, False, True], [True, False, True, False])
    b = _run("poems", "code", 2, [True, False, True, True], [True, False, False, False])
    c = _run("docs", "name", 1, [True, True, True, True], [True, True, True, True])
    rows = bench_needle.summarize([a, b, c])
    assert [(r["haystack"], r["needle"], r["length"]) for r in rows][:6] == [
        ("poems", "code", 1024), ("poems", "code", 2048), ("poems", "code", "all"),
        ("docs", "name", 1024), ("docs", "name", 2048), ("docs", "name", "all")]
    first = rows[0]  # 1,024 tokens: seed 1's first two prompts, then seed 2's
    ref, it = [True, True, True, False], [True, False, True, False]
    assert first["prompts"] == 4 and first["seeds"] == 2
    assert (first["bf16_only"], first["it_only"]) == (1, 0)
    assert first["diff_ci"] == (lambda d: (d.lo, d.hi))(paired_difference(ref, it))
    assert first["bf16_wilson"] == wilson(3, 4) and first["it_wilson"] == wilson(2, 4)
    everything = rows[2]
    assert everything["prompts"] == 8 and (everything["bf16_only"], everything["it_only"]) == (4, 1)
    lines = bench_needle.table(rows)
    assert lines[0].startswith("| haystack | needle |")
    assert lines[2].startswith("| poems | code | default | oscar | 1024 | 4 |")
    assert "75.0 [30.1, 95.4]" in lines[2] and "1 / 0" in lines[2]


def test_each_haystack_and_each_needle_is_pooled_over_the_other():
    runs = [_run("plays", "code", 1, [True, True, True, True], [True, False, True, True]),
            _run("plays", "name", 1, [True, False, True, True], [False, False, True, True]),
            _run("docs", "code", 1, [False, True, True, True], [False, True, True, False])]
    rows = {(r["haystack"], r["needle"], r["length"]): r for r in bench_needle.summarize(runs)}
    assert ("docs", "name", "all") not in rows  # no such family was run, so no row
    plays = rows[("plays", "all", "all")]  # both needles' prompts on the plays: 8 pairs
    assert plays["prompts"] == 8 and (plays["bf16_only"], plays["it_only"]) == (2, 0)
    assert plays["bf16_wilson"] == wilson(7, 8) and plays["it_wilson"] == wilson(5, 8)
    code = rows[("all", "code", 1024)]  # the code needle's 1,024-token prompts on both haystacks
    assert code["prompts"] == 4 and (code["bf16"], code["it"]) == (0.75, 0.5)
    assert rows[("all", "name", "all")]["prompts"] == 4 and rows[("docs", "all", 2048)]["prompts"] == 2
