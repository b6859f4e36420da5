"""Capture of what attention reads: post-QK-norm, post-RoPE Q and K, V as projected, and the attention output, for
every layer, through an attention function registered with transformers (so every supported architecture's own
RoPE / QK-norm code runs unchanged). The observer sees tensors; nothing is stored here, and each model carries its own
observer (`attention_binding.attention_bound`), so two models can be captured at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..attention_binding import attention_bound, bound_value
from .placement import model_device

CAPTURE_IMPL = "oscar_capture"

# observer(layer_idx, q [B, H_q, T, D], k [B, H_kv, T, D], v [B, H_kv, T, D], out [B, H_q, T, D], scaling)
Observer = Callable[[int, Tensor, Tensor, Tensor, Tensor, float], None]


def _capture_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
    observer = bound_value(module)
    if observer is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        observer(module.layer_idx, query, key, value, out.transpose(1, 2), scale)
    return out, weights


@contextmanager
def capturing(model: torch.nn.Module, observer: Observer) -> Iterator[None]:
    """Within the block, every attention call of `model` reports its inputs/outputs to `observer` (another model's
    calls, or this model's after the block, do not)."""
    with attention_bound(model, CAPTURE_IMPL, _capture_attention, observer):
        yield


def forward_batches(model: torch.nn.Module, input_ids: Tensor, batch_size: int, start: int = 0,
                    on_batch: Callable[[int], None] | None = None) -> None:
    """Prefill-only forward passes (no cache, no logits kept) over sequences [start:], `batch_size` at a time;
    `on_batch(done)` runs after each batch with the number of sequences finished."""
    device = model_device(model)  # with a device map: where the embeddings run; accelerate's hooks move the rest
    with torch.inference_mode():
        for i in range(start, input_ids.shape[0], batch_size):
            batch = input_ids[i : i + batch_size].to(device)
            model.base_model(input_ids=batch, use_cache=False)  # the decoder stack only: no logits needed
            if on_batch:
                on_batch(min(i + batch_size, input_ids.shape[0]))
