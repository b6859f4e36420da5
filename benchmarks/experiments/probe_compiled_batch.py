"""Probe (GPU): compiled decoder layers against the eager step at several batch sizes, with programmatic dependent
launch on and off, both without a CUDA graph ("compiled") and replayed ("graph"): per setting, the largest logit
difference (relative to the largest logit) over 60 teacher-forced steps after a 330-token prompt. Run it with
TORCH_LOGS=graph_breaks,recompiles to see dynamo's breaks (how the batch > 1 fault was found:
benchmarks/notes/2026-12-04-compiled-decode-step.md).

    python3 -m benchmarks.experiments.probe_compiled_batch [--archs qwen3] [--batches 1 3 8] [--layers 12]

Any architecture of tests/runtime/test_compiled_step.py runs (2 layers, SmolLM2's attention shape); `--force-compile`
compiles one that `compiled.COMPILED_TYPES` leaves out, to check it before admitting it. (Gemma2's "compiled" row is its
compiled layers without a graph, 1.8e-6 on the H200; its "graph" row is the eager step since its steps are never
captured, graph.py; how its captured step was found 11 % off: benchmarks/notes/2026-12-05-moe-and-gemma2-captured.md.)
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from oscar_zoo.runtime import compiled, config
from oscar_zoo.runtime.attention import enable_oscar
from oscar_zoo.runtime.graph import decode_graphs, static_experts
from tests.runtime.test_compiled_step import ARCH_TYPES, _arch
from tests.runtime.test_static_step import _cache, _llama, _qwen3


def _model(arch: str, device: str, layers: int | None) -> torch.nn.Module:
    if arch not in ("qwen3", "llama"):
        return enable_oscar(_arch(arch, device))
    model = _qwen3(device) if arch == "qwen3" else _llama(device=device)
    if layers is not None:  # the same shapes, more layers (a fresh random model)
        cfg = model.config.to_dict()
        cfg.update(num_hidden_layers=layers, layer_types=None)
        torch.manual_seed(0)
        model = type(model)(type(model.config)(**cfg)).to(device=device)
        model.generation_config.eos_token_id = None
    return enable_oscar(model.float().eval())


@torch.no_grad()
def _run(model, B: int, mode: str) -> torch.Tensor:
    """mode: eager (no graph, eager layers), compiled (compiled layers, no graph), graph (compiled layers replayed)."""
    cfg = model.config
    enable_oscar(model, compile=mode != "eager")
    cache = _cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    ids = torch.randint(0, cfg.vocab_size, (B, 390), generator=torch.Generator().manual_seed(2)).to(model.device)
    out = [model(ids[:, :330], past_key_values=cache).logits[:, -1]]
    for t in range(330, 390):
        kw = {"input_ids": ids[:, t : t + 1], "use_cache": True, "past_key_values": cache}
        if mode == "graph":
            out.append(decode_graphs(model)(**kw).logits[:, -1])
        elif mode == "compiled":
            with static_experts(model), decode_graphs(model).compiled.step(cache):
                out.append(model(**kw).logits[:, -1])
        else:
            out.append(model(**kw).logits[:, -1])
    return torch.stack(out, 1).float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", nargs="+", default=["qwen3", "llama"], choices=ARCH_TYPES,
                   help="qwen3 / llama: the tests' Qwen3-8B and SmolLM2 shapes (--layers applies); others: _arch's")
    p.add_argument("--force-compile", action="store_true", help="compile --archs even outside COMPILED_TYPES")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 3, 8])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the test models' 4 / 2)")
    p.add_argument("--pdl", nargs="+", type=int, default=[1, 0], choices=[0, 1])
    args = p.parse_args()
    rows = []
    for arch in args.archs:
        model = _model(arch, args.device, args.layers)
        if args.force_compile:
            decode_graphs(model).compiled.types = compiled.COMPILED_TYPES | set(args.archs)
        for B in args.batches:
            eager = _run(model, B, "eager")
            for pdl in map(bool, args.pdl):
                for mode in ("compiled", "graph"):
                    with config.use(dataclasses.replace(config.current(), pdl=pdl)):
                        got = _run(model, B, mode)
                    diff = (got - eager).abs()
                    err = (diff.max() / eager.abs().max()).item()
                    bad = (diff.amax(dim=(0, 2)) > 1e-2 * eager.abs().max()).nonzero()
                    first = int(bad[0]) if len(bad) else -1
                    rows.append((arch, B, pdl, mode, err, first))
                    print(f"{arch} B={B} pdl={pdl} {mode}: max rel err {err:.2e}, first bad step {first}", flush=True)
    print("| arch | batch | PDL | mode | max rel err | first step over 1 % |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| {} | {} | {} | {} | {:.2e} | {} |".format(*row))


if __name__ == "__main__":
    main()
