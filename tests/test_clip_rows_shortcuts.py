"""`reference.clip_rows` skips its sort when every row shares the sort's answer (no clip: τ = ∞; a ratio of (D−1)/D or
more: τ = max|x|); the result is the sort's bit for bit, NaN, ±inf and −0.0 rows included."""

import math

import pytest
import torch

from oscar_zoo.format import reference


def _sorted_clip(x: torch.Tensor, ratio) -> torch.Tensor:
    """clip_rows as the sort computes it, for every ratio."""
    x = x.float()
    k = reference.clip_index(ratio, x.shape[-1]).expand(x.shape[:-1])
    tau = torch.sort(x.abs(), dim=-1).values.gather(-1, k.clamp(min=0).unsqueeze(-1))
    tau = torch.where(k.unsqueeze(-1) < 0, torch.full_like(tau, math.inf), tau)
    return torch.minimum(torch.maximum(x, -tau), tau)


@pytest.mark.parametrize("ratio", [0.0, -1.0, 1.0, 0.999, 0.96, [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.96]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_rows_equals_the_sorted_threshold_bit_for_bit(ratio, dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 40, 64)
    x[0, 0, 0, 5] = math.nan
    x[0, 0, 1] = 0.0
    x[0, 0, 2] = -0.0
    x[0, 0, 3, 7] = math.inf
    x[0, 1, 4, 9] = -math.inf
    x[0, 2, 5, :3] = -0.0
    x = x.to(dtype)
    r = torch.tensor(ratio).reshape(3, 1) if isinstance(ratio, list) else ratio
    got, want = reference.clip_rows(x, r), _sorted_clip(x, r)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_clip_rows_still_refuses_a_ratio_that_does_not_fit_the_rows():
    with pytest.raises(RuntimeError):
        reference.clip_rows(torch.randn(1, 3, 8, 64), torch.ones(4, 1))
