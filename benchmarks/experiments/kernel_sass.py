"""Static profile of the decode kernel without a GPU: compile it for sm_90 (Triton's bundled ptxas/cuobjdump), with the
argument specialisation the JIT would apply to a real launch, and count the SASS instructions of its token loops and
of the INT2 branch's lead-in (what every program runs once before its first tile: at batch 1, where a program has
only a few tiles, this fixed work shows in the time).

The number that matters is warp instructions per (token, KV head) of the INT2 loop: an H200 SM issues 4 per clock, and
reading one token-head of a d = 128 INT2 row (K and V, 72 B) at the copy bandwidth leaves ≈ 6 issue slots per SM, so
a loop above that cannot reach the bandwidth floor whatever its memory pipeline does. Shared memory per program is
printed too (a kernel above 227 KiB does not launch). Usage:
    python -m benchmarks.experiments.kernel_sass [--shape 32,8,128] [--block-n 64] [--warps 1] [--stages 3]
        [--key-block 128] [--key-bits 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
from collections import Counter
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from oscar_zoo.format import layout
from oscar_zoo.runtime import config, dispatch, ops
from oscar_zoo.runtime.kernels import KernelTable, decode


def _specialise(fn, values: dict, constexprs: dict):
    """Signature and attributes as the JIT builds them: pointers 16-byte aligned, integers equal to 1 become
    constants, integers divisible by 16 get that divisibility."""
    sig, attrs, consts = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        v = values[name]
        if isinstance(v, torch.Tensor):
            sig[name] = "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                               torch.uint8: "u8", torch.int8: "i8", torch.int32: "i32"}[v.dtype]  # fmt: skip
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v == 1:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)


def compile_decode(H_q: int, H_kv: int, D: int, context: int, batch: int = 1, group_size: int = 0,
                   key_block: int = 0, key_bits: int = layout.BITS):
    """The decode kernel as `ops.tiered_decode_attention` would launch it on an H200 (132 SMs) for this shape
    (`key_block` > 0: keys per channel over blocks of that many tokens; `key_bits`: the history keys' code width)."""
    captured = {}

    class Grab:  # stands in for the kernel: records the launch arguments instead of running
        def __getitem__(self, grid):
            return lambda *args, **kw: captured.update(args=args, kw=kw, grid=grid)

    hist = context - layout.SINK - layout.RECENT
    if key_block:
        hist = hist // key_block * key_block  # the history holds whole blocks
    NG = D // layout.resolve_group_size(D, group_size)
    cuda = torch.device("cuda", 0)
    q = torch.empty(batch, H_q, D, dtype=torch.bfloat16)
    tiers = dict(
        sink=(torch.empty(batch, H_kv, layout.SINK, D, dtype=torch.bfloat16),) * 2
             + (torch.empty(batch, dtype=torch.int32),),
        hist=(layout.history_codes(batch, H_kv, hist, D, "cpu", bits=key_bits),
              torch.empty(batch, H_kv, hist // key_block, D, 2, dtype=torch.float16) if key_block
              else torch.empty(batch, H_kv, hist, NG, 2, dtype=torch.float16),
              layout.history_codes(batch, H_kv, hist, D, "cpu", tokens_contiguous=True),
              torch.empty(batch, H_kv, hist, NG, 2, dtype=torch.float16),
              torch.empty(batch, dtype=torch.int32)),
        recent=(torch.empty(batch, H_kv, layout.RECENT + layout.FLUSH, D, dtype=torch.bfloat16),) * 2
               + (torch.empty(batch, dtype=torch.int32),),
    )  # fmt: skip
    # the launch on CPU tensors as an H100/H200 (132 SMs, sm_90) makes it, captured by a stand-in for the kernel
    skip = type("Skip", (), {"__getitem__": lambda self, grid: lambda *a, **k: None})()  # the block-query prepass
    table = dataclasses.replace(KernelTable(*(None,) * 8), decode=Grab(), block_query=skip)
    with dispatch.stand_in(dispatch.StandIn(table, sm_count=132)):
        s_hist = ops.int2_splits(batch, H_kv, H_q // H_kv, D, hist, cuda)
        s_sink, s_recent = ops.bf16_splits(layout.SINK, cuda), ops.bf16_splits(layout.RECENT + layout.FLUSH, cuda)
        S = s_sink + s_hist + s_recent
        o, lse = torch.empty(batch, H_q, S, D), torch.empty(batch, H_q, S)
        ops.launch_decode(q, o, lse, D**-0.5, sink=tiers["sink"], hist=tiers["hist"], recent=tiers["recent"],
                          s_sink=s_sink, s_hist=s_hist, s_recent=s_recent, key_block=key_block)  # fmt: skip
    kw = dict(captured["kw"])
    warps, maxnreg = kw.pop("num_warps"), kw.pop("maxnreg")
    kw.pop("launch_pdl")
    fn = decode._decode_kernel
    values = dict(zip([n for n in fn.arg_names if n not in kw], captured["args"]))
    src = _specialise(fn, values, kw)
    options = dict(num_warps=warps, maxnreg=maxnreg)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options), kw, warps


def _cuobjdump(cubin: bytes, tmp: Path, flag: str) -> str:
    path = tmp / "decode.cubin"
    path.write_bytes(cubin)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), flag, str(path)], capture_output=True, text=True, check=True).stdout


def resources(cubin: bytes, tmp: Path) -> dict:
    """Registers per thread and stack bytes per thread (where register spills go), as the driver will see them: the
    registers bound how many programs an SM holds at once (65,536 per SM)."""
    out = _cuobjdump(cubin, tmp, "-res-usage")
    return dict(registers=int(re.search(r"REG:(\d+)", out).group(1)),
                stack=int(re.search(r"STACK:(\d+)", out).group(1)))


def loops(cubin: bytes, tmp: Path) -> list[tuple[int, Counter, int, Counter]]:
    """(instruction count, opcode counts, skippable instructions, lead-in opcode counts) of every loop in the SASS. A
    loop is a strongly connected set of basic blocks (so a block the compiler placed out of line, e.g. the lazy
    softmax's rescale, counts with its loop, and a back-edge that only returns from such a block is not a loop of its
    own). Skippable: the loop's instructions in blocks that some trip around the loop can avoid (they do not dominate
    every back-edge), e.g. that rarely taken rescale; the rest is the common path. Lead-in: the instructions laid out
    between the previous path's unconditional EXIT and the loop, i.e. what a program of this branch runs once before
    its first tile (q's operands, the pipeline's first loads)."""
    sass = _cuobjdump(cubin, tmp, "-sass")
    ins = []  # (address, opcode, operands, predicated)
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4), m.group(2) is not None and "PT" not in m.group(2)))
    index = {a: i for i, (a, *_) in enumerate(ins)}
    target = {}
    for i, (_, op, rest, _) in enumerate(ins):
        t = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) in index:
            target[i] = index[int(t.group(1), 16)]
    ends = {i for i, (_, op, _, _) in enumerate(ins) if op.startswith(("BRA", "EXIT", "RET"))}
    leaders = sorted({0} | set(target.values()) | {i + 1 for i in ends if i + 1 < len(ins)})
    blocks = [(lo, hi) for lo, hi in zip(leaders, leaders[1:] + [len(ins)])]  # [lo, hi) instruction indices
    block_of = {lo: k for k, (lo, _) in enumerate(blocks)}
    succ = []
    for lo, hi in blocks:
        last, nxt = hi - 1, {block_of[hi]} if hi < len(ins) else set()
        op, pred = ins[last][1], ins[last][3]
        if last in target:
            succ.append({block_of[target[last]]} | (nxt if pred else set()))
        elif op.startswith(("EXIT", "RET")) and not pred:
            succ.append(set())
        else:
            succ.append(nxt)

    def reach(k):
        seen, todo = set(), [k]
        while todo:
            for n in succ[todo.pop()]:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    reaches = [reach(k) for k in range(len(blocks))]
    found, done = [], set()
    for k in range(len(blocks)):
        if k in done or k not in reaches[k]:
            continue
        scc = {j for j in reaches[k] if k in reaches[j]}
        done |= scc
        if len(scc) == 1 and blocks[k][1] - blocks[k][0] == 1:
            continue  # the trailing `BRA self` after EXIT
        header = min(scc, key=lambda j: (not any(j in succ[i] for i in range(len(blocks)) if i not in scc), j))
        dom = {j: set(scc) for j in scc}  # dominators inside the loop, from its header
        dom[header] = {header}
        changed = True
        while changed:
            changed = False
            for j in scc - {header}:
                preds = [i for i in scc if j in succ[i]]
                new = {j} | set.intersection(*(dom[i] for i in preds)) if preds else {j}
                if new != dom[j]:
                    dom[j], changed = new, True
        latches = [j for j in scc if header in succ[j]]
        common = set.intersection(*(dom[j] for j in latches))
        body = [ins[i][1].split(".")[0] for j in scc for i in range(*blocks[j])]
        skip = sum(blocks[j][1] - blocks[j][0] for j in scc - common)
        first = lead = min(blocks[j][0] for j in scc)
        while lead > 0 and not (ins[lead - 1][1].startswith(("EXIT", "RET")) and not ins[lead - 1][3]):
            lead -= 1
        found.append((len(body), Counter(body), skip, Counter(ins[i][1].split(".")[0] for i in range(lead, first))))
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="32,8,128", help="H_q,H_kv,D")
    ap.add_argument("--context", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block-n", type=int)
    ap.add_argument("--warps", type=int)
    ap.add_argument("--maxnreg", type=int, help="register cap (0: none)")
    ap.add_argument("--stages", type=int, help="software-pipeline depth of the INT2 loop")
    ap.add_argument("--slack", type=float, help="DecodeConfig.rescale_slack (0: rescale whenever a maximum grows)")
    ap.add_argument("--group-size", type=int, default=0, help="scale/zero group (0: one per row)")
    ap.add_argument("--key-block", type=int, default=0, help="keys per channel over blocks of this many tokens")
    ap.add_argument("--key-bits", type=int, default=layout.BITS, choices=layout.KEY_BITS, help="the history keys' bits")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    args = ap.parse_args()
    H_q, H_kv, D = (int(x) for x in args.shape.split(","))
    if args.key_block and (args.key_block not in layout.KEY_BLOCKS or args.group_size not in (0, D)):
        ap.error(f"--key-block must be one of {layout.KEY_BLOCKS} with per-row value scales (--group-size 0)")
    cfg = ops.decode_config(D)
    cfg = dataclasses.replace(cfg, block_n=args.block_n or cfg.block_n,
                              warps=args.warps or cfg.warps, stages=args.stages or cfg.stages,
                              maxnreg=cfg.maxnreg if args.maxnreg is None else args.maxnreg or None,
                              rescale_slack=cfg.rescale_slack if args.slack is None else args.slack)  # fmt: skip
    import tempfile

    with config.use(dataclasses.replace(config.current(), decode_64=cfg, decode_128=cfg)):
        compiled, kw, warps = compile_decode(H_q, H_kv, D, args.context, args.batch, args.group_size,
                                               args.key_block, args.key_bits)
    with tempfile.TemporaryDirectory() as tmp:
        found = loops(compiled.asm["cubin"], Path(tmp))
        res = resources(compiled.asm["cubin"], Path(tmp))
    # the INT2 loop: the one with the byte-permute unpack (the BF16 tiers' loop has none; at d = 256 it is the longer)
    int2 = max(found, key=lambda f: (f[1].get("PRMT", 0), f[1].get("HMMA", 0) > 0, f[0]))
    per = (int2[0] - int2[2]) * warps / kw["BLOCK_N"]  # the common path: without the skippable rescale
    if args.json:
        print(json.dumps(dict(triton=triton.__version__, shared=compiled.metadata.shared, warps=warps, GP=kw["GP"],
                              BLOCK_N=kw["BLOCK_N"], loop_instructions=int2[0], skippable=int2[2],
                              per_token_head=per, ops=dict(int2[1]), lead_in=int2[3].total(),
                              lead_in_ops=dict(int2[3]), **res)))  # fmt: skip
        return
    print(f"triton {triton.__version__}, sm_90, {H_q}/{H_kv} heads d={D}: one KV head per program, "
          f"GP {kw['GP']}, BLOCK_N {kw['BLOCK_N']}, {warps} warps, shared {compiled.metadata.shared} B, "
          f"{res['registers']} registers/thread, {res['stack']} B stack (spills)/thread")
    print(f"INT2 loop: {int2[0]} instructions per warp per tile, {int2[2]} of them skippable (the lazy rescale) → "
          f"{per:.1f} warp instructions per token-head on the common path")
    print("  " + ", ".join(f"{op} {n}" for op, n in int2[1].most_common(12)))
    print(f"before it, once per program (the INT2 branch's entry to the first tile): {int2[3].total()} instructions")
    print("  " + ", ".join(f"{op} {n}" for op, n in int2[3].most_common(12)))


if __name__ == "__main__":
    main()
