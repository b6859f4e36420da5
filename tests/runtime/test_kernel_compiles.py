"""The decode kernel compiles for an H200 (sm_90) as `ops` launches it, without a GPU (benchmarks/kernel_sass.py in a
fresh process, where Triton is not in interpreter mode): catches what the CPU interpreter cannot (non-constexpr
globals, shared memory beyond what an SM has, register spills in the token loop); an earlier draft of the kernel
needed 512 KB of shared memory at 32/8 heads and passed every interpreter test.."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
SM90_SHARED = 227 * 1024  # bytes of shared memory one program may use on an H100/H200


@pytest.mark.parametrize("shape, group_size", [("32,8,128", 0), ("9,3,64", 0), ("32,8,128", 32)])
def test_decode_kernel_compiles_for_sm90(shape, group_size):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--shape", shape,
                           "--group-size", str(group_size), "--json"],
                          capture_output=True, text=True, env=env, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.splitlines()[-1])
    H_q, H_kv, _ = (int(x) for x in shape.split(","))
    assert r["shared"] <= SM90_SHARED
    assert r["HPP"] * (H_q // H_kv) <= r["BLOCK_H"]
    assert r["ops"]["HMMA"] > 0  # the token loop runs on tensor cores
    assert r["ops"].get("STL", 0) == 0, "register spills (local-memory stores) in the token loop"
