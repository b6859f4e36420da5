"""Teacher-forced tiered attention for `verify`: an attention function registered with transformers (so the model's own
RoPE / QK-norm run unchanged) that hands post-RoPE q, k, v of the whole sequence to a runner, and a fast blocked
equivalent of `reference.windowed_attention_ref` (same windows, same math, SDPA over only the keys a query block reads);
and the name under which this transformers takes a cache (generation and the needle grid pass one).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention_binding import attention_bound, bound_value
from ..format import reference

VERIFY_IMPL = "oscar_verify"
QUERY_BLOCK = 256

# runner(layer_idx, q [B, H_q, T, D], k [B, H_kv, T, D], v [B, H_kv, T, D], scale) -> fp32 [B, H_q, T, D]
Runner = Callable[[int, Tensor, Tensor, Tensor, float], Tensor]


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Exact causal attention in fp32 (GQA by the repeat-interleave convention); fp32 [B, H_q, T, D]."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


@functools.lru_cache(maxsize=8)
def _plan(T: int, sink: int, recent: int, block: int, device: torch.device) -> list[tuple[int, int, Tensor, Tensor]]:
    """Per query block [a, b): indices into cat(exact keys, quantized keys) [2T] of the keys the block reads, and the
    block's boolean mask over them. Derived from `reference.full_precision_mask` (the one definition of the windows)."""
    full = reference.full_precision_mask(T, sink, recent, device)  # [T, T] bool
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    read_exact, read_quant = full & causal, ~full & causal
    plan = []
    for a in range(0, T, block):
        b = min(T, a + block)
        rows_e, rows_q = read_exact[a:b], read_quant[a:b]  # [n, T]
        idx_e = rows_e.any(0).nonzero().squeeze(1)  # keys some query of the block reads exactly
        idx_q = rows_q.any(0).nonzero().squeeze(1)  # keys some query of the block reads quantized
        mask = torch.cat([rows_e.index_select(1, idx_e), rows_q.index_select(1, idx_q)], dim=1)  # [n, S_e + S_q]
        plan.append((a, b, torch.cat([idx_e, idx_q + T]), mask))
    return plan


def windowed_attention(q: Tensor, k: Tensor, v: Tensor, k_hat: Tensor, v_hat: Tensor, scale: float, sink: int,
                       recent: int, block: int = QUERY_BLOCK) -> Tensor:
    """`reference.windowed_attention_ref` computed block by block: query i reads key j from (k, v) where
    `reference.full_precision_mask` says so and from (k_hat, v_hat) otherwise, causal, exact softmax over the union.

    Each block of queries attends (one fp32 SDPA call) to the exact and quantized keys it can read, under the matching
    boolean mask; that skips the never-read part of the 2·T×T product (≈ 3× less work than the dense reference at
    2048 tokens) and bounds memory by the block. q [B, H_q, T, D]; k, v, k_hat, v_hat [B, H_kv, T, D]. Returns fp32
    [B, H_q, T, D]."""
    T = q.shape[2]
    qf = q.float()
    keys = torch.cat([k.float(), k_hat.float()], dim=2)  # [B, H_kv, 2T, D]: exact, then quantized
    values = torch.cat([v.float(), v_hat.float()], dim=2)
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for a, b, idx, mask in _plan(T, sink, recent, block, q.device):
        out[:, :, a:b] = F.scaled_dot_product_attention(qf[:, :, a:b], keys.index_select(2, idx),
                                                        values.index_select(2, idx), attn_mask=mask, scale=scale,
                                                        enable_gqa=gqa)
    return out


def _verify_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                      sliding_window=None, **kwargs):
    """transformers attention interface: query [B, H_q, T, D], key/value [B, H_kv, T, D] post-RoPE, whole sequence
    (no cache). Causality is applied by the runner; `attention_mask` is unused (verify feeds unpadded sequences)."""
    runner = bound_value(module)
    if runner is None:
        raise RuntimeError("the oscar_verify attention was called outside `verifying(...)`")
    if softcap is not None or sliding_window is not None:
        raise NotImplementedError(
            f"layer {module.layer_idx} uses a logit softcap or a sliding window: verify supports plain full-attention "
            "layers only")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = runner(module.layer_idx, query, key, value, scale)  # fp32 [B, H_q, T, D]
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


@contextmanager
def verifying(model: torch.nn.Module, runner: Runner) -> Iterator[None]:
    """Within the block every attention layer of `model` is computed by `runner` (each model by its own: the runner
    is bound to the model's modules, `attention_binding.attention_bound`)."""
    with attention_bound(model, VERIFY_IMPL, _verify_attention, runner):
        yield


def cache_argument() -> str:
    """transformers 5 renamed generate's `past_key_values` to `cache` (the old name warns, and goes in 6.0)."""
    try:
        from transformers.generation.utils import ALL_CACHE_NAMES
    except ImportError:
        return "past_key_values"
    return "cache" if "cache" in ALL_CACHE_NAMES else "past_key_values"
