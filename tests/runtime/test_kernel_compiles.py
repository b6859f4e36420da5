"""The decode kernel compiles for an H200 (sm_90) as `ops` launches it, without a GPU
(benchmarks/experiments/kernel_sass.py in a fresh process, where Triton is not in interpreter mode): catches what the
CPU interpreter cannot (non-constexpr globals, shared memory beyond what an SM has, a register cap the compiler did not
apply); an earlier draft of the kernel needed 512 KB of shared memory at 32/8 heads and passed every interpreter test; a
later one took 67 KB per program, so only 3 of the 4 programs per SM the split rule counts on fitted, and measured 1.7×
slower. Small register spills are accepted (up to 272 B per thread at d = 64 with a GQA group of 16, 136 B at d = 256);
a one-warp program for a group of 64 spilled 5 KB, hence the extra warps for large groups (`ops._warps`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
from oscar_zoo.runtime import config, dispatch, ops  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SM90_SHARED = 227 * 1024  # bytes of shared memory one program may use on an H100/H200
SM90_SM_SHARED = 228 * 1024  # bytes per SM, of which each resident program also takes 1 KB reserved
SM90_REGISTERS = 65536  # per SM, allocated per warp in units of 8 registers per thread


@pytest.mark.parametrize("shape, group_size, key_block, int8_dots, key_bits", [
    ("32,8,128", 0, 0, True, 2), ("9,3,64", 0, 0, True, 2), ("32,4,64", 0, 0, False, 2), ("32,8,128", 32, 0, False, 2),
    ("32,32,128", 0, 0, False, 2), ("64,1,128", 0, 0, True, 2), ("16,16,256", 0, 0, False, 2),
    ("8,4,256", 0, 0, False, 2), ("32,8,128", 0, 128, True, 2), ("9,3,64", 0, 64, False, 2),
    ("32,8,128", 0, 128, True, 3), ("9,3,64", 0, 64, False, 3),
])  # fmt: skip
def test_decode_kernel_compiles_for_sm90(shape, group_size, key_block, int8_dots, key_bits):
    """int8_dots: whether the score dots run in integers (`kernels/decode.py`: groups padded to 4 or ≥ 8 with ≥ 32 dims
    of contraction, one scale per row): IMMA, or IGMMA where a program has a warpgroup (4 warps: the group of 64).
    key_block: keys per channel, at 32/8/128 on the integer dots with the block
    operands (`ops.block_query`), at 9/3/64 with q·s folded per tile (bfloat16 dots). key_bits 3: calibrate's codec
    for its 3-bit-key layers at both head dims (the rows read in pairs, docs/format.md §6b)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.experiments.kernel_sass", "--shape", shape,
                           "--group-size", str(group_size), "--key-block", str(key_block), "--key-bits", str(key_bits),
                           "--json"],
                          capture_output=True, text=True, env=env, timeout=900, check=False)  # fmt: skip (a hang guard)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.splitlines()[-1])
    H_q, H_kv, D = (int(x) for x in shape.split(","))
    assert r["shared"] <= SM90_SHARED
    assert r["GP"] == dispatch.next_pow2(H_q // H_kv)
    assert r["ops"]["HMMA"] > 0  # the token loop runs on tensor cores
    assert (r["ops"].get("IMMA", 0) + r["ops"].get("IGMMA", 0) > 0) == int8_dots
    assert r["ops"].get("PRMT", 0) > 0 or not config.current().int2_asm  # the INT2 loop was found (byte-permute unpack)
    assert r["registers"] <= (ops.decode_config(D).maxnreg or 255)
    cfg = ops.decode_config(D)  # the split rule assumes programs_per_sm one-warp slots are resident on an SM at once
    by_regs = SM90_REGISTERS // (-(-r["registers"] // 8) * 8 * 32 * r["warps"])
    by_shared = SM90_SM_SHARED // (r["shared"] + 1024)
    assert min(by_regs, by_shared) >= cfg.programs_per_sm * cfg.warps // r["warps"], (by_regs, by_shared)
    assert r["stack"] <= 512, "register spills beyond the few hundred bytes the chosen settings have"


@pytest.mark.parametrize("d, ratio, group_size", [
    (128, "0.96", 0), (128, "0.92", 0), (64, "0.96", 0), (128, "tensor", 0), (64, "tensor", 0), (128, "0.96", 32),
    (64, "0.92", 16)])  # fmt: skip
def test_quantize_kernel_compiles_for_sm90(d, ratio, group_size):
    """The quantize/pack kernel as ops.quantize_pack launches it (packed 16-bit sort; the top-8 and top-16 builds a
    float ratio picks, the same builds the cache's bounded per-head tensors take, and the per-row dispatch of a ratio
    tensor): compiles for sm_90, fits shared memory, one row per thread without shared-memory shuffles of the row."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.experiments.quantize_sass", "--d", str(d),
                           "--ratio", ratio, "--group-size", str(group_size), "--json"],
                          capture_output=True, text=True, env=env, timeout=900, check=False)  # fmt: skip (a hang guard)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.splitlines()[-1])
    assert r["shared"] <= SM90_SHARED
    assert r["ops"].get("HMNMX2", 0) > 0  # the order statistic runs on packed bf16 pairs
    # every row reduction stays in its thread: the per-row dispatch (a ratio tensor) adds only the few shuffles of the
    # block's largest-m reduction (Triton 3.6: 4), and its build spills 32 B with Triton 3.9 (none with 3.6). This runs
    # with the installed Triton; what the GPU image's 3.6 made of the earlier row load (516 shuffles, 56 B to 5 KB of
    # spills) shows only with a 3.6 wheel first on PYTHONPATH (README: kernel_sass.py / quantize_sass.py).
    dispatch = ratio == "tensor"
    assert r["ops"].get("SHFL", 0) <= (8 if dispatch else 0)
    assert r["stack"] <= (32 if dispatch else 0), "register spills"
