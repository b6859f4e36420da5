"""Probe (GPU): which experts implementation a Qwen3-MoE decode step can be captured with, and what each costs.

graph.STATIC_EXPERTS ("batched_mm") gathers each token's routed experts' weights before its matmul, so a step reads the
routed weights about three times; a grouped GEMM ("grouped_mm") reads them once but may read the routing back to the
host. Per implementation, a random-weight model of Qwen3-30B-A3B's layer shapes (`--layers` decoder layers, bfloat16)
prefills a `--context`-token prompt into an OscarCache and runs `--steps` teacher-forced decode steps through
`generate()`'s graph path (DecodeGraphs; compiled layers or not): whether the step was captured (replays), the largest
logit difference from the eager step with the model's own experts (relative to the largest logit), and ms per replayed
step (CUDA events over the steps after the first 16).

    python3 -m benchmarks.experiments.probe_moe_experts [--layers 4] [--context 1024] [--steps 64]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from oscar_zoo.runtime import graph
from oscar_zoo.runtime.attention import enable_oscar
from tests.runtime.test_static_step import _cache


def _model(layers: int) -> torch.nn.Module:
    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=layers,
                               num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                               num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                               max_position_embeddings=40960, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


@torch.no_grad()
def _run(model, ids: torch.Tensor, prompt: int, mode: str,
         experts: str = graph.STATIC_EXPERTS) -> tuple[torch.Tensor, float, int]:
    """mode: eager (the model's own experts, no graph) or graph / compiled (DecodeGraphs, its static steps' experts as
    `experts`). Logits [steps, V] fp32, ms per step over the steps after the first 16, replays."""
    enable_oscar(model, compile=mode == "compiled")
    if mode != "eager":
        graph.decode_graphs(model).experts = experts
    cfg = model.config
    cache = _cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    forward = model if mode == "eager" else graph.decode_graphs(model)
    out = [model(ids[:, :prompt], past_key_values=cache).logits[:, -1]]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for t in range(prompt, ids.shape[1]):
        if t == prompt + 16:
            start.record()
        out.append(forward(input_ids=ids[:, t : t + 1], use_cache=True, past_key_values=cache).logits[:, -1])
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / (ids.shape[1] - prompt - 16)
    return torch.stack(out, 1)[0].float(), ms, 0 if mode == "eager" else graph.decode_graphs(model).replays


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--impls", nargs="+", default=["batched_mm", "grouped_mm"])
    args = p.parse_args()
    model = _model(args.layers)
    ids = torch.randint(0, 151936, (1, args.context + args.steps), generator=torch.Generator().manual_seed(2)).cuda()
    eager, eager_ms, _ = _run(model, ids, args.context, "eager")
    rows = [("(the model's own, eager)", "eager", 0.0, eager_ms, 0)]
    for impl in args.impls:
        for mode in ("graph", "compiled"):
            try:
                got, ms, replays = _run(model, ids, args.context, mode, impl)
            except Exception as e:  # noqa: BLE001 - a probe: the failure is the finding, printed
                print(f"{impl} {mode}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                rows.append((impl, mode, float("nan"), float("nan"), -1))
                continue
            err = ((got - eager).abs().max() / eager.abs().max()).item()
            rows.append((impl, mode, err, ms, replays))
            print(f"{impl} {mode}: max rel err {err:.2e}, {ms:.3f} ms/step, {replays} replays", flush=True)
    print(f"| experts in the static step | step | max rel err vs eager | ms/step ({args.layers} layers, "
          f"{args.context} tokens) | replays |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| {} | {} | {:.2e} | {:.3f} | {} |".format(*row))


if __name__ == "__main__":
    main()
