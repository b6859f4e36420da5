"""`ops.dequantize_into` (kernels/dequant.py): packed history rows dequantized straight into a dense buffer, what a
later prefill chunk attends over (`OscarLayer.dense_kv`). The reference is `reference.dequantize_unpack` /
`dequantize_unpack_channel` (float32, the codec's definition): float32 output must equal it bit for bit, and a
bfloat16 output must be it rounded once to nearest even (torch's `.to(torch.bfloat16)`), bit for bit."""

import pytest
import torch

from oscar_zoo.format import layout, reference
from oscar_zoo.runtime import ops
from oscar_zoo.runtime.cache import OscarCache

from .test_static_step import _rotations

CASES = [  # D, key bits, group size (0: the row), key block (0: per row), V's token-major layout
    (64, 2, 0, 0, False), (128, 3, 0, 0, False), (128, 2, 32, 0, False), (128, 2, 0, 128, False),
    (64, 3, 0, 32, False), (128, 2, 0, 0, True), (256, 3, 0, 64, False),
]


def _packed(D, bits, group, key_block, token_major, seed, B=2, H=3, T=256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g) * torch.linspace(0.5, 3, D)  # channels of different ranges
    if key_block:
        codes, sz = reference.quantize_pack_channel_ref(x, key_block, bits)
        want = reference.dequantize_unpack_channel(codes, sz, bits)
    else:
        codes, sz = reference.quantize_pack_ref(x, 0.95, group, bits=bits)
        want = reference.dequantize_unpack(codes, sz, bits)
    if token_major:  # V's codes as the cache stores them
        codes = layout.history_codes(B, H, T, D, "cpu", tokens_contiguous=True).copy_(codes)
    return codes, sz, want


@pytest.mark.parametrize(("D", "bits", "group", "key_block", "token_major"), CASES,
                         ids=["64", "128-k3", "128-g32", "128-kb128", "64-k3-kb32", "128-token-major",
                              "256-k3-kb64"])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_into_a_slice(device, D, bits, group, key_block, token_major, dtype):
    """Into the middle of a NaN-filled buffer (rows 3 … T+3 of T + 7; nothing outside them is written), from views of
    the history storage (the first T of T_cap rows), every code layout: 2- and 3-bit, groups, keys per channel."""
    codes, sz, want = _packed(D, bits, group, key_block, token_major, seed=D + bits + group + key_block)
    T = codes.shape[2]
    out = torch.full((2, 3, T + 7, D), float("nan"), dtype=dtype, device=device)
    cap_codes = torch.zeros(2, 3, T + 32, codes.shape[-1], dtype=torch.uint8)  # storage with spare rows
    cap_codes[:, :, :T] = codes
    if token_major:
        cap_codes = layout.history_codes(2, 3, T + 32, D, "cpu", tokens_contiguous=True).copy_(cap_codes)
    ops.dequantize_into(out[:, :, 3 : 3 + T], cap_codes[:, :, :T].to(device), sz.to(device), bits, key_block)
    got = out.cpu()
    assert got[:, :, :3].isnan().all() and got[:, :, 3 + T :].isnan().all()
    assert torch.equal(got[:, :, 3 : 3 + T], want.to(dtype))


@pytest.mark.parametrize("key_block", [0, 64])
def test_dense_kv_of_a_cache_equals_its_tiers_read_back(device, key_block):
    """A real OscarCache (two float32 prompt chunks, 3-bit keys per row or per channel) read back densely in
    bfloat16 with a chunk appended: its sink, recent and chunk rows as stored, its history as `history()` (the float32
    reference) rounded."""
    H, D = 2, 64
    g = torch.Generator().manual_seed(7)
    cache = OscarCache.from_tensors(_rotations(1, H, D), _rotations(1, H, D, seed=9), 0.96, 0.92, key_bits=[3],
                       key_block=key_block)
    k, v = (torch.randn(1, H, 700, D, generator=g) for _ in range(2))
    cache.update(k[:, :, :400].to(device), v[:, :, :400].to(device), 0)
    cache.update(k[:, :, 400:690].to(device), v[:, :, 400:690].to(device), 0)
    layer = cache.layers[0]
    assert layer.n_hist > 0
    extra = (k[:, :, 690:].bfloat16().to(device), v[:, :, 690:].bfloat16().to(device))
    dk, dv = layer.dense_kv(torch.bfloat16, extra)
    hist_k, hist_v = layer.history()
    s, h, r = layer.n_sink, layer.n_hist, layer.n_recent
    for got, sink, hist, recent, chunk in ((dk, layer.sink_k, hist_k, layer.recent_k, extra[0]),
                                           (dv, layer.sink_v, hist_v, layer.recent_v, extra[1])):
        assert got.shape == (1, H, s + h + r + 10, D) and got.dtype == torch.bfloat16
        got = got.cpu().float()
        assert torch.equal(got[:, :, :s], sink[:, :, :s].cpu().float())
        assert torch.equal(got[:, :, s + h : s + h + r], recent[:, :, :r].cpu().float())
        assert torch.equal(got[:, :, -10:], chunk.cpu().float())
        assert torch.equal(got[:, :, s : s + h], hist.cpu().bfloat16().float())
