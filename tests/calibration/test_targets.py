"""Streaming float64 accumulators against one-shot products; merge; the contiguous GQA convention."""

import torch

from oscar_zoo.calibration.targets import SecondMoment, group_heads, key_weights, per_layer


def test_group_heads_is_the_repeat_interleave_convention():
    torch.manual_seed(0)
    B, H_q, H_kv, T, D = 2, 6, 2, 5, 4
    q = torch.randn(B, H_q, T, D)
    grouped = group_heads(q, H_kv)  # [H_kv, B·g·T, D]
    kv_of_query_head = torch.arange(H_kv).repeat_interleave(H_q // H_kv)  # HF's repeat_kv mapping
    for h in range(H_kv):
        expected = q[:, kv_of_query_head == h].reshape(-1, D)
        assert torch.equal(grouped[h].sort(0).values, expected.sort(0).values)
        assert torch.allclose(grouped[h].T.double() @ grouped[h].double(), expected.T.double() @ expected.double())


def test_streaming_equals_one_shot_and_merge_equals_concatenation():
    torch.manual_seed(1)
    chunks = [torch.randn(3, n, 8, dtype=torch.bfloat16) for n in (5, 17, 1)]
    weights = [torch.rand(3, c.shape[1]) for c in chunks]
    acc = SecondMoment.zeros(2, 3, 8)
    wacc = SecondMoment.zeros(2, 3, 8)
    for c, w in zip(chunks, weights):
        acc.add(1, c)
        wacc.add(1, c, w)
    x = torch.cat(chunks, 1).double()
    w = torch.cat(weights, 1).double()
    one_shot = torch.stack([x[h].T @ x[h] for h in range(3)]) / x.shape[1]
    weighted = torch.stack([(x[h] * w[h, :, None]).T @ x[h] for h in range(3)]) / w.sum(1)[:, None, None]
    assert torch.allclose(acc.mean()[1], one_shot, rtol=1e-12, atol=1e-12)
    assert torch.allclose(wacc.mean()[1], weighted, rtol=1e-12, atol=1e-12)
    assert torch.equal(acc.mean()[0], torch.zeros(3, 8, 8))  # untouched layer

    a, b = SecondMoment.zeros(2, 3, 8), SecondMoment.zeros(2, 3, 8)
    a.add(1, chunks[0])
    b.add(1, chunks[1])
    b.add(1, chunks[2])
    merged = a.merge(b)
    assert torch.allclose(merged.sums, acc.sums, rtol=1e-12) and torch.equal(merged.weights, acc.weights)
    state = merged.state("key")
    assert torch.equal(SecondMoment.from_state(state, "key").sums, merged.sums)


def test_key_weights_are_expected_squared_logits():
    torch.manual_seed(2)
    q = torch.randn(2, 1000, 4, dtype=torch.float64)
    k = torch.randn(2, 7, 4, dtype=torch.float64)
    C = torch.einsum("hnd,hne->hde", q, q) / 1000
    w = key_weights(k, C)
    direct = (torch.einsum("hnd,hkd->hkn", q, k) ** 2).mean(-1)  # mean over queries of (q·k)²
    assert torch.allclose(w, direct, rtol=1e-10)
    assert per_layer(C[None]).shape == (1, 1, 4, 4)
    assert torch.allclose(per_layer(C[None])[0, 0], C.mean(0))
