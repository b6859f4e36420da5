"""The keys-per-channel quantize/pack kernel (`ops.quantize_pack_channel`, docs/format.md §6d) against
`reference.quantize_pack_channel_ref`: bit for bit (codes and the float16 scale/zero pairs) over dtypes, head dims,
2- and 3-bit codes, block sizes, strided inputs, the range floors, outliers and values on the rounding boundaries; a
float64 known-answer construction; the GPU build (per-token loads joined in registers, two passes over chunks) run
on the interpreter; input errors; and a realistic-size check and a CUDA-graph capture for the GPU (marked `gpu`).

Channels are rows transposed: the row kernel's constructions (`_midpoint_rows`, `_boundary_rows`, `FRAGILE_ENDS`)
become channels whose block holds those values along its tokens."""

import dataclasses

import pytest
import torch

from oscar_zoo.format import layout, reference
from oscar_zoo.runtime import config, ops

from .test_quantize_pack_kernel import FRAGILE_ENDS, _boundary_rows, _codes_in_row, _every_value, _midpoint_rows


def _keys(B, H, T, D, dtype, device, seed, block=64):
    """Random keys with what breaks a per-channel quantizer: channel offsets and scales that differ by block, constant
    channels (+0, −0, 0.731: the absolute range floor; −3: the relative one), a near-constant channel (7·(1 + 2^-14·n):
    the relative floor in float32, constant in 16 bits), a tiny one (the absolute floor with varying values), a huge
    outlier, an all-positive channel far from 0 (zero < 0) and an all-negative one (zero > 2^bits − 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g) * torch.rand(1, 1, 1, D, generator=g).mul(2).add(0.1)
    x = x + torch.randn(1, H, 1, D, generator=g) * 2  # per-channel offsets, as keys have
    x = x * torch.rand(1, 1, T // block, 1, generator=g).mul(3).add(0.2).repeat_interleave(block, dim=2)
    x[..., 1] = 0.731
    x[..., 2] = 0.0
    x[..., 3] = -3.0
    x[..., 4] = 7.0 * (1 + 2.0**-14 * torch.randn(B, H, T, generator=g))
    x[..., 5] = 1e-5 * (1 + torch.rand(B, H, T, generator=g))
    x[..., 6] = -0.0
    x[:, :, 7 % T, 7] = 3000.0  # one outlier in block 0
    x[..., D - 2] = 50 + torch.rand(B, H, T, generator=g)
    x[..., D - 1] = -50 - torch.rand(B, H, T, generator=g)
    return x.to(dtype).to(device)


def _assert_bit_exact(x, block, bits):
    codes, sz = ops.quantize_pack_channel(x, block, bits)
    codes_ref, sz_ref = reference.quantize_pack_channel_ref(x.cpu(), block, bits)
    T, D = x.shape[-2:]
    assert codes.dtype == torch.uint8 and sz.dtype == torch.float16
    assert codes.shape == (*x.shape[:-1], layout.packed_dim(D, bits)) == codes_ref.shape
    assert sz.shape == (*x.shape[:-2], T // block, D, 2) == sz_ref.shape
    assert torch.equal(codes.cpu(), codes_ref)
    assert torch.equal(sz.cpu().view(torch.int16), sz_ref.view(torch.int16))  # bit for bit, incl. signed zeros


def _channels(rows: torch.Tensor) -> torch.Tensor:
    """Rows [D, KB] (one construction each) → one block of keys [1, 1, KB, D] whose channel c holds row c."""
    return rows.t().contiguous()[None, None]


# ------------------------------------------------------------------------------------------------ bit for bit


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bit_exact_dtypes_head_dims_bits(device, dtype, D, bits):
    _assert_bit_exact(_keys(1, 2, 128, D, dtype, device, seed=D + bits), 64, bits)


@pytest.mark.parametrize("D, block, bits", [(64, 128, 2), (128, 128, 3), (64, 16, 3), (16, 16, 2), (16, 32, 3)])
def test_bit_exact_block_sizes(device, D, block, bits):
    """Blocks of 16, 32 and 128 tokens (and D = 16), several blocks per (batch, head), B·H > 1."""
    _assert_bit_exact(_keys(2, 2, 2 * block, D, torch.bfloat16, device, seed=block + D, block=block), block, bits)


@pytest.mark.parametrize("bits", [2, 3])
def test_strided_slice_of_a_tier(device, bits):
    """The demotion path: the first F tokens of a [B, H, W, D] buffer (a strided view, no copy), and a view whose
    channels are not contiguous (copied)."""
    tier = _keys(2, 2, 96, 64, torch.bfloat16, device, seed=5, block=32)
    view = tier[:, :, :64]
    assert not view.is_contiguous()
    _assert_bit_exact(view, 32, bits)
    _assert_bit_exact(tier.transpose(-1, -2)[:, :, :, :64].transpose(-1, -2), 32, bits)  # stride(-1) = 96


def test_leading_dims_fold(device):
    """[..., T, D] with 1, 2 or 3 leading dims (folded into the kernel's [B, H]), and a bare [T, D]."""
    x = _keys(6, 2, 64, 64, torch.bfloat16, device, seed=9, block=32)
    _assert_bit_exact(x.reshape(2, 3, 2, 64, 64), 32, 3)
    _assert_bit_exact(x[0], 32, 2)
    _assert_bit_exact(x[0, 1], 32, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [2, 3])
def test_bit_exact_at_rounding_midpoints(device, bits, dtype):
    """Channels of known scale s = 2^e and zero z (integers and two short fractions: `_midpoint_rows`) holding every
    level and every midpoint (x = (j/2 − z)·s: x/s + z = i − ½, where ⌊· + ½⌋ steps), the float32 ties of x/s + z at
    each rounding threshold, and their neighbours; the reference's scale of each channel is its s (checked)."""
    rows = torch.cat([_midpoint_rows(dtype, bits, 128, seed=s) for s in (bits, bits + 10)])  # [54, 128]
    fill = torch.randn(64 - rows.shape[0], 128, generator=torch.Generator().manual_seed(bits)).to(dtype)
    x = _channels(torch.cat([rows, fill]))
    _, sz_ref = reference.quantize_pack_channel_ref(x, 128, bits)
    scales = (2.0 ** torch.tensor([-8.0, -1.0, 4.0])).repeat_interleave(9).repeat(2)
    assert torch.equal(sz_ref[0, 0, 0, :54, 0].float(), scales)
    _assert_bit_exact(x.to(device), 128, bits)


@pytest.mark.parametrize("dtype, bits", [(torch.bfloat16, 2), (torch.float32, 2), (torch.bfloat16, 3)])
def test_bit_exact_at_code_boundaries(device, dtype, bits):
    """Channels holding every value at which one of the codes changes and the value just below it (`_boundary_rows`:
    16 ranges, one sign or both, each in 4 channels in different token orders), over a block of 128 tokens."""
    rows = _boundary_rows(dtype, 16, 128, seed=23 + bits, bits=bits)
    rows = torch.cat([rows, rows.flip(1), rows.roll(37, 1), rows.flip(1).roll(5, 1)])
    _assert_bit_exact(_channels(rows).to(device), 128, bits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bit_exact_where_the_quotient_last_bit_decides(device, dtype):
    """Channels holding the values whose code an inexact quotient x·RN(1/s) would change (`FRAGILE_ENDS`)."""
    KB = 64
    every = _every_value(dtype)
    rows = []
    for a, b in FRAGILE_ENDS[dtype]:
        ends = torch.tensor([a, b])
        vals = every[(every >= a) & (every <= b)]
        codes, s, z = _codes_in_row(ends, vals)
        fragile = vals[torch.floor(vals * (1 / s) + z + 0.5).clamp(0, 3) != codes]
        assert 1 <= fragile.numel() <= KB - 2
        rows.append(torch.cat([ends, fragile, torch.linspace(a, b, KB - 2 - fragile.numel())]))
    rows = torch.stack(rows + rows[:2] + [r.flip(0) for r in rows] + rows[2:4])  # 16 channels
    _assert_bit_exact(_channels(rows).to(dtype).to(device), KB, 2)


def test_outlier_and_range_floor_pairs(device):
    """The pairs `_keys` was built for, against values worked out by hand: +0 and 0.731 constant channels take the
    absolute floor (scale = RN16(3·2^-14 / 3) = 2^-14), −3 the relative one (3·2^-12 / 3 = 2^-12, zero RN16(3·2^12)),
    the outlier's channel has its (block 0, channel 7) range alone."""
    x = _keys(1, 1, 128, 64, torch.float32, device, seed=3)
    _assert_bit_exact(x, 64, 2)
    _, sz = ops.quantize_pack_channel(x, 64, 2)
    sz = sz.cpu().float()[0, 0]  # [2 blocks, D, 2]
    assert torch.equal(sz[:, 1, 0], torch.full((2,), 2.0**-14)) and torch.equal(sz[:, 2, 0], sz[:, 1, 0])
    assert torch.equal(sz[:, 3], torch.tensor([[2.0**-12, 3 * 2.0**12]] * 2))
    assert sz[0, 7, 0] > 900 and sz[1, 7, 0] < 10  # the outlier widens block 0 of its channel only


# ------------------------------------------------------------------------------------------------ known answers


@pytest.mark.parametrize("bits", [2, 3])
def test_known_answer_float64(device, bits):
    """Float64 keys whose codes are known: in block n, channel c holds lo + r·q/L for the codes q = (t + c) mod 2^bits
    (L = 2^bits − 1; 2-bit: lo + r·{0, 1/3, 2/3, 1}) with r = L·s, s = 2^(c mod 5 − 2 + n) and lo = −z·s, z = c mod
    2^bits: so scale s, zero z and the codes q, all exact. The packed bytes are built here by hand (byte j holds
    channels j + i·D/4 in bits 2i; 3-bit: byte D/4 + j holds channels j + i·D/8's third bit in bit i) and the
    dequantized (q − zero)·scale equals x."""
    D, KB, T = 16, 16, 32
    L = 2**bits - 1
    t = torch.arange(T)[:, None]
    c = torch.arange(D)[None, :]
    q = (t + c) % (L + 1)
    s = 2.0 ** (c % 5 - 2 + t // KB).double()
    z = (c % (L + 1)).double()
    x = (q.double() - z) * s  # = lo + r·q/L
    codes, sz = ops.quantize_pack_channel(x.to(device), KB, bits)
    codes, sz = codes.cpu(), sz.cpu()
    want = torch.zeros(T, layout.packed_dim(D, bits), dtype=torch.int64)
    for tt in range(T):
        for ch in range(D):
            want[tt, ch % (D // 4)] += (int(q[tt, ch]) & 3) << (2 * (ch // (D // 4)))
            if bits == 3:
                want[tt, D // 4 + ch % (D // 8)] += (int(q[tt, ch]) >> 2) << (ch // (D // 8))
    assert torch.equal(codes.long(), want)
    assert torch.equal(sz[..., 0].double(), s[::KB].expand(T // KB, D))
    assert torch.equal(sz[..., 1].double(), z.expand(T // KB, D))
    x_hat = (q.double() - sz[..., 1].double().repeat_interleave(KB, 0)) * sz[..., 0].double().repeat_interleave(KB, 0)
    assert torch.equal(x_hat, x)
    assert set(q[:KB, 0].tolist()) == set(range(L + 1))  # every code occurs


# ------------------------------------------------------------------------------------------------ the GPU build


@pytest.mark.parametrize("D, block, bits", [(128, 32, 2), (128, 32, 3), (64, 32, 2), (64, 16, 3), (256, 16, 3),
                                            (32, 16, 2), (16, 16, 3)])  # fmt: skip
def test_gpu_build_on_the_interpreter(device, monkeypatch, D, block, bits):
    """The build the GPU runs (per-token loads joined in registers, chunks of quant_channel_chunk tokens in two
    passes) rather than the interpreter's flat one: every split of a pack group over lanes (4, 2 or 1 channels a
    thread; 2-bit groups on 1, 2 or 4 lanes, 3-bit ones on 2, 4 or 8), blocks of one and of two chunks."""
    with config.use(dataclasses.replace(config.current(), quant_channel_interpret_gpu_build=True)):
        _assert_bit_exact(_keys(1, 2, 2 * block, D, torch.bfloat16, device, seed=D + block, block=block), block, bits)


_COMPILE_FOR_SM90 = r"""
import dataclasses, json, sys, tempfile
from pathlib import Path
import torch, triton
from triton.backends.compiler import GPUTarget
from benchmarks.experiments.kernel_sass import _specialise, resources
from oscar_zoo.runtime import dispatch, ops
from oscar_zoo.runtime.kernels import KernelTable
from oscar_zoo.runtime.kernels import quantize_channel as qp

D, KB, bits = map(int, sys.argv[1:4])
captured = {}
class Grab:  # stands in for the kernel: records the launch as ops makes it
    def __getitem__(self, grid):
        return lambda *args, **kw: captured.update(args=args, kw=kw)
table = dataclasses.replace(KernelTable(*(None,) * 8), quantize_pack_channel=Grab())
with dispatch.stand_in(dispatch.StandIn(table)):
    ops.quantize_pack_channel(torch.empty(1, 8, 4096, D, dtype=torch.bfloat16), KB, bits)
kw = dict(captured["kw"])
warps = kw.pop("num_warps")
fn = qp._quantize_pack_channel_kernel
values = dict(zip([n for n in fn.arg_names if n not in kw], captured["args"]))
compiled = triton.compile(_specialise(fn, values, kw), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
with tempfile.TemporaryDirectory() as tmp:
    res = resources(compiled.asm["cubin"], Path(tmp))
print(json.dumps(dict(res, shared=compiled.metadata.shared, warps=warps, FLAT=kw["FLAT"], TC=kw["TC"])))
"""


@pytest.mark.parametrize("D, block, bits", [(128, 128, 3), (64, 64, 2)])
def test_kernel_compiles_for_sm90(D, block, bits):
    """The GPU build as ops launches it compiles for an H200 (sm_90) without a GPU, in a fresh process (not in
    interpreter mode): no register spills, registers and shared memory that leave room for many programs per SM
    (observed: 134 / 61 registers, 512 / 256 B shared)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90, str(D), str(block), str(bits)], cwd=root,
                          capture_output=True, text=True, env=env, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.splitlines()[-1])
    assert not r["FLAT"] and r["TC"] == config.current().quant_channel_chunk
    assert r["stack"] == 0, "register spills"
    assert r["registers"] <= 168 and r["shared"] <= 4096
    assert r["warps"] == 1  # D / 4 channels a program's threads, one warp up to D = 128


def test_falls_back_to_the_reference(device):
    """Head dims the kernel does not take (not a power of two, above 256) and float64 on the fallback path."""
    _assert_bit_exact(_keys(1, 2, 32, 96, torch.bfloat16, device, seed=1, block=16), 16, 2)
    _assert_bit_exact(_keys(1, 1, 32, 512, torch.bfloat16, device, seed=2, block=16), 16, 3)


# ------------------------------------------------------------------------------------------------ input errors


def test_bad_inputs_raise():
    x = torch.randn(1, 2, 64, 64)
    with pytest.raises(ValueError, match="floating-point"):
        ops.quantize_pack_channel(torch.zeros(64, 64, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="at least two dims"):
        ops.quantize_pack_channel(torch.randn(64), 16)
    for block in (48, 8, 0, 64.0):
        with pytest.raises(ValueError, match="power of two"):
            ops.quantize_pack_channel(x, block)
    with pytest.raises(ValueError, match="whole blocks of 128"):
        ops.quantize_pack_channel(x, 128)
    with pytest.raises(ValueError, match="bit"):
        ops.quantize_pack_channel(x, 16, bits=4)
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.quantize_pack_channel(torch.randn(1, 2, 16, 20), 16, bits=3)
    with pytest.raises(ValueError, match="multiple of 4"):
        ops.quantize_pack_channel(torch.randn(1, 2, 16, 18), 16, bits=2)


# ------------------------------------------------------------------------------------------------ GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("bits", [2, 3])
def test_bit_exact_on_cuda_at_a_realistic_size(bits, block, dtype):
    """B = 1, H = 8, T = 4096, D = 128 (a prefill's history keys) on the GPU, bit for bit with the reference."""
    x = _keys(1, 8, 4096, 128, dtype, "cuda", seed=bits + block, block=block)
    _assert_bit_exact(x, block, bits)
    _assert_bit_exact(_keys(1, 8, 4096 + 256, 128, dtype, "cuda", seed=7, block=block)[:, :, :4096], block, bits)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3])
def test_cuda_graph_capture(bits):
    """Captured in a CUDA graph on a strided slice of a tier buffer, replayed on new contents: the outputs follow."""
    tier = torch.zeros(2, 8, 192, 128, dtype=torch.bfloat16, device="cuda")
    tier.copy_(_keys(2, 8, 192, 128, torch.bfloat16, "cuda", seed=1))
    ops.quantize_pack_channel(tier[:, :, :128], 64, bits)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        codes, sz = ops.quantize_pack_channel(tier[:, :, :128], 64, bits)
    for seed in (2, 3):
        tier.copy_(_keys(2, 8, 192, 128, torch.bfloat16, "cuda", seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        codes_ref, sz_ref = reference.quantize_pack_channel_ref(tier[:, :, :128].cpu(), 64, bits)
        assert torch.equal(codes.cpu(), codes_ref)
        assert torch.equal(sz.cpu().view(torch.int16), sz_ref.view(torch.int16))
