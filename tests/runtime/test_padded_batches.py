"""Left-padded batches through OscarCache (`rows.PaddedRows`): every row of a padded batch generates what its prompt
generates alone (batch 1), with lengths that straddle the windows in one batch — shorter than the sink, inside the
recent window, past several demotions — and batch operations keep each row's own lengths."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DynamicCache

from oscar_zoo.runtime.attention import enable_oscar, fold_value_rotation
from oscar_zoo.runtime.cache import OscarCache

from .test_static_step import _cache, _llama

PAD = 0
# sink 4, recent 16: 3 tokens (inside the sink), 13 (inside the recent window), 61 and 44 (past several demotions)
LENGTHS = (3, 13, 61, 44)
TIERS = dict(sink=4, recent=16)


def _prompts(lengths=LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (n,), generator=g) for n in lengths]


def _left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, max length], each prompt right-aligned after PAD tokens."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), PAD)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = p, 1
    return ids, mask


@pytest.fixture(scope="module")
def model():
    model = enable_oscar(_llama(layers=2, dtype=torch.float32))
    model.generation_config.pad_token_id = PAD
    return model


def _alone(model, prompt: torch.Tensor, settings: dict, new: int, **gen) -> torch.Tensor:
    cache = _cache(2, **settings)
    out = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long), cache=cache,
                         max_new_tokens=new, **gen)
    return out[0, len(prompt):]


@pytest.mark.parametrize("settings", [dict(TIERS, flush=8), dict(TIERS, key_block=16), dict(TIERS, flush=8, pin=4)],
                         ids=["keys-per-row", "keys-per-channel", "pinned"])
def test_padded_batch_generates_what_each_prompt_generates_alone(model, settings):
    """Greedy, 40 new tokens: the short rows fill their sink and recent windows during decoding and then demote at
    their own pace (flush 8 or key blocks of 16), the long rows demote from the prompt on; every row's tokens equal
    its prompt's tokens generated alone with a fresh cache, and its tiers hold what batch 1 holds."""
    prompts, new = _prompts(), 40
    ids, mask = _left_padded(prompts)
    cache = _cache(2, **settings)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new, do_sample=False)
    layer = cache.layers[1]
    for b, prompt in enumerate(prompts):
        alone_cache = _cache(2, **settings)
        alone = model.generate(prompt[None], cache=alone_cache, max_new_tokens=new, do_sample=False)
        assert torch.equal(out[b, ids.shape[1]:], alone[0, len(prompt):]), f"row {b} ({len(prompt)} tokens)"
        row, one = layer.rows[b], alone_cache.layers[1]
        assert (row.n_sink, row.n_pinned, row.n_hist, row.n_recent) == (one.n_sink, one.n_pinned, one.n_hist,
                                                                         one.n_recent)
        assert [int(t[b]) for t in (layer.sink_len, layer.hist_len, layer.recent_len)] == [
            int(t[0]) for t in (one.sink_len, one.hist_len, one.recent_len)]
        if one.n_hist:
            assert torch.equal(layer.hist_k[b, :, : one.n_hist], one.hist_k[0, :, : one.n_hist])
    assert cache.get_seq_length() == ids.shape[1] + new - 1


def test_padded_batch_of_the_real_smollm2_generates_what_each_prompt_generates_alone(smollm2):
    """The bundled SmolLM2 (real weights, float32 on the CPU reference path) with an OscarCache of its shapes (30
    layers, 3 KV heads, random rotations; sink 4, recent 16, flush 8): a left-padded batch of prompts of 3, 13, 61
    and 44 tokens of real text generates, row for row, the 24 greedy tokens each prompt generates alone."""
    tok, model = smollm2.tokenizer, smollm2.model
    text = ("The quick brown fox jumps over the lazy dog while the farmer watches from the old stone wall, "
            "counting the sheep that wander across the green hills toward the river. ") * 4
    ids_all = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    prompts = [ids_all[:n] for n in LENGTHS]
    ids, mask = _left_padded(prompts)
    previous = model.config._attn_implementation
    enable_oscar(model)
    try:
        kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=PAD)
        out = model.generate(ids, attention_mask=mask, cache=_cache(30, **TIERS, flush=8), **kw)
        for b, prompt in enumerate(prompts):
            alone = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   cache=_cache(30, **TIERS, flush=8), **kw)
            assert torch.equal(out[b, ids.shape[1]:], alone[0, len(prompt):]), f"row {b} ({len(prompt)} tokens)"
    finally:
        model.set_attn_implementation(previous)


def test_a_ragged_demotion_reserves_the_history_as_a_captured_step_does():
    """The eager step and the CUDA-graph capture of a padded batch must run on the same history capacity (the decode
    kernel's split count follows it, and with it the last bits). Rows of 276 tokens (sink 4, history 256 — exactly the
    first capacity —, recent 16) and 27 (a prompt of 20, then 7 single tokens: recent 23, it demotes next): before its
    capture the step's key reserves the longest history plus a flush; the eager step, whose only demoting row needs 8
    rows, reserves the same."""
    H, D = 3, 64
    g = torch.Generator().manual_seed(4)
    caches = []
    for _ in range(2):
        cache = _cache(1, **TIERS, flush=8)
        layer = cache.layers[0]
        k, v = torch.randn(2, H, 276, D, generator=g), torch.randn(2, H, 276, D, generator=g)
        layer.lazy_initialization(k, v)
        layer.make_rows([0, 276 - 27])
        layer.rows[0].file_rotated(k[:1], v[:1])
        layer.rows[1].file_rotated(k[1:, :, :20], v[1:, :, :20])
        for t in range(20, 27):
            layer.rows[1].update(k[1:, :, t : t + 1], v[1:, :, t : t + 1])
        assert layer.hist_k.shape[2] == 256 and layer.demotes_next() == (False, True)
        caches.append(cache)
    captured, eager = caches
    captured.static_step_key()  # what DecodeGraphs asks before each static step (and so before a capture)
    eager.update(torch.randn(2, H, 1, D), torch.randn(2, H, 1, D), 0)
    assert eager.layers[0].rows[1].n_hist == 8
    assert eager.layers[0].hist_k.shape[2] == captured.layers[0].hist_k.shape[2] >= 256 + 8


def _sdpa_generate(model, ids, mask, **gen) -> torch.Tensor:
    model.set_attn_implementation("sdpa")
    try:
        return model.generate(ids, attention_mask=mask, cache=DynamicCache(), do_sample=False, **gen)
    finally:
        enable_oscar(model)


def test_a_one_token_prompt_beside_an_empty_row(model):
    """The narrowest padded batch: a one-token prompt and a row of padding only (generate() calls the one-token
    prompt a decode-sized step). The padding is not filed — the empty row's first step attends nothing, as the model's
    own sdpa attention with a DynamicCache gives it — and both rows generate sdpa's tokens."""
    ids, mask = torch.tensor([[PAD], [5]]), torch.tensor([[0], [1]])
    cache = _cache(2, sink=4, recent=8, flush=4)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False)
    assert [row.get_seq_length() for row in cache.layers[0].rows] == [5, 6]  # their own tokens only
    assert torch.equal(out, _sdpa_generate(model, ids, mask, max_new_tokens=6))


def test_chunked_prefill_of_a_padded_batch(model):
    """transformers' chunked prefill (`prefill_chunk_size`) of prompts of 8 and 24 tokens in chunks of 8: the short
    row's padding fills two chunks, so the second still pads it, and its tokens make the third — the chunk it makes
    alone. Every row generates what it generates alone in chunks of 8, and holds its own tokens only."""
    prompts = _prompts((8, 24))
    ids, mask = _left_padded(prompts)
    gen = dict(max_new_tokens=12, do_sample=False, prefill_chunk_size=8)
    cache = _cache(2, **TIERS, flush=8)
    out = model.generate(ids, attention_mask=mask, cache=cache, **gen)
    for b, prompt in enumerate(prompts):
        alone_cache = _cache(2, **TIERS, flush=8)
        alone = model.generate(prompt[None], cache=alone_cache, **gen)
        assert torch.equal(out[b, ids.shape[1]:], alone[0, len(prompt):]), f"row {b} ({len(prompt)} tokens)"
        row, one = cache.layers[1].rows[b], alone_cache.layers[1]
        assert (row.n_sink, row.n_hist, row.n_recent) == (one.n_sink, one.n_hist, one.n_recent)
    assert cache.get_seq_length() == 24 + 11


def test_a_value_fold_between_two_generations_reaches_every_row():
    """`fold_value_rotation` between two generate() calls that continue one padded batch's cache: every row's second
    generation equals that row's alone (the same calls, batch 1) — the rows' views take the fold too, or they would
    rotate the values again and un-rotate what o_proj now un-rotates."""
    prompts, more = _prompts((3, 13, 30)), _prompts((5,), seed=9)[0]

    def two_generations(ids, mask):
        model = enable_oscar(_llama(layers=2, dtype=torch.float32))
        model.generation_config.pad_token_id = PAD
        cache = _cache(2, sink=4, recent=8, flush=4)
        first = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=10, do_sample=False)
        fold_value_rotation(model, cache)
        ids2 = torch.cat([first, more[None].expand(len(first), -1)], 1)
        mask2 = torch.cat([mask, torch.ones(len(first), ids2.shape[1] - mask.shape[1], dtype=torch.long)], 1)
        return model.generate(ids2, attention_mask=mask2, cache=cache, max_new_tokens=10, do_sample=False)[:, -10:]

    ids, mask = _left_padded(prompts)
    batched = two_generations(ids, mask)
    for b, prompt in enumerate(prompts):
        alone = two_generations(prompt[None], torch.ones(1, len(prompt), dtype=torch.long))
        assert torch.equal(batched[b], alone[0]), f"row {b} ({len(prompt)} tokens)"


def test_padded_batch_sampling_matches_alone(model):
    """Sampling with a seed: the batch's draws come from one generator, so compare the distributions instead — each
    row's first-step logits with padding equal its logits alone (float32 reference path, within 1e-5)."""
    prompts = _prompts()
    ids, mask = _left_padded(prompts)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, cache=_cache(2, **TIERS)).logits[:, -1]
        alone = [model(prompt[None], cache=_cache(2, **TIERS)).logits[0, -1] for prompt in prompts]
    for b in range(len(prompts)):
        torch.testing.assert_close(logits[b], alone[b], rtol=0, atol=1e-5)
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=mask, cache=_cache(2, **TIERS), max_new_tokens=8,
                         do_sample=True, top_k=20)
    assert out.shape == (len(prompts), ids.shape[1] + 8)


def test_right_padding_is_refused(model):
    ids, mask = _left_padded(_prompts((3, 9)))
    ids, mask = ids.flip(1), mask.flip(1)  # padding after the tokens
    with pytest.raises(NotImplementedError, match="padded on the left"), torch.no_grad():
        model(ids, attention_mask=mask, cache=_cache(2, **TIERS))


def test_without_an_oscar_cache_padded_rows_attend_their_own_tokens(model):
    """"oscar" attention without an OscarCache (DynamicCache, or no cache) is exact attention: a padded batch then
    generates what the model's own sdpa attention generates, and a forward without a cache gives its logits."""
    ids, mask = _left_padded(_prompts((5, 21, 30)))
    got = model.generate(ids, attention_mask=mask, cache=DynamicCache(), max_new_tokens=10, do_sample=False)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, use_cache=False).logits
    model.set_attn_implementation("sdpa")
    try:
        want = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        with torch.no_grad():
            want_logits = model(ids, attention_mask=mask, use_cache=False).logits
    finally:
        enable_oscar(model)
    assert torch.equal(got, want)
    real = mask.bool()
    torch.testing.assert_close(logits[real], want_logits[real], rtol=1e-5, atol=1e-5)


def test_beam_search_and_return_sequences_keep_each_rows_lengths(model):
    """Beam search (reorder_cache) and num_return_sequences (batch_repeat_interleave) over a padded batch, with the BF16
    history and identity rotations (an OscarCache then holds exact K/V): the same sequences as DynamicCache."""
    prompts = _prompts((5, 21, 30))
    ids, mask = _left_padded(prompts)
    for gen in (dict(num_beams=3, max_new_tokens=12), dict(num_return_sequences=2, do_sample=True, max_new_tokens=12)):
        torch.manual_seed(0)
        got = model.generate(ids, attention_mask=mask, cache=_exact(), **gen)
        torch.manual_seed(0)
        model.set_attn_implementation("sdpa")
        try:
            want = model.generate(ids, attention_mask=mask, **gen)
        finally:
            enable_oscar(model)
        assert torch.equal(got, want), gen


def _exact(**settings) -> OscarCache:
    """Identity rotations and the BF16 history (the test switch): the cache then holds the model's K/V (in BF16)."""
    eye = torch.eye(64).expand(2, 3, 64, 64).contiguous()
    return OscarCache.from_tensors(eye, eye, 1.0, 1.0, quantize=False, **{**TIERS, **settings})


def test_crop_drops_each_rows_last_tokens_as_dynamic_cache_does(model):
    """A padded batch, a 6-token chunk, crop(-6), another 3-token chunk: the same next-token logits as DynamicCache
    taking the same calls (within BF16 storage of K/V; the chunk demoted earlier tokens, which stay demoted); tokens
    already demoted into the INT2 history cannot be dropped, nor more tokens than a row holds (ValueError, nothing
    changed)."""
    ids, mask = _left_padded(_prompts((5, 21, 30)))
    extra, more = torch.randint(1, 512, (3, 6)), torch.randint(1, 512, (3, 3))
    ones = lambda n: torch.ones(3, n, dtype=torch.long)  # noqa: E731
    logits = {}
    with torch.no_grad():
        for name in ("oscar", "dynamic"):
            if name == "dynamic":
                model.set_attn_implementation("sdpa")
            cache = _exact() if name == "oscar" else DynamicCache()
            try:
                model(ids, attention_mask=mask, cache=cache)
                model(extra, attention_mask=torch.cat([mask, ones(6)], 1), cache=cache)
                cache.crop(-6)
                assert cache.get_seq_length() == ids.shape[1]
                logits[name] = model(more, attention_mask=torch.cat([mask, ones(3)], 1), cache=cache).logits.float()
            finally:
                enable_oscar(model)
    torch.testing.assert_close(logits["oscar"], logits["dynamic"], rtol=0, atol=3e-2)
    assert torch.equal(logits["oscar"].argmax(-1), logits["dynamic"].argmax(-1))
    cache = _cache(2, **TIERS, flush=8)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
    with pytest.raises(ValueError, match="a row holds 5 .* padding"):
        cache.crop(-6)  # the 5-token row
    with pytest.raises(ValueError, match="only the last 16 are still BF16 .* not reversible"):
        cache.layers[0].rows[2].crop(-17)  # the 30-token row: 4 sink, 10 history, 16 recent
    assert cache.get_seq_length() == 30


def test_assisted_generation_with_an_oscar_cache(model):
    """Assisted decoding (a draft model proposes tokens, the cache drops the rejected ones with `crop`): the greedy
    tokens of plain greedy decoding, with DynamicCache's through an exact OscarCache."""
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_config(model.config).eval()
    prompt = _prompts((40,))[0][None]
    got = model.generate(prompt, cache=_exact(), assistant_model=draft, max_new_tokens=30, do_sample=False)
    model.set_attn_implementation("sdpa")
    try:
        want = model.generate(prompt, max_new_tokens=30, do_sample=False)
    finally:
        enable_oscar(model)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("key_block", [0, 128], ids=["keys-per-row", "keys-per-channel"])
def test_padded_batch_on_the_gpu_replays_per_row_demotions(key_block):
    """generate() on a GPU (kernels, CUDA-graph replays) with a left-padded batch whose prompts straddle the windows
    (sink 16, recent 64; 10 tokens: inside the sink; 50: inside the recent window; 450 and 700: past demotions), 300
    greedy tokens: the captured steps (one per pattern of rows demoting) equal the eager steps bit for bit, tokens and
    logits; most steps were replays; every row's first 24 tokens equal its prompt's alone (batch 1: the kernels'
    split counts depend on the batch size, so later near-ties of this random model may legitimately differ) and
    its first logits are within 0.05; each row's lengths are batch 1's."""
    from oscar_zoo.runtime.graph import decode_graphs

    model = enable_oscar(_llama(device="cuda"), compile=False)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    model.generation_config.pad_token_id = PAD
    prompts = _prompts((10, 50, 700, 450))
    ids, mask = _left_padded(prompts)
    ids, mask = ids.cuda(), mask.cuda()
    runs = {}
    for mode in ("eager", "graph"):
        cache = _cache(2, sink=16, recent=64, key_block=key_block)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=300, do_sample=False, **{kw: cache},
                             disable_compile=mode == "eager", output_logits=True, return_dict_in_generate=True)
        runs[mode] = (out.sequences, torch.stack(out.logits, 1).float(), cache)
    graphs = decode_graphs(model)
    assert graphs.replays >= 180 and graphs.captures >= 3
    assert torch.equal(runs["graph"][0], runs["eager"][0])
    assert torch.equal(runs["graph"][1], runs["eager"][1])
    seqs, logits, cache = runs["graph"]
    T = ids.shape[1]
    for b, prompt in enumerate(prompts):
        alone_cache = _cache(2, sink=16, recent=64, key_block=key_block)
        alone = model.generate(prompt[None].cuda(), max_new_tokens=300, do_sample=False, **{kw: alone_cache},
                               output_logits=True, return_dict_in_generate=True)
        assert torch.equal(seqs[b, T : T + 24], alone.sequences[0, len(prompt) : len(prompt) + 24]), f"row {b}"
        assert (logits[b, 0] - alone.logits[0][0].float()).abs().max() < 0.05
        row, one = cache.layers[1].rows[b], alone_cache.layers[1]
        assert (row.n_sink, row.n_hist, row.n_recent) == (one.n_sink, one.n_hist, one.n_recent)
