"""transformers' own quantized KV cache (`QuantizedCache`, backends quanto and HQQ) as `verify` methods: the cache a
user gets today from `generate(cache_implementation="quantized", cache_config={"backend": …, "nbits": …})`.

Nothing is re-implemented: every key and value goes through a real `QuantizedCache` layer of the installed
transformers, built with its documented defaults (`axis_key`, `axis_value`, `q_group_size`, `residual_length` left
unset; only `nbits` is chosen). Teacher forcing feeds a layer's K/V to such a layer in the chunks at which the cache
flushes its residual window during decode — the first token, then `residual_length` tokens at a time — so every query
attends to exactly what that cache would return at its position had the text been decoded one token at a time
(tests/evaluation/test_peers.py checks this against real token-by-token decoding). Bits per element are counted from
the bytes the cache holds (packed codes, scales, zero points or shifts, and the residual window). Which peers `verify`
offers, and under which names, is registry.py's.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import InputError
from .baselines import Method


@dataclass(frozen=True)
class PeerSpec:
    backend: str  # QuantizedCache backend: "quanto" or "hqq"
    nbits: int

# backend → (module that must import, PyPI package that provides it)
PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
INSTALL_ADVICE = "pip install 'oscar-zoo[peers]' (optimum-quanto and hqq), or leave that baseline out"


def missing_package(backend: str) -> str | None:
    """The PyPI package the backend needs when it is not installed, else None."""
    module, package = PACKAGES[backend]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package (`optimum`)
        found = False
    return None if found else package


def require_installed(name: str, spec: PeerSpec) -> None:
    """InputError (exit 2) when the package of peer `name` is missing."""
    package = missing_package(spec.backend)
    if package is not None:
        raise InputError(f"baseline {name} runs transformers' QuantizedCache, which needs the package {package} "
                         "(not installed)", INSTALL_ADVICE)


def new_cache(spec: PeerSpec, config):
    """What generate(cache_implementation="quantized", cache_config={"backend", "nbits"}) builds: every other
    setting is the layer class's default."""
    from transformers import QuantizedCache

    return QuantizedCache(backend=spec.backend, config=config, nbits=spec.nbits)


def layer_settings(layer) -> dict[str, int]:
    """The settings a QuantizedCache layer runs with (its defaults, as read back from the instance)."""
    return {k: getattr(layer, k) for k in ("nbits", "axis_key", "axis_value", "q_group_size", "residual_length")}


def flush_chunks(T: int, residual_length: int) -> list[tuple[int, int]]:
    """Token ranges [a, b) that reproduce token-by-token decoding: the cache quantizes its whole content on its first
    update and again whenever the residual window reaches `residual_length` tokens, so between two flushes a query
    reads the same quantized states plus the exact tokens since the last flush — one chunk."""
    bounds = [(0, min(1, T))]
    a = 1
    while a < T:
        bounds.append((a, min(T, a + residual_length)))
        a += residual_length
    return bounds


def _tensors(obj) -> Iterator[Tensor]:
    """Every plain tensor an object of the cache holds: tensor subclasses (quanto's QBits / Packed tensors) are
    unflattened into their inner tensors; tuples, lists and dicts (HQQ's (codes, meta)) are walked."""
    if isinstance(obj, Tensor):
        if type(obj) in (Tensor, torch.nn.Parameter):
            yield obj
        else:
            names, _ = obj.__tensor_flatten__()
            for n in names:
                yield from _tensors(getattr(obj, n))
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def stored_bytes(*objs) -> int:
    """Bytes of the storages behind every tensor in `objs`, each storage once."""
    seen, total = set(), 0
    for obj in objs:
        for t in _tensors(obj):
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def layer_bytes(layer) -> tuple[int, int]:
    """(K bytes, V bytes) one QuantizedCache layer holds: quantized states and the residual window."""
    return (stored_bytes(layer._quantized_keys, layer.keys), stored_bytes(layer._quantized_values, layer.values))


class PeerCache(Method):
    """transformers' QuantizedCache as a verify method. `attend` replaces prepare + windowed attention: the real
    cache layer returns the K/V a query reads (dequantized history, exact residual), attention runs in fp32;
    generation and the needle grid decode through a fresh QuantizedCache (`make_cache`)."""

    kind, cache_path = "baseline", "quantized-cache"

    def __init__(self, name: str, spec: PeerSpec, config, head_dim: int):
        self.name, self.spec, self.config, self.head_dim = name, spec, config, head_dim
        layer = new_cache(spec, config).layers[0]
        self.settings = layer_settings(layer)
        s = self.settings
        self.label = (f"transformers QuantizedCache, {spec.backend} INT{spec.nbits} (defaults: axis_key "
                      f"{s['axis_key']}, axis_value {s['axis_value']}, q_group_size {s['q_group_size']}, "
                      f"residual_length {s['residual_length']})")
        self.measured: dict[int, tuple[float, float]] = {}  # context → bits per K, V element, from a real run

    def make_cache(self):
        return new_cache(self.spec, self.config)

    def new_layer(self, layer_idx: int = 0):
        return self.make_cache().layers[layer_idx]

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float, windows=None) -> Tensor:
        """q [B, H_q, T, D], k/v [B, H_kv, T, D] post-RoPE of the whole sequence → fp32 [B, H_q, T, D]: each chunk of
        `flush_chunks` goes through a fresh cache layer's `update`; its queries attend causally to what it returns
        (the cache decides what each query reads: `windows` is not used)."""
        B, H_q, T, D = q.shape
        layer = self.new_layer(layer_idx)
        out = torch.empty(B, H_q, T, D, dtype=torch.float32, device=q.device)
        gqa = H_q != k.shape[1]
        for a, b in flush_chunks(T, self.settings["residual_length"]):
            keys, values = layer.update(k[:, :, a:b].contiguous(), v[:, :, a:b].contiguous())  # [B, H_kv, b, D]
            if keys.shape[2] != b:
                raise RuntimeError(f"QuantizedCache returned {keys.shape[2]} keys after {b} tokens")
            allowed = torch.arange(b, device=q.device)[None, :] <= torch.arange(a, b, device=q.device)[:, None]
            out[:, :, a:b] = F.scaled_dot_product_attention(q[:, :, a:b].float(), keys.float(), values.float(),
                                                            attn_mask=allowed, scale=scale, enable_gqa=gqa)
        k_bytes, v_bytes = layer_bytes(layer)
        elements = k.numel()
        self.measured[T] = (8 * k_bytes / elements, 8 * v_bytes / elements)
        return out

    def bits(self, context: int) -> tuple[float, float]:
        """Bits per K and V element the cache held after `context` tokens: measured in a run at that context, else
        measured now on a bfloat16 layer brought to the same state (`stored_state_bits`)."""
        if context not in self.measured:
            self.measured[context] = self.stored_state_bits(context)
        return self.measured[context]

    def stored_state_bits(self, context: int, dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
        """Bits per K, V element of a fresh layer holding what decoding `context` tokens leaves (the tokens up to the
        last flush quantized, the rest in the residual window), reached in two updates of zeros: the stored shapes,
        hence the bytes, do not depend on the values or on how the quantized part was reached."""
        cfg = self.config.get_text_config(decoder=True)
        last = flush_chunks(context, self.settings["residual_length"])[-1]
        quantized = last[1] if last[1] - last[0] == self.settings["residual_length"] or last[0] == 0 else last[0]
        layer = self.new_layer()
        x = torch.zeros(1, cfg.num_key_value_heads, context, self.head_dim, dtype=dtype)
        layer.update(x[:, :, :quantized], x[:, :, :quantized])  # first update: all of it quantized
        if context > quantized:
            layer.update(x[:, :, quantized:], x[:, :, quantized:])  # fewer than residual_length: the residual window
        k_bytes, v_bytes = layer_bytes(layer)
        return 8 * k_bytes / x.numel(), 8 * v_bytes / x.numel()

    def history_bits(self) -> float:
        """Bits per element of the quantized states alone (codes, scales, zeros), bfloat16, K and V averaged."""
        cfg = self.config.get_text_config(decoder=True)
        x = torch.zeros(1, cfg.num_key_value_heads, 1024, self.head_dim, dtype=torch.bfloat16)
        layer = self.new_layer()
        layer.update(x, x)
        return 8 * sum(layer_bytes(layer)) / (2 * x.numel())

