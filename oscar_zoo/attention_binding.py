"""A value bound to a model's attention modules, which an attention function registered with transformers finds
again (`bound_value(module)`): not a module global, so two models, or nested blocks on one, each see their own.
`attention_bound` switches a model's attention for a block (calibration's capture, verify's scoring); `bind` keeps a
value for the model's life (the runtime's `OscarBinding`, made by `enable_oscar`). Imports torch and transformers only
(the GPU machines have no other of the CLI's dependencies)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_BOUND = "_oscar_bound_attention"  # attribute of a model's layer modules: the value its bound attention function reads


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "layer_idx")]


def bind(model: torch.nn.Module, value: object) -> None:
    """Give every layer module of `model` (those with a `layer_idx`) `value`, for as long as the model lives (or until
    another `bind`); an `attention_bound` block on the model puts it back on exit."""
    for m in _layers(model):
        m.__dict__[_BOUND] = value  # a plain attribute, even for an nn.Module value (never a registered submodule)


@contextmanager
def attention_bound(model: torch.nn.Module, name: str, function: Callable, value: object) -> Iterator[None]:
    """Within the block, every attention layer of `model` runs `function` (registered with transformers as `name`),
    which finds `value` with `bound_value(module)`. The value lives on this model's modules, not in a module global, so
    two models (or nested blocks on one model) each see their own; on exit the previous attention implementation and
    values come back."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)
    layers = _layers(model)
    saved = [m.__dict__.get(_BOUND, _BOUND) for m in layers]  # _BOUND itself: the module had none
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    for m in layers:
        m.__dict__[_BOUND] = value
    try:
        yield
    finally:
        for m, old in zip(layers, saved):
            if old is _BOUND:
                m.__dict__.pop(_BOUND, None)
            else:
                m.__dict__[_BOUND] = old
        model.set_attn_implementation(previous)


def bound_value(module: object) -> object | None:
    """The value `attention_bound` or `bind` gave `module`'s model (None: none). A plain attribute read, which dynamo
    traces (the runtime's compiled decode step reads it)."""
    return getattr(module, _BOUND, None)
