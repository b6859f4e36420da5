"""Pinned tokens (docs/format.md §6c): a prompt's last queries choose, per KV head, the history tokens that stay BF16
beside the sink; the rest is quantized as before. Known answers: queries aimed at one planted token pin it (and only
its neighbours), bit for bit; the history holds exactly the other rows, quantized, in position order; a decode step
equals float64 attention over the tiers so built; a second prompt chunk re-chooses over old and new candidates."""

from __future__ import annotations

import inspect
import math

import torch
from transformers import DynamicCache

from oscar_zoo.format import layout, reference
from oscar_zoo.runtime import rotate_op
from oscar_zoo.runtime.attention import enable_oscar, oscar_attention
from oscar_zoo.runtime.cache import OscarCache

from .test_attention import H_KV, H_Q, SCALE, STUB, _dense_ref, _identity, _kv, _model, _prompt, _rotations

D = 64
PIN = 4


def test_pin_scores_equal_a_float64_loop():
    g = torch.Generator().manual_seed(0)
    B, W, c, T = 2, 5, 40, 70
    q, cand, keys = torch.randn(B, H_Q, W, D, generator=g), torch.randn(B, H_KV, c, D, generator=g), \
        torch.randn(B, H_KV, T, D, generator=g)
    got = reference.pin_scores(q, cand, keys, SCALE, pool=3)
    want = torch.zeros(B, H_KV, c, dtype=torch.float64)
    for b in range(B):
        for j in range(H_Q):
            h = j // (H_Q // H_KV)
            for w in range(W):
                z = sum(math.exp(SCALE * float(q[b, j, w].double() @ keys[b, h, t].double())) for t in range(T))
                for i in range(c):
                    want[b, h, i] += math.exp(SCALE * float(q[b, j, w].double() @ cand[b, h, i].double())) / z
    pooled = want + torch.stack([want[..., max(0, i - 1) : i + 2].amax(-1) for i in range(c)], -1)
    torch.testing.assert_close(got.double(), pooled, rtol=1e-5, atol=1e-9)


def _aimed_queries(k: torch.Tensor, targets: list[int], n: int, seed: int) -> torch.Tensor:
    """Queries [B, H_q, n, D]: random, but the last PIN_WINDOW aim at key `targets[h]` of their KV head (32 times its
    direction: its logit then dwarfs every other key's)."""
    q = torch.randn(k.shape[0], H_Q, n, D, generator=torch.Generator().manual_seed(seed))
    for j in range(H_Q):
        t = k[:, j // (H_Q // H_KV), targets[j // (H_Q // H_KV)]].float().cpu()  # [B, D]
        q[:, j, -layout.PIN_WINDOW :] = (32 * t / t.norm(dim=-1, keepdim=True))[:, None]
    return q


def _history_rows(layer) -> torch.Tensor:
    """The history's key codes and scales as stored [B, H, n_hist, ...] (for bit-exact comparisons)."""
    return layer.hist_k[:, :, : layer.n_hist], layer.sz_k[:, :, : layer.n_hist]


def test_aimed_queries_pin_their_token_exactly_and_the_rest_is_quantized_in_order(device):
    B, prompt = 2, 400
    Mk, Mv = _rotations(1).to(device), _rotations(1, seed=7).to(device)
    clip = 0.93
    cache = OscarCache.from_tensors(Mk, Mv, clip, clip, pin=PIN)
    k, v = (t.to(device) for t in _kv(B, prompt + 1, seed=5))
    targets = [100, 120, 140]  # one per KV head, inside the history (positions 64 … 143)
    key, value = cache.update(k[:, :, :prompt], v[:, :, :prompt], 0)
    q = _aimed_queries(k, targets, prompt, seed=1).to(device)
    oscar_attention(STUB, q, key, value, None, scaling=SCALE, oscar_cache=cache)
    layer = cache.layers[0]
    hist = prompt - layout.SINK - layout.RECENT - PIN
    assert (layer.n_sink, layer.n_pinned, layer.n_hist, layer.n_recent) == (layout.SINK, PIN, hist, layout.RECENT)
    assert layer.sink_len.tolist() == [layout.SINK + PIN] * B and cache.get_seq_length() == prompt

    # the tiers' rows, by position: the prompt's rotation as the cache runs it (on a GPU in bfloat16 the split GEMM,
    # whose accuracy test_rotate_kernel checks against float64; elsewhere float32)
    rk, rv = (rotate_op.rotate_chunk(x[:, :, :prompt], M).to(layout.TIER_DTYPE) for x, M in ((k, Mk[0]), (v, Mv[0])))
    pinned = layer.sink_k[:, :, layout.SINK : layout.SINK + PIN]
    positions = torch.zeros(B, H_KV, PIN, dtype=torch.long)
    for b in range(B):
        for h in range(H_KV):
            for i in range(PIN):  # each pinned row is one position's row, bit for bit
                hits = (rk[b, h] == pinned[b, h, i]).all(-1).nonzero().flatten().tolist()
                assert len(hits) == 1, hits
                positions[b, h, i] = hits[0]
            got = positions[b, h].tolist()
            assert targets[h] in got and got == sorted(got), got  # the aimed token, in position order
            assert all(abs(p - targets[h]) <= layout.PIN_POOL // 2 for p in got), got  # and only its neighbours
            assert torch.equal(layer.sink_v[b, h, layout.SINK : layout.SINK + PIN], rv[b, h, positions[b, h]])
    codes, sz = _history_rows(layer)
    for b in range(B):
        for h in range(H_KV):
            rest = [t for t in range(layout.SINK, prompt - layout.RECENT) if t not in positions[b, h].tolist()]
            want_codes, want_sz = reference.quantize_pack_ref(rk[b, h, rest].float().cpu(), torch.tensor(clip))
            assert torch.equal(codes[b, h].cpu(), want_codes) and torch.equal(sz[b, h].cpu(), want_sz)

    # a decode step reads the pinned tokens exactly: float64 attention over [sink, pinned, historŷ, recent, new]
    key, value = cache.update(k[:, :, prompt:], v[:, :, prompt:], 0)
    q1 = torch.randn(B, H_Q, 1, D, generator=torch.Generator().manual_seed(9)).to(device)
    out, _ = oscar_attention(STUB, q1, key, value, None, scaling=SCALE, oscar_cache=cache)
    k_hat, v_hat = (t.float() for t in layer.dense_kv())
    ks, vs = [], []
    for b in range(B):
        kb, vb = [], []
        for h in range(H_KV):
            rest = [t for t in range(layout.SINK, prompt - layout.RECENT) if t not in positions[b, h].tolist()]
            order = list(range(layout.SINK)) + positions[b, h].tolist() + rest + list(range(prompt - layout.RECENT,
                                                                                             prompt))
            kr = rk[b, h, order].float()
            vr = rv[b, h, order].float()
            n_exact = layout.SINK + PIN
            kr[n_exact : n_exact + len(rest)] = reference.fake_quant(kr[n_exact : n_exact + len(rest)], clip)
            vr[n_exact : n_exact + len(rest)] = reference.fake_quant(vr[n_exact : n_exact + len(rest)], clip)
            kb.append(kr)
            vb.append(vr)
        ks.append(torch.stack(kb))
        vs.append(torch.stack(vb))
    new_k = reference.rotate(k[:, :, prompt:], Mk[0]).to(layout.TIER_DTYPE).float()
    new_v = reference.rotate(v[:, :, prompt:], Mv[0]).to(layout.TIER_DTYPE).float()
    want_k, want_v = torch.cat([torch.stack(ks), new_k], 2), torch.cat([torch.stack(vs), new_v], 2)
    torch.testing.assert_close(k_hat, want_k, rtol=1e-6, atol=1e-6)  # the tiers are what the construction says
    expected = _dense_ref(q1.cpu(), want_k.cpu(), want_v.cpu(), Mk[0].cpu(), Mv[0].cpu(), q_offset=prompt)
    # the kernels' tolerance (docs/format.md §9): twice the error of a bf16 PyTorch run of the same math on the tiers
    g = H_Q // H_KV
    q_rot = (q1.double().cpu() @ Mk[0].double().cpu().repeat_interleave(g, 0))[:, :, 0]
    p = torch.softmax(torch.einsum("bhd,bhtd->bht", q_rot.bfloat16(), want_k.bfloat16().cpu().repeat_interleave(g, 1))
                      * SCALE, -1)
    o_bf16 = torch.einsum("bht,bhtd,hed->bhe", p, want_v.bfloat16().cpu().repeat_interleave(g, 1),
                          Mv[0].cpu().repeat_interleave(g, 0).bfloat16()).unsqueeze(1)
    err, err_bf16 = (out.double().cpu() - expected).abs().max(), (o_bf16.double() - expected).abs().max()
    assert err <= 2 * err_bf16, (err, err_bf16)


def test_a_second_prompt_chunk_rechooses_over_old_and_new_candidates(device):
    B, n1, n2 = 1, 400, 100
    M = _identity(1).to(device)
    cache = OscarCache.from_tensors(M, M, 0.96, 0.92, pin=PIN)
    k, v = (t.to(device) for t in _kv(B, n1 + n2, seed=11))
    key, value = cache.update(k[:, :, :n1], v[:, :, :n1], 0)
    oscar_attention(STUB, _aimed_queries(k, [100] * H_KV, n1, 2).to(device), key, value, None, scaling=SCALE,
                    oscar_cache=cache)
    layer = cache.layers[0]
    first = layer.sink_k[:, :, layout.SINK : layout.SINK + PIN].clone()
    # chunk 2 moves rows 144 … 243 out of the recent window; its last queries aim at row 200
    key, value = cache.update(k[:, :, n1:], v[:, :, n1:], 0)
    oscar_attention(STUB, _aimed_queries(k, [200] * H_KV, n2, 3).to(device), key, value, None, scaling=SCALE,
                    oscar_cache=cache)
    assert (layer.n_pinned, layer.n_hist) == (PIN, n1 + n2 - layout.SINK - layout.RECENT - PIN)
    rows = k.to(layout.TIER_DTYPE)[0]
    for h in range(H_KV):
        got = [(rows[h] == r).all(-1).nonzero().item() for r in layer.sink_k[0, h, layout.SINK : layout.SINK + PIN]]
        assert 200 in got and all(abs(p - 200) <= layout.PIN_POOL // 2 for p in got), got
    # the tokens pinned first went to the history (quantized), right after the first chunk's history rows
    hist1 = n1 - layout.SINK - layout.RECENT - PIN
    codes, sz = _history_rows(layer)
    want_codes, _ = reference.quantize_pack_ref(first.float().cpu(), torch.full((H_KV, 1), 0.96))
    assert torch.equal(codes[0, :, hist1 : hist1 + PIN].cpu(), want_codes[0])


def test_pinning_the_whole_history_answers_as_bf16(device, fewest_programs):
    """pin ≥ the prompt's history: every prompt token stays BF16, so the INT2 cache (identity rotations, a bf16
    model) generates exactly what DynamicCache does until decode demotes a token (flush = 8 steps)."""
    model = _model("llama", dtype=torch.bfloat16).to(device)
    ids = _prompt().to(device)  # 400 tokens: 64 sink, 80 history, 256 recent
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def generate(cache):
        return model.generate(ids, max_new_tokens=7, do_sample=False, attention_mask=torch.ones_like(ids),
                              **{kw: cache})

    expected = generate(DynamicCache())
    enable_oscar(model)
    cache = OscarCache.from_tensors(_identity(2), _identity(2), pin=80)
    got = generate(cache)
    assert torch.equal(got, expected)
    layer = cache.layers[1]
    assert (layer.n_sink, layer.n_pinned, layer.n_hist) == (64, 80, 0)
    assert len(set(expected[0, 400:].tolist())) > 2


def test_context_filed_without_attention_waits_exact_for_the_question(device):
    """The needle grid's flow: the context's K/V filed by `update` alone (no attention, so nothing is chosen yet),
    then the question as a chunk through the attention: its queries pin over the whole context — as if the prompt
    had been one chunk — while the chunk itself reads the would-be history as INT2, bit for bit what the history
    would hold without pinning (so the question's own answer token gains nothing from pinning). Until a decode step,
    no step is static; a beam reorder moves the waiting rows with the rest."""
    B, n1, n2 = 1, 400, 12
    M = _identity(1).to(device)
    cache = OscarCache.from_tensors(M, M, 0.96, 0.92, pin=PIN)
    k, v = (t.to(device) for t in _kv(B, n1 + n2, seed=13))
    cache.update(k[:, :, :n1], v[:, :, :n1], 0)
    layer = cache.layers[0]
    assert layer.n_hist == 0 and cache.get_seq_length() == n1
    dense_k, _ = layer.dense_kv()
    rows = k[:, :, :n1].to(layout.TIER_DTYPE)
    lo, hi = layout.SINK, n1 - layout.RECENT
    assert torch.equal(dense_k[:, :, :lo], rows[:, :, :lo].float()) and torch.equal(dense_k[:, :, hi:],
                                                                                     rows[:, :, hi:].float())
    want = reference.dequantize_unpack(*reference.quantize_pack_ref(rows[:, :, lo:hi].float().cpu(), 0.96))
    assert torch.equal(dense_k[:, :, lo:hi].cpu(), want)  # the INT2 view, not the exact rows
    assert cache.static_step_key() is None
    cache.reorder_cache(torch.zeros(B, dtype=torch.long, device=device))  # rows wait through a beam reorder too
    key, value = cache.update(k[:, :, n1:], v[:, :, n1:], 0)
    q = _aimed_queries(k, [90] * H_KV, n2, 4).to(device)
    oscar_attention(STUB, q, key, value, None, scaling=SCALE, oscar_cache=cache)
    assert (layer.n_pinned, layer.n_hist) == (PIN, n1 + n2 - layout.SINK - layout.RECENT - PIN)
    rows = k.to(layout.TIER_DTYPE)[0]
    for h in range(H_KV):
        got = [(rows[h] == r).all(-1).nonzero().item() for r in layer.sink_k[0, h, layout.SINK : layout.SINK + PIN]]
        assert 90 in got and all(abs(p - 90) <= layout.PIN_POOL // 2 for p in got), got
