"""Where calibration's tensors live when a model is spread over devices: the device a layer runs on, and accumulators
whose per-batch products are formed in float64 on the layer's device and only then summed into the accumulator's device
(the model's first device, or the CPU), so what crosses devices is one [H, D, D] product per layer per batch.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .targets import SecondMoment


def second_moment(x: Tensor, w: Tensor | None = None) -> Tensor:
    """Σ_n w_n x_n x_nᵀ per head, in float64 on x's device: x [H, N, D], w [H, N] or None → [H, D, D]. On an H200 a
    float64 product of one q batch [8, 32768, 128] takes 0.39 ms (FP64 tensor cores), no faster in fp32 or in token
    chunks (benchmarks/RESULTS.md), so the sums stay float64 end to end as METHOD.md §1 asks."""
    x64 = x.to(torch.float64)
    xw = x64 if w is None else x64 * w.to(x.device, torch.float64)[..., None]
    return torch.einsum("hnd,hne->hde", xw, x64)


class PlacedMoment(SecondMoment):
    """A `SecondMoment` whose per-batch product is computed where the samples are (the layer's device) and added
    into the sums wherever they live; merge, mean and state are SecondMoment's."""

    def add(self, layer: int, x: Tensor, w: Tensor | None = None) -> None:
        """x [H, N, D] samples per head; w [H, N] optional weights."""
        self.sums[layer] += second_moment(x, w).to(self.sums.device)
        if w is None:
            self.weights[layer] += x.shape[1]
        else:
            self.weights[layer] += w.sum(-1).to(self.weights.device, torch.float64)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model's inputs and first layer live: the first real device of an accelerate device map (a "disk"
    entry computes on the CPU), else the device of its parameters."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        first = next(iter(device_map.values()))
        if isinstance(first, int):
            return torch.device("cuda", first)
        return torch.device("cpu" if first == "disk" else first)
    return next(model.parameters()).device


def accumulator_device(model: torch.nn.Module, accumulate_on: str) -> torch.device:
    """`model`: the model's first device; `cpu`: host memory (products still form on each layer's device)."""
    return torch.device("cpu") if accumulate_on == "cpu" else model_device(model)


def sample_on(sample, device: torch.device):
    """A clip-search LayerSample moved to `device` (the search runs where the model's first layer runs)."""
    return replace(sample, q=sample.q.to(device), k=sample.k.to(device), v=sample.v.to(device))
