"""BF16 caches of the decode benchmarks: "prealloc" (K/V written in place, read as an exact-length view) and
"bf16graph" (fixed capacity, a device-side length, read at that length by the runtime's split-K BF16 kernel: the
fastest BF16 decode a CUDA graph can hold). Inside a compiled step (`oscar_zoo.runtime.compiled`) the bf16graph
layer's write and attention run as one opaque custom op, as OSCAR's do, so a compiled comparison compares like with
like."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from types import SimpleNamespace

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from oscar_zoo.runtime import compiled, ops
from oscar_zoo.runtime.attention import dense_attention
from oscar_zoo.runtime.binding import running_step


class PreallocLayer(CacheLayerMixin):
    """BF16 K/V [B, H_kv, capacity, D] written in place; attention reads the exact-length view (no copy, no mask)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.n = capacity, 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, H, _, D = key_states.shape
        self.keys = torch.empty(B, H, self.capacity, D, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.empty_like(self.keys)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        if self.n + n > self.capacity:
            raise ValueError(f"prealloc cache full: {self.n} + {n} tokens > capacity {self.capacity}")
        self.keys[:, :, self.n : self.n + n] = key_states
        self.values[:, :, self.n : self.n + n] = value_states
        self.n += n
        return self.keys[:, :, : self.n], self.values[:, :, : self.n]

    def get_seq_length(self) -> int:
        return self.n

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        q = query_length if isinstance(query_length, int) else query_length.shape[0]  # older API: cache_position
        return self.n + q, 0

    def get_max_length(self) -> int:
        return self.capacity


class GraphBF16Layer(PreallocLayer):
    """A BF16 K/V buffer of fixed capacity with an int32 [B] device length: a decode token is written at that length
    (index_copy_, no host value), and `bf16_split_attention` reads exactly `length` rows with the runtime's split-K
    BF16 kernel. The fastest BF16 decode that a CUDA graph can hold (no mask, no repeat_kv, no padding reads)."""

    is_compileable = True
    LAYERS: "weakref.WeakValueDictionary[int, GraphBF16Layer]" = weakref.WeakValueDictionary()  # layer_idx → layer
    # for the attention function (benchmark only; weak, so a finished row's cache is freed)
    STORAGE_IDS = itertools.count(1)

    def __init__(self, capacity: int, layer_idx: int):
        super().__init__(capacity)
        self.layer_idx = layer_idx
        GraphBF16Layer.LAYERS[layer_idx] = self

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        B, H, _, D = key_states.shape
        self.length = torch.zeros(B, dtype=torch.int32, device=key_states.device)
        self.empty = torch.zeros(B, H, 0, D, dtype=key_states.dtype, device=key_states.device)  # no sink tier
        self.storage_id = next(GraphBF16Layer.STORAGE_IDS)  # unique per allocation (graphs are keyed by it)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling():  # only a compiled step traces it: the step's custom op writes the token
            return key_states, value_states
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[2] != 1:
            out = super().update(key_states, value_states)
            self.length.fill_(self.n)
            return out
        slot = self.length[:1].long()
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        self.length.add_(1)
        self.n += 1  # host mirror (a replayed step advances it in `advance_host`)
        return key_states, value_states


class GraphBF16Cache(Cache):
    """Cache of GraphBF16Layer with the static-step protocol of oscar_zoo.runtime.graph.DecodeGraphs."""

    # what a compiled step's binding reads of the cache it runs (`binding.OscarBinding.compiled`): set to the binding
    # there; no means of an artifact to check
    binding = None
    read_from_artifact = centred = False

    def __init__(self, capacity: int, num_layers: int):
        super().__init__(layers=[GraphBF16Layer(capacity, i) for i in range(num_layers)])

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if torch.compiler.is_compiling():  # (a compiled step) before `self.layers[layer_idx]`: indexing it makes
            return key_states, value_states  # dynamo guard on layer_idx and compile every layer apart (to its limit)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def static_step_key(self):
        ok = all(layer.is_initialized and layer.n < layer.capacity for layer in self.layers)
        return (False, tuple(layer.storage_id for layer in self.layers)) if ok else None

    def host_lengths(self):
        return [layer.n for layer in self.layers]

    def restore_host_lengths(self, lengths):
        for layer, n in zip(self.layers, lengths):
            layer.n = n

    def advance_host(self):
        for layer in self.layers:
            layer.n += 1

    @contextlib.contextmanager
    def rehearsal(self, demote: bool):
        """Nothing to set: a BF16 step never demotes, so its key stays (False, …) and only the plain kind is captured
        ahead."""
        yield


def bf16_split_attention(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
    """Attention of "bf16graph": decode steps through ops.decode_bf16_partial + merge over the exact length; a
    prefill chunk (fill=model) through SDPA over the buffer's exact-length view. A logit softcap (Gemma2) is applied
    in the decode kernel as OSCAR's is."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if torch.compiler.is_compiling():  # only a compiled decode step traces it: write + attend is one op
        return bf16_decode(query, key, value, scale, softcap), None
    layer = GraphBF16Layer.LAYERS[module.layer_idx]
    if query.shape[2] != 1:
        out = dense_attention(query, layer.keys[:, :, : layer.n], layer.values[:, :, : layer.n], scale, softcap)
        return out.transpose(1, 2).contiguous(), None
    zero = torch.zeros_like(layer.length)
    B, H_kv, T_cap = layer.keys.shape[:3]
    # the INT2 split rule
    splits = ops.int2_splits(B, H_kv, query.shape[1] // H_kv, query.shape[-1], T_cap, query.device)
    o, lse = ops.decode_bf16_partial(query[:, :, 0], layer.empty, layer.empty, zero, layer.keys, layer.values,
                                     layer.length, scale, num_splits=splits, softcap=softcap)  # fmt: skip
    o, _ = ops.merge_partials(o, lse)  # [B, H_q, D] fp32
    return o.to(query.dtype).unsqueeze(1), None


def check_bf16graph(model, cache: GraphBF16Cache) -> float:
    """Max |kernel − SDPA| of layer 0's decode attention at the filled length, random q (0 when not on the kernels)."""
    layer = cache.layers[0]
    cfg = model.config
    B = layer.keys.shape[0]
    q = torch.randn(B, cfg.num_attention_heads, 1, layer.keys.shape[-1], device=layer.keys.device, dtype=torch.bfloat16)
    got, _ = bf16_split_attention(SimpleNamespace(layer_idx=0), q, None, None, None)
    ref = dense_attention(q, layer.keys[:, :, : layer.n], layer.values[:, :, : layer.n], q.shape[-1] ** -0.5)
    return (got.float() - ref.transpose(1, 2).float()).abs().max().item()



@torch.library.custom_op("oscar_bench::bf16_decode", mutates_args=())
def bf16_decode(query: Tensor, key: Tensor, value: Tensor, scaling: float, softcap: float | None) -> Tensor:
    """The running compiled step's layer: write this token's key/value at the device length and attend (what the
    eager step does in `GraphBF16Layer.update` + `bf16_split_attention`); [B, 1, H_q, D]."""
    module = running_step().module
    query, key, value = compiled.eager_layout(query), compiled.eager_layout(key), compiled.eager_layout(value)
    GraphBF16Layer.LAYERS[module.layer_idx].update(key, value)
    out, _ = bf16_split_attention(module, query, key, value, None, scaling, softcap)
    return out.contiguous()


@bf16_decode.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, scaling: float, softcap: float | None) -> Tensor:
    B, H_q, n, D = query.shape
    return query.new_empty(B, n, H_q, D)

