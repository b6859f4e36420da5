"""The lse merge kernel (`ops.merge_partials`) against float64 computations: exact softmax over the union of partials,
invariant to the number and the order of splits, empty partials ignored, all-empty rows → (0, −inf)."""

import math

import pytest
import torch

from oscar_zoo.runtime import config, ops


def _attention_splits(q, k, v, bounds, sm_scale):
    """Partial (o, lse) of q over the token ranges [bounds[i], bounds[i+1]) of k/v [N, T, D]: o [N, S, D],
    lse [N, S]."""
    os_, lses = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        logits = torch.einsum("nd,ntd->nt", q, k[:, a:b]) * sm_scale
        lse = torch.logsumexp(logits, -1) if b > a else torch.full(q.shape[:1], -math.inf)
        p = torch.exp(logits - lse[:, None]) if b > a else logits
        os_.append(torch.einsum("nt,ntd->nd", p, v[:, a:b]))
        lses.append(lse)
    return torch.stack(os_, 1), torch.stack(lses, 1)


@pytest.mark.parametrize("D", [64, 128])
def test_merge_equals_full_softmax_for_any_split(device, D):
    g = torch.Generator().manual_seed(D)
    N, T = 6, 97
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((N, D), (N, T, D), (N, T, D)))
    full_o, full_lse = _attention_splits(q, k, v, [0, T], D**-0.5)
    for bounds in ([0, T], [0, 10, 10, 50, T], [0, 1, 2, 3, 40, 41, 90, T, T], list(range(0, T, 5)) + [T]):
        o, lse = _attention_splits(q, k, v, bounds, D**-0.5)
        perm = torch.randperm(o.shape[1], generator=g)
        for oo, ll in ((o, lse), (o[:, perm], lse[:, perm])):
            m, m_lse = ops.merge_partials(oo.float().to(device), ll.float().to(device))
            torch.testing.assert_close(m.cpu().double(), full_o[:, 0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(m_lse.cpu().double(), full_lse[:, 0], atol=1e-5, rtol=1e-5)


def test_merge_matches_reference_with_empty_and_all_empty(device):
    """Three chunks of partials per program (the kernel's split block is merge_tile // 16 splits with 6 rows of D = 64,
    16 dims per program), each row's maximum in a later chunk by only 0.7–1.3 (so dropping or mis-scaling an earlier
    chunk moves the result far beyond the tolerance), a row whose first chunk is all empty, an all-empty row, and NaN
    garbage in empty partials; against a float64 merge."""
    g = torch.Generator().manual_seed(0)
    B, H, D = 2, 3, 64
    block = config.current().merge_tile // 16
    S = 2 * block + 44
    o = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    lse = torch.randn(B, H, S, generator=g, dtype=torch.float64)
    empty = torch.rand(B, H, S, generator=g) < 0.4
    empty[..., block + 7] = False
    empty[..., S - 5] = False
    lse[0, 1, :block] = -math.inf  # the first chunk all empty: the online step starts from m = −inf in the second
    lse[..., block + 7] = lse.max(-1).values + 0.7  # a new maximum in the second chunk
    lse[..., S - 5] = lse.max(-1).values + 0.6  # and again in the third
    lse[empty] = -math.inf
    lse[1, 2] = -math.inf  # an all-empty row
    o[torch.isinf(lse)] = 0.0
    garbage = o.masked_fill(torch.isinf(lse)[..., None], float("nan"))  # empty partials' o is never read
    m, m_lse = ops.merge_partials(garbage.float().to(device), lse.float().to(device))
    r_lse = torch.logsumexp(lse, -1)  # float64 (reference.merge_partials_ref works in float32)
    r = (torch.exp(lse - torch.where(torch.isinf(r_lse), 0.0, r_lse)[..., None])[..., None] * o).sum(-2)
    assert m.shape == (B, H, D) and m_lse.shape == (B, H)
    torch.testing.assert_close(m.cpu().double(), r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m_lse.cpu().double(), r_lse, atol=1e-5, rtol=1e-6)
    assert torch.equal(m[1, 2].cpu(), torch.zeros(D)) and m_lse[1, 2].item() == -math.inf


def test_merge_bad_shapes():
    with pytest.raises(ValueError, match="lse"):
        ops.merge_partials(torch.randn(2, 4, 8), torch.randn(2, 5))
