"""An independent float64 computation of what `verify` reports for an artifact, to test verify against.

Written from docs/format.md and verify's definitions, not from `oscar_zoo.evaluation`: the model's own layers run in
float64 with an attention function of this module; for the artifact's method, query i reads key/value j exactly iff
j < sink or j > i − recent, and otherwise the INT2 round trip (`reference.fake_quant`, the codec's one definition) of
the rotated row k·M_K (v·M_V), with the artifact's per-(layer, head) clip ratios; queries are rotated by M_K of their
KV head (query head j → KV head j // g) and outputs un-rotated by M_Vᵀ. A centred artifact (k_mean, v_mean;
docs/format.md §6a) is computed in the uncentred frame, without relying on softmax's shift invariance: the stored row is
x·M − μ·M (rounded to the model's dtype, as the cache stores it), what attention reads is that row (or its INT2 round
trip) plus μ·M, so neither the logits nor the output need a correction. Keys of a layer with 3-bit keys
(docs/format.md §6b, `key_bits`) take the 3-bit round trip. Then, over scored positions (those at or past
sink + recent): KL(exact ‖ method) per position, top-1 agreement, and the perplexity ratio, all in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from oscar_zoo.format import reference

IMPL = "float64_tier_reference"


@dataclass(frozen=True)
class Expected:
    kl: float
    top1: float
    ppl_increase: float
    scored: int  # positions scored over all sequences


class _Attention:
    """rotations None: exact causal attention; else (k_rotation, v_rotation [L, H, D, D], k_clip, v_clip [L, H],
    k_mean, v_mean [L, H, D] or None)."""

    def __init__(self, rotations, sink: int, recent: int, group_size: int, key_bits: list[int] | None = None):
        self.rotations, self.sink, self.recent, self.group_size = rotations, sink, recent, group_size
        self.key_bits = key_bits

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        q, k, v = query.double(), key.double(), value.double()  # [B, H_q, T, D], [B, H_kv, T, D]
        B, H_q, T, D = q.shape
        H_kv = k.shape[1]
        g = H_q // H_kv
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        causal = j <= i
        scale = scaling if scaling is not None else D**-0.5
        if self.rotations is None:
            logits = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale
            p = torch.softmax(logits.masked_fill(~causal, -math.inf), -1)
            out = p @ v.repeat_interleave(g, 1)
        else:
            k_rot, v_rot, k_clip, v_clip, k_mean, v_mean = (None if t is None else t[module.layer_idx]
                                                            for t in self.rotations)  # [H, D, D], [H], [H, D]
            Mk, Mv = k_rot.double().expand(H_kv, D, D), v_rot.double().expand(H_kv, D, D)  # shared: one for all heads
            ck, cv = k_clip.expand(H_kv), v_clip.expand(H_kv)
            kb = self.key_bits[module.layer_idx] if self.key_bits else 2
            kr, vr = torch.einsum("bhtd,hde->bhte", k, Mk), torch.einsum("bhtd,hde->bhte", v, Mv)
            if k_mean is None:
                # the INT2 round trip, from the rotated rows in the model's dtype (as the cache stores them), per head
                k_hat = reference.fake_quant(kr.to(key.dtype), ck[None, :, None], self.group_size, kb).double()
                v_hat = reference.fake_quant(vr.to(value.dtype), cv[None, :, None], self.group_size).double()
            else:  # μ·M [1, H, 1, D]; stored rows x·M − μ·M in the model's dtype; read back with μ·M added
                mk = torch.einsum("hd,hde->he", k_mean.double().expand(H_kv, D), Mk)[None, :, None]
                mv = torch.einsum("hd,hde->he", v_mean.double().expand(H_kv, D), Mv)[None, :, None]
                k_st, v_st = (kr - mk).to(key.dtype), (vr - mv).to(value.dtype)
                k_hat = reference.fake_quant(k_st, ck[None, :, None], self.group_size, kb).double() + mk
                v_hat = reference.fake_quant(v_st, cv[None, :, None], self.group_size).double() + mv
                kr, vr = k_st.double() + mk, v_st.double() + mv
            exact = (j < self.sink) | (j > i - self.recent)  # [T, T]
            qr = torch.einsum("bhtd,hde->bhte", q, Mk.repeat_interleave(g, 0))
            logits = torch.where(exact, qr @ kr.repeat_interleave(g, 1).transpose(-1, -2),
                                 qr @ k_hat.repeat_interleave(g, 1).transpose(-1, -2)) * scale
            p = torch.softmax(logits.masked_fill(~causal, -math.inf), -1)
            o = (torch.where(exact, p, 0) @ vr.repeat_interleave(g, 1)
                 + torch.where(~exact, p, 0) @ v_hat.repeat_interleave(g, 1))
            out = torch.einsum("bhte,hde->bhtd", o, Mv.repeat_interleave(g, 0))  # o·M_Vᵀ
        return out.to(query.dtype).transpose(1, 2).contiguous(), None


@torch.no_grad()
def _logprobs(model, ids: torch.Tensor, attention: _Attention) -> torch.Tensor:
    AttentionInterface.register(IMPL, attention)
    AttentionMaskInterface.register(IMPL, lambda *a, **k: None)  # causality is the function's own
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPL)
    try:
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].double()  # position t predicts token t+1
    finally:
        model.set_attn_implementation(previous)
    return torch.log_softmax(logits, -1)


def expected_metrics(model64, ids: torch.Tensor, rotations, sink: int, recent: int, group_size: int = 0,
                     key_bits: list[int] | None = None) -> Expected:
    """model64: the model in float64; ids [N, T]; rotations: artifacts.Rotations indexed by model layer (layer_ids
    0..L-1 in order); key_bits per layer (None: INT2 keys). KL, top-1 and the perplexity increase past the windows
    (positions ≥ sink + recent)."""
    assert rotations.layer_ids.tolist() == list(range(rotations.k_rotation.shape[0]))
    tensors = (rotations.k_rotation, rotations.v_rotation, rotations.k_clip, rotations.v_clip, rotations.k_mean,
               rotations.v_mean)
    start = sink + recent
    ref = _logprobs(model64, ids, _Attention(None, sink, recent, group_size))[:, start:]  # [N, P, V]
    got = _logprobs(model64, ids, _Attention(tensors, sink, recent, group_size, key_bits))[:, start:]
    targets = ids[:, start + 1 :, None]
    kl = (ref.exp() * (ref - got)).sum(-1)  # [N, P]
    top1 = (ref.argmax(-1) == got.argmax(-1)).double()
    nll_ref, nll_got = -ref.gather(-1, targets).squeeze(-1), -got.gather(-1, targets).squeeze(-1)
    return Expected(kl=kl.mean().item(), top1=top1.mean().item(),
                    ppl_increase=math.exp(nll_got.mean().item() - nll_ref.mean().item()) - 1, scored=kl.numel())
