"""Where calibration's tensors live when a model is spread over devices: the device a layer runs on, and accumulators
whose per-batch products are formed in float64 on the layer's device and only then summed into the accumulator's device
(the model's first device, or the CPU), so what crosses devices is one [H, D, D] product per layer per batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .targets import SecondMoment

# Tokens per float64 partial product on a GPU. One [H, D, n]·[H, n, D] product per batch gives too few output tiles to
# fill the GPU (H·(D/128)² of them); splitting the token axis into chunks multiplies the tiles by N/n and the chunk
# products are summed in float64 afterwards. Sums stay float64 end to end (METHOD.md §1).
GPU_CHUNK = 1024


def second_moment(x: Tensor, w: Tensor | None = None) -> Tensor:
    """Σ_n w_n x_n x_nᵀ per head, in float64 on x's device: x [H, N, D], w [H, N] or None → [H, D, D]."""
    H, N, D = x.shape
    if x.device.type != "cuda" or N <= GPU_CHUNK:
        x64 = x.to(torch.float64)
        xw = x64 if w is None else x64 * w.to(x.device, torch.float64)[..., None]
        return torch.einsum("hnd,hne->hde", xw, x64)
    S = -(-N // GPU_CHUNK)
    x64 = x.new_zeros(H, S * GPU_CHUNK, D, dtype=torch.float64)  # zero rows pad the last chunk and add nothing
    x64[:, :N] = x
    x64 = x64.view(H * S, GPU_CHUNK, D)  # [H·S, n, D]
    if w is None:
        xw = x64
    else:
        w64 = w.new_zeros(H, S * GPU_CHUNK, dtype=torch.float64)
        w64[:, :N] = w
        xw = x64 * w64.view(H * S, GPU_CHUNK, 1)
    return torch.bmm(xw.transpose(1, 2), x64).view(H, S, D, D).sum(1)  # [H·S, D, D] → [H, D, D]


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
