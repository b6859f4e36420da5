"""Where calibration's tensors live when a model is spread over devices: the device its inputs go to, where the
accumulators' sums live (`targets.SecondMoment` forms each product on the layer's device), and where the clip search
runs."""

from __future__ import annotations

from dataclasses import replace

import torch


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


def layer_devices(model: torch.nn.Module) -> dict[int, torch.device]:
    """Where each attention layer's weights live (by its `layer_idx`): with a device map, the clip search of a layer
    runs on its GPU, and the layers on different GPUs overlap. Offloaded layers (meta weights) use `model_device`."""
    devices = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        param = next(module.parameters(), None)
        if isinstance(idx, int) and param is not None and idx not in devices:
            devices[idx] = param.device if param.device.type != "meta" else model_device(model)
    return devices


def accumulator_device(model: torch.nn.Module, accumulate_on: str) -> torch.device:
    """`model`: the model's first device; `cpu`: host memory (products still form on each layer's device)."""
    return torch.device("cpu") if accumulate_on == "cpu" else model_device(model)


def sample_on(sample, device: torch.device):
    """A clip-search LayerSample moved to `device` (the search runs where the model's first layer runs)."""
    return replace(sample, q=sample.q.to(device), k=sample.k.to(device), v=sample.v.to(device))
