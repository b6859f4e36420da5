"""The clip search's `objective="reconstruction"` option: the plain MSE of the rotated rows through the reference
quantizer, per KV head (summed over heads for a shared per-layer rotation), and its validation."""

import pytest
import torch

from oscar_zoo.calibration import clip_search
from oscar_zoo.calibration.targets import group_heads
from oscar_zoo.format import reference as R


def _sample(seed=0, S=2, H_q=6, H_kv=2, T=33, D=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, H_q, T, D, generator=g)
    k = torch.randn(S, H_kv, T, D, generator=g) + torch.randn(D, generator=g) * 3
    k[..., 7] *= 10  # an outlier channel
    v = torch.randn(S, H_kv, T, D, generator=g)
    return clip_search.LayerSample(q, k, v, D**-0.5)


def _key_target(s, H_kv):
    qg = group_heads(s.q, H_kv).double()
    return torch.einsum("hnd,hne->hde", qg, qg) / qg.shape[1]


@pytest.mark.parametrize("group_size", [0, 16])
def test_reconstruction_objective_is_row_mse_per_head(group_size):
    s, H_kv, D = _sample(), 2, 64
    torch.manual_seed(1)
    M_K = torch.stack([torch.linalg.qr(torch.randn(D, D))[0] for _ in range(H_kv)])
    M_V = torch.stack([torch.linalg.qr(torch.randn(D, D))[0] for _ in range(H_kv)])
    grid = clip_search.search_grid()
    key, value = clip_search.objectives(s, M_K, M_V, _key_target(s, H_kv), grid, group_size,
                                        objective="reconstruction")
    assert key.shape == value.shape == (len(grid), H_kv)
    for i, r in enumerate(grid):
        for h in range(H_kv):
            for table, x, M in ((key, s.k, M_K), (value, s.v, M_V)):
                rows = x[:, h].reshape(-1, D) @ M[h]  # every (sequence, token) row of head h, rotated
                direct = ((R.fake_quant(rows, r, group_size) - rows).double() ** 2).sum(-1).mean()
                assert torch.allclose(table[i, h], direct, rtol=1e-5)
    # the searched ratio is never worse than the fixed defaults on its own objective (they are in the grid)
    # nearest grid index (picks are float32)
    at = lambda r: min(range(len(grid)), key=lambda i: abs(grid[i] - float(r)))
    for h in range(H_kv):
        assert key[at(clip_search.pick(key, grid)[h]), h] <= key[at(0.96), h]
        assert value[at(clip_search.pick(value, grid)[h]), h] <= value[at(0.92), h]


def test_reconstruction_objective_shared_rotation_sums_heads():
    s, H_kv, D = _sample(seed=3), 2, 64
    torch.manual_seed(2)
    M = torch.linalg.qr(torch.randn(D, D))[0]
    grid = clip_search.search_grid()
    target = _key_target(s, H_kv)
    shared_k, shared_v = clip_search.objectives(s, M[None], M[None], target, grid, 0, objective="reconstruction")
    per_k, per_v = clip_search.objectives(s, M.expand(H_kv, D, D), M.expand(H_kv, D, D), target, grid, 0,
                                          objective="reconstruction")
    assert shared_k.shape == (len(grid), 1)
    assert torch.allclose(shared_k[:, 0], per_k.sum(-1)) and torch.allclose(shared_v[:, 0], per_v.sum(-1))


def test_attention_is_the_default_objective_and_unknown_objectives_are_refused():
    s, H_kv, D = _sample(seed=4), 2, 64
    eye = torch.eye(D).expand(H_kv, D, D)
    grid = clip_search.search_grid()
    target = _key_target(s, H_kv)
    default = clip_search.objectives(s, eye, eye, target, grid, 0)
    attention = clip_search.objectives(s, eye, eye, target, grid, 0, objective="attention")
    assert all(torch.equal(a, b) for a, b in zip(default, attention))
    with pytest.raises(ValueError, match="reconstruction"):
        clip_search.objectives(s, eye, eye, target, grid, 0, objective="mse")
