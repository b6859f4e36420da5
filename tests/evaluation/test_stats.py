"""The retrieval statistics `verify --needle` prints: Wilson intervals against published values, the paired difference's
interval by its coverage on simulated paired outcomes, the sign test by exact binomial sums."""

from __future__ import annotations

import random

import pytest

from oscar_zoo.evaluation.stats import paired_difference, sign_test, wilson


@pytest.mark.parametrize(("k", "n", "want"), [(81, 263, (0.2553, 0.3662)), (15, 148, (0.0624, 0.1605)),
                                              (0, 20, (0.0, 0.1611)), (1, 29, (0.0061, 0.1718))])
def test_wilson_matches_newcombes_published_examples(k, n, want):
    """Newcombe (Statistics in Medicine 17, 857–872, 1998), table I, the score method without continuity correction."""
    assert wilson(k, n) == pytest.approx(want, abs=5e-5)


def test_sign_test_exact_values():
    assert sign_test(0, 5) == pytest.approx(2 / 32)
    assert sign_test(9, 1) == pytest.approx(2 * (1 + 10) / 1024)
    assert sign_test(3, 3) == 1.0 and sign_test(0, 0) == 1.0


def _sample(rng: random.Random, n: int, cells: tuple[float, float, float, float]) -> tuple[list[bool], list[bool]]:
    """n pairs drawn from P(both, ref only, it only, neither) = cells."""
    ref, it = [], []
    for _ in range(n):
        u, acc = rng.random(), 0.0
        for r, i, p in zip((True, True, False, False), (True, False, True, False), cells):
            acc += p
            if u < acc:
                break
        ref.append(r)
        it.append(i)
    return ref, it


@pytest.mark.parametrize("cells", [(0.88, 0.06, 0.02, 0.04), (0.60, 0.10, 0.10, 0.20)])
def test_paired_interval_covers_the_true_difference_95_percent_of_the_time(cells):
    """Paired outcomes like the needle's (most prompts answered by both: strongly correlated) and an uncorrelated-ish
    case: the interval holds the true difference (cells[2] − cells[1]) in 95 % ± 2.5 % of 1,500 samples of 300 pairs.
    Ignoring the pairing (φ = 0) or flipping φ's sign widens the first case's interval to 99.4 % / 99.9 % coverage
    (measured, before φ's continuity correction): either fails here."""
    rng = random.Random(0)
    truth = cells[2] - cells[1]
    hits = 0
    for _ in range(1500):
        d = paired_difference(*_sample(rng, 300, cells))
        assert d.lo <= d.diff <= d.hi
        hits += d.lo <= truth <= d.hi
    assert 0.925 <= hits / 1500 <= 0.975


def test_paired_difference_matches_a_published_example():
    """Newcombe's method 10 on a published paired table (both 59, only the first 6, only the second 16, neither 80:
    the difference of the second's rate less the first's is +0.0046 to +0.1186; Fagerland, Lydersen and Laake,
    "Statistical Analysis of Contingency Tables", the Newcombe square-and-add interval). Asymmetric, so swapped
    bounds fail; without φ's continuity correction it gives +0.0059 to +0.1174 and fails too."""
    ref = [True] * 59 + [True] * 6 + [False] * 16 + [False] * 80
    it = [True] * 59 + [False] * 6 + [True] * 16 + [False] * 80
    d = paired_difference(ref, it)
    assert d.diff == pytest.approx(10 / 161)
    assert (d.lo, d.hi) == pytest.approx((0.0046, 0.1186), abs=5e-5)


def test_paired_difference_counts_and_symmetry():
    ref = [True] * 90 + [True] * 6 + [False] * 2 + [False] * 2
    it = [True] * 90 + [False] * 6 + [True] * 2 + [False] * 2
    d, back = paired_difference(ref, it), paired_difference(it, ref)
    assert (d.n, d.ref_only, d.it_only) == (100, 6, 2)
    assert d.ref == pytest.approx(0.96) and d.it == pytest.approx(0.92) and d.diff == pytest.approx(-0.04)
    assert (back.diff, back.lo, back.hi) == pytest.approx((-d.diff, -d.hi, -d.lo))
    same = paired_difference(ref, ref)  # no discordant pair: no difference, a narrow interval around it
    assert same.diff == 0 and same.lo < 0 < same.hi and same.hi - same.lo < 0.1
    with pytest.raises(ValueError):
        paired_difference(ref, it[:-1])


def test_verify_pairs_each_method_with_the_reference_per_length():
    """A report of 2 lengths × 3 depths × 2 trials (answers length-major, as the grid runs): the artifact answers only
    the first length's prompts, a baseline only the second length's last two; each length's slice is paired with the
    reference's own answers there, and a report without keys (written before they were kept) pairs nothing."""
    from oscar_zoo.evaluation.needle import paired_against_reference
    from oscar_zoo.format.verification import NeedleMethod, NeedleReport

    keys = [f"{10000 + i}" for i in range(12)]
    right = [f" {k}." for k in keys]

    def method(name, kind, answers):
        return NeedleMethod(name=name, label=name, kind=kind, accuracy=[[0.0] * 3] * 2, overall=0.0, answers=answers)

    ref = right[:11] + [" no"]  # the reference misses the very last prompt
    methods = [method("bf16", "reference", ref), method("oscar", "artifact", right[:6] + [" 1"] * 6),
               method("naive", "baseline", [" 2"] * 10 + right[10:])]
    report = NeedleReport(lengths=[1024, 2048], depths=[0.2, 0.5, 0.8], trials=2, seed=0, needle="", question="",
                          sink=64, recent=256, methods=methods, min_relative_accuracy=0.0, passed=True, failures=[],
                          wall_seconds=0.0, keys=keys)
    got = {(name, length): (d.n, d.ref_only, d.it_only, round(d.ref, 4), round(d.it, 4))
           for name, length, d in paired_against_reference(report)}
    assert got == {("oscar", 1024): (6, 0, 0, 1.0, 1.0), ("oscar", 2048): (6, 5, 0, round(5 / 6, 4), 0.0),
                   ("naive", 1024): (6, 6, 0, 1.0, 0.0), ("naive", 2048): (6, 4, 1, round(5 / 6, 4), round(2 / 6, 4))}
    assert paired_against_reference(report.replace(keys=[])) == []
