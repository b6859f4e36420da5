"""benchmarks/experiments/needle_mechanism.py's artifact variants code a layer's history as the artifact's runtime
does: keys per channel over its key blocks at the layer's key bits (checked against the format's reference codec and
against the levels and error any such codec must have), values per token, and with keys or values exact, exactly the
other side of the artifact's coding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from oscar_zoo.format import reference as ref

mech = pytest.importorskip("benchmarks.experiments.needle_mechanism")

H, T, D, BLOCK = 2, 128, 64, 64


def _rotations(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    orth = [torch.linalg.qr(torch.randn(H, D, D, generator=g, dtype=torch.float64))[0].float() for _ in range(4)]
    return SimpleNamespace(k_rotation=[orth[0], orth[1]], v_rotation=[orth[2], orth[3]],
                           k_clip=[torch.ones(H), torch.ones(H)], v_clip=[torch.ones(H), torch.ones(H)])


def _variant(name: str):
    # layer 0 has 3-bit keys, layer 1 2-bit ones; keys per channel over 64-token blocks
    return next(v for v in mech.variants(D, 2, False, [3, 2], BLOCK) if v.name == name)


@pytest.mark.parametrize("layer, bits", [(0, 3), (1, 2)])
def test_the_artifact_codes_keys_per_channel_over_its_blocks_at_the_layers_bits(layer, bits):
    rot = _rotations()
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(H, T, D, generator=g), torch.randn(H, T, D, generator=g)
    kh, vh = mech.code_layer(_variant("the artifact"), layer, k, v, rot)
    Mk, Mv = rot.k_rotation[layer], rot.v_rotation[layer]
    kr, kr_hat = k @ Mk, kh @ Mk  # the rotated space the codec works in
    torch.testing.assert_close(kr_hat, ref.fake_quant_channel(kr, BLOCK, bits), atol=2e-5, rtol=0)
    for b in range(T // BLOCK):  # each (block, channel): at most 2^bits levels, each within half a step
        x, xh = kr[:, b * BLOCK : (b + 1) * BLOCK], kr_hat[:, b * BLOCK : (b + 1) * BLOCK]
        step = (x.amax(1) - x.amin(1)) / (2**bits - 1)  # [H, D]
        assert ((xh - x).abs() <= step[:, None] / 2 * 1.01 + 1e-4).all()
        ordered = xh.sort(dim=1).values  # levels: runs of values within 1e-3 (the rotation back adds ~1e-6)
        levels = int(((ordered.diff(dim=1) > 1e-3).sum(1) + 1).max())
        assert levels <= 2**bits
        assert levels > 2 ** (bits - 1)  # (more levels than one bit fewer could give)
    # values per token, unclipped, at 2 bits
    torch.testing.assert_close(vh @ Mv, ref.fake_quant(v @ Mv, 1.0, 0, 2), atol=2e-5, rtol=0)


def test_keys_or_values_exact_leave_the_other_side_coded_as_the_artifact_codes_it():
    rot = _rotations(2)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(H, T, D, generator=g), torch.randn(H, T, D, generator=g)
    kh, vh = mech.code_layer(_variant("the artifact"), 0, k, v, rot)
    k_exact, v_k = mech.code_layer(_variant("the artifact, K bf16"), 0, k, v, rot)
    k_v, v_exact = mech.code_layer(_variant("the artifact, V bf16"), 0, k, v, rot)
    torch.testing.assert_close(k_exact, k, atol=1e-5, rtol=0)
    torch.testing.assert_close(v_exact, v, atol=1e-5, rtol=0)
    torch.testing.assert_close(v_k, vh, atol=0, rtol=0)
    torch.testing.assert_close(k_v, kh, atol=0, rtol=0)
    assert (kh - k).abs().max() > 0.05 and (vh - v).abs().max() > 0.05  # (the artifact does code both)


def test_reading_layers_exact_keep_one_side_of_those_layers_only():
    """k_exact_layers / v_exact_layers: in the named layer that side is exact and the other coded as the artifact
    codes it; in any other layer both sides are the artifact's."""
    rot = _rotations(4)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(H, T, D, generator=g), torch.randn(H, T, D, generator=g)
    own = _variant("the artifact").opts
    for layer in (0, 1):
        kh, vh = mech.code_layer(_variant("the artifact"), layer, k, v, rot)
        k1, v1 = mech.code_layer(mech.Variant("K", k_exact_layers={0}, **own), layer, k, v, rot)
        k2, v2 = mech.code_layer(mech.Variant("V", v_exact_layers={0}, **own), layer, k, v, rot)
        torch.testing.assert_close(k1, k if layer == 0 else kh, atol=1e-5, rtol=0)
        torch.testing.assert_close(v2, v if layer == 0 else vh, atol=1e-5, rtol=0)
        torch.testing.assert_close(v1, vh, atol=0, rtol=0)
        torch.testing.assert_close(k2, kh, atol=0, rtol=0)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_values_with_8_bit_metadata_are_per_token_codes_at_their_bits(bits):
    """v_meta8: each rotated value row takes at most 2^bits levels, within 1.25 steps of the exact value (float8
    e4m3 keeps the scale within 1/16 of range/levels, and the int8 zero point moves the grid by at most half a
    step), and coarser than float16 metadata would be on some row (the metadata really is rounded)."""
    rot = _rotations(6)
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(H, T, D, generator=g), torch.randn(H, T, D, generator=g)
    # layer 0 names its value bits; layer 1 names none and takes 2 bits, as most layers of the variants do
    var = mech.Variant("m", v_meta8=True, v_clip=0.0, v_bits={0: bits})
    for layer, b in ((0, bits), (1, 2)):
        _, vh = mech.code_layer(var, layer, k, v, rot)
        vr, vr_hat = v @ rot.v_rotation[layer], vh @ rot.v_rotation[layer]
        step = (vr.amax(-1) - vr.amin(-1)) / (2**b - 1)  # [H, T]
        assert ((vr_hat - vr).abs() <= 1.25 * step[..., None] + 1e-4).all()
        ordered = vr_hat.sort(dim=-1).values
        assert int(((ordered.diff(dim=-1) > 1e-3).sum(-1) + 1).max()) <= 2**b
        fp16 = mech.uniform(vr, b)  # the same rows with float16 scale and zero
        assert ((vr_hat - fp16).abs() > 1e-3).float().mean() > 0.1  # a tenth of the values or more move


def test_paired_outcomes_against_bf16_and_the_artifact_by_group():
    """A constructed set of outcomes with a known answer: the pooled, per-haystack and per-needle pairs and their
    discordant counts."""
    keys = ["1:plays/passkey/0", "1:plays/passkey/1", "2:docs/passkey/0", "2:docs/name/0"]
    scored = {"bf16": dict(zip(keys, [True, True, True, False])),
              "the artifact": dict(zip(keys, [True, False, True, False])),
              "v": dict(zip(keys, [False, True, True, True]))}
    out = mech.paired(scored, "v", ["plays/passkey", "docs/passkey", "docs/name"])
    a = out["all vs bf16"]
    assert (a["n"], a["ref"], a["it"], a["ref_only"], a["it_only"]) == (4, 0.75, 0.75, 1, 1)
    assert a["lo"] < 0 < a["hi"]
    assert (out["plays vs bf16"]["n"], out["plays vs bf16"]["ref_only"], out["plays vs bf16"]["it_only"]) == (2, 1, 0)
    assert (out["docs vs bf16"]["n"], out["docs vs bf16"]["it_only"]) == (2, 1)
    assert (out["passkey vs bf16"]["n"], out["name vs bf16"]["n"]) == (3, 1)
    b = out["all vs the artifact"]
    assert (b["ref"], b["it"], b["ref_only"], b["it_only"]) == (0.5, 0.75, 1, 2)
    assert "all vs the artifact" not in mech.paired(scored, "the artifact", ["plays/passkey"])


def test_key_blocks_per_layer_code_each_layer_over_its_own_blocks():
    """k_chan_layers: a layer named there codes its keys per channel over its own token blocks, every other layer over
    k_chan's; both at the layer's key bits, against the format's reference codec."""
    rot = _rotations(6)
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(H, T, D, generator=g), torch.randn(H, T, D, generator=g)
    var = mech.Variant("finer keys in layer 0", k_bits={0: 3, 1: 3}, k_chan=128, history_block=128,
                       k_chan_layers={0: 32})
    for layer, block in ((0, 32), (1, 128)):
        kh, _ = mech.code_layer(var, layer, k, v, rot)
        kr = k @ rot.k_rotation[layer]
        torch.testing.assert_close(kh @ rot.k_rotation[layer], ref.fake_quant_channel(kr, block, 3), atol=2e-5, rtol=0)
    kh0, _ = mech.code_layer(var, 0, k, v, rot)
    coarse, _ = mech.code_layer(mech.Variant("coarse", k_bits={0: 3}, k_chan=128, history_block=128), 0, k, v, rot)
    assert (kh0 - k).pow(2).mean() < 0.7 * (coarse - k).pow(2).mean()  # finer blocks: a smaller error
    # the two variants on the demo artifact's key bits: their bits at 32K, and the 4-bit one's key bits per layer
    demo = [2] * 7 + [3] * 16 + [2] * 2 + [3] * 5
    by_name = {v.name: v for v in mech.variants(D, 30, False, demo, BLOCK)}
    stem = "the artifact, 3-bit K and V in the needle-reading layers, K blocks of 128"
    finer, four = by_name[f"{stem}, 64 in the reading layers"], by_name[f"{stem}, 4-bit K in 23 and 24"]
    assert finer.opts["k_chan_layers"] == {i: 64 for i in range(20, 25)}
    assert (round(finer.bpe(32768, D), 3), round(four.bpe(32768, D), 3)) == (2.991, 2.987)
    kb = four.opts["k_bits"]
    assert (kb[23], kb[24], kb[20], 13 in kb) == (4, 4, 3, False)
