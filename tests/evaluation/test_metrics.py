"""Metric functions against hand-computed and float64 cases."""

import math

import torch
import torch.nn.functional as F

from oscar_zoo.evaluation import metrics


def test_kl_of_identical_distributions_is_zero():
    logits = torch.randn(7, 50)
    lp = torch.log_softmax(logits, -1)
    assert torch.allclose(metrics.kl_divergence(lp, lp), torch.zeros(7), atol=1e-7)


def test_kl_of_a_known_pair_matches_the_float64_formula():
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    expected = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))  # = 0.25·ln 2
    got = metrics.kl_divergence(p.log().float(), q.log().float())
    assert abs(got.item() - expected) < 1e-6 and abs(expected - 0.25 * math.log(2)) < 1e-12
    torch.manual_seed(0)
    a, b = torch.randn(5, 1000, dtype=torch.float64), torch.randn(5, 1000, dtype=torch.float64)
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    ref = (la.exp() * (la - lb)).sum(-1)
    assert torch.allclose(metrics.kl_divergence(la.float(), lb.float()).double(), ref, rtol=1e-4)


def test_token_metrics_nll_kl_and_agreement():
    torch.manual_seed(0)
    T, V = 300, 40  # more positions than one chunk
    logits, targets = torch.randn(T, V), torch.randint(0, V, (T,))
    ref = metrics.reference_of(logits)
    same = metrics.token_metrics(logits, targets, ref)
    assert torch.allclose(same.nll, F.cross_entropy(logits, targets, reduction="none"), atol=1e-5)
    assert same.kl.abs().max() < 1e-6 and bool(same.agree.all())
    other = logits.clone()
    other[:10] = -other[:10]  # flips the argmax of the first 10 rows
    diff = metrics.token_metrics(other, targets, ref)
    assert not bool(diff.agree[:10].any()) and bool(diff.agree[10:].all())
    assert (diff.kl[:10] > 0).all() and diff.kl[10:].abs().max() < 1e-6


def test_perplexity_is_exp_of_mean_nll():
    nll = torch.tensor([1.0, 2.0, 3.0])
    assert abs(metrics.perplexity(nll) - math.exp(2.0)) < 1e-9
    assert math.isnan(metrics.perplexity(torch.tensor([])))


def test_relative_error_and_bins():
    ref = torch.tensor([3.0, 4.0])
    assert abs(metrics.relative_error(torch.tensor([3.0, 4.5]), ref) - 0.1) < 1e-12
    values = torch.arange(10.0).reshape(2, 5)  # 2 sequences × 5 positions
    assert metrics.binned_mean(values, 2) == [3.0, 5.0, 6.5]


def test_token_metrics_equal_the_plain_formulas_bit_for_bit():
    """The in-place KL and the kept reference probabilities change no bit of NLL, KL or agreement; the reference
    run's own row read from its `Reference` equals `token_metrics` without one."""
    torch.manual_seed(0)
    T, V = 600, 300
    logits = (3 * torch.randn(T + 1, V)).bfloat16()
    other = (logits.float() + 0.3 * torch.randn(T + 1, V)).bfloat16()
    targets = torch.randint(0, V, (T,))
    ref = metrics.reference_of(logits[:T])
    got = metrics.token_metrics(other[:T], targets, ref)
    lp = torch.log_softmax(other[:T].float(), -1)
    plain_kl = (ref.logprobs.exp() * (ref.logprobs - lp)).sum(-1).clamp(min=0.0)
    assert torch.equal(got.kl, plain_kl) and torch.equal(got.agree, lp.argmax(-1) == ref.top1)
    assert torch.equal(got.nll, -lp.gather(-1, targets[:, None]).squeeze(-1))
    without = metrics.token_metrics(other[:T], targets, metrics.Reference(ref.logprobs, ref.top1))  # probs made here
    assert torch.equal(without.kl, got.kl)
    own = metrics.reference_metrics(ref, targets)
    plain = metrics.token_metrics(logits[:T], targets, None)
    assert torch.equal(own.nll, plain.nll) and torch.equal(own.kl, plain.kl) and torch.equal(own.agree, plain.agree)
