"""The "oscar" attention function for transformers: rotate q by M_K, attend over the tiers, un-rotate by M_Vᵀ.

Prefill chunks attend to their own exact K/V (plus earlier tokens as their tiers present them); single-token decode
steps go through `ops.tiered_decode_attention`. Binding is explicit: `enable_oscar` gives the model one
`binding.OscarBinding` (on its attention modules) and a pre-hook on every attention module that hands the attention
function the OscarCache the module was called with (kwarg `oscar_cache`, `OscarBinding.enter`); the function reads
layer `module.layer_idx` of it. Usage (Llama, Mistral, Qwen2/3, Gemma-style GQA models):

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
    enable_oscar(model)                                   # registers "oscar" and switches the model to it
    cache = OscarCache.from_folder("artifacts/")          # rotations.safetensors (+ manifest.json)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    print(cache.memory_bytes(), cache.bytes_per_token_per_layer())
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..attention_binding import bind
from ..format import layout, reference
from . import compiled, ops, rotate_op
from .binding import ATTN_IMPLEMENTATION, CACHE_ARGS, OscarBinding, binding_of, cache_argument
from .cache import OscarCache, OscarLayer
from .graph import install

__all__ = ["ATTN_IMPLEMENTATION", "dense_attention", "enable_oscar", "fold_value_rotation", "model_binding",
           "oscar_attention", "oscar_mask", "register", "warm_up"]


def dense_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None = None, q_offset: int | None = None,
    causal: bool = True,
) -> Tensor:  # fmt: skip
    """Causal attention, q [B, H_q, n, D] at positions q_offset.. (default: the last n of k), k/v [B, H_kv, S, D]
    (`causal` False: every query sees every key, as in an encoder). SDPA in q's dtype (as transformers' sdpa path
    runs it); fp32 eager math when a logit softcap is set. On a GPU in bfloat16/float16 a later prefill chunk (the last
    n of S keys) takes SDPA's lower-right causal bias with the KV heads as they are: its flash kernel, with no mask
    tensor and no repeated K/V."""
    n, S = q.shape[2], k.shape[2]
    q_offset = S - n if q_offset is None else q_offset

    def allowed() -> Tensor:  # [n, S] bool, made only where a path needs the mask itself (n·S bytes)
        if not causal:
            return torch.ones(n, S, dtype=torch.bool, device=q.device)
        return torch.arange(S, device=q.device)[None, :] <= (q_offset + torch.arange(n, device=q.device))[:, None]

    g = q.shape[1] // k.shape[1]
    k, v = k.to(q.dtype), v.to(q.dtype)
    if softcap is None:
        if not causal or (n == 1 and q_offset == S - 1):  # every key is visible
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=g > 1)
        if q_offset == 0 and n == S:  # a fresh prefill chunk
            return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, enable_gqa=g > 1)
        if q_offset == S - n and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            # a later chunk on the flash kernel (query i sees keys ..S − n + i); where flash does not run (CPU,
            # float32) SDPA would materialise the lower-right mask and, with GQA, take its math kernel, which holds the
            # [B, H_q, n, S] scores: the masked path below keeps its memory-efficient kernels
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, S), scale=scale,
                                                  enable_gqa=g > 1)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed(), scale=scale)
    k, v = k.float().repeat_interleave(g, dim=1), v.float().repeat_interleave(g, dim=1)
    logits = (q.float() @ k.transpose(-1, -2)) * scale  # [B, H_q, n, S]
    logits = torch.tanh(logits / softcap) * softcap
    p = torch.softmax(logits.masked_fill(~allowed(), -math.inf), dim=-1)
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
    oscar_cache: OscarCache | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention interface: query [B, H_q, n, D] post-RoPE, key/value as returned by the cache's
    `update` [B, H_kv, n, D]; `oscar_cache` the cache the module was called with (set by `enable_oscar`'s hook).
    Returns [B, n, H_q, D] in query's dtype, and no attention weights."""
    binding = binding_of(module)
    if binding is not None and binding.stepping and torch.compiler.is_compiling():  # a compiled decode step: the
        # cache side is one op
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return compiled.decode_attention(query, key, value, scale, softcap, sliding_window), None
    if attention_mask is not None and not _is_padding(attention_mask, query):
        raise NotImplementedError(
            "oscar attention got an explicit attention mask: custom masks are not supported (padded batches are, "
            "through an OscarCache, padded on the left)"
        )
    if dropout and module.training:
        raise NotImplementedError("oscar attention is inference-only (attention dropout requested); call model.eval()")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    layer = oscar_cache.layers[module.layer_idx] if oscar_cache is not None else None
    pending = layer.take_pending(key) if layer is not None else None
    if sliding_window is not None:
        total = key.shape[2] + (pending.past_len if pending is not None else 0)
        if total > sliding_window:
            raise NotImplementedError(
                f"layer {getattr(module, 'layer_idx', '?')} is a sliding-window layer (window {sliding_window}) and "
                f"the context reached {total} tokens: OSCAR covers full-attention layers only; keep the context "
                f"within the window or use a model without sliding-window layers"
            )
    if pending is None:  # no OscarCache (e.g. use_cache=False, or an encoder): exact attention on the key/value given
        # a bidirectional module (a vision tower that `set_attn_implementation` switched too) says so as transformers'
        # sdpa path reads it: the call's `is_causal`, else the module's
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        if attention_mask is None:
            out = dense_attention(query, key, value, scale, softcap, causal=bool(causal))
            return out.transpose(1, 2).contiguous(), None
        return _padded_exact(query, key, value, attention_mask, scale, softcap, bool(causal)), None

    if not getattr(oscar_cache, "kernels_ready", True) and query.is_cuda:  # build before the first decode step
        rehearsed = binding.rehearsed if binding is not None else set()
        # a padded batch's rows also file alone (batch 1): until every row's windows are full, and at each demotion
        for q in (query, query[:1]) if layer.rows is not None else (query,):
            warm_up(oscar_cache, q, key.shape[1], scale, softcap, layer.v_folded, rehearsed=rehearsed)
    if layer.rows is not None and not (query.shape[2] == 1 and layer.quantize):
        return _attend_rows(layer, query, value, scale, softcap), None
    return _attend(layer, pending, query, key, value, scale, softcap), None


def _is_padding(mask: Tensor, query: Tensor) -> bool:
    """Whether an attention function's mask is `oscar_mask`'s padding of the keys (bool [B, kv_length])."""
    return isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.dim() == 2 and \
        mask.shape[0] == query.shape[0] and mask.shape[1] >= query.shape[2]


def _padded_exact(query: Tensor, key: Tensor, value: Tensor, tokens: Tensor, scale: float, softcap: float | None,
                  causal: bool) -> Tensor:
    """Exact attention (no OscarCache) of a left-padded batch, row by row: row b's real keys are the last
    tokens[b].sum() of key [B, H_kv, S, D] (`tokens` bool [B, S]), its real queries the last of those; padding
    queries get zeros. Returns [B, n, H_q, D]."""
    n, S = query.shape[2], key.shape[2]
    if tokens.shape[1] != S:
        raise NotImplementedError(f"oscar attention got a padding mask of {tokens.shape[1]} positions for {S} keys: "
                                  f"use the model's own attention for this cache")
    out = query.new_zeros(query.transpose(1, 2).shape)
    for b, m in enumerate(tokens.sum(1).tolist()):
        q_real = min(n, m)
        if q_real:
            row, keys = slice(b, b + 1), slice(S - m, None)
            o = dense_attention(query[row, :, n - q_real :], key[row, :, keys], value[row, :, keys], scale, softcap,
                                causal=causal)
            out[row, n - q_real :] = o.transpose(1, 2)
    return out


def _attend_rows(layer: OscarLayer, query: Tensor, value: Tensor, scale: float, softcap: float | None) -> Tensor:
    """A ragged layer's chunk (or, with the BF16-history test switch, single token), row by row: each row's real
    queries [1, H_q, n_b, D] against its own view's tiers (`rows.PaddedRows`), as batch 1 would run them. Padding
    positions get zeros. Returns [B, n, H_q, D]."""
    B, H_q, n, D = query.shape
    out = query.new_zeros(B, n, H_q, D)
    for b, row in enumerate(layer.rows):
        pending = row.pending  # what the row's update left (a chunk's rows only)
        if pending is None and (n > 1 or row.get_seq_length() == 0):  # a row of padding only
            continue
        m = pending.key.shape[2] if pending is not None else 1
        if pending is not None:
            row.take_pending(pending.key)
        out[b : b + 1, n - m :] = _attend(row, pending, query[b : b + 1, :, n - m :],
                                          pending.key if pending is not None else None,
                                          value[b : b + 1, :, n - m :], scale, softcap)
    return out


def _attend(layer: OscarLayer, pending, query: Tensor, key: Tensor, value: Tensor, scale: float,
            softcap: float | None) -> Tensor:
    """The "oscar" attention of one layer whose update left `pending`: a single-token step through the tiers, a chunk
    through its own exact K/V and the earlier tokens' tiers. Returns [B, n, H_q, D]."""
    n, H_q = query.shape[2], query.shape[1]
    Mk_q, Mvt_q, mu_v = layer.per_query_head(H_q)  # [H_q, D, D] (or shared [1, D, D]): M_K, M_Vᵀ; μ_V·M_V [H_q, D]
    if layer.v_folded:  # o_proj un-rotates
        Mvt_q = None
    # Centred tiers (docs/format.md §6a): every key of the cache and of the chunk is k·M_K − μ_K·M_K, which shifts all
    # logits of a query by the same q·μ_K·M_K (softmax ignores it), and the output of centred values lacks exactly
    # μ_V·M_V (the weights sum to 1): `_unrotate` (or, on the decode path, the merge) adds it back, in M_V space, before
    # M_Vᵀ or o_proj.
    if n == 1 and layer.quantize:
        # three launches: q·M_K (fp32, each query head by its KV head's M_K), the tiered decode + merge (the merge
        # adds μ_V·M_V back and rounds to the model's dtype when nothing follows), and o·M_Vᵀ unless o_proj does it.
        # A logit softcap runs inside the decode kernel, after each query's q·μ_K·M_K (centred keys) is added back
        rot = layer.rotation
        q_rot = rotate_op.rotate_rows(query[:, :, 0], rot.k, None, out_dtype=torch.float32)  # [B, H_q, D]
        out_dtype = query.dtype if Mvt_q is None else torch.float32
        o, _ = ops.tiered_decode_attention(q_rot, *layer.tier_args(), scale, v_mean=mu_v, out_dtype=out_dtype,
                                           key_block=layer.key_block, softcap=softcap,
                                           logit_bias=_key_mean_logits(q_rot, layer, softcap, scale),
                                           ragged=layer.rows is not None and query.shape[0] > 1)
        if Mvt_q is not None:
            o = rotate_op.rotate_rows(o, rot.v.transpose(-1, -2), None, out_dtype=query.dtype)
        return o.unsqueeze(1)  # [B, 1, H_q, D]
    q_rot = rotate_op.rotate_chunk(query, Mk_q)  # [B, H_q, n, D] q·M_K in the model's dtype, as sdpa would see q
    if n == 1:  # BF16 history (test switch): the tiers densely, the new token included
        k, v = layer.dense_kv(query.dtype)
        o = dense_attention(q_rot, _uncentred_keys(k, layer, softcap), v, scale, softcap)
    else:  # a chunk: earlier tokens through their tiers (if any), then its own exact K/V
        k, v = (key, value) if pending.past is None else pending.past  # earlier tokens (their tiers) and the chunk
        if k.dtype != query.dtype:  # (a model whose queries and keys differ in dtype)
            k, v = k.to(query.dtype), v.to(query.dtype)
        o = dense_attention(q_rot, _uncentred_keys(k, layer, softcap), v, scale, softcap, q_offset=pending.past_len)
        if layer.staged is not None:  # the chunk's last queries choose the history tokens pinned in BF16
            window, keys = q_rot[:, :, -layout.PIN_WINDOW :], _uncentred_keys(k, layer, softcap)
            layer.pin_tokens(lambda cand: reference.pin_scores(window, _uncentred_keys(cand, layer, softcap), keys,
                                                               scale, softcap=softcap))
    return _unrotate(o, Mvt_q, query.dtype, mu_v)


def warm_up(cache: OscarCache, query: Tensor, kv_heads: int, scale: float, softcap: float | None = None,
            v_folded: bool = False, rehearsed: set[tuple] | None = None) -> float:
    """Build every Triton kernel a generation with `cache` can launch before its first decode step: for each distinct
    kernel build among the cache's layers (key bits, clip builds, window settings, means, value fold, batch shape,
    dtype, softcap), a scratch layer of the same settings runs a prompt that fills every tier, then single-token steps
    across two demotions (`flush`-row demotions, keys per channel a whole block each), attending at every step through
    `oscar_attention` — the path a generate() step takes, eager or inside the compiled step's op. The cache's own tiers
    are not touched. Called by the "oscar" attention at a cache's first call on a GPU (the prefill), with that call's
    query [B, H_q, n, D], its KV head count and value fold (the whole model's); layers of another head dim than D are
    not rehearsed. One line on stderr when it took over a second. Returns the seconds it took (0.0: nothing left to
    build). `rehearsed` holds the builds run so far, by `_build_key` (the model's `OscarBinding.rehearsed`; None: a
    new set, every build runs); each build found there is skipped, each one run is added. Kernel split and block
    counts are not specialised on (`kernels/decode.py`), so a growing history builds nothing more; CUDA graph capture
    of the static steps comes after, and compiles nothing."""
    cache.kernels_ready = True
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        return 0.0
    B, H_q, _, D = query.shape
    rehearsed = set() if rehearsed is None else rehearsed
    t0 = time.perf_counter()
    for layer in cache.layers:
        if layer.rotation is None or not layer.quantize or layer.rotation.k.shape[-1] != D:
            continue
        key = _build_key(layer, query, kv_heads, softcap, v_folded)
        if key not in rehearsed:
            _rehearse(layer, query, kv_heads, scale, softcap, v_folded)
            rehearsed.add(key)
    seconds = time.perf_counter() - t0
    if seconds > 1.0:
        print(f"oscar-zoo: built the OSCAR cache's Triton kernels in {seconds:.1f} s, before the first decode step "
              f"(later processes on this machine reuse Triton's on-disk cache)", file=sys.stderr)
    return seconds


def _build_key(layer, query: Tensor, kv_heads: int, softcap: float | None, v_folded: bool) -> tuple:
    """What decides the kernel builds a layer's steps use: the batch shape, dtype and device of the query, the softcap,
    the value fold, the layer's settings, key bits, its clips (their top-k builds, `quantize_ops`) and means."""
    rot = layer.rotation
    return (query.device, query.dtype, query.shape[0], query.shape[1], kv_heads, softcap, v_folded, tuple(rot.k.shape),
            rot.k_bits, rot.k_mean is None, rot.v_mean is None, rot.k_min_clip, rot.v_min_clip, layer.group_size,
            layer.sink, layer.recent, layer.flush, layer.pin, layer.key_block)


def _rehearse(layer, query: Tensor, H_kv: int, scale: float, softcap: float | None, v_folded: bool) -> None:
    """Run a scratch copy of `layer` (same rotation and settings, empty tiers) through a prompt and decode steps across
    two demotions, with random K/V [B, H_kv, n, D] and queries shaped as `query` [B, H_q, n, D] (see `warm_up`)."""
    B, H_q, _, D = query.shape
    scratch = OscarLayer(layer.rotation, 0, dataclasses.replace(layer.settings, quantize=True))
    scratch.v_folded = v_folded
    cache = _Scratch([scratch])
    module = _Scratch(None)  # (layer_idx 0, not training)

    def step(n: int) -> None:
        kv = [torch.randn(B, H_kv, n, D, dtype=query.dtype, device=query.device) for _ in range(2)]
        q = torch.randn(B, H_q, n, D, dtype=query.dtype, device=query.device)
        key, value = scratch.update(*kv)
        oscar_attention(module, q, key, value, None, scaling=scale, softcap=softcap, oscar_cache=cache)

    step(layer.sink + layer.recent + 2 * layer.flush + 1)  # a prompt: every tier, history rows (pinned ones too)
    demotions = 0
    while demotions < 2:
        demotions += scratch.is_static_step(1) and scratch.demotes_next()
        step(1)
    step(1)  # the step after a demotion


class _Scratch:
    """The few attributes `oscar_attention` reads of a cache (`layers`, `kernels_ready`) and of a module."""

    def __init__(self, layers):
        self.layers, self.kernels_ready, self.layer_idx, self.training = layers, True, 0, False


def _key_mean_logits(q_rot: Tensor, layer, softcap: float | None, scale: float) -> Tensor | None:
    """What centring took off each logit of a query, q·μ_K·M_K·scale [B, H_q] (fp32), when a softcap needs it back
    (`_uncentred_keys`); None otherwise."""
    k_mean = layer.rotation.k_mean
    if softcap is None or k_mean is None:
        return None
    H_q = q_rot.shape[1]
    k_mean = k_mean if k_mean.shape[0] == 1 else k_mean.repeat_interleave(H_q // k_mean.shape[0], dim=0)
    return (q_rot * k_mean.float()).sum(-1) * scale


def _uncentred_keys(k: Tensor, layer, softcap: float | None) -> Tensor:
    """A logit softcap (tanh) is not shift-invariant: with one, centred keys get μ_K·M_K back (fp32) before the logits;
    without one (every other case) the keys are used as the tiers hold them."""
    if softcap is None or layer.rotation.k_mean is None:
        return k
    return k.float() + layer.rotation.k_mean.float().unsqueeze(-2)


def _unrotate(o: Tensor, Mvt_q: Tensor | None, dtype: torch.dtype, v_mean_q: Tensor | None = None) -> Tensor:
    """o [B, H_q, n, D] in M_V space (of centred values when `v_mean_q`, μ_V·M_V per query head [H_q, D], is given:
    it is added back first) → o·M_Vᵀ per query head (None: o_proj does it), as [B, n, H_q, D] in `dtype`."""
    if Mvt_q is not None and o.is_cuda and o.dtype == dtype == torch.bfloat16:
        # (o + μ)·M_Vᵀ = o·M_Vᵀ + μ·M_Vᵀ as one tensor-core GEMM, rounded once (`rotate_op.rotate_chunk`)
        mean = None if v_mean_q is None else -(v_mean_q.float().unsqueeze(-2) @ Mvt_q.float()).squeeze(-2)
        o = rotate_op.rotate_chunk(o, Mvt_q, mean)
    else:
        o = reference.add_value_mean(o, v_mean_q)
        if Mvt_q is not None:
            o = reference.rotate(o.float(), Mvt_q)
    return o.to(dtype).transpose(1, 2).contiguous()


@torch.no_grad()
def fold_value_rotation(model: torch.nn.Module, cache: OscarCache) -> int:
    """Fold each layer's value rotation into the weights, as the reference runtime does: the V rows of KV head h in
    v_proj become M_hᵀ·W_h (bias b_h·M_h), and the input columns of query head j in o_proj become W_o,j·M_h(j), so
    the cache rotates no value and the attention un-rotates no output. Exact in real arithmetic; computed in float64
    and stored in the weights' dtype. The model then gives the same outputs with no cache or a BF16 one; `cache` (and
    any OscarCache with the same rotations) skips the two steps, and an OscarCache of other rotations is refused.
    Returns the number of layers folded. Needs `enable_oscar` first and plain nn.Linear v_proj/o_proj (Llama, Mistral,
    Qwen2/3, Gemma); refuses a model folded already."""
    folded = 0
    for module in _attention_modules(model):
        layer = cache.layers[module.layer_idx] if module.layer_idx < len(cache.layers) else None
        if layer is None or layer.rotation is None:
            continue
        if getattr(module, "_oscar_v_fold", None) is not None:
            raise ValueError(f"layer {module.layer_idx} is folded already; reload the model to fold other rotations")
        v_proj, o_proj = getattr(module, "v_proj", None), getattr(module, "o_proj", None)
        if not (isinstance(v_proj, torch.nn.Linear) and isinstance(o_proj, torch.nn.Linear)):
            raise NotImplementedError(
                f"{type(module).__name__} has no plain v_proj/o_proj linear layers to fold the value rotation into; "
                f"use the cache unfolded"
            )
        M = layer.rotation.v.to(device=v_proj.weight.device, dtype=torch.float64)  # [H or 1, D, D]
        D = M.shape[-1]
        H_kv, H_q = v_proj.out_features // D, o_proj.in_features // D
        M_kv = M.expand(H_kv, D, D)
        W_v = v_proj.weight.double().view(H_kv, D, -1)  # [H_kv, D, hidden]
        v_proj.weight.copy_(torch.einsum("hde,hdk->hek", M_kv, W_v).reshape(v_proj.weight.shape))
        if v_proj.bias is not None:
            v_proj.bias.copy_(torch.einsum("hd,hde->he", v_proj.bias.double().view(H_kv, D), M_kv).flatten())
        M_q = M_kv.repeat_interleave(H_q // H_kv, dim=0)  # [H_q, D, D]
        W_o = o_proj.weight.double().view(o_proj.out_features, H_q, D)  # [hidden, H_q, D]
        o_proj.weight.copy_(torch.einsum("kjd,jde->kje", W_o, M_q).reshape(o_proj.weight.shape))
        module._oscar_v_fold = layer.v_fingerprint
        folded += 1
    return folded


def oscar_mask(
    batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
    attention_mask: Tensor | None = None, **kwargs,
) -> None:  # fmt: skip
    """Mask factory for "oscar": causality is implicit, so no causal mask is built. A left-padded batch (a 2D
    padding mask [B, kv_length] with padding, each row's padding before its tokens) gets the padding of its keys
    back, bool [B, kv_length] (True: a token): the attention module's hook hands a prompt chunk's part to an
    OscarCache (`OscarLayer.expect_padding`), which from then on files and attends every row as it would be alone;
    without an OscarCache the attention attends each row's own tokens (`_padded_exact`). A single-token decode step
    of a compileable cache (transformers turns the causal shortcut off for it; a one-token prompt is not one) gets
    None: padding only ever leads a sequence and an OscarCache knows each row's lengths, so the step stays
    capturable (transformers' own compileable caches are not supported by "oscar" attention). Refused: padding
    anywhere but before a row's tokens (right padding), and any other departure from the causal pattern for a query
    chunk: transformers then turns off its causal shortcut (`allow_is_causal_skip`), which it does for packed
    sequences (position ids that restart), custom `or_mask_function`/`and_mask_function`s and block overlays;
    "oscar" would silently attend across them."""
    skip = kwargs.get("allow_is_causal_skip", True)
    if q_length == 1 and not skip and kv_length > 1:  # a decode step (a one-token prompt still hands its padding)
        return None
    padding = None
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        tokens = attention_mask.bool()
        if bool((tokens[:, :-1] & ~tokens[:, 1:]).any()):  # a token followed by padding
            raise NotImplementedError(
                "\"oscar\" attention takes padded batches padded on the left (padding before each prompt, as "
                "tokenizer(..., padding=True, padding_side=\"left\") makes them); this batch has padding after "
                "tokens"
            )
        padding = tokens.contiguous()
    if q_length > 1 and not skip:
        raise NotImplementedError(
            "oscar attention is plain causal attention and this call needs another mask (packed sequences whose "
            "position ids restart, or a custom mask function): run it with the model's own attention "
            "(model.set_attn_implementation('sdpa')) and without an OscarCache"
        )
    return padding


def register() -> None:
    """Register the "oscar" attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, oscar_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, oscar_mask)


def _bind_cache(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of an attention module: pass the OscarCache it is called with on to the attention function
    (`OscarBinding.enter`). Not while a compiled step traces: its custom op enters, in the step."""
    binding = binding_of(module)
    if binding is None or (binding.stepping and torch.compiler.is_compiling()):
        return args, kwargs
    cache = cache_argument(kwargs)
    kwargs.update(binding.enter(module, cache))
    mask, hidden = kwargs.get("attention_mask"), kwargs.get("hidden_states", args[0] if args else None)
    n = hidden.shape[1] if isinstance(hidden, Tensor) and hidden.dim() == 3 else 1
    if isinstance(cache, OscarCache) and module.layer_idx < len(cache.layers) and isinstance(mask, Tensor) \
            and mask.dtype == torch.bool and mask.dim() == 2:  # `oscar_mask`'s padding: a prompt chunk's part
        pads = (~mask[:, -n:]).sum(1).tolist()
        if any(pads):
            cache.layers[module.layer_idx].expect_padding(pads)
    return args, kwargs


def _attention_modules(model: torch.nn.Module):
    """Modules that own a KV-cache layer: a `layer_idx`, a cache argument, and no attention module inside them."""
    for module in model.modules():
        params = inspect.signature(module.forward).parameters if hasattr(module, "layer_idx") else {}
        if any(name in params for name in CACHE_ARGS) and not hasattr(module, "self_attn"):
            yield module


def model_binding(model: torch.nn.Module) -> OscarBinding:
    """The model's `OscarBinding` (made and bound to its attention modules on first use, for the model's life)."""
    found = next((b for m in _attention_modules(model) if (b := binding_of(m)) is not None), None)
    if found is None:
        found = OscarBinding(attend=oscar_attention, model=model)
        bind(model, found)
    return found


def enable_oscar(model: torch.nn.Module, compile: bool | None = None) -> torch.nn.Module:
    """Register "oscar", switch `model` (a transformers PreTrainedModel) to it and bind its attention modules to the
    cache they are called with; returns the model. Rotations are applied only when an OscarCache is the cache; without
    one the model runs exact. On a GPU, generate() then replays single-token decode steps as CUDA graphs (graph.py),
    whose decoder layers are compiled by inductor around the OSCAR work (compiled.py; the first such step
    compiles). `compile=False` captures the eager layers instead; None (the default) keeps what an earlier call set,
    and compiles on a first call."""
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    model_binding(model)
    for module in _attention_modules(model):
        if not getattr(module, "_oscar_bound", False):
            module.register_forward_pre_hook(_bind_cache, with_kwargs=True)
            module._oscar_bound = True
    install(model, compile=compile)
    return model
