"""The "oscar" attention with OscarCache: decode/prefill against dense references, and whole-model generation on
random-weight transformers models of real shapes (GQA 9 q / 3 kv heads, head_dim 64) against DynamicCache."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from oscar_zoo.format import layout, reference
from oscar_zoo.runtime.attention import enable_oscar, fold_value_rotation, oscar_attention
from oscar_zoo.runtime.cache import OscarCache

H_Q, H_KV, D = 9, 3, 64
SCALE = D**-0.5
STUB = SimpleNamespace(layer_idx=0, training=False)  # what oscar_attention reads from the attention module


def _rotations(L: int, seed: int = 0) -> torch.Tensor:
    mats = [reference.random_orthogonal(D, seed=seed + i) for i in range(L * H_KV)]
    return torch.stack(mats).float().reshape(L, H_KV, D, D)


def _identity(L: int) -> torch.Tensor:
    return torch.eye(D).expand(L, H_KV, D, D).clone()


def _dense_ref(q, k_hat, v_hat, Mk, Mv, q_offset, scale=SCALE, softcap=None):
    """float64 causal attention of q [B, H_q, n, D] over rotated k_hat/v_hat [B, H_kv, S, D]: (q·M_K)(k̂)ᵀ, softmax,
    ·v̂, ·M_Vᵀ per query head. Returns [B, n, H_q, D]."""
    g = H_Q // H_KV
    Mk_q, Mv_q = Mk.double().repeat_interleave(g, 0), Mv.double().repeat_interleave(g, 0)
    qr = q.double() @ Mk_q
    kx, vx = k_hat.double().repeat_interleave(g, 1), v_hat.double().repeat_interleave(g, 1)
    logits = qr @ kx.transpose(-1, -2) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    n, S = q.shape[2], k_hat.shape[2]
    allowed = torch.arange(S)[None, :] <= (q_offset + torch.arange(n))[:, None]
    o = torch.softmax(logits.masked_fill(~allowed, -math.inf), -1) @ vx
    return (o @ Mv_q.transpose(-1, -2)).transpose(1, 2)


def _kv(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(B, H_KV, T, D, generator=g) * 2 + torch.randn(1, H_KV, 1, D, generator=g)).bfloat16()
    return k, torch.randn(B, H_KV, T, D, generator=g).bfloat16()


# ------------------------------------------------------------------------------------ attention vs dense references


def test_quantized_decode_matches_dense_reference(decode_calls):
    """A decode step (through ops.tiered_decode_attention) equals float64 attention over the sequence as the tiers
    present it (reference.fake_quant_tiers of the rotated K/V), within fp32 noise; and equals
    reference.tiered_decode_attention_ref on the cache tensors."""
    B, prompt, steps = 2, 400, 13
    Mk, Mv = _rotations(1), _rotations(1, seed=7)
    k_clip, v_clip = torch.tensor([[0.94, 0.96, 0.9]]), torch.full((1, H_KV), 0.92)
    cache = OscarCache.from_tensors(Mk, Mv, k_clip, v_clip)
    k, v = _kv(B, prompt + steps)
    cache.update(k[:, :, :prompt], v[:, :, :prompt], 0)
    for t in range(prompt, prompt + steps):
        key, value = cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
    q = torch.randn(B, H_Q, 1, D)
    out, weights = oscar_attention(STUB, q, key, value, None, scaling=SCALE, oscar_cache=cache)
    assert decode_calls == [1] and weights is None and out.shape == (B, 1, H_Q, D)

    layer = cache.layers[0]
    chunks = [slice(0, prompt)] + [slice(t, t + 1) for t in range(prompt, prompt + steps)]
    rk = torch.cat([reference.rotate(k[:, :, c], Mk[0]) for c in chunks], 2)  # as the cache rotated it
    rv = torch.cat([reference.rotate(v[:, :, c], Mv[0]) for c in chunks], 2)
    k_hat = reference.fake_quant_tiers(rk.float(), k_clip[0], sink=layout.SINK, recent=layer.n_recent)
    v_hat = reference.fake_quant_tiers(rv.float(), v_clip[0], sink=layout.SINK, recent=layer.n_recent)
    expected = _dense_ref(q, k_hat, v_hat, Mk[0], Mv[0], q_offset=prompt + steps - 1)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)

    q_rot = reference.rotate(q[:, :, 0:1], Mk[0].repeat_interleave(3, 0))[:, :, 0]
    o_ref, _ = reference.tiered_decode_attention_ref(q_rot, *layer.tier_args(), SCALE)
    o_ref = reference.rotate(o_ref.unsqueeze(2), Mv[0].repeat_interleave(3, 0).transpose(-1, -2)).transpose(1, 2)
    # Through the kernels (TRITON_INTERPRET=1) the sums run in another order than in the fp32 reference twin, so the
    # tolerance is the 2× rule (docs/format.md §9): at most twice the error of a plain bf16 PyTorch run of the same math
    # over the same cache tensors (q·M_K, the tiers as stored, softmax, ·v, ·M_Vᵀ, all in bf16). The reference path is
    # exact.
    k_all, v_all = (t.bfloat16().repeat_interleave(3, 1) for t in layer.dense_kv())  # [B, H_q, T, D]
    p = torch.softmax(torch.einsum("bhd,bhtd->bht", q_rot.bfloat16(), k_all) * SCALE, -1)
    o_bf16 = torch.einsum("bht,bhtd,hed->bhe", p, v_all, Mv[0].repeat_interleave(3, 0).bfloat16()).unsqueeze(1)
    err, err_bf16 = (out - o_ref).abs().max(), (o_bf16.float() - o_ref).abs().max()
    assert err <= 2 * err_bf16, (err, err_bf16)


def test_second_chunk_attends_tiers_and_its_own_exact_kv():
    """A 150-token chunk after a 400-token prefill sees the earlier tokens through their tiers (INT2 history
    dequantized, in the chunk's dtype) and its own K/V unquantized, causally."""
    B, n1, n2 = 1, 400, 150
    Mk, Mv = _rotations(1), _rotations(1, seed=7)
    cache = OscarCache.from_tensors(Mk, Mv, 0.96, 0.92)
    k, v = _kv(B, n1 + n2, seed=3)
    cache.update(k[:, :, :n1], v[:, :, :n1], 0)
    key, value = cache.update(k[:, :, n1:], v[:, :, n1:], 0)
    q = torch.randn(B, H_Q, n2, D)
    out, _ = oscar_attention(STUB, q, key, value, None, scaling=SCALE, oscar_cache=cache)

    rk1, rv1 = reference.rotate(k[:, :, :n1], Mk[0]), reference.rotate(v[:, :, :n1], Mv[0])
    k_hat = torch.cat([reference.fake_quant_tiers(rk1.float(), torch.full((H_KV,), 0.96)).to(key.dtype), key], 2)
    v_hat = torch.cat([reference.fake_quant_tiers(rv1.float(), torch.full((H_KV,), 0.92)).to(value.dtype), value], 2)
    expected = _dense_ref(q, k_hat, v_hat, Mk[0], Mv[0], q_offset=n1)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
    assert cache.layers[0].n_recent == layout.RECENT and cache.get_seq_length() == n1 + n2


@pytest.mark.gpu
@pytest.mark.parametrize("B, H_q, H_kv, n, S", [(1, 32, 8, 1024, 5000), (2, 9, 3, 333, 1200)])
def test_later_chunk_takes_the_flash_kernel_and_sees_the_right_keys(B, H_q, H_kv, n, S):
    """`dense_attention` on a later prefill chunk (the last n of S keys, GQA, bfloat16) runs on the GPU's flash kernel
    alone (every other SDPA backend disabled: no mask tensor, no repeated K/V) and equals float64 causal attention
    over the same bfloat16 inputs with query i seeing keys ..S − n + i, within twice the error of rounding that output
    to bfloat16 plus 1/6400 of its largest |o| (the kernel's float32 sums and bfloat16 P·V operand); one key more or
    less per query moves the reference by more than that tolerance."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from oscar_zoo.runtime.attention import dense_attention

    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(B, h, t, 128, device="cuda", generator=g, dtype=torch.bfloat16)
               for h, t in ((H_q, n), (H_kv, S), (H_kv, S)))  # fmt: skip
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = dense_attention(q, k, v, 128**-0.5).double().cpu()

    def f64(shift):
        qd, kd, vd = q.double().cpu(), k.double().cpu(), v.double().cpu()
        kd, vd = kd.repeat_interleave(H_q // H_kv, 1), vd.repeat_interleave(H_q // H_kv, 1)
        allowed = torch.arange(S)[None, :] <= (S - n + shift + torch.arange(n))[:, None]
        logits = (qd @ kd.transpose(-1, -2) * 128**-0.5).masked_fill(~allowed, -math.inf)
        return torch.softmax(logits, -1) @ vd

    ref = f64(0)
    tol = 2 * (ref.to(torch.bfloat16).double() - ref).abs().max() + 1e-2 * ref.abs().max() / 64
    assert (out - ref).abs().max() <= tol
    assert (f64(-1) - ref).abs().max() > tol and (f64(1)[:, :, :-1] - ref[:, :, :-1]).abs().max() > tol


def test_softcap_and_scaling_are_respected():
    """Gemma-style logit softcap and a non-default scale, on the dense path (decode with softcap included)."""
    Mk, Mv = _rotations(1), _rotations(1, seed=7)
    cache = OscarCache.from_tensors(Mk, Mv, 0.96, 0.92)
    k, v = _kv(1, 101, seed=5)
    key, value = cache.update(k[:, :, :100], v[:, :, :100], 0)
    q = torch.randn(1, H_Q, 100, D) * 3
    out, _ = oscar_attention(STUB, q, key, value, None, scaling=0.2, softcap=5.0, oscar_cache=cache)
    expected = _dense_ref(q, key, value, Mk[0], Mv[0], 0, scale=0.2, softcap=5.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
    key, value = cache.update(k[:, :, 100:], v[:, :, 100:], 0)
    q1 = torch.randn(1, H_Q, 1, D) * 3
    out, _ = oscar_attention(STUB, q1, key, value, None, scaling=0.2, softcap=5.0, oscar_cache=cache)
    k_all, v_all = cache.layers[0].dense_kv()
    expected = _dense_ref(q1, k_all, v_all, Mk[0], Mv[0], 100, scale=0.2, softcap=5.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


# -------------------------------------------------------------------------------------------------- whole models

CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}


def _model(arch: str = "llama", layers: int = 2, dtype=torch.float32, **extra):
    """A random-weight model of real attention shape (9 q / 3 kv heads, head_dim 64), small elsewhere. The larger
    init spread keeps greedy generation from collapsing onto one repeated token."""
    sizes = dict(vocab_size=512, hidden_size=144, intermediate_size=288, num_hidden_layers=layers,
                 num_attention_heads=H_Q, num_key_value_heads=H_KV, head_dim=D, max_position_embeddings=1024,
                 initializer_range=0.1)  # fmt: skip
    sizes.update(extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch](**sizes), attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # always generate the full count
    return model.to(dtype).eval()


def _prompt(B: int = 1, T: int = 400, vocab: int = 512, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, cache, n):
    return model.generate(ids, max_new_tokens=n, do_sample=False, cache=cache, attention_mask=torch.ones_like(ids))


@torch.no_grad()
def _teacher_forced_logits(model, ids, prompt, cache):
    """Logits [steps, V] of a prefill of ids[:, :prompt] then one token at a time over the rest of ids."""
    out = [model(ids[:, :prompt], cache=cache).logits[:, -1]]
    for t in range(prompt, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], cache=cache).logits[:, -1])
    return torch.stack(out, 1)[0].float()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_identity_unquantized_generation_reproduces_dynamic_cache(arch):
    """Identity rotations + BF16 history: a bf16 model generates the same 20 tokens as with DynamicCache, from a
    400-token prompt (sink + history + recent, two demotions during decode)."""
    model = _model(arch, dtype=torch.bfloat16)
    ids = _prompt()
    expected = _generate(model, ids, DynamicCache(), 20)
    enable_oscar(model)
    cache = OscarCache.from_tensors(_identity(2), _identity(2), quantize=False)
    got = _generate(model, ids, cache, 20)
    assert len(set(expected[0, 400:].tolist())) > 5  # a non-degenerate continuation
    assert torch.equal(got, expected)
    layer = cache.layers[1]
    assert (layer.n_sink, layer.n_hist, layer.n_recent) == (64, 96, 259)


def test_rotated_unquantized_logits_equal_plain_model():
    """Random orthogonal rotations + BF16 history, fp32 model, teacher-forced: the prefill logits equal the plain
    model's to fp32 noise (the chunk attends to its exact rotated K/V); decode logits, read from BF16 tiers, stay
    within 2× the error that identity rotations + BF16 tiers show (the bf16 storage noise; docs/format.md §9).
    Observed: prefill max |Δ| 6e-6 (max |logit| 4.2); decode: identity 0.018, rotated 0.022 (1.2×)."""
    model = _model("llama")
    ids = _prompt(T=410)
    expected = _teacher_forced_logits(model, ids, 400, DynamicCache())
    enable_oscar(model)
    ident = _teacher_forced_logits(model, ids, 400, OscarCache.from_tensors(_identity(2), _identity(2), quantize=False))
    rotated = _teacher_forced_logits(model, ids, 400,
                                     OscarCache.from_tensors(_rotations(2), _rotations(2, 50), quantize=False))
    scale = expected.abs().max()
    torch.testing.assert_close(rotated[0], expected[0], rtol=0, atol=1e-5 * scale)
    err_rot, err_id = (rotated[1:] - expected[1:]).abs().max(), (ident[1:] - expected[1:]).abs().max()
    assert 0 < err_id < 1e-2 * scale
    assert err_rot <= 2 * err_id


def test_without_oscar_cache_attention_is_exact():
    """Without an OscarCache (use_cache=False, or a DynamicCache), "oscar" is plain causal attention: logits and
    greedy tokens equal sdpa's."""
    model = _model("qwen2")
    ids = _prompt(T=50)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        expected_tokens = _generate(model, ids, DynamicCache(), 5)
        got = enable_oscar(model)(ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(_generate(model, ids, DynamicCache(), 5), expected_tokens)


def test_equal_length_batch_matches_rows(monkeypatch):
    """Each row of an equal-length batch generates exactly what it generates alone. Exactness holds for the reference
    ops, which this pins (no TRITON_INTERPRET): the kernels pick their split count from the batch size
    (`ops.int2_splits`), so their fp32 sums legitimately differ between B=2 and B=1 in the last bits, enough to flip
    a near-tie of this random bf16 model's greedy tokens. Kernels on batches are checked in test_decode_kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = enable_oscar(_model("mistral", dtype=torch.bfloat16))
    ids = _prompt(B=2, T=350)
    both = _generate(model, ids, OscarCache.from_tensors(_rotations(2), _rotations(2, 50)), 10)
    for b in range(2):
        row = _generate(model, ids[b : b + 1], OscarCache.from_tensors(_rotations(2), _rotations(2, 50)), 10)
        assert torch.equal(both[b : b + 1], row)


def test_gemma2_scaling_softcap_and_sliding_window_guard():
    """Gemma2 (query_pre_attn_scalar ≠ head_dim, logit softcap, alternating sliding layers): identity + BF16
    history matches the eager model's prefill logits; a context beyond the sliding window raises."""
    cfg = Gemma2Config(vocab_size=512, hidden_size=144, intermediate_size=288, num_hidden_layers=2,
                       num_attention_heads=H_Q, num_key_value_heads=H_KV, head_dim=D, query_pre_attn_scalar=32,
                       attn_logit_softcapping=20.0, sliding_window=96, initializer_range=0.1)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ids = _prompt(T=80)
    with torch.no_grad():
        expected = model(ids).logits
        enable_oscar(model)
        got = model(ids, cache=OscarCache.from_tensors(_identity(2), _identity(2), quantize=False)).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        with pytest.raises(NotImplementedError, match="sliding-window"):
            model(_prompt(T=120), cache=OscarCache.from_tensors(_identity(2), _identity(2)))


def test_smollm2_shaped_generation_uses_int2_decode(decode_calls):
    """A random-weight Llama of SmolLM2-135M's exact layer shape (hidden 576, 9 q / 3 kv heads, head_dim 64, MLP 1536,
    vocab 49152; 4 of its 30 layers), bf16, OSCAR-style rotations U·H·P: a quantized 420-token generate runs every
    decode step through ops.tiered_decode_attention, keeps the tiers as specified and uses less memory than BF16."""
    L = 4
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=L,
                      num_attention_heads=H_Q, num_key_value_heads=H_KV, head_dim=D, rope_theta=100000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(torch.bfloat16).eval()
    ids = _prompt(T=400, vocab=49152)
    expected = _generate(model, ids, DynamicCache(), 1)
    enable_oscar(model)
    Mk = reference.compose_rotation(_rotations(L, seed=3).double()).float()  # M = U·H·P for random U
    Mv = reference.compose_rotation(_rotations(L, seed=9).double()).float()
    cache = OscarCache.from_tensors(Mk, Mv, 0.96, 0.92)
    got = _generate(model, ids, cache, 20)
    assert got.shape == (1, 420) and torch.equal(got[:, :401], expected)  # prefill is exact up to rotation rounding
    assert len(decode_calls) == L * 19
    layer = cache.layers[L - 1]
    assert (layer.n_sink, layer.n_hist + layer.n_recent) == (64, 419 - 64)
    assert layout.RECENT <= layer.n_recent < layout.RECENT + layout.FLUSH
    bf16_bytes = 2 * H_KV * D * 2  # K and V, per token per layer
    assert cache.bytes_per_token_per_layer() < bf16_bytes


def test_folded_value_rotation_equals_unfolded():
    """fold_value_rotation puts M_V into v_proj's rows (bias included: Qwen2) and M_Vᵀ into o_proj's columns. fp32
    model, unquantized rotated cache, teacher-forced: the folded prefill logits equal the unfolded ones to fp32 noise,
    the decode logits (read from BF16 tiers, so rounded at other points) stay within 2× the unfolded error against the
    exact DynamicCache run (docs/format.md §9's 2× rule), and without a cache the folded model is the plain one; a
    transposed rotation or a wrong head mapping moves logits by O(1). Observed: prefill 5.4e-6; decode 0.0254 vs
    0.0253."""
    model = _model("qwen2")
    ids = _prompt(T=410)
    with torch.no_grad():
        plain = model(ids).logits
    exact = _teacher_forced_logits(model, ids, 400, DynamicCache())
    enable_oscar(model)
    Mk, Mv = _rotations(2), _rotations(2, 50)
    unfolded = _teacher_forced_logits(model, ids, 400, OscarCache.from_tensors(Mk, Mv, quantize=False))
    cache = OscarCache.from_tensors(Mk, Mv, quantize=False)
    assert fold_value_rotation(model, cache) == 2
    folded = _teacher_forced_logits(model, ids, 400, cache)
    assert all(layer.v_folded for layer in cache.layers)
    scale = exact.abs().max()
    torch.testing.assert_close(folded[0], unfolded[0], rtol=0, atol=2e-5 * scale)
    assert (folded[1:] - exact[1:]).abs().max() <= 2 * (unfolded[1:] - exact[1:]).abs().max()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=2e-5 * plain.abs().max())
    with pytest.raises(ValueError, match="another value rotation"), torch.no_grad():
        model(ids[:, :8], cache=OscarCache.from_tensors(Mk, _rotations(2, 90), quantize=False))
    with pytest.raises(ValueError, match="folded already"):
        fold_value_rotation(model, cache)


def test_misuses_are_refused_before_any_wrong_output():
    """What a user can get wrong around the cache fails at once with a message naming it: rotations for a deeper model
    (same head shape), a model whose attention was never switched to "oscar" (its sdpa would read rotated keys with
    an unrotated query), and packed sequences without a cache (position ids that restart: "oscar" has no mask)."""
    ids = _prompt(T=40)
    plain = _model("llama")
    with pytest.raises(ValueError, match='not running "oscar" attention'):
        _generate(plain, ids, OscarCache.from_tensors(_rotations(2), _rotations(2, 50)), 1)
    enable_oscar(plain).set_attn_implementation("sdpa")  # hooks installed, attention switched back
    with pytest.raises(ValueError, match='not running "oscar" attention'):
        _generate(plain, ids, OscarCache.from_tensors(_rotations(2), _rotations(2, 50)), 1)
    model = enable_oscar(_model("llama"))
    with pytest.raises(ValueError, match="has 30 layers and the model 2"):
        _generate(model, ids, OscarCache.from_tensors(_rotations(30), _rotations(30, 50)), 1)
    packed = torch.cat([torch.arange(25), torch.arange(15)])[None]
    with torch.no_grad(), pytest.raises(NotImplementedError, match="packed sequences"):
        model(ids, position_ids=packed, use_cache=False)
    with torch.no_grad():  # positions that do not restart stay plain causal attention
        model(ids, position_ids=torch.arange(40)[None], use_cache=False)


def test_a_reset_cache_takes_a_new_batch_size():
    """reset() empties the cache; the next generate may use another batch size and gives what a fresh cache gives."""
    model = enable_oscar(_model("llama"))
    cache = OscarCache.from_tensors(_rotations(2), _rotations(2, 50))
    _generate(model, _prompt(B=1, T=330), cache, 3)
    cache.reset()
    ids = _prompt(B=2, T=330, seed=2)
    fresh = OscarCache.from_tensors(_rotations(2), _rotations(2, 50))
    assert torch.equal(_generate(model, ids, cache, 3), _generate(model, ids, fresh, 3))


@pytest.mark.parametrize("how", ["module", "call"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_bidirectional_modules_run_exact_bidirectional_attention(how, softcap):
    """`enable_oscar` switches every sub-config (a vision tower's too); without an OscarCache "oscar" must then be
    exact attention of the kind the module asks for: a bidirectional module (module.is_causal False, or is_causal=False
    in the call) sees every key. Before, it ran causal attention and changed a Llava vision tower's output by 2 units.
    Reference: float64 softmax attention over all keys."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 9, 64, generator=g).bfloat16() for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = how != "module"
    kwargs = {"is_causal": False} if how == "call" else {}
    out, _ = oscar_attention(module, q, k, v, None, scaling=0.125, softcap=softcap, **kwargs)
    logits = (q.double() @ k.double().transpose(-1, -2)) * 0.125
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    ref = (torch.softmax(logits, -1) @ v.double()).transpose(1, 2)
    assert out.shape == (2, 9, 6, 64)
    assert (out.double() - ref).abs().max() <= 2 * 2**-8 * ref.abs().max()  # bf16 output rounding, twice
