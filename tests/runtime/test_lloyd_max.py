"""The Lloyd-Max levels variant of the INT2 codec (measured through fake quantization only, benchmarks/QUALITY.md):
the uniform levels reproduce the uniform codec bit for bit, and the fit finds known optima."""

from __future__ import annotations

import pytest
import torch

from oscar_zoo.format import reference as R


@pytest.mark.parametrize("group_size", [0, 16])
def test_uniform_levels_are_the_uniform_codec(group_size):
    """Levels 0, 1, 2, 3 give exactly `fake_quant` (same codes at the same thresholds, same scale and zero), with
    per-head clip ratios and per-head levels broadcast over tokens."""
    g = torch.Generator().manual_seed(group_size)
    x = (torch.randn(2, 3, 57, 64, generator=g) * 2 + torch.randn(3, 1, 64, generator=g)).bfloat16()
    clip = torch.tensor([[0.9], [0.94], [1.0]])
    levels = torch.tensor(R.UNIFORM_LEVELS).expand(3, 1, 4)
    assert torch.equal(R.fake_quant_levels(x, clip, levels, group_size), R.fake_quant(x, clip, group_size))


def test_levels_change_only_the_reconstruction_values():
    """Other levels: every row value comes back as (ℓ_q − zero)·scale for the level ℓ_q nearest to it in code units."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g)
    levels = torch.tensor([0.3, 1.2, 1.8, 2.7])
    out = R.fake_quant_levels(x, 1.0, levels)
    _, sz = R.quantize(x)
    s, z = sz[..., 0].float(), sz[..., 1].float()  # [4, 1]
    u = x / s + z
    nearest = levels[(u[..., None] - levels).abs().argmin(-1)]
    torch.testing.assert_close(out, (nearest - z) * s, rtol=0, atol=1e-6)


def test_fit_finds_known_optima():
    """Uniform density on [0, 3]: the MSE-optimal four levels are the centres of four equal cells (3/8, 9/8, 15/8,
    21/8). Samples on four points: the levels are those points."""
    g = torch.Generator().manual_seed(0)
    u = torch.rand(400_000, generator=g, dtype=torch.float64) * 3
    torch.testing.assert_close(R.fit_levels(u), torch.tensor([3, 9, 15, 21], dtype=torch.float64) / 8, rtol=0,
                               atol=0.01)
    points = torch.tensor([0.2, 1.1, 1.9, 2.8], dtype=torch.float64)
    u = points[torch.randint(0, 4, (1000,), generator=g)]
    torch.testing.assert_close(R.fit_levels(u), points, rtol=0, atol=1e-12)
