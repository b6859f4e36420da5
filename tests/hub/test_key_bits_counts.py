"""What the hub shows of an artifact with 3-bit keys (docs/format.md §6b): the zoo index's bits per element at 128K
and the model card's table count the keys' third bit, computed here by hand from the format's byte layout."""

from __future__ import annotations

import pytest

from oscar_zoo.hub.card import render_model_card
from oscar_zoo.hub.zoo import zoo_entry

from .helpers import make_manifest


def _by_hand(context: int, key_bits: list[int], D: int = 16, sink: int = 64, recent: int = 256) -> float:
    """Mean over K and V of the bits of one element: history rows of packed codes (keys: the layers' mean bits) and a
    float16 scale and zero per row (group = head_dim here), BF16 windows."""
    hist, full = context - sink - recent, sink + recent
    k_codes = sum(key_bits) / len(key_bits)
    k = (hist * (k_codes + 32 / D) + full * 16) / context
    v = (hist * (2 + 32 / D) + full * 16) / context
    return (k + v) / 2


def test_zoo_entry_and_card_count_three_bit_keys():
    base = make_manifest(granularity="per-layer", L=4, H_kv=2, D=16)
    assert base.quant.group_size == 16 and (base.quant.sink, base.quant.recent) == (64, 256)
    three = base.replace(schema_version=3,
                                    quant=base.quant.replace(key_bits=[3, 3, 2, 3]))
    expected = pytest.approx(_by_hand(131072, [2] * 4), abs=1e-4)
    assert zoo_entry(base, "", "0" * 64, "t").bits_per_element_128k == expected
    want = _by_hand(131072, [3, 3, 2, 3])
    assert zoo_entry(three, "", "0" * 64, "t").bits_per_element_128k == pytest.approx(want, abs=1e-4)
    assert want - _by_hand(131072, [2] * 4) == pytest.approx(0.75 / 2 * (131072 - 320) / 131072)
    card = render_model_card(three, "org/repo", "", "hf")
    assert f"| 32K | {_by_hand(32768, [3, 3, 2, 3]):.2f} |" in card and f"| 128K | {want:.2f} |" in card
    assert "keys 3-bit in 3/4 layers" in card
