"""The clip search's objectives against direct computations over real (q, k) pairs and softmax outputs, and its
choice never worse than the fixed defaults on that objective."""

import torch

from oscar_zoo.calibration import clip_search
from oscar_zoo.calibration.targets import group_heads
from oscar_zoo.format import reference as R


def _sample(seed=0, S=2, H_q=6, H_kv=2, T=48, D=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, H_q, T, D, generator=g) * 2
    k = torch.randn(S, H_kv, T, D, generator=g) + torch.randn(D, generator=g) * 3  # a mean offset, like real keys
    k[..., 5] *= 8  # an outlier channel
    v = torch.randn(S, H_kv, T, D, generator=g)
    return clip_search.LayerSample(q, k, v, D**-0.5)


def test_objectives_equal_direct_computation_and_search_beats_defaults():
    s = _sample()
    H_kv, D = 2, 64
    key_target = torch.einsum("hnd,hne->hde", group_heads(s.q, H_kv).double(), group_heads(s.q, H_kv).double())
    key_target /= group_heads(s.q, H_kv).shape[1]
    torch.manual_seed(1)
    M_K = torch.stack([torch.linalg.qr(torch.randn(D, D))[0] for _ in range(H_kv)])
    M_V = torch.stack([torch.linalg.qr(torch.randn(D, D))[0] for _ in range(H_kv)])
    grid = clip_search.search_grid()
    assert 0.96 in grid and 0.92 in grid
    key_table, value_table = clip_search.objectives(s, M_K, M_V, key_target, grid, 0)

    for i, r in enumerate(grid):
        for h in range(H_kv):
            # keys: mean over every (query of the group, key) pair of the squared logit error, in the rotated space
            qh = (s.q[:, 3 * h : 3 * h + 3].reshape(-1, D) @ M_K[h]).double()
            kh = s.k[:, h].reshape(-1, D) @ M_K[h]
            dk = (R.fake_quant(kh, r) - kh).double()
            direct_k = ((qh @ dk.T) ** 2).mean()
            assert torch.allclose(key_table[i, h], direct_k, rtol=1e-4)
            # values: attention-output error of each query with its own causal softmax
            errs = []
            for b in range(2):
                vh = s.v[b, h] @ M_V[h]
                dv = (R.fake_quant(vh, r) - vh).double()
                for j in range(3 * h, 3 * h + 3):
                    logits = (s.q[b, j] @ s.k[b, h].T).double() * s.scaling
                    logits = logits.masked_fill(torch.ones(48, 48, dtype=torch.bool).triu(1), float("-inf"))
                    errs.append(((torch.softmax(logits, -1) @ dv) ** 2).sum(-1).mean())
            assert torch.allclose(value_table[i, h], torch.stack(errs).mean(), rtol=1e-4)

    k_pick, v_pick = clip_search.pick(key_table, grid), clip_search.pick(value_table, grid)
    at = lambda r: min(range(len(grid)), key=lambda i: abs(grid[i] - float(r)))  # noqa: E731 (float32 picks)
    for h in range(H_kv):
        assert key_table[at(k_pick[h]), h] <= key_table[at(0.96), h]
        assert value_table[at(v_pick[h]), h] <= value_table[at(0.92), h]
    # the outlier channel makes clipping worthwhile for keys without rotation (identity M): the search clips
    eye = torch.eye(D).expand(H_kv, D, D)
    key_table_eye, _ = clip_search.objectives(s, eye, eye, key_target, grid, 0)
    assert torch.all(clip_search.pick(key_table_eye, grid) < 1.0)


def test_per_layer_rotation_sums_heads_into_one_column():
    s = _sample(seed=3)
    D = 64
    key_target = torch.eye(D, dtype=torch.float64).expand(2, D, D)
    M = torch.linalg.qr(torch.randn(D, D))[0][None]
    grid = [0.9, 1.0]
    kt, vt = clip_search.objectives(s, M, M, key_target, grid, 0)
    per_head_k, per_head_v = clip_search.objectives(s, M.expand(2, D, D), M.expand(2, D, D), key_target, grid, 0)
    assert kt.shape == (2, 1)
    assert torch.allclose(kt[:, 0], per_head_k.sum(-1)) and torch.allclose(vt[:, 0], per_head_v.sum(-1))


def test_key_noise_is_the_unclipped_logit_error_and_ranks_layers_for_three_bits():
    """key_noise equals the direct mean of (q·δk)² over (query, key) pairs with unclipped INT2 keys; choose_key_bits
    gives 3 bits to the noisiest layers, round((mean − 2)·L) of them, and 2 everywhere at mean 2."""
    s = _sample(seed=3)
    H_kv, D = 2, 64
    qg = group_heads(s.q, H_kv).double()
    key_target = torch.einsum("hnd,hne->hde", qg, qg) / qg.shape[1]
    torch.manual_seed(2)
    M_K = torch.stack([torch.linalg.qr(torch.randn(D, D))[0] for _ in range(H_kv)])
    noise = clip_search.key_noise(s, M_K, key_target, 0)
    for h in range(H_kv):
        qh = (s.q[:, 3 * h : 3 * h + 3].reshape(-1, D) @ M_K[h]).double()
        kh = s.k[:, h].reshape(-1, D) @ M_K[h]
        dk = (R.fake_quant(kh, 1.0) - kh).double()  # ratio 1.0: τ = max|x|, nothing clipped
        assert torch.equal(R.fake_quant(kh, 1.0), R.fake_quant(kh, 0.0))
        assert torch.allclose(noise[h], ((qh @ dk.T) ** 2).mean(), rtol=1e-4)
    # a sample scaled by 3 has 9× the noise: it must be chosen first
    loud = clip_search.LayerSample(s.q, s.k * 3, s.v, s.scaling)
    per_layer = torch.stack([noise, clip_search.key_noise(loud, M_K, key_target, 0), noise * 0.5, noise * 2])
    assert torch.allclose(per_layer[1], noise * 9, rtol=1e-3)
    assert clip_search.choose_key_bits(per_layer, 2.0) == [2, 2, 2, 2]
    assert clip_search.choose_key_bits(per_layer, 2.25) == [2, 3, 2, 2]
    assert clip_search.choose_key_bits(per_layer, 2.5) == [2, 3, 2, 3]
    assert clip_search.choose_key_bits(per_layer, 2.7) == [3, 3, 2, 3]  # round(0.7·4) = 3
    assert clip_search.choose_key_bits(per_layer, 3.0) == [3, 3, 3, 3]
    for bad in (1.9, 3.1, float("nan")):
        try:
            clip_search.choose_key_bits(per_layer, bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} was accepted")
