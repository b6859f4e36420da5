"""The blocked windowed attention against `reference.windowed_attention_ref`, the rotation helper against
`reference.rotate`, and the methods' quantization layouts and bits per element."""

import pytest
import torch

from oscar_zoo.evaluation.baselines import Kivi, RotatedInt2, hadamard_rotation
from oscar_zoo.evaluation.teacher_forcing import windowed_attention
from oscar_zoo.format import layout, reference


@pytest.mark.parametrize("T,sink,recent,block", [(1, 4, 8, 16), (15, 4, 8, 4), (333, 16, 32, 64), (700, 64, 256, 256)])
def test_windowed_attention_equals_the_reference(T, sink, recent, block):
    torch.manual_seed(T)
    q = torch.randn(1, 9, T, 64, dtype=torch.bfloat16)
    k, v = torch.randn(1, 3, T, 64, dtype=torch.bfloat16), torch.randn(1, 3, T, 64, dtype=torch.bfloat16)
    k_hat, v_hat = reference.fake_quant(k, 0.96), reference.fake_quant(v, 0.92)
    ref = reference.windowed_attention_ref(q, k, v, k_hat, v_hat, 0.125, sink, recent)
    out = windowed_attention(q, k, v, k_hat, v_hat, 0.125, sink, recent, block)
    assert (out - ref).abs().max() < 1e-5


def test_rotated_int2_quantizes_only_the_history_rows_with_the_reference_codec():
    torch.manual_seed(0)
    T, sink, recent = 100, 8, 16
    q, k, v = torch.randn(1, 9, T, 64), torch.randn(1, 3, T, 64), torch.randn(1, 3, T, 64)
    M = hadamard_rotation(1, 64)
    clip = torch.full((1, 1), 0.9)
    m = RotatedInt2("h", "h", "baseline", M, M, clip, clip, 0, sink, recent)
    kv = m.prepare(0, q, k, v, reference.quantize_pack_ref)
    k_rot = reference.rotate(k, M[0, 0])
    assert torch.equal(kv.k, k_rot)
    assert torch.equal(kv.k_hat[:, :, sink : T - recent], reference.fake_quant(k_rot[:, :, sink : T - recent], 0.9))
    assert torch.equal(kv.k_hat[:, :, :sink], k_rot[:, :, :sink].float())
    # un-rotating the output with M_Vᵀ undoes the value rotation
    assert torch.allclose(reference.rotate(kv.v.float(), kv.out_rotation), v, atol=1e-5)


def test_kivi_quantizes_keys_per_channel_over_token_groups_and_values_per_token():
    torch.manual_seed(0)
    T, sink, recent = 200, 8, 32
    k, v = torch.randn(1, 3, T, 64), torch.randn(1, 3, T, 64)
    kivi = Kivi(64, sink, recent)
    kv = kivi.prepare(0, torch.randn(1, 9, T, 64), k, v, reference.quantize_pack_ref)
    group = k[:, :, sink + 32 : sink + 64]  # second token group: each channel is one row of 32 tokens
    expected = reference.fake_quant(group.transpose(-1, -2), 0.0).transpose(-1, -2)
    assert torch.equal(kv.k_hat[:, :, sink + 32 : sink + 64], expected)
    assert torch.equal(kv.v_hat, reference.fake_quant(v, 0.0, 32))
    bits_k, bits_v = kivi.bits(131072)
    assert bits_k == layout.bits_per_element(131072, 32, sink, recent) and abs(bits_k - 3.0) < 0.04 and bits_v == bits_k


def test_two_models_verify_at_once_each_with_its_own_runner():
    """Nested `verifying` on two models: each model's layers call only its own runner, while its block is open."""
    from oscar_zoo.evaluation.teacher_forcing import causal_attention, verifying

    from ..conftest import tiny_model

    a, b = tiny_model("llama"), tiny_model("qwen3", seed=1, num_hidden_layers=3, num_attention_heads=4)
    ids = torch.randint(0, 512, (1, 12))
    calls = {"a": [], "b": []}

    def runner(name):
        def run(layer, q, k, v, scale):
            calls[name].append((layer, q.shape[1]))
            return causal_attention(q, k, v, scale)
        return run

    with torch.no_grad():
        exact_a = a(ids).logits
        with verifying(a, runner("a")):
            with verifying(b, runner("b")):
                b(ids)
                inside = a(ids).logits  # a's block is open under b's: a uses its own runner
            after = a(ids).logits  # b's block closed: a's still open
        b(ids)  # back to sdpa: no runner
    assert calls["a"] == [(0, 6), (1, 6)] * 2
    assert calls["b"] == [(0, 4), (1, 4), (2, 4)]
    assert torch.allclose(inside, exact_a, atol=1e-4) and torch.allclose(after, exact_a, atol=1e-4)
    assert a.config._attn_implementation == b.config._attn_implementation == "sdpa"
