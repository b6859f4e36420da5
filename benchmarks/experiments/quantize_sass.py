"""Static profile of the fused quantize/pack kernel without a GPU: compile it for sm_90 as `ops.quantize_pack` would
launch it (Triton's bundled ptxas/cuobjdump, the JIT's argument specialisation: `kernel_sass._specialise`) and count
its SASS instructions per row.

The kernel holds one row per thread, so the straight-line instruction count of one thread is the number of warp
instructions per 32 rows. Budget at the copy bandwidth of an H200 (≈ 4.0 TB/s, 132 SMs × 4 warp issues per clock at
≈ 1.98 GHz): bytes per row / 4.0e12 × 1.045e12 warp instructions; d = 128 (292 B/row) affords ≈ 76 warp instructions
per row, d = 64 (148 B/row) ≈ 39. Compare, min/max, integer and logic instructions issue at half rate (64 lanes per SM
per clock), so they are counted twice in `issue_slots`. A float ratio compiles the build ops launches for it: the top-8
(m ≤ 8: 0.96 at d = 128) or top-16 (m ≤ 16: 0.92) path alone, as for the cache's per-head ratios with their host
bound (`min_ratio`); `--ratio tensor` compiles the per-row dispatch of a ratio tensor without a bound (its static count
includes all three paths).
Usage:
    python -m benchmarks.experiments.quantize_sass [--d 128] [--ratio 0.96] [--group-size 0] [--warps 4] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tempfile
from collections import Counter
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

from oscar_zoo.format import layout
from oscar_zoo.runtime import config, dispatch, ops
from oscar_zoo.runtime.kernels import KernelTable, quantize_pack as qp

from .kernel_sass import _cuobjdump, _specialise, resources

HALF_RATE = ("FMNMX", "IMNMX", "FSETP", "ISETP", "FSET", "FSEL", "SEL", "LOP3", "SHF", "IADD3", "PRMT", "LEA", "VIMNMX",
             "IMAD", "BMSK", "SGXT", "P2R", "R2P", "PLOP3")  # fmt: skip
CONVERSIONS = ("F2I", "I2F", "FRND", "F2F", "I2FP", "F2IP")  # 16 lanes per SM per clock


def compile_quantize(D: int, ratio, group_size: int = 0, warps: int = config.DEFAULT.quant_warps,
                     asm: bool = config.DEFAULT.quant_asm,
                     rows: int = 1 << 20):
    """The kernel as `ops.quantize_pack` launches it for bf16 rows [1, 8, rows/8, D] (no rotation)."""
    captured = {}

    class Grab:  # stands in for the kernel: records the launch arguments instead of running
        def __getitem__(self, grid):
            return lambda *args, **kw: captured.update(args=args, kw=kw, grid=grid)

    table = KernelTable(*(None,) * 8)
    table = dataclasses.replace(table, quantize_pack=Grab(), round_thresholds=qp.ROUND_THRESHOLDS)
    x = torch.empty(1, 8, rows // 8, D, dtype=torch.bfloat16)  # the launch on CPU tensors, as a GPU makes it
    clip = torch.full((8, 1), 0.96) if ratio == "tensor" else float(ratio)
    with dispatch.stand_in(dispatch.StandIn(table)):
        with config.use(dataclasses.replace(config.current(), quant_warps=warps, quant_asm=asm)):
            ops.quantize_pack(x, clip, group_size)
    kw = dict(captured["kw"])
    warps = kw.pop("num_warps")
    fn = qp._quantize_pack_kernel
    values = dict(zip([n for n in fn.arg_names if n not in kw], captured["args"]))
    if values["r_ptr"].dtype == torch.float64:  # a float ratio's device scalar: count with a float32 one (one load/row)
        values["r_ptr"] = values["r_ptr"].float()
    src = _specialise(fn, values, kw)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)), kw, warps


def sass_ops(cubin: bytes, tmp: Path) -> Counter:
    sass = _cuobjdump(cubin, tmp, "-sass")
    ops_ = Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            ops_[m.group(2).split(".")[0]] += 1
    for idle in ("NOP", "EXIT", "BRA"):
        ops_.pop(idle, None)
    return ops_


def profile(D: int, ratio, group_size: int = 0, warps: int = config.DEFAULT.quant_warps,
            asm: bool = config.DEFAULT.quant_asm) -> dict:
    compiled, kw, warps = compile_quantize(D, ratio, group_size, warps, asm)
    with tempfile.TemporaryDirectory() as tmp:
        counts = sass_ops(compiled.asm["cubin"], Path(tmp))
        res = resources(compiled.asm["cubin"], Path(tmp))
    total = sum(counts.values())
    half = sum(n for op, n in counts.items() if op in HALF_RATE)
    conv = sum(n for op, n in counts.items() if op in CONVERSIONS)
    rows_per_warp = 32 * kw["BLOCK_T"] // (32 * warps)  # rows one thread holds × 32 lanes
    per_row = total / rows_per_warp
    slots = max(total, 2 * half + (total - half), 8 * conv) / rows_per_warp  # issue-slot estimate per row
    nbytes = 2 * D + layout.bytes_per_token(D, layout.resolve_group_size(D, group_size))
    budget = nbytes / 4.0e12 * 132 * 4 * 1.98e9
    return dict(triton=triton.__version__, D=D, ratio=ratio, group_size=group_size, warps=warps,
                BLOCK_T=kw["BLOCK_T"], MAX_M=kw["MAX_M"], NET16=kw["NET16"], shared=compiled.metadata.shared,
                instructions=total,
                warp_instructions_per_row=per_row, issue_slots_per_row=slots, budget_per_row=budget,
                bytes_per_row=nbytes, ops=dict(counts.most_common()), **res)  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--ratio", default="0.96", help="float clip ratio, or 'tensor' (per-head ratios)")
    ap.add_argument("--group-size", type=int, default=0)
    ap.add_argument("--warps", type=int, default=config.DEFAULT.quant_warps)
    ap.add_argument("--asm", type=int, default=int(config.DEFAULT.quant_asm),
                    help="1: sort |x| as packed 16-bit pairs (PTX)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = profile(args.d, args.ratio, args.group_size, args.warps, bool(args.asm))
    if args.json:
        print(json.dumps(r))
        return
    print(f"triton {r['triton']}, sm_90, d={r['D']} G={args.group_size or r['D']} ratio {r['ratio']} "
          f"(MAX_M {r['MAX_M']}): {r['warps']} warps, {r['BLOCK_T']} rows/program, shared {r['shared']} B, "
          f"{r['registers']} registers/thread, {r['stack']} B stack (spills)/thread")
    print(f"{r['instructions']} SASS instructions → {r['warp_instructions_per_row']:.1f} warp instructions per row, "
          f"≈ {r['issue_slots_per_row']:.1f} issue slots (half-rate ops twice); budget at 4.0 TB/s "
          f"{r['budget_per_row']:.1f} ({r['bytes_per_row']} B/row)")
    print("  " + ", ".join(f"{op} {n}" for op, n in Counter(r["ops"]).most_common(16)))


if __name__ == "__main__":
    main()
