"""A model's attention switched, for a block, to a function registered with transformers, which finds a value bound to
the model's modules (not a module global: two models, or nested blocks on one, each see their own). Calibration's
capture and verify's scoring run through it. Imports torch and transformers only (the GPU machines have no pydantic)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_BOUND = "_oscar_bound_attention"  # attribute of a model's layer modules: the value its bound attention function reads


@contextmanager
def attention_bound(model: torch.nn.Module, name: str, function: Callable, value: object) -> Iterator[None]:
    """Within the block, every attention layer of `model` runs `function` (registered with transformers as `name`),
    which finds `value` with `bound_value(module)`. The value lives on this model's modules, not in a module global, so
    two models (or nested blocks on one model) each see their own; on exit the previous attention implementation and
    values come back."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)
    layers = [m for m in model.modules() if hasattr(m, "layer_idx")]
    saved = [m.__dict__.get(_BOUND, _BOUND) for m in layers]  # _BOUND itself: the module had none
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    for m in layers:
        m.__dict__[_BOUND] = value  # a plain attribute, even for an nn.Module value (never a registered submodule)
    try:
        yield
    finally:
        for m, old in zip(layers, saved):
            if old is _BOUND:
                m.__dict__.pop(_BOUND, None)
            else:
                m.__dict__[_BOUND] = old
        model.set_attn_implementation(previous)


def bound_value(module: torch.nn.Module) -> object | None:
    """The value `attention_bound` gave `module`'s model for the current block (None outside one)."""
    return module.__dict__.get(_BOUND)
