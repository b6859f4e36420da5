"""The "oscar" attention function for transformers: rotate q by M_K, attend over the tiers, un-rotate by M_Vᵀ.

Prefill chunks attend to their own exact K/V (plus earlier tokens as their tiers present them); single-token decode
steps go through `ops.tiered_decode_attention`. Usage (Llama, Mistral, Qwen2/3, Gemma-style GQA models):

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
    enable_oscar(model)                                   # registers "oscar" and switches the model to it
    cache = OscarCache.from_folder("artifacts/")          # rotations.safetensors (+ manifest.json)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    print(cache.memory_bytes(), cache.bytes_per_token_per_layer())
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from . import ops, reference
from .cache import take_pending

ATTN_IMPLEMENTATION = "oscar"


def dense_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None = None, q_offset: int | None = None
) -> Tensor:
    """Causal attention, q [B, H_q, n, D] at positions q_offset.. (default: the last n of k), k/v [B, H_kv, S, D].
    SDPA in q's dtype (as transformers' sdpa path runs it); fp32 eager math when a logit softcap is set."""
    n, S = q.shape[2], k.shape[2]
    q_offset = S - n if q_offset is None else q_offset
    allowed = torch.arange(S, device=q.device)[None, :] <= (q_offset + torch.arange(n, device=q.device))[:, None]
    g = q.shape[1] // k.shape[1]
    k, v = k.to(q.dtype), v.to(q.dtype)
    if softcap is None:
        if n == 1 and q_offset == S - 1:  # decode: every key is visible
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=g > 1)
        if q_offset == 0 and n == S:  # a fresh prefill chunk
            return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, enable_gqa=g > 1)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    k, v = k.float().repeat_interleave(g, dim=1), v.float().repeat_interleave(g, dim=1)
    logits = (q.float() @ k.transpose(-1, -2)) * scale  # [B, H_q, n, S]
    logits = torch.tanh(logits / softcap) * softcap
    p = torch.softmax(logits.masked_fill(~allowed, -math.inf), dim=-1)
    return (p @ v).to(q.dtype)


def oscar_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention interface: query [B, H_q, n, D] post-RoPE, key/value as returned by the cache's
    `update` [B, H_kv, n, D]. Returns [B, n, H_q, D] in query's dtype, and no attention weights."""
    if attention_mask is not None:
        raise NotImplementedError(
            "oscar attention got an explicit attention mask: padded batches and custom masks are not supported; "
            "batch prompts of equal length (or run them one by one)"
        )
    if dropout and module.training:
        raise NotImplementedError("oscar attention is inference-only (attention dropout requested); call model.eval()")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    pending = take_pending(key)
    if sliding_window is not None:
        total = key.shape[2] + (pending.past_len if pending is not None else 0)
        if total > sliding_window:
            raise NotImplementedError(
                f"layer {getattr(module, 'layer_idx', '?')} is a sliding-window layer (window {sliding_window}) and "
                f"the context reached {total} tokens: OSCAR covers full-attention layers only; keep the context "
                f"within the window or use a model without sliding-window layers"
            )
    if pending is None:  # no OscarCache (e.g. use_cache=False): exact attention on the key/value given
        out = dense_attention(query, key, value, scale, softcap)
        return out.transpose(1, 2).contiguous(), None

    layer, n, H_q = pending.layer, query.shape[2], query.shape[1]
    rot = layer.rotation
    Mk_q = rot.per_query_head(rot.k, H_q)  # [H_q, D, D] (or shared [1, D, D])
    if n == 1 and layer.quantize and softcap is None:
        q_rot = reference.rotate(query.float(), Mk_q)[:, :, 0]  # [B, H_q, D] q·M_K, kept fp32 for the kernel
        o, _ = ops.tiered_decode_attention(q_rot, *layer.tier_args(), scale)  # [B, H_q, D] fp32, M_V space
        o = o.unsqueeze(2)
        return _unrotate(o, rot, H_q, query.dtype), None
    q_rot = reference.rotate(query, Mk_q)  # [B, H_q, n, D] q·M_K in the model's dtype, as sdpa would see q
    if n == 1:  # BF16 history (test switch) or softcap: the tiers densely, the new token included
        k, v = layer.dense_kv(query.dtype)
        o = dense_attention(q_rot, k, v, scale, softcap)
    else:  # a chunk: earlier tokens through their tiers (if any), then its own exact K/V
        k, v = key, value
        if pending.past is not None:
            past_k, past_v = pending.past  # fp32, dequantized history included
            k, v = torch.cat([past_k, key.to(past_k.dtype)], dim=2), torch.cat([past_v, value.to(past_v.dtype)], dim=2)
        o = dense_attention(q_rot, k, v, scale, softcap, q_offset=pending.past_len)
    return _unrotate(o, rot, H_q, query.dtype), None


def _unrotate(o: Tensor, rot, n_q_heads: int, dtype: torch.dtype) -> Tensor:
    """o [B, H_q, n, D] in M_V space → o·M_Vᵀ per query head, as [B, n, H_q, D] in `dtype` (what o_proj reads)."""
    out = reference.rotate(o.float(), rot.per_query_head(rot.v, n_q_heads).transpose(-1, -2))
    return out.to(dtype).transpose(1, 2).contiguous()


def oscar_mask(
    batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
    attention_mask: Tensor | None = None, **kwargs,
) -> None:  # fmt: skip
    """Mask factory for "oscar": causality is implicit, so no mask is built; a 2D padding mask with any padded
    position is refused (the cache keeps one length per tier for the whole batch)."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise NotImplementedError(
            "OscarCache does not support padded batches (the attention mask has padding): batch prompts of equal "
            "length, or generate one prompt at a time"
        )
    return None


def register() -> None:
    """Register the "oscar" attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, oscar_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, oscar_mask)


def enable_oscar(model: torch.nn.Module) -> torch.nn.Module:
    """Register "oscar" and switch `model` (a transformers PreTrainedModel) to it; returns the model.
    Rotations are applied only when an OscarCache is passed as past_key_values; without one the model runs exact."""
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model
