"""One OscarCache holds one context: a second `generate()` with the same cache continues the first context (the
documented behaviour, as DynamicCache's), `reset()` empties it, and `reserve` refuses a token count that is not an
integer ≥ 0 instead of accepting it silently."""

from __future__ import annotations

import pytest
import torch

from oscar_zoo.runtime.attention import enable_oscar
from oscar_zoo.runtime.cache import OscarCache

from ..conftest import tiny_model
from ..hub.helpers import random_rotations


def _cache(model) -> OscarCache:
    cfg = model.config
    L, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    return OscarCache.from_tensors(random_rotations(L, H, D), random_rotations(L, H, D, seed=1), sink=4, recent=8)


@pytest.fixture(scope="module")
def model():
    return enable_oscar(tiny_model(), compile=False)


def _generate(model, cache, ids):
    return model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=4,
                          do_sample=False)


def test_a_reused_cache_continues_the_first_context_until_reset(model):
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    other = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    fresh = _generate(model, _cache(model), other)
    cache = _cache(model)
    _generate(model, cache, ids)
    held = cache.get_seq_length()
    assert held >= 24
    reused = _generate(model, cache, other)
    assert cache.get_seq_length() > held  # the second prompt was filed after the first context, not in its place
    cache.reset()
    assert cache.get_seq_length() == 0
    assert torch.equal(_generate(model, cache, other), fresh)  # after reset(): what a new cache gives
    assert reused.shape == fresh.shape


def test_the_docs_say_a_cache_holds_one_context():
    doc = OscarCache.__doc__
    assert "continues from the tokens it already holds" in doc and "reset()" in doc


@pytest.mark.parametrize("tokens", [-5, -1, 2.5, True, "100", None])
def test_reserve_refuses_what_is_not_a_token_count(model, tokens):
    cache = _cache(model)
    with pytest.raises(ValueError, match=r"reserve\(tokens\): expected a number of tokens ≥ 0"):
        cache.reserve(tokens)


def test_reserve_accepts_a_token_count(model):
    cache = _cache(model)
    _generate(model, cache, torch.randint(0, model.config.vocab_size, (1, 24),
                                          generator=torch.Generator().manual_seed(2)))
    cache.reserve(0)
    cache.reserve(600)
    live = [layer for layer in cache.layers if layer.is_initialized]
    assert live and all(layer.hist_k.shape[2] >= 600 - layer.sink - layer.recent for layer in live)
