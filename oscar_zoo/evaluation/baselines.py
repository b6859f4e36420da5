"""The attention variants `verify` compares: exact BF16, the artifact's OSCAR rotations, and data-free baselines
(naive INT2, clip-only INT2, Hadamard-only INT2, KIVI-2-style), each turning post-RoPE q/k/v of one layer into what
attention reads, and storing K/V in a runtime cache where it can. Every quantization goes through the runtime's own
quantize/pack (`ops` on Triton, `reference` on torch) and `reference.dequantize_unpack`: nothing here re-implements the
codec. Which of them `verify` runs, under which names, is registry.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..format import layout, reference
from .teacher_forcing import causal_attention, windowed_attention

KIVI_GROUP = 32  # KIVI-2: keys per channel over groups of 32 tokens, values per token over groups of 32 channels

# quantize_pack(x [..., D], clip_ratio, group_size) -> (packed uint8 [..., D/4], scale_zero float16 [..., D/G, 2])
QuantizePack = Callable[..., tuple[Tensor, Tensor]]


def fake_quant_with(quantize_pack: QuantizePack, x: Tensor, clip: float | Tensor, group_size: int = 0,
                    bits: int = layout.BITS) -> Tensor:
    """What attention reads back from history rows of `bits`-bit codes: quantize_pack (kernel or reference) →
    dequantize_unpack, fp32."""
    packed, scale_zero = quantize_pack(x, clip, group_size, bits=bits)
    return reference.dequantize_unpack(packed, scale_zero, bits)


@dataclass
class LayerKV:
    """One layer's attention inputs as a method presents them. q [B, H_q, T, D]; k, v [B, H_kv, T, D] (rotated when
    the method rotates, and centred when it centres); k_hat, v_hat fp32 (None: exact method); out_mean [H_q or 1, D]
    is added to the output first (μ_V·M_V of centred values, `reference.add_value_mean`), then out_rotation
    [H_q or 1, D, D] un-rotates it."""

    q: Tensor
    k: Tensor
    v: Tensor
    k_hat: Tensor | None = None
    v_hat: Tensor | None = None
    out_rotation: Tensor | None = None
    out_mean: Tensor | None = None


@dataclass(frozen=True)
class Windows:
    """How teacher-forced attention reads a method's history: the runtime's quantize/pack, and the exact windows (the
    first `sink` keys and the last `recent` before each query)."""

    quantize_pack: QuantizePack
    sink: int
    recent: int


class Method:
    """An attention variant. Teacher forcing: `attend` one layer (by default `prepare` → windowed attention → the
    value mean added back → un-rotate); bits per K and V element at a context; and, when `cache_path` is set, a fresh
    cache that stores K/V as the method models them (`make_cache`: generation and the needle grid decode through it)."""

    name: str = ""
    label: str = ""
    kind: str = "baseline"  # "reference" | "artifact" | "baseline"
    head_dim: int = 0
    # the cache it decodes through: "dynamic-cache" (the model's own), "oscar-cache" (the runtime's OscarCache),
    # "quantized-cache" (transformers' QuantizedCache); None: teacher forcing only
    cache_path: str | None = None

    def prepare(self, layer: int, q: Tensor, k: Tensor, v: Tensor, quantize_pack: QuantizePack) -> LayerKV:
        raise NotImplementedError

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, windows: Windows) -> Tensor:
        """q [B, H_q, T, D], k/v [B, H_kv, T, D] post-RoPE of the whole sequence → fp32 [B, H_q, T, D]."""
        kv = self.prepare(layer, q, k, v, windows.quantize_pack)
        if kv.k_hat is None:
            out = causal_attention(kv.q, kv.k, kv.v, scale)
        else:
            out = windowed_attention(kv.q, kv.k, kv.v, kv.k_hat, kv.v_hat, scale, windows.sink, windows.recent)
        out = reference.add_value_mean(out, kv.out_mean)  # centred values: + μ_V·M_V (M_V space)
        if kv.out_rotation is not None:
            out = reference.rotate(out, kv.out_rotation)  # fp32 o·M_Vᵀ per query head
        return out  # fp32 [B, H_q, T, D]

    def bits(self, context: int) -> tuple[float, float]:
        raise NotImplementedError

    def make_cache(self):
        """A fresh cache of the kind `cache_path` names, for `generate` and the needle grid."""
        raise NotImplementedError(f"{self.name} runs teacher-forced only: it has no cache to decode through")


DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "FP16", torch.float32: "FP32"}


class Exact(Method):
    """The model's own cache, unquantized: the reference. Its name stays "bf16" (reports key on it); its label says
    the dtype the model ran in (`for_dtype`)."""

    name, label, kind, cache_path = "bf16", "BF16 (reference)", "reference", "dynamic-cache"

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> Exact:
        exact = cls()
        exact.label = f"{DTYPE_NAMES.get(dtype, str(dtype))} (reference)"
        return exact

    def prepare(self, layer, q, k, v, quantize_pack):
        return LayerKV(q, k, v)

    def bits(self, context):
        return 16.0, 16.0

    def make_cache(self):
        from transformers import DynamicCache

        return DynamicCache()


class RotatedInt2(Method):
    """Rotate (per layer, per KV head) → centre → clip → INT2 per row groups → attention → add the value mean back →
    un-rotate: OSCAR and its ablations, exactly as the runtime's tiers store and read them (docs/format.md §6a).

    k_rotation/v_rotation float32 [L, H, D, D] (H = H_kv or 1) indexed by model layer; clips float32 [L, H] (0 = none);
    k_mean/v_mean float32 [L, H, D] in the model's basis (None: uncentred; needs rotations); key_bits: the history
    keys' bits per model layer (None: 2 in every layer); flush and pin: the settings of its OscarCache (`make_cache`);
    key_block > 0: history keys per channel over blocks of that many tokens from the sink's end, unclipped
    (docs/format.md §6d; a last partial block is coded over the tokens it has — the runtime would still hold those in
    its recent tier, so teacher forcing is slightly harder on this codec than the cache is)."""

    cache_path = "oscar-cache"

    def __init__(self, name: str, label: str, kind: str, k_rotation: Tensor | None, v_rotation: Tensor | None,
                 k_clip: Tensor, v_clip: Tensor, group_size: int, sink: int, recent: int,
                 k_mean: Tensor | None = None, v_mean: Tensor | None = None, key_bits: list[int] | None = None,
                 flush: int = layout.FLUSH, pin: int = 0, key_block: int = 0):
        self.name, self.label, self.kind = name, label, kind
        self.key_bits = [layout.BITS] * k_clip.shape[0] if key_bits is None else list(key_bits)  # per layer, resolved
        self.flush, self.pin, self.key_block = flush, pin, key_block
        self.k_rotation, self.v_rotation = k_rotation, v_rotation
        self.k_mean, self.v_mean = k_mean, v_mean
        self.k_clip, self.v_clip = k_clip.float(), v_clip.float()
        self.group_size, self.sink, self.recent = group_size, sink, recent
        self._device_cache: dict = {}

    def _layer_tensors(self, layer: int, device: torch.device):
        key = (layer, device)
        if key not in self._device_cache:
            rot = None if self.k_rotation is None else (self.k_rotation[layer].to(device),
                                                       self.v_rotation[layer].to(device))
            means = (None, None)
            if self.k_mean is not None:  # μ·M per head [H, D], as OscarCache makes them
                means = (reference.rotate_mean(self.k_mean[layer], self.k_rotation[layer]).to(device),
                         reference.rotate_mean(self.v_mean[layer], self.v_rotation[layer]).to(device))
            clips = (self.k_clip[layer].reshape(-1, 1).to(device), self.v_clip[layer].reshape(-1, 1).to(device))
            self._device_cache[key] = (rot, means, clips)
        return self._device_cache[key]

    def prepare(self, layer, q, k, v, quantize_pack):
        rot, (mu_k, mu_v), (k_clip, v_clip) = self._layer_tensors(layer, q.device)
        out_rotation = out_mean = None
        if rot is not None:
            M_k, M_v = rot  # [H, D, D]
            g = q.shape[1] // M_k.shape[0] if M_k.shape[0] > 1 else 1
            # As the runtime's decode path: q·M_K kept fp32; k·M_K − μ_K·M_K, v·M_V − μ_V·M_V rounded once to the model
            # dtype (the BF16 tiers, and what the INT2 history is quantized from).
            q = reference.rotate(q.float(), M_k.repeat_interleave(g, dim=0))  # [B, H_q, T, D]
            k, v = reference.rotate_centred(k, M_k, mu_k), reference.rotate_centred(v, M_v, mu_v)  # [B, H_kv, T, D]
            out_rotation = M_v.transpose(-1, -2).repeat_interleave(g, dim=0)  # [H_q, D, D] M_Vᵀ
            if mu_v is not None:
                out_mean = mu_v if mu_v.shape[0] == 1 else mu_v.repeat_interleave(g, dim=0)  # [H_q, D]
        k_bits = self.key_bits[layer]
        if self.key_block:
            k_hat = self._history(lambda x: reference.fake_quant_channel(x, self.key_block, k_bits), k)
        else:
            k_hat = self._history(lambda x: fake_quant_with(quantize_pack, x, k_clip, self.group_size, k_bits), k)
        v_hat = self._history(lambda x: fake_quant_with(quantize_pack, x, v_clip, self.group_size), v)
        return LayerKV(q, k, v, k_hat, v_hat, out_rotation, out_mean)

    def _history(self, fake_quant, x: Tensor) -> Tensor:
        """x [B, H, T, D] with rows sink ≤ j < T − recent through `fake_quant` (the only rows any query reads as
        INT2)."""
        T = x.shape[2]
        lo = min(self.sink, T)
        hi = max(lo, T - self.recent)
        out = x.float().clone()
        if hi > lo:
            out[:, :, lo:hi] = fake_quant(x[:, :, lo:hi])
        return out

    def bits(self, context):
        G = layout.resolve_group_size(self.head_dim, self.group_size)
        key_bits = sum(self.key_bits) / len(self.key_bits)  # the mean over layers: what bits per element count
        return (layout.bits_per_element(context, G, self.sink, self.recent, key_bits, key_block=self.key_block),
                layout.bits_per_element(context, G, self.sink, self.recent))

    def make_cache(self):
        """The runtime OscarCache that stores K/V exactly as this method models them (rotation or identity, its clips,
        means, key bits and pins; docs/format.md §6c)."""
        from ..runtime.cache import OscarCache

        L, D = self.k_clip.shape[0], self.head_dim
        rot_k, rot_v = self.k_rotation, self.v_rotation
        if rot_k is None:
            rot_k = rot_v = torch.eye(D).expand(L, 1, D, D).contiguous()
        return OscarCache.from_tensors(rot_k, rot_v, self.k_clip, self.v_clip, torch.arange(L), k_mean=self.k_mean,
                                       v_mean=self.v_mean, group_size=self.group_size, sink=self.sink,
                                       recent=self.recent, flush=self.flush, num_layers=L, key_bits=self.key_bits,
                                       pin=self.pin, key_block=self.key_block)


class Kivi(Method):
    """KIVI-2-style: no rotation, no clip; keys per channel over groups of 32 tokens (counted from the sink's end),
    values per token over groups of 32 channels; float16 scale and zero per group (3 bits/element in the history).

    Teacher-forcing note: a key read as INT2 by query i satisfies j ≤ i − recent, so its whole 32-token group lies at
    positions ≤ i (no look-ahead). A real KIVI cache quantizes a group only once all 32 tokens have left the residual
    window, so at a group's edge it would still hold a few of these keys in full precision (slightly kinder to KIVI)."""

    name, label = "kivi", "KIVI-2-style INT2 (K per-channel/32 tokens, V per-token/32)"

    def __init__(self, head_dim: int, sink: int, recent: int, group: int = KIVI_GROUP):
        self.head_dim, self.sink, self.recent, self.group = head_dim, sink, recent, group
        self.v_group = group if head_dim % group == 0 else head_dim

    def prepare(self, layer, q, k, v, quantize_pack):
        B, H, T, D = k.shape
        n = max(0, (T - self.sink) // self.group)  # whole token groups after the sink
        k_hat = k.float().clone()  # positions outside whole groups are never read as INT2 (they are in a window)
        if n:
            span = k[:, :, self.sink : self.sink + n * self.group]  # [B, H, n·32, D]
            rows = span.reshape(B, H, n, self.group, D).transpose(-1, -2)  # [B, H, n, D, 32]: one row per channel
            deq = fake_quant_with(quantize_pack, rows.contiguous(), 0.0, 0)  # [B, H, n, D, 32]
            k_hat[:, :, self.sink : self.sink + n * self.group] = deq.transpose(-1, -2).reshape(B, H, n * self.group, D)
        v_hat = fake_quant_with(quantize_pack, v, 0.0, self.v_group)
        return LayerKV(q, k, v, k_hat, v_hat)

    def bits(self, context):
        return (layout.bits_per_element(context, self.group, self.sink, self.recent),
                layout.bits_per_element(context, self.v_group, self.sink, self.recent))


def hadamard_rotation(num_layers: int, head_dim: int) -> Tensor:
    """H·P for every layer (data-free, QuaRot-like): `reference.compose_rotation` of the identity, float32
    [L, 1, D, D]."""
    M = reference.compose_rotation(torch.eye(head_dim, dtype=torch.float64)).float()
    return M.expand(num_layers, 1, head_dim, head_dim).contiguous()
