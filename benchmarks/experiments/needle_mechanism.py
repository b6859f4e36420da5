"""Where 2-bit retrieval is lost: the needle grid of `verify --needle` scored for many codec variants at once.

Each prompt's context (any haystack of evaluation/haystacks.py with any needle of evaluation/needle.py) is prefilled
once in BF16; every variant then replaces the cached K/V of the history positions (between the sink and recent
windows) by what its codec reconstructs — rotated with the artifact's M_K / M_V, coded, decoded, rotated back
(orthogonal, so logits are those the tiered runtime computes) — and the question plus the key's tokens run as one
teacher-forced chunk. A prompt counts as retrieved when every answer token through the key is the argmax and the
token after it does not extend the key (the needle's own check: greedy decoding would write exactly the key).
Accuracy per length and per depth with 95 % Wilson intervals, bits per element at 32K context as `inspect` counts
them, and per layer the attention mass that the question's last token (the one that predicts the answer) puts on
the needle's tokens, averaged over query heads and prompts: where a codec loses the needle, and in which layers.
Several haystacks and needles run as families in one process (each pair its own prompts, from its own seeded
generator), scored a round at a time (one prompt per family, length and depth, for one seed) until `--time-budget`;
the tables are per family, then pooled. "the artifact" is the artifact's own codec (its key bits and key layout);
"the artifact, K bf16" and "…, V bf16" keep the keys or the values exact, which splits a loss between them. `--seed`
takes several seeds (each draws its own prompts); every variant's outcomes are paired prompt by prompt against
BF16's and the artifact's, pooled, per haystack and per needle (Newcombe's interval and the discordant prompts, also
in `--json`).

    .venv/bin/python -m benchmarks.experiments.needle_mechanism --artifacts artifacts/demo --trials 2 \
        --lengths 1024,2048 --haystack plays,poems,docs --needle passkey,name,code \
        --only "the artifact;the artifact, K bf16;the artifact, V bf16" --json /tmp/needle_mechanism.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

import torch
from transformers import AttentionInterface, DynamicCache

from oscar_zoo.artifacts import load_artifacts
from oscar_zoo.evaluation.haystacks import DEFAULT_HAYSTACK, HAYSTACKS, filler, haystack_named
from oscar_zoo.evaluation.needle import NEEDLES, PASSKEY, build_prompt, needle_named
from oscar_zoo.evaluation.stats import paired_difference, wilson
from oscar_zoo.evaluation.teacher_forcing import cache_argument
from oscar_zoo.format import layout, reference as ref
from oscar_zoo.models import load_model

# ------------------------------------------------------------------------------------------- debiased attention
# BIAS[layer]: [H_kv, T] coefficients c_t (0 outside the INT2 history); the logit of key t is scaling·q·k̂_t minus
# scaling²·‖q‖²·c_t, c_t = s_t²/24: half the variance of the quantization noise q·δk (uniform error of step s_t per
# rotated coordinate), so that E[exp(logit)] is exp of the exact logit (log-normal debiasing).
BIAS: dict[int, torch.Tensor] = {}
# OBSERVED[layer]: [H_kv, T] attention mass the question's queries give each cached token (summed over the question's
# tokens and the query heads of a KV head), recorded while RECORD is on: what the prompt's last tokens look at during
# prefill (the observation window of SnapKV), the score the "observed" variants keep exact by.
OBSERVED: dict[int, torch.Tensor] = {}
RECORD = False
# MASS = (query index in the chunk, first needle position, end): while set, NEEDLE_MASS[layer] is the attention mass
# that query gives the needle's tokens, averaged over the query heads
MASS: tuple[int, int, int] | None = None
NEEDLE_MASS: dict[int, float] = {}


def debiased_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    g = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(g, 1)
    v = value.float().repeat_interleave(g, 1)
    q = query.float()
    logits = q @ k.transpose(-1, -2) * scaling
    c = BIAS.get(module.layer_idx)
    if c is not None:
        c = c.repeat_interleave(g, 0)[None, :, None, : k.shape[2]]  # [1, H_q, 1, T]
        logits = logits - scaling**2 * q.pow(2).sum(-1, keepdim=True) * c
    # one unpadded sequence: the causal mask with the chunk's offset, whatever mask transformers passes (5.25 passes
    # none here, other versions a boolean or an additive one)
    T, n = k.shape[2], q.shape[2]
    causal = torch.ones(n, T, dtype=torch.bool, device=q.device).tril(T - n)
    logits = logits.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(logits, -1)
    if RECORD:
        H = key.shape[1]
        OBSERVED[module.layer_idx] = probs[0].sum(1).view(H, g, -1).sum(1)
    if MASS is not None:
        qi, a, b = MASS
        NEEDLE_MASS[module.layer_idx] = float(probs[0, :, qi, a:b].sum(-1).mean())
    out = probs @ v
    return out.transpose(1, 2).to(query.dtype), None


AttentionInterface.register("needle_debiased", debiased_attention)
# the model's cache keyword: `cache` in transformers 5.25, `past_key_values` in 5.17 (the GPU machine's), which took
# `cache=` silently as an unused keyword, so every chunk ran without its context and every variant scored 0 %
CACHE = cache_argument()


# ------------------------------------------------------------------------------------------- codecs on rows [T, D]


def uniform(x: torch.Tensor, bits: int, lo=None, hi=None, meta8: bool = False) -> torch.Tensor:
    """Asymmetric min-max with 2^bits levels per row (float16 scale/zero as the codec stores them; `meta8`: 8-bit
    metadata instead, the scale as float8 e4m3 and the zero point an int8 number of steps)."""
    levels = 2**bits - 1
    lo = x.amin(-1, keepdim=True) if lo is None else lo
    hi = x.amax(-1, keepdim=True) if hi is None else hi
    scale = ((hi - lo).clamp(min=1e-8) / levels).half().float()
    zero = (-lo / scale).half().float()
    if meta8:
        scale = scale.to(torch.float8_e4m3fn).float().clamp(min=2**-9)
        zero = torch.round(-lo / scale).clamp(-128, 127)
    q = torch.floor(x / scale + zero + 0.5).clamp(0, levels)
    return (q - zero) * scale


def per_channel(x: torch.Tensor, bits: int, tokens: int, meta8: bool = False) -> torch.Tensor:
    """x [H, T, D] coded per channel over blocks of `tokens` consecutive tokens (a scale/zero pair per channel and
    block: KIVI's key layout), `reference.fake_quant` unclipped at `bits`; the last partial block per row."""
    H, T, D = x.shape
    n = T // tokens * tokens

    def code(t):  # the runtime's widths through its reference, others (4 bits) through `uniform`
        if meta8 or bits not in layout.KEY_BITS:
            return uniform(t.float(), bits, meta8=meta8)
        return ref.fake_quant(t, 0.0, 0, bits)

    body = x[:, :n].reshape(H, n // tokens, tokens, D).transpose(2, 3).contiguous()  # [H, blocks, D, tokens]
    body = code(body).transpose(2, 3).reshape(H, n, D)
    return torch.cat([body, code(x[:, n:])], 1) if n < T else body


def waterfill(w: torch.Tensor, mean_bits: float, max_bits: int = 8) -> torch.Tensor:
    """Integer bits per channel [H, D] minimising Σ_c w_c·4^(−b_c) (each channel's error at b_c bits, weighted) with
    round(mean_bits·D) bits per head: greedily one bit at a time to the channel whose error it lowers most."""
    H, D = w.shape
    bits = torch.zeros(H, D, dtype=torch.long)
    err = w.double().cpu().clone()
    for _ in range(round(mean_bits * D)):
        c = err.argmax(-1)  # [H]
        rows = torch.arange(H)
        bits[rows, c] += 1
        err[rows, c] = torch.where(bits[rows, c] >= max_bits, -1.0, err[rows, c] / 4)
    return bits


def eigen_keys(k: torch.Tensor, layer: int, rot, mean_bits: float, tokens: int) -> torch.Tensor:
    """k [H, T, D] coded in the eigenbasis U of the keys' rotation (M = U·H·P without the Hadamard mixing), per channel
    over blocks of `tokens`, with bits per channel water-filled by the query energy there times the keys' variance
    (C_Q's eigenvalue × this history's variance: an oracle-ish stand-in for what calibration would measure); 0-bit
    channels keep only their block means. Returns the reconstruction in the model's basis."""
    H, T, D = k.shape
    U = eigenbasis(rot.k_rotation[layer]).float()
    lam = rot.k_eigenvalues[layer].float()
    U, lam = U.expand(H, -1, -1), lam.expand(H, -1).clamp(min=0)
    y = torch.einsum("htd,hde->hte", k.float(), U)
    bits = waterfill(lam * y.var(1), mean_bits).to(k.device)
    n = T // tokens * tokens
    blocks = y[:, :n].reshape(H, n // tokens, tokens, D)
    out = blocks.clone()
    for b in bits.unique().tolist():
        sel = bits == b  # [H, D]
        for h in range(H):
            cols = sel[h].nonzero()[:, 0]
            if len(cols) == 0:
                continue
            x = blocks[h][..., cols].transpose(1, 2)  # [blocks, cols, tokens]
            q = x.mean(-1, keepdim=True).half().float().expand_as(x) if b == 0 else uniform(x, b)
            out[h][..., cols] = q.transpose(1, 2)
    yq = torch.cat([out.reshape(H, n, D), y[:, n:]], 1)  # (the last partial block waits exact, as in the runtime)
    return torch.einsum("hte,hde->htd", yq, U)


def int2(x: torch.Tensor, clip, group: int = 0) -> torch.Tensor:
    return ref.fake_quant(x, clip, group)


class Variant:
    """How one variant codes a layer's history: k, v [H, T, D] in the model's basis → reconstructions."""

    def __init__(self, name, extra_bits_k=0.0, extra_bits_v=0.0, **opts):
        self.name, self.opts = name, opts
        self.extra_k, self.extra_v = extra_bits_k, extra_bits_v  # history bits/element above the 2.5 of G = D

    def bpe(self, context: int, D: int, sink=64, recent=256) -> float:
        base = layout.bits_per_element(context, D, sink, recent)
        hist = (context - sink - recent) / context
        return base + hist * (self.extra_k + self.extra_v) / 2


def eigenbasis(M: torch.Tensor) -> torch.Tensor:
    """U of M = U·H·P (columns in ascending eigenvalue order), float64."""
    D = M.shape[-1]
    HP = ref.hadamard(D)[:, ref.eigen_permutation(D)].to(M.device)
    return M.double() @ HP.T


def code_layer(var: Variant, layer: int, k: torch.Tensor, v: torch.Tensor, rot) -> tuple[torch.Tensor, torch.Tensor]:
    o = var.opts
    H, T, D = k.shape
    Mk, Mv = rot.k_rotation[layer].float(), rot.v_rotation[layer].float()
    if Mk.shape[0] == 1:
        Mk, Mv = Mk.expand(H, -1, -1), Mv.expand(H, -1, -1)
    kc, vc = rot.k_clip[layer].float()[:, None], rot.v_clip[layer].float()[:, None]  # [H, 1]
    k_clip = o.get("k_clip")
    if isinstance(k_clip, dict):  # per-layer key clip
        k_clip = k_clip.get(layer)
    if k_clip is not None:
        kc = torch.full_like(kc, k_clip)
    if o.get("v_clip") is not None:
        vc = torch.full_like(vc, o["v_clip"])
    if o.get("bf16_layer") == layer or layer in o.get("bf16_layers", ()):
        return k, v
    kr = torch.einsum("htd,hde->hte", k.float(), Mk)
    vr = torch.einsum("htd,hde->hte", v.float(), Mv)
    g = o.get("group", 0)
    kq = kr if o.get("k_exact") else int2(kr, kc, o.get("k_group", g))
    vq = vr if o.get("v_exact") else int2(vr, vc, o.get("v_group", g))
    kb = o.get("k_bits")
    if isinstance(kb, dict):  # per-layer key bits
        kb = kb.get(layer)
    if kb:  # uniform k_bits per row after the clip
        kq = uniform(ref.clip_rows(kr, kc), kb)
    if o.get("k_chan"):  # per channel over token blocks (unclipped), at the layer's key bits and key block
        kq = per_channel(kr, kb or 2, o.get("k_chan_layers", {}).get(layer, o["k_chan"]), o.get("meta8", False))
    if o.get("k_eig"):  # keys in C_Q's eigenbasis, water-filled bits per channel (eigen_keys)
        kq = torch.einsum("htd,hde->hte", eigen_keys(k, layer, rot, o["k_eig"], 64), Mk)
    vb = o.get("v_bits")
    if isinstance(vb, dict):  # per-layer value bits
        vb = vb.get(layer)
    if vb or o.get("v_meta8"):  # uniform v_bits (2 unless set) per row after the clip; 8-bit scale/zero if v_meta8
        vq = uniform(ref.clip_rows(vr, vc), vb or 2, meta8=o.get("v_meta8", False))
    if o.get("meta8") and not (o.get("v_exact") or vb):  # values per token, unclipped, 8-bit metadata
        vq = uniform(vr, 2, meta8=True)
    if o.get("v_chan"):  # values per channel over token blocks too
        vq = per_channel(vr, vb or 2, o["v_chan"])
    if o.get("k_channel_eq"):  # static per-channel scale (the rows' RMS per channel), then per-row INT2
        s = kr.pow(2).mean(1, keepdim=True).sqrt().clamp(min=1e-6)
        kq = int2(kr / s, kc) * s
    U = eigenbasis(rot.k_rotation[layer]).float()
    if U.shape[0] == 1:
        U = U.expand(H, -1, -1)
    if o.get("top_exact"):  # the top-r directions of C_Q reconstructed exactly (a float16 residual per direction)
        r = o["top_exact"]
        W = torch.einsum("hde,hef->hdf", Mk.transpose(1, 2), U[:, :, D - r:])  # rotated-space directions [H, D, r]
        e = torch.einsum("htd,hdr->htr", kr - kq, W).half().float()
        kq = kq + torch.einsum("htr,hdr->htd", e, W)
    if o.get("quarter_bits"):  # block-Hadamard rotation: the top quarter of C_Q's directions at more bits
        qb, shared = o["quarter_bits"], o.get("shared_range", True)
        n = D // 4
        Ud = U.flip(-1)  # descending
        Hb = torch.block_diag(*[ref.hadamard(n).float()] * 4).to(k.device)
        Mq = Ud @ Hb  # [H, D, D]
        x = ref.clip_rows(torch.einsum("htd,hde->hte", k.float(), Mq), kc)
        if shared:
            lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
            xa = uniform(x[..., :n], qb, lo, hi)
            xb = uniform(x[..., n:], 2, lo, hi)
        else:
            xa, xb = uniform(x[..., :n], qb), uniform(x[..., n:], 2)
        kq_model = torch.einsum("hte,hde->htd", torch.cat([xa, xb], -1), Mq)
        kq = torch.einsum("htd,hde->hte", kq_model, Mk)
    if layer in o.get("k_exact_layers", ()):
        kq = kr
    if layer in o.get("v_exact_layers", ()):
        vq = vr
    kh = torch.einsum("hte,hde->htd", kq, Mk)
    vh = torch.einsum("hte,hde->htd", vq, Mv)
    if o.get("debias"):
        kb = o.get("k_bits") or 2
        xr = ref.clip_rows(kr, kc)
        step = (xr.amax(-1) - xr.amin(-1)) / (2**kb - 1)  # [H, T]
        BIAS[layer] = o["debias"] * step.pow(2) / 24
    if o.get("outliers"):  # a fraction of tokens per head kept exact (largest C_Q-weighted key error)
        lam = rot.k_eigenvalues[layer].float()
        lam = lam.expand(H, -1) if lam.shape[0] == 1 else lam
        err = torch.einsum("htd,hde->hte", k.float() - kh, U).pow(2)  # error in the eigenbasis
        score = (err * lam[:, None, :]).sum(-1)  # [H, T]
        n_keep = max(1, round(o["outliers"] * T))
        idx = score.topk(n_keep, dim=-1).indices
        kh = kh.scatter(1, idx[..., None].expand(-1, -1, D), k.float().gather(1, idx[..., None].expand(-1, -1, D)))
        vh = vh.scatter(1, idx[..., None].expand(-1, -1, D), v.float().gather(1, idx[..., None].expand(-1, -1, D)))
    if o.get("observed"):  # tokens the question attends to most, per head, kept exact (max-pooled over neighbours)
        score = OBSERVED[layer][:, o["lo"]: o["lo"] + T].float()
        pool = o.get("pool", 7)
        score = torch.nn.functional.max_pool1d(score[:, None], pool, 1, pool // 2)[:, 0]
        n = o["observed"]
        n_keep = min(T, n if isinstance(n, int) else max(1, round(n * T)))
        if o.get("shared"):  # one choice for every KV head of the layer (each head's share of its mass, summed)
            score = (score / score.sum(-1, keepdim=True)).sum(0, keepdim=True).expand(H, -1)
        idx = score.topk(n_keep, dim=-1).indices
        kh = kh.scatter(1, idx[..., None].expand(-1, -1, D), k.float().gather(1, idx[..., None].expand(-1, -1, D)))
        vh = vh.scatter(1, idx[..., None].expand(-1, -1, D), v.float().gather(1, idx[..., None].expand(-1, -1, D)))
    return kh.to(k.dtype), vh.to(v.dtype)


# SmolLM2's layers by descending no-clip INT2 key logit noise on the calibration held-out set
KEY_NOISE_ORDER = [18, 19, 16, 27, 25, 17, 20, 13, 11, 26, 12, 22, 15, 14, 7,
                   28, 21, 29, 9, 8, 10, 23, 5, 3, 24, 6, 4, 1, 2, 0]
# SmolLM2's layers by ascending needle attention mass under the demo artifact (the mean of the two harness runs in
# benchmarks/notes/2026-12-06-needle-three-haystacks-harness.md: nine families, seeds 7501 and 7502)
NEEDLE_MASS_ORDER = [13, 12, 9, 11, 16, 10, 25, 4, 3, 27, 2, 1, 6, 5, 0, 19, 8, 29, 26, 15,
                     7, 14, 28, 17, 18, 24, 20, 22, 21, 23]


def variants(D: int, layers: int, per_layer: bool, key_bits: list[int], key_block: int = 0) -> list[Variant]:
    row = 32 / D  # one more float16 scale/zero pair per row, in bits per element
    three = {i for i, b in enumerate(key_bits) if b == 3}
    n3 = len(three) / layers
    # the artifact as it is: its key bits per layer, keys per channel over its key block (else per row, its clips),
    # values as its clips say; then with keys or values exact, to split a loss between them
    # (with keys per channel the history holds whole blocks: `history_block`, also where the keys stay exact)
    own = dict(k_bits={i: 3 for i in three}) | (dict(k_chan=key_block, history_block=key_block) if key_block else {})
    own_k = n3 + (32 / key_block - row if key_block else 0.0)
    # 3-bit values in the layers that give the needle most of its attention mass (20–24 of SmolLM2's 30); then also
    # 3-bit keys there, paid for by 2-bit keys in the five 3-bit-key layers of least key noise outside them
    reading = set(range(20, 25)) & set(range(layers))
    own_v3 = dict(own, v_bits={i: 3 for i in reading}, v_clip=0.0)
    quiet = [i for i in reversed(KEY_NOISE_ORDER) if i in three and i not in reading][: len(reading)]
    moved = (three | reading) - set(quiet)
    # the 3-bit values of the needle-reading layers paid for by 2-bit keys in the four 3-bit-key layers that give the
    # needle the least attention mass (0.017 bits each at 32K: 3.061 − 4 × 0.017 ≤ 3.0)
    least = [i for i in NEEDLE_MASS_ORDER if i in three and i not in reading][:4]
    kept = three - set(least)
    more = [i for i in reversed(NEEDLE_MASS_ORDER) if i < layers and i not in three | reading][:1]
    massive = [i for i in reversed(NEEDLE_MASS_ORDER) if i < layers and i not in reading][:9]
    exact_k = (13.5 * len(reading) - len(reading & three)) / layers  # 16-bit keys there, over the artifact's own
    top2 = {i for i in (23, 24) if i in reading}  # the reading layers whose 3-bit keys carried half the gain
    out = [
        Variant("bf16", k_exact=True, v_exact=True, extra_bits_k=13.5, extra_bits_v=13.5),
        Variant("the artifact, 3-bit K and V in the needle-reading layers", extra_bits_k=own_k + (len(moved) - len(
            three)) / layers, extra_bits_v=len(reading) / layers, **(own_v3 | {"k_bits": {i: 3 for i in moved}})),
        Variant("the artifact, 3-bit V in the needle-reading layers", extra_bits_k=own_k,
                extra_bits_v=len(reading) / layers, **own_v3),
        Variant("the artifact, 3-bit V in the needle-reading layers, 2-bit K where the needle has least mass",
                extra_bits_k=own_k - len(least) / layers, extra_bits_v=len(reading) / layers,
                **(own_v3 | {"k_bits": {i: 3 for i in kept}})),
        Variant("the artifact", extra_bits_k=own_k, **own),
        # 3-bit keys and values in the needle-reading layers, every other 3-bit-key layer kept, paid for by the keys'
        # metadata: one (scale, zero) pair per channel and 128 tokens, not 64 (keys −0.25 bits at head_dim 64)
        Variant("the artifact, 3-bit K and V in the needle-reading layers, K blocks of 128",
                extra_bits_k=len(three | reading) / layers + 32 / 128 - row, extra_bits_v=len(reading) / layers,
                **(own_v3 | dict(k_bits={i: 3 for i in three | reading}, k_chan=128, history_block=128))),
        # its two halves apart: the same 128-token key blocks with 3-bit values in the reading layers alone
        Variant("the artifact, 3-bit V in the needle-reading layers, K blocks of 128",
                extra_bits_k=n3 + 32 / 128 - row, extra_bits_v=len(reading) / layers,
                **(own_v3 | dict(k_chan=128, history_block=128))),
        # values with 8-bit metadata (scale float8 e4m3, zero an int8 number of steps: −0.25 bits per value at
        # head_dim 64), and what those bits buy: 4-bit values in the reading layers; 4-bit keys and values there with
        # key blocks of 256; 3-bit values in the nine other layers of most needle mass
        *[Variant(f"the artifact, K blocks of {blk}, V 8-bit metadata, {what}",
                  extra_bits_k=sum(b - 2 for b in kb.values()) / layers + 32 / blk - row,
                  extra_bits_v=sum(b - 2 for b in vb.values()) / layers - row / 2,
                  **(own_v3 | dict(k_bits=kb, v_bits=vb, v_meta8=True, k_chan=blk, history_block=blk)))
          for blk, kb, vb, what in [
              (128, {i: 3 for i in three | reading}, {i: 3 for i in reading},
               "3-bit K and V in the needle-reading layers"),
              (128, {i: 3 for i in three | reading}, {i: 4 for i in reading},
               "3-bit K and 4-bit V in the needle-reading layers"),
              (256, {i: 4 if i in reading else 3 for i in three | reading}, {i: 4 for i in reading},
               "4-bit K and V in the needle-reading layers"),
              (128, {i: 3 for i in three | reading}, {i: 3 for i in reading | set(massive)},
               "3-bit K and V in the needle-reading layers, 3-bit V in 9 more layers")]],
        # the reading layers' keys hold more of the loss than their values (one side exact: −2.2 against −4.4, 270
        # prompts); so the candidate's keys there finer: blocks of 64 tokens in the reading layers, 128 elsewhere
        # (the history still takes whole 128-token blocks); then 4-bit keys in the two reading layers that carried
        # half the candidate's gain (23, 24), paid for by 2-bit keys in the 3-bit-key layer of least needle mass
        Variant("the artifact, 3-bit K and V in the needle-reading layers, K blocks of 128, 64 in the reading layers",
                extra_bits_k=(len(three | reading) + len(reading) * (32 / 64 - 32 / 128)) / layers + 32 / 128 - row,
                extra_bits_v=len(reading) / layers,
                **(own_v3 | dict(k_bits={i: 3 for i in three | reading}, k_chan=128, history_block=128,
                                 k_chan_layers={i: 64 for i in reading}))),
        Variant("the artifact, 3-bit K and V in the needle-reading layers, K blocks of 128, 4-bit K in 23 and 24",
                extra_bits_k=(len(three | reading) + len(top2) - len(least[:1])) / layers + 32 / 128 - row,
                extra_bits_v=len(reading) / layers,
                **(own_v3 | dict(k_bits={i: 4 if i in top2 else 3 for i in (three | reading) - set(least[:1])},
                                 k_chan=128, history_block=128))),
        # the bits it leaves under 3.0 spent on 3-bit keys in the 2-bit-key layer of most needle mass
        Variant("the artifact, 3-bit K and V in the needle-reading layers, K blocks of 128, one more 3-bit K layer",
                extra_bits_k=len(three | reading | set(more)) / layers + 32 / 128 - row,
                extra_bits_v=len(reading) / layers,
                **(own_v3 | dict(k_bits={i: 3 for i in three | reading | set(more)}, k_chan=128, history_block=128))),
        # the reading layers' keys and values at 4 bits, paid for by 2-bit keys in every other layer
        Variant("4-bit K and V in the needle-reading layers, 2-bit K elsewhere",
                extra_bits_k=own_k - n3 + 2 * len(reading) / layers, extra_bits_v=2 * len(reading) / layers,
                **(own | {"k_bits": {i: 4 for i in reading}, "v_bits": {i: 4 for i in reading}, "v_clip": 0.0})),
        # a bound, not a codec: how much of the loss the needle-reading layers hold; then their keys and their
        # values apart
        Variant("the artifact, K and V bf16 in the needle-reading layers", extra_bits_k=own_k + exact_k,
                extra_bits_v=13.5 * len(reading) / layers, bf16_layers=reading, **own),
        Variant("the artifact, K bf16 in the needle-reading layers", extra_bits_k=own_k + exact_k,
                k_exact_layers=reading, **own),
        Variant("the artifact, V bf16 in the needle-reading layers", extra_bits_k=own_k,
                extra_bits_v=13.5 * len(reading) / layers, v_exact_layers=reading, **own),
        Variant("the artifact, K bf16", k_exact=True, extra_bits_k=13.5, history_block=key_block),
        Variant("the artifact, V bf16", extra_bits_k=own_k, v_exact=True, extra_bits_v=13.5, **own),
        Variant("oscar"),
        Variant("K int2, V bf16", v_exact=True, extra_bits_v=13.5),
        Variant("K bf16, V int2", k_exact=True, extra_bits_k=13.5),
        Variant("K clip off", k_clip=0.0),
        Variant("K and V clip off", k_clip=0.0, v_clip=0.0),
        Variant("groups of 32", group=32, extra_bits_k=1 - row, extra_bits_v=1 - row),
        Variant("K groups of 16", k_group=16, extra_bits_k=2 - row),
        Variant("K per-channel scale", k_channel_eq=True),
        Variant("K 3 bits", k_bits=3, extra_bits_k=1.0),
        Variant("K 4 bits", k_bits=4, extra_bits_k=2.0),
        Variant("outlier tokens 1 %", outliers=0.01, extra_bits_k=0.01 * 14, extra_bits_v=0.01 * 14),
        Variant("outlier tokens 3 %", outliers=0.03, extra_bits_k=0.03 * 14, extra_bits_v=0.03 * 14),
        Variant("K top-1 C_Q direction exact", top_exact=1, extra_bits_k=16 / D),
        Variant("K top-2 C_Q directions exact", top_exact=2, extra_bits_k=32 / D),
        Variant("K top-4 C_Q directions exact", top_exact=4, extra_bits_k=64 / D),
        Variant("K top quarter 4 bits (shared range)", quarter_bits=4, extra_bits_k=0.5),
        Variant("K top quarter 4 bits (own range)", quarter_bits=4, shared_range=False, extra_bits_k=0.5 + row),
    ]
    out += [Variant(f"{v.name}, K clip off", v.extra_k, v.extra_v, **(v.opts | {"k_clip": 0.0}))
            for v in out[[v.name for v in out].index("oscar"):] if v.name != "K per-channel scale"]
    out += [Variant(f"K clip {r}", k_clip=r) for r in (0.96, 0.98)]
    out += [Variant("K groups of 16, K clip off", k_group=16, k_clip=0.0, extra_bits_k=2 - row)]
    out += [Variant("oscar, debiased", debias=1.0), Variant("K clip off, debiased", k_clip=0.0, debias=1.0),
            Variant("K clip off, debiased x2", k_clip=0.0, debias=2.0),
            Variant("K 3 bits, K clip off, debiased", k_bits=3, k_clip=0.0, debias=1.0, extra_bits_k=1.0)]
    for n in (14, 18, 22):
        top = set(KEY_NOISE_ORDER[:n])
        out += [Variant(f"K 3 bits clip off on top {n}", k_bits={i: 3 for i in top},
                        k_clip={i: 0.0 for i in top}, extra_bits_k=n / layers),
                Variant(f"K 3 bits clip off on top {n}, rest clip off", k_bits={i: 3 for i in top}, k_clip=0.0,
                        extra_bits_k=n / layers)]
    top = set(KEY_NOISE_ORDER[:22])
    out += [Variant("K 3 bits clip off on top 22, V bf16", k_bits={i: 3 for i in top}, k_clip={i: 0.0 for i in top},
                    v_exact=True, extra_bits_k=22 / layers, extra_bits_v=13.5),
            Variant("K 3 bits clip off on top 22, V clip off", k_bits={i: 3 for i in top},
                    k_clip={i: 0.0 for i in top}, v_clip=0.0, extra_bits_k=22 / layers),
            Variant("K 3 bits clip off on top 22, V clip 0.96", k_bits={i: 3 for i in top},
                    k_clip={i: 0.0 for i in top}, v_clip=0.96, extra_bits_k=22 / layers)]
    art = dict(k_bits={i: 3 for i in three}, k_clip={i: 0.0 for i in three})  # its 3-bit layers, keys per row
    out += [Variant("artifact codec", extra_bits_k=n3, **art),
            Variant("artifact codec, V clip off", extra_bits_k=n3, **art, v_clip=0.0),
            Variant("artifact codec, V bf16", extra_bits_k=n3, **art, v_exact=True, extra_bits_v=13.5),
            Variant("artifact codec, outlier tokens 1 %", extra_bits_k=n3 + 0.14, extra_bits_v=0.14, **art,
                    outliers=0.01),
            Variant("artifact codec, K groups of 32", extra_bits_k=n3 + (1 - n3) * (1 - row), **art, k_group=32)]
    # keys per channel over blocks of tokens (KIVI's layout; same scale/zero count as a row at 64 tokens and D = 64)
    for n in (64, 32):
        extra = 32 / n - row
        out += [Variant(f"K per channel, {n}-token blocks", k_chan=n, extra_bits_k=extra),
                Variant(f"artifact codec, K per channel, {n}-token blocks", extra_bits_k=n3 + extra, k_chan=n,
                        k_bits=art["k_bits"])]
    v3 = {i: 3 for i in three}
    out += [Variant("K per channel 64, V 3 bits in the artifact's 3-bit-key layers", k_chan=64, v_bits=v3,
                    extra_bits_v=n3),
            Variant("K per channel 64, V 3 bits everywhere", k_chan=64, v_bits=3, extra_bits_v=1.0),
            Variant("K per channel 64, K 3 bits everywhere", k_chan=64, k_bits=3, extra_bits_k=1.0),
            Variant("K and V per channel, 64-token blocks", k_chan=64, v_chan=64),
            Variant("artifact codec, K per channel 64, V clip off", extra_bits_k=n3, k_chan=64, k_bits=art["k_bits"],
                    v_clip=0.0),
            Variant("artifact codec, K per channel 128, V clip off", extra_bits_k=n3 - row / 2, k_chan=128,
                    k_bits=art["k_bits"], v_clip=0.0),
            Variant("K per channel 64, V clip off", k_chan=64, v_clip=0.0)]
    # the default codec (keys per channel 64, 3-bit keys in the artifact's layers, values unclipped) with more on V
    default = dict(k_chan=64, k_bits=art["k_bits"], v_clip=0.0)
    out += [Variant("default codec, V bf16", extra_bits_k=n3, extra_bits_v=13.5, **default, v_exact=True),
            Variant("default codec, V 3 bits everywhere", extra_bits_k=n3, extra_bits_v=1.0, **default, v_bits=3),
            Variant("default codec, V groups of 32", extra_bits_k=n3, extra_bits_v=1 - row, **default, v_group=32),
            Variant("default codec, K bf16", extra_bits_k=13.5, v_clip=0.0, k_exact=True),  # (k_chan would code K)
            Variant("default codec, K 3 bits everywhere", extra_bits_k=1.0, **(default | {"k_bits": 3})),
            Variant("default codec, K 4 bits everywhere", extra_bits_k=2.0, **(default | {"k_bits": 4})),
            Variant("default codec, K 4 bits in its 3-bit layers", extra_bits_k=2 * n3,
                    **(default | {"k_bits": {i: 4 for i in three}})),
            Variant("default codec, K blocks of 32", extra_bits_k=n3 + 1 - row, **(default | {"k_chan": 32})),
            Variant("default codec, K 3 bits everywhere, blocks of 32", extra_bits_k=2 - row,
                    **(default | {"k_chan": 32, "k_bits": 3}))]
    # 3-bit keys over 32-token blocks with 8-bit scale/zero for keys and values: the bits of 32-token blocks at 16-bit
    # metadata less the half that 8 bits save (K 3 + 0.5, V 2 + 0.25: 2.875 in the history)
    out += [Variant("K 3 bits everywhere, blocks of 32, 8-bit metadata", extra_bits_k=1.0, extra_bits_v=-row / 2,
                    k_chan=32, k_bits=3, v_clip=0.0, meta8=True)]
    # keys in the eigenbasis with water-filled bits per channel, at the default codec's mean key bits and fewer
    out += [Variant(f"K eigenbasis, water-filled {b} bits, V default", extra_bits_k=b - 2, k_eig=b, v_clip=0.0)
            for b in (2.7, 2.0)]
    # observed tokens: a BF16 copy (16 bits) and a 32-bit position per kept token and head, beside the INT2 codes
    tok = 16 + 32 / D
    for frac in (0.01, 0.02):
        out += [Variant(f"oscar, observed {frac * 100:.0f} %", observed=frac, extra_bits_k=frac * tok,
                        extra_bits_v=frac * tok),
                Variant(f"artifact codec, observed {frac * 100:.0f} %", extra_bits_k=n3 + frac * tok,
                        extra_bits_v=frac * tok, observed=frac, **art)]
    for n in (32, 64):  # a fixed count per layer, the same tokens for every head (what a runtime tier can hold)
        out += [Variant(f"artifact codec, observed {n} per layer", extra_bits_k=n3 + n / 32448 * tok,
                        extra_bits_v=n / 32448 * tok, observed=n, shared=True, **art)]
    out += [Variant("artifact codec, observed 1 %, no pooling", extra_bits_k=n3 + 0.01 * tok, extra_bits_v=0.01 * tok,
                    observed=0.01, pool=1, **art)]
    if per_layer:
        out += [Variant(f"layer {i} bf16", bf16_layer=i) for i in range(layers)]
        out += [Variant(f"K clip off, layer {i} K 4 bits", k_clip=0.0, k_bits={i: 4}, extra_bits_k=2.0 / layers)
                for i in range(layers)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", default="artifacts/demo")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--seed", default="0", help="comma-separated seeds: each draws its own prompts; tables pool them")
    p.add_argument("--per-layer", action="store_true", help="also: one layer at a time in BF16")
    p.add_argument("--only", default=None, help="semicolon-separated variant names (default: all)")
    p.add_argument("--prompts", default=None, help="comma-separated indices (in the order drawn, as `verify --needle` "
                   "numbers them) of the prompts to score; the others are drawn and skipped")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--texts", default=None, help="a folder of the haystacks' files (`bench_needle --write-texts`), "
                   "where the corpus package is missing")
    p.add_argument("--haystack", default=DEFAULT_HAYSTACK, help=f"comma-separated, of {', '.join(HAYSTACKS)}")
    p.add_argument("--needle", default=PASSKEY.name, help=f"comma-separated, of {', '.join(NEEDLES)}: every "
                   "(haystack, needle) pair is a family of its own prompts")
    p.add_argument("--time-budget", type=float, default=0.0, help="start no round of prompts after this many seconds "
                   "(0: no limit); a round is one prompt per family, length and depth, for one seed")
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    manifest, rot = load_artifacts(Path(a.artifacts))
    dev = a.device
    rot = dataclasses.replace(rot, **{n: t.to(dev) for n, t in rot.tensors().items()})
    loaded = load_model("demo", device=dev, dtype="bfloat16")
    model, tok, info = loaded.model, loaded.tokenizer, loaded.info
    model.set_attn_implementation("needle_debiased")
    lengths = [int(x) for x in a.lengths.split(",")]
    depths = [float(x) for x in a.depths.split(",")]
    vs = variants(info.head_dim, info.num_layers, a.per_layer, manifest.key_bits, manifest.quant.key_block)
    if a.only:
        keep = set(a.only.split(";"))
        missing = keep - {v.name for v in vs}
        if missing:
            raise SystemExit(f"no variant named {', '.join(sorted(missing))}")
        vs = [v for v in vs if v.name in keep or v.name == "bf16"]
    sink, recent = manifest.quant.sink, manifest.quant.recent
    chosen = None if a.prompts is None else {int(i) for i in a.prompts.split(",")}
    # every family's prompts drawn up front, in `verify --needle`'s order (length, depth, trial) from its own seeded
    # generator, so an index names the same prompt however many families run; scored a round at a time
    seeds = list(dict.fromkeys(int(x) for x in a.seed.split(",")))  # a repeated seed would score its prompts twice
    runs = []  # (family, seed, fact, grid): every family's grid once per seed
    for hay in a.haystack.split(","):
        ids = filler(tok, haystack_named(hay).text(a.texts))
        for name in a.needle.split(","):
            fact = needle_named(name)
            for seed in seeds:
                rng = random.Random(seed if "," not in a.haystack + a.needle else f"{seed}:{hay}:{name}")
                grid = [(L, d, build_prompt(tok, ids, L, d, rng, fact)) for L in lengths for d in depths
                        for _ in range(a.trials)]
                runs.append((f"{hay}/{name}", seed, fact, grid))
    families = list(dict.fromkeys(f for f, _, _, _ in runs))
    right = {(f, v.name): {L: 0 for L in lengths} for f in families for v in vs}
    count = {f: {L: 0 for L in lengths} for f in families}
    by_depth = {v.name: {d: 0 for d in depths} for v in vs}
    depth_count = {d: 0 for d in depths}
    mass = {v.name: [0.0] * info.num_layers for v in vs}  # Σ over prompts of each layer's needle mass
    scored: dict[str, dict[str, bool]] = {v.name: {} for v in vs}  # per family/prompt index
    t0 = time.time()
    with torch.inference_mode():
        for trial, seed in ((t, s) for t in range(a.trials) for s in seeds):  # the budget is checked per seed
            if a.time_budget and time.time() - t0 > a.time_budget:
                print(f"time budget: stopped before round {trial + 1} of {a.trials}, seed {seed}", flush=True)
                break
            for fam, _, fact, grid in (r for r in runs if r[1] == seed):
                for index, (L, depth, pr) in enumerate(grid):
                    if index % a.trials != trial or (chosen is not None and index not in chosen):
                        continue
                    if chosen is not None:
                        print(f"{fam} seed {seed} prompt {index}: length {L}, depth {depth}, key {pr.key}", flush=True)
                    ok = score_prompt(model, tok, fact, pr, vs, sink, recent, rot, dev, mass)
                    count[fam][L] += 1
                    depth_count[depth] += 1
                    for var in vs:
                        right[(fam, var.name)][L] += ok[var.name]
                        by_depth[var.name][depth] += ok[var.name]
                        key = f"{seed}:{fam}/{index}" if len(seeds) > 1 else f"{fam}/{index}"
                        scored[var.name][key] = ok[var.name]
            print(f"round {trial + 1}, seed {seed}: {time.time() - t0:.0f} s", flush=True)
    n_all = sum(sum(c.values()) for c in count.values())
    if not n_all:
        raise SystemExit("no prompt was scored (--prompts names none of the grid's indices)")
    D = info.head_dim
    pooled = {v.name: {L: sum(right[(f, v.name)][L] for f in families) for L in lengths} for v in vs}
    n_len = {L: sum(count[f][L] for f in families) for L in lengths}

    def cell(k: int, n: int) -> str:
        if not n:
            return f"{'-':>16s}"
        lo_, hi_ = wilson(k, n)
        return f"{100 * k / n:5.1f} [{100 * lo_:3.0f},{100 * hi_:3.0f}]"

    if len(families) > 1:
        for fam in families:
            print(f"\n{fam}: " + ", ".join(f"{count[fam][L]} prompts at {L}" for L in lengths))
            for var in vs:
                print(f"  {var.name:40s} " + " ".join(cell(right[(fam, var.name)][L], count[fam][L]) for L in lengths))
    rows = []
    print(f"\n{'pooled' if len(families) > 1 else families[0]}\n{'variant':42s} bits@32K "
          + " ".join(f"{L:>16d}" for L in lengths) + "        all")
    for var in vs:
        ks = [pooled[var.name][L] for L in lengths]
        bpe = var.bpe(32768, D, sink, recent)
        print(f"{var.name:42s} {bpe:8.3f} " + " ".join(cell(k, n_len[L]) for L, k in zip(lengths, ks))
              + " " + cell(sum(ks), n_all))
        rows.append({"variant": var.name, "bits_32k": round(bpe, 3), "right": ks, "n": [n_len[L] for L in lengths],
                     "by_family": {f: [right[(f, var.name)][L] for L in lengths] for f in families},
                     "right_by_depth": [by_depth[var.name][d] for d in depths],
                     "n_by_depth": [depth_count[d] for d in depths],
                     "needle_mass": [round(m / n_all, 5) for m in mass[var.name]], "prompts": scored[var.name]})
    print(f"\n{'variant':42s} " + " ".join(f"{'depth ' + format(d, 'g'):>16s}" for d in depths))
    for r in rows:
        print(f"{r['variant']:42s} " + " ".join(cell(k, n) for k, n in zip(r["right_by_depth"], r["n_by_depth"])))
    ref_mass = rows[0]["needle_mass"]  # bf16 first
    print("\nneedle attention mass of the answering query (mean over layers; the 5 layers that lose most vs BF16)")
    for r in rows:
        drop = sorted(range(len(ref_mass)), key=lambda i: r["needle_mass"][i] - ref_mass[i])[:5]
        print(f"{r['variant']:42s} {sum(r['needle_mass']) / len(ref_mass):.4f}  " + ", ".join(
            f"L{i} {r['needle_mass'][i]:.3f}/{ref_mass[i]:.3f}" for i in drop))
    for r in rows:
        r["paired"] = {} if r["variant"] == "bf16" else paired(scored, r["variant"], families)
    print_paired(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"families": families, "seeds": seeds, "count": count, "lengths": lengths, "depths": depths,
                       "trials": a.trials, "rows": rows, "wall_s": round(time.time() - t0, 1)}, f, indent=1)


def paired(scored: dict[str, dict[str, bool]], name: str, families: list[str]) -> dict[str, dict]:
    """The variant's outcomes paired prompt by prompt against BF16's and against the artifact's (where it ran):
    pooled, per haystack and per needle, the difference with Newcombe's 95 % interval and the discordant prompts."""
    groups = {"all": families}
    for pos in (0, 1):  # per haystack, then per needle
        for x in dict.fromkeys(f.split("/")[pos] for f in families):
            groups[x] = [f for f in families if f.split("/")[pos] == x]
    out = {}
    for against in ("bf16", "the artifact"):
        if against not in scored or against == name:
            continue
        ref_ok, it_ok = scored[against], scored[name]
        for group, fams in groups.items():
            keys = [k for k in ref_ok if k.split(":")[-1].rsplit("/", 1)[0] in fams]
            d = paired_difference([ref_ok[k] for k in keys], [it_ok[k] for k in keys])
            out[f"{group} vs {against}"] = {"n": d.n, "ref": round(d.ref, 4), "it": round(d.it, 4),
                                            "diff": round(d.diff, 4), "lo": round(d.lo, 4), "hi": round(d.hi, 4),
                                            "ref_only": d.ref_only, "it_only": d.it_only}
    return out


def print_paired(rows: list[dict]) -> None:
    print("\npaired, points [95 %] (only the reference / only the variant)")
    for r in rows:
        for group, d in r["paired"].items():
            print(f"{r['variant']:42s} {group:24s} n {d['n']:5d}  {100 * d['ref']:5.1f} → {100 * d['it']:5.1f}  "
                  f"{100 * d['diff']:+5.1f} [{100 * d['lo']:+5.1f}, {100 * d['hi']:+5.1f}] "
                  f"({d['ref_only']} / {d['it_only']})")


def score_prompt(model, tok, fact, pr, vs, sink: int, recent: int, rot, dev, mass) -> dict[str, bool]:
    """One prompt: its context prefilled once in BF16, then per variant the question and key as one teacher-forced
    chunk over the context's history coded by the variant; whether each variant retrieves the key, and each layer's
    needle mass added to `mass`."""
    global RECORD, MASS
    tail = tok(fact.question + " " + pr.key + ".", add_special_tokens=False).input_ids
    if tail[: len(pr.question)] != pr.question:
        raise SystemExit("question tokens change when the answer follows")
    answer = tail[len(pr.question):]
    n_key = next(n for n in range(1, len(answer) + 1) if pr.key in tok.decode(answer[:n]))
    ctx = torch.tensor([pr.context], device=dev)
    base = DynamicCache()
    BIAS.clear()
    model(input_ids=ctx, use_cache=True, **{CACHE: base}, logits_to_keep=1)
    kv = [(lay.keys.clone(), lay.values.clone()) for lay in base.layers]
    T = ctx.shape[1]
    lo, hi = sink, T - recent
    RECORD = True  # the question's queries over the BF16 context (what prefill of the prompt sees)
    model(input_ids=torch.tensor([pr.question], device=dev), use_cache=True, **{CACHE: base}, logits_to_keep=1)
    RECORD = False
    for var in vs:
        var.opts["lo"] = lo
    chunk = torch.tensor([tail], device=dev)
    start = len(pr.question) - 1  # the logit of the question's last token predicts answer[0]
    MASS = (start, pr.needle_start, pr.needle_start + pr.needle_len)
    ok = {}
    for var in vs:
        cache = DynamicCache()
        BIAS.clear()
        # keys per channel: the runtime's history takes whole blocks, the rest wait in the BF16 recent tier
        block = var.opts.get("history_block") or var.opts.get("k_chan")
        end = lo + (hi - lo) // block * block if block else hi
        for li, (k, v) in enumerate(kv):
            k2, v2 = k.clone(), v.clone()
            kh, vh = code_layer(var, li, k[0, :, lo:end], v[0, :, lo:end], rot)
            k2[0, :, lo:end], v2[0, :, lo:end] = kh, vh
            if li in BIAS:
                full = torch.zeros(k.shape[1], T + len(tail), device=dev)
                full[:, lo:end] = BIAS[li]
                BIAS[li] = full
            cache.update(k2, v2, li)
        NEEDLE_MASS.clear()
        logits = model(input_ids=chunk, use_cache=True, **{CACHE: cache}).logits[0]
        got = logits.argmax(-1).tolist()[start : start + n_key + 1]
        ok[var.name] = got[:n_key] == answer[:n_key] and fact.is_right(tok.decode(got), pr.key)
        for li, m in NEEDLE_MASS.items():
            mass[var.name][li] += m
    MASS = None
    return ok

if __name__ == "__main__":
    main()
