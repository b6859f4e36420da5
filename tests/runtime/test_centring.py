"""The centred codec (docs/format.md §6a) in the runtime: every tier holds x·M − μ·M, the logits need no correction
(softmax is shift-invariant per query) and the output gets μ_V·M_V back. Checked against float64 computations in the
*uncentred* frame (stored row + μ·M read back, no shift invariance used), on GQA 9 q / 3 kv heads, head_dim 64."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config

from oscar_zoo.format import layout, reference
from oscar_zoo.runtime.attention import enable_oscar, fold_value_rotation, oscar_attention
from oscar_zoo.runtime.cache import OscarCache

H_Q, H_KV, D = 9, 3, 64
G = H_Q // H_KV
SCALE = D**-0.5
STUB = SimpleNamespace(layer_idx=0, training=False)


def _rotations(L: int, seed: int = 0) -> torch.Tensor:
    mats = [reference.random_orthogonal(D, seed=seed + i) for i in range(L * H_KV)]
    return torch.stack(mats).float().reshape(L, H_KV, D, D)


def _offset_kv(B: int, T: int, seed: int = 0):
    """Keys and values with a large per-head offset (the case centring is for: |offset| ≈ 6 per channel against
    unit noise), bf16, and the calibrated means: the offsets off by a little (a calibration never hits them)."""
    g = torch.Generator().manual_seed(seed)
    k_off, v_off = torch.randn(H_KV, D, generator=g) * 6, torch.randn(H_KV, D, generator=g) * 3
    k = (torch.randn(B, H_KV, T, D, generator=g) + k_off[None, :, None]).bfloat16()
    v = (torch.randn(B, H_KV, T, D, generator=g) + v_off[None, :, None]).bfloat16()
    k_mean = (k_off + 0.1 * torch.randn(H_KV, D, generator=g))[None]  # [1, H_kv, D]
    v_mean = (v_off + 0.1 * torch.randn(H_KV, D, generator=g))[None]
    return k, v, k_mean, v_mean


def _mean_rot64(mean: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """μ·M per head in float64, [H, D]."""
    return torch.einsum("hd,hde->he", mean.double(), M.double())


def _expected64(q, k_rows, v_rows, Mk, Mv, q_offset, scale=SCALE, softcap=None):
    """float64 attention of q [B, H_q, n, D] over keys/values [B, H_kv, S, D] already in the rotated, uncentred frame
    (what the cache reads back with μ·M added): (q·M_K)·kᵀ, optional softcap, causal softmax, ·v, ·M_Vᵀ.
    Returns [B, n, H_q, D]."""
    qr = q.double() @ Mk.double().repeat_interleave(G, 0)
    logits = qr @ k_rows.double().repeat_interleave(G, 1).transpose(-1, -2) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    n, S = q.shape[2], k_rows.shape[2]
    allowed = torch.arange(S)[None, :] <= (q_offset + torch.arange(n))[:, None]
    o = torch.softmax(logits.masked_fill(~allowed, -math.inf), -1) @ v_rows.double().repeat_interleave(G, 1)
    return (o @ Mv.double().repeat_interleave(G, 0).transpose(-1, -2)).transpose(1, 2)


def _read_back(stored: torch.Tensor, clip, mean_rot64: torch.Tensor, recent: int, dtype=torch.float32) -> torch.Tensor:
    """Stored centred rows [B, H, T, D] as attention reads them, in the uncentred frame: the history's INT2 round trip
    (`reference.fake_quant`, the codec's one definition) or the exact row, in `dtype` (a later prefill chunk reads
    them in its own: `OscarLayer.dense_kv`), plus μ·M (float64)."""
    deq = reference.fake_quant_tiers(stored.float(), clip, sink=layout.SINK, recent=recent)
    return deq.to(dtype).double() + mean_rot64[None, :, None]


# ------------------------------------------------------------------------------------------------------ reference


def test_reference_centring_equals_float64_definitions():
    """rotate_mean = μ·M (float64); rotate_centred = x·M − μ·M rounded once to x's dtype, per head and shared, and
    plain `rotate` without a mean; add_value_mean adds μ·M of each query head's KV head."""
    g = torch.Generator().manual_seed(0)
    M = _rotations(1)[0]
    mean = torch.randn(H_KV, D, generator=g) * 5
    x = (torch.randn(2, H_KV, 7, D, generator=g) * 3 + 5).bfloat16()
    mu = reference.rotate_mean(mean, M)
    torch.testing.assert_close(mu.double(), _mean_rot64(mean, M), rtol=0, atol=1e-5)
    want = torch.einsum("bhtd,hde->bhte", x.double(), M.double()) - _mean_rot64(mean, M)[None, :, None]
    got = reference.rotate_centred(x, M, mu)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-5).all()  # one bf16 rounding of the exact row
    shared_mu = reference.rotate_mean(mean[:1], M[:1])  # per-layer form: [1, D, D], [1, D]
    want = x.double() @ M[0].double() - _mean_rot64(mean[:1], M[:1])[None, :, None]
    got = reference.rotate_centred(x, M[:1], shared_mu)
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-5).all()
    assert torch.equal(reference.rotate_centred(x, M, None), reference.rotate(x, M))
    assert reference.rotate_centred(x, None, None) is x
    o = torch.randn(2, H_Q, 3, D, generator=g)
    back = reference.add_value_mean(o.clone(), mu.repeat_interleave(G, 0))
    torch.testing.assert_close(back, o + mu.repeat_interleave(G, 0)[None, :, None], rtol=0, atol=0)
    assert reference.add_value_mean(o, None) is o


# ------------------------------------------------------------------------------------------------------ the cache


def test_centred_tiers_hold_rotated_rows_minus_the_rotated_mean_and_the_history_error_is_the_centred_one():
    """After a 500-token prefill every tier holds bf16(k·M − μ·M); the INT2 history (clip ratio 1: nothing clipped)
    reads back within half a step of the *centred* row's own range/3, a bound that knows nothing of the offset."""
    Mk, Mv = _rotations(1), _rotations(1, seed=7)
    k, v, k_mean, v_mean = _offset_kv(1, 500)
    cache = OscarCache.from_tensors(Mk, Mv, 1.0, 1.0, k_mean=k_mean, v_mean=v_mean)
    key, _ = cache.update(k, v, 0)
    layer = cache.layers[0]
    stored_k = reference.rotate_centred(k, Mk[0], reference.rotate_mean(k_mean[0], Mk[0]))
    assert torch.equal(key, stored_k)  # the chunk as returned = as filed
    assert torch.equal(layer.sink_k[:, :, : layer.n_sink], stored_k[:, :, : layout.SINK])
    assert torch.equal(layer.recent_k[:, :, : layer.n_recent], stored_k[:, :, -layout.RECENT :])
    hist_k, _ = layer.history()
    rows = stored_k[:, :, layout.SINK : layout.SINK + layer.n_hist].double()
    step = (rows.amax(-1, keepdim=True) - rows.amin(-1, keepdim=True)) / 3
    assert ((hist_k.double() - rows).abs() <= step / 2 * (1 + 2**-9) + 1e-6).all()
    # what that bound is worth: the centred rows span about a sixth of the uncentred ones here
    uncentred = reference.rotate(k, Mk[0]).double()[:, :, layout.SINK : layout.SINK + layer.n_hist]
    assert (step.mean() * 3) < 0.5 * (uncentred.amax(-1) - uncentred.amin(-1)).mean()


def test_centred_decode_equals_the_uncentred_frame_in_float64(decode_calls):
    """A decode step through ops.tiered_decode_attention (the kernels under TRITON_INTERPRET=1, else the reference)
    over centred tiers, plus μ_V·M_V, equals float64 attention over the rows read back in the uncentred frame (no
    shift invariance assumed) within fp32 noise; and the kernel path is within the 2× rule (docs/format.md §9) of the
    reference twin on the same tensors."""
    B, prompt, steps = 2, 400, 13
    Mk, Mv = _rotations(1), _rotations(1, seed=7)
    k_clip, v_clip = torch.tensor([[0.94, 0.96, 0.9]]), torch.full((1, H_KV), 0.92)
    k, v, k_mean, v_mean = _offset_kv(B, prompt + steps, seed=1)
    cache = OscarCache.from_tensors(Mk, Mv, k_clip, v_clip, k_mean=k_mean, v_mean=v_mean)
    cache.update(k[:, :, :prompt], v[:, :, :prompt], 0)
    for t in range(prompt, prompt + steps):
        key, value = cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
    q = torch.randn(B, H_Q, 1, D, generator=torch.Generator().manual_seed(2)) * 2
    out, _ = oscar_attention(STUB, q, key, value, None, scaling=SCALE, oscar_cache=cache)
    assert decode_calls == [1] and out.shape == (B, 1, H_Q, D)

    layer = cache.layers[0]
    mu_k, mu_v = reference.rotate_mean(k_mean[0], Mk[0]), reference.rotate_mean(v_mean[0], Mv[0])
    chunks = [slice(0, prompt)] + [slice(t, t + 1) for t in range(prompt, prompt + steps)]
    stored_k = torch.cat([reference.rotate_centred(k[:, :, c], Mk[0], mu_k) for c in chunks], 2)
    stored_v = torch.cat([reference.rotate_centred(v[:, :, c], Mv[0], mu_v) for c in chunks], 2)
    k_rows = _read_back(stored_k, k_clip[0], _mean_rot64(k_mean[0], Mk[0]), layer.n_recent)
    v_rows = _read_back(stored_v, v_clip[0], _mean_rot64(v_mean[0], Mv[0]), layer.n_recent)
    expected = _expected64(q, k_rows, v_rows, Mk[0], Mv[0], q_offset=prompt + steps - 1)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)

    q_rot = reference.rotate(q, Mk[0].repeat_interleave(G, 0))[:, :, 0]
    o_ref, _ = reference.tiered_decode_attention_ref(q_rot, *layer.tier_args(), SCALE)
    mvt = Mv[0].repeat_interleave(G, 0).transpose(-1, -2)
    o_ref = reference.rotate((o_ref + mu_v.repeat_interleave(G, 0)).unsqueeze(2), mvt).transpose(1, 2)
    k_all, v_all = (t.bfloat16().repeat_interleave(G, 1) for t in layer.dense_kv())
    p = torch.softmax(torch.einsum("bhd,bhtd->bht", q_rot.bfloat16(), k_all) * SCALE, -1)
    o_bf16 = torch.einsum("bht,bhtd->bhd", p, v_all) + mu_v.repeat_interleave(G, 0).bfloat16()
    o_bf16 = torch.einsum("bhd,hed->bhe", o_bf16, Mv[0].repeat_interleave(G, 0).bfloat16()).unsqueeze(1)
    err, err_bf16 = (out - o_ref).abs().max(), (o_bf16.float() - o_ref).abs().max()
    assert err <= 2 * err_bf16, (err, err_bf16)


@pytest.mark.parametrize(("softcap", "interpret"), [(None, False), (5.0, False), (5.0, True)])
def test_centred_prefill_chunk_and_softcap_equal_the_uncentred_frame(softcap, interpret, monkeypatch):
    """A 150-token chunk after a 400-token prefill (earlier tokens through their tiers, its own K/V exact), and, with a
    logit softcap, a decode step (tanh is not shift-invariant: each logit gets q·μ_K·M_K back before the cap, inside
    the decode kernel: under the Triton interpreter, or its reference fallback), equal float64 attention in the
    uncentred frame."""
    if interpret:
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    B, n1, n2 = 1, 400, 150
    Mk, Mv = _rotations(1), _rotations(1, seed=7)
    k, v, k_mean, v_mean = _offset_kv(B, n1 + n2 + 1, seed=3)
    cache = OscarCache.from_tensors(Mk, Mv, 0.96, 0.92, k_mean=k_mean, v_mean=v_mean)
    cache.update(k[:, :, :n1], v[:, :, :n1], 0)
    key, value = cache.update(k[:, :, n1 : n1 + n2], v[:, :, n1 : n1 + n2], 0)
    q = torch.randn(B, H_Q, n2, D, generator=torch.Generator().manual_seed(4))
    out, _ = oscar_attention(STUB, q, key, value, None, scaling=SCALE, softcap=softcap, oscar_cache=cache)

    mk64, mv64 = _mean_rot64(k_mean[0], Mk[0]), _mean_rot64(v_mean[0], Mv[0])
    mu_k, mu_v = reference.rotate_mean(k_mean[0], Mk[0]), reference.rotate_mean(v_mean[0], Mv[0])
    stored_k1 = reference.rotate_centred(k[:, :, :n1], Mk[0], mu_k)
    stored_v1 = reference.rotate_centred(v[:, :, :n1], Mv[0], mu_v)
    clips_k, clips_v = torch.full((H_KV,), 0.96), torch.full((H_KV,), 0.92)
    k_rows = torch.cat([_read_back(stored_k1, clips_k, mk64, layout.RECENT, key.dtype),
                        key.double() + mk64[None, :, None]], 2)
    v_rows = torch.cat([_read_back(stored_v1, clips_v, mv64, layout.RECENT, value.dtype),
                        value.double() + mv64[None, :, None]], 2)
    expected = _expected64(q, k_rows, v_rows, Mk[0], Mv[0], q_offset=n1, softcap=softcap)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)

    if softcap is not None:  # a decode step with softcap: the cap inside the decode, after q·μ_K·M_K comes back
        key, value = cache.update(k[:, :, -1:], v[:, :, -1:], 0)
        q1 = torch.randn(B, H_Q, 1, D, generator=torch.Generator().manual_seed(5)) * 3
        out, _ = oscar_attention(STUB, q1, key, value, None, scaling=SCALE, softcap=softcap, oscar_cache=cache)
        k_all, v_all = cache.layers[0].dense_kv()
        expected = _expected64(q1, k_all.double() + mk64[None, :, None], v_all.double() + mv64[None, :, None],
                               Mk[0], Mv[0], n1 + n2, softcap=softcap)
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ whole models


def _qwen2():
    """fp32 Qwen2 (v_proj has a bias) of SmolLM2's attention shape, random weights, a per-head value offset through
    the bias (values are not zero-mean in real models either)."""
    cfg = Qwen2Config(vocab_size=512, hidden_size=144, intermediate_size=288, num_hidden_layers=2,
                      num_attention_heads=H_Q, num_key_value_heads=H_KV, head_dim=D, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.bias.add_(torch.randn(H_KV * D) * 2)
            layer.self_attn.k_proj.bias.add_(torch.randn(H_KV * D) * 2)
    return model


@torch.no_grad()
def _teacher_forced(model, ids, prompt, cache):
    out = [model(ids[:, :prompt], cache=cache).logits[0]]
    for t in range(prompt, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], cache=cache).logits[0])
    return torch.cat(out)  # [T, V]


def test_centred_cache_keeps_a_model_exact_and_folds():
    """fp32 Qwen2, unquantized (BF16-history switch) cache with rotations and per-(layer, head) means: the prefill
    logits equal the plain model's to fp32 noise (the chunk reads its own exact K/V: centring is exact in real
    arithmetic); decode logits, read from BF16 tiers, stay within 2× the error of the same uncentred cache against the
    exact DynamicCache run (docs/format.md §9); folding M_V into v_proj/o_proj with a centred cache gives the unfolded
    centred logits (prefill to fp32 noise, decode by the same 2× rule): μ_V·M_V is added in M_V space before o_proj."""
    model = _qwen2()
    ids = torch.randint(0, 512, (1, 410), generator=torch.Generator().manual_seed(0))
    exact = _teacher_forced(model, ids, 400, DynamicCache())
    enable_oscar(model)
    Mk, Mv = _rotations(2), _rotations(2, 50)
    g = torch.Generator().manual_seed(9)
    k_mean, v_mean = torch.randn(2, H_KV, D, generator=g) * 2, torch.randn(2, H_KV, D, generator=g) * 2
    plain_rot = _teacher_forced(model, ids, 400, OscarCache.from_tensors(Mk, Mv, quantize=False))
    centred = _teacher_forced(model, ids, 400,
                              OscarCache.from_tensors(Mk, Mv, quantize=False, k_mean=k_mean, v_mean=v_mean))
    scale = exact.abs().max()
    torch.testing.assert_close(centred[:400], exact[:400], rtol=0, atol=2e-5 * scale)
    assert (centred[400:] - exact[400:]).abs().max() <= 2 * (plain_rot[400:] - exact[400:]).abs().max()
    cache = OscarCache.from_tensors(Mk, Mv, quantize=False, k_mean=k_mean, v_mean=v_mean)
    assert fold_value_rotation(model, cache) == 2
    folded = _teacher_forced(model, ids, 400, cache)
    torch.testing.assert_close(folded[:400], centred[:400], rtol=0, atol=2e-5 * scale)
    assert (folded[400:] - exact[400:]).abs().max() <= 2 * (centred[400:] - exact[400:]).abs().max()


def test_invalid_means_are_refused():
    Mk = _rotations(2)
    with pytest.raises(ValueError, match=r"k_mean must be \[L, H, D\]"):
        OscarCache.from_tensors(Mk, Mk, k_mean=torch.zeros(2, H_KV, D - 1), v_mean=torch.zeros(2, H_KV, D))
    bad = torch.zeros(2, H_KV, D)
    bad[1, 2, 5] = math.nan
    with pytest.raises(ValueError, match=r"v_mean at layer 1 head 2 \(index \[1, 2, 5\]\) holds nan"):
        OscarCache.from_tensors(Mk, Mk, k_mean=torch.zeros(2, H_KV, D), v_mean=bad)
