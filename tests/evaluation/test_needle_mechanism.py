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
