"""The compiled decode step (runtime/compiled.py): decoder layers compiled by inductor around one opaque custom op per
layer that files the token and attends over the tiers. On CPU inductor compiles C++ and the op runs the reference
ops; the GPU copies check generate()'s compiled CUDA-graph replay against the eager path (marked gpu)."""

from __future__ import annotations

import contextlib
import inspect
import os

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessorList

from oscar_zoo.format import layout
from oscar_zoo.runtime import compiled, graph
from oscar_zoo.runtime.attention import enable_oscar
from oscar_zoo.runtime.compiled import CompiledLayers
from oscar_zoo.runtime.graph import ROUTED_TYPES, decode_graphs, static_experts

from .test_static_step import D, _cache, _llama, _qwen3

ARCH_TYPES = ("gemma", "gemma2", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe")  # models.ARCHITECTURES, spelled
# out for the parametrization (checked against it below)
ARCH_EXTRA = {"gemma2": {"final_logit_softcapping": None}, "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2,
                                                                      "moe_intermediate_size": 96}}


@pytest.fixture(autouse=True)
def _avx2_vectors():
    """With torch forced to its AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, how the suite is run as a CPU without native
    bfloat16), inductor's CPU code at its default vector width gave NaN from the first compiled step (measured; at
    256-bit vectors or none it matches the eager step to 1e-5). The product compiles only on GPUs (graph.py): the CPU
    tests here check the op around inductor, so they compile at AVX2's width there."""
    if os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        yield
        return
    import torch._inductor.config

    with torch._inductor.config.patch({"cpp.simdlen": 256}):
        yield


@torch.no_grad()
def _teacher_forced(model, cache, ids, prompt: int, layers: CompiledLayers | None) -> torch.Tensor:
    """Prefill ids[:, :prompt] eagerly, then one token at a time (through `layers` and the static step's experts, as
    DecodeGraphs runs a step, when given); logits [B, steps, V]."""
    out = [model(ids[:, :prompt], cache=cache).logits[:, -1]]
    for t in range(prompt, ids.shape[1]):
        if layers is None:
            out.append(model(ids[:, t : t + 1], cache=cache).logits[:, -1])
        else:
            with static_experts(model), layers.step(cache):
                out.append(model(ids[:, t : t + 1], cache=cache).logits[:, -1])
    return torch.stack(out, 1)


def test_compiled_layers_equal_the_eager_step_across_demotions():
    """A float32 Llama-shaped model, batch 2: 40 decode steps after a 330-token prompt (5 demotions of 8 rows) give
    the eager path's logits to float32 round-off, one graph serves both layers (no recompilation from layer to layer,
    step to step or at a demotion step), and the history grew by exactly the demoted rows (the op filed every token
    once)."""
    model = enable_oscar(_llama(layers=2, dtype=torch.float32))
    ids = torch.randint(0, 512, (2, 370), generator=torch.Generator().manual_seed(1))
    eager_cache, compiled_cache = _cache(2), _cache(2)
    want = _teacher_forced(model, eager_cache, ids, 330, None)
    layers = CompiledLayers(model)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    got = _teacher_forced(model, compiled_cache, ids, 330, layers)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # one graph for both layers, whatever the step
    assert sum(counters["graph_break"].values()) == breaks
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-4 * scale  # fused reductions round differently (1.2e-5 at AVX2 width)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    n_hist = 330 - layout.SINK - layout.RECENT + 40  # 40 decode tokens: 5 demotions of 8
    assert compiled_cache.layers[1].n_hist == eager_cache.layers[1].n_hist == n_hist
    assert not layers.binding().stepping and all("forward" not in m.__dict__ for m in layers.layers)  # restored on exit


def test_batch_shapes_past_dynamos_recompile_limit_stay_compiled(monkeypatch):
    """Each batch shape is one dynamo entry on the layer class's forward. With dynamo's limit at 1, a second shape would
    run that frame eagerly inside the step, and the eager update would refuse (check_filing): the step raises the limit
    for its layers, so batch 1 then batch 2 both give the eager logits. Past MAX_SHAPES, new shapes run eager layers."""
    model = enable_oscar(_llama(layers=2, dtype=torch.float32))
    layers = CompiledLayers(model)
    for B in (1, 2):
        ids = torch.randint(0, 512, (B, 333), generator=torch.Generator().manual_seed(B))
        want = _teacher_forced(model, _cache(2), ids, 330, None)
        with torch._dynamo.config.patch(recompile_limit=1):  # (monkeypatch would delete the config entry on undo)
            got = _teacher_forced(model, _cache(2), ids, 330, layers)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    monkeypatch.setattr(CompiledLayers, "MAX_SHAPES", 2)
    assert layers.admit((1, 1)) and layers.admit((2, 1)) and layers.admit((1, 1)) and not layers.admit((3, 1))


@pytest.mark.parametrize("model_type", sorted(compiled.COMPILED_TYPES - {"llama"}))  # Llama: the tests above
def test_every_compiled_architecture_compiles_to_its_eager_step(model_type):
    """Every other architecture whose step is compiled, float32, batch 2: 17 decode steps after a 330-token prompt (two
    demotions) through the compiled layers give the eager step's logits to 1e-4 of the largest, with no graph break in
    a decoder layer. A break is where a host read sits, which a CUDA graph cannot hold: Qwen3-MoE's own "eager" experts
    break twice per layer at `nonzero()` (measured; the model is set to them here: its default on this machine,
    "grouped_mm", hides its host read in an opaque op), so its static step runs graph.STATIC_EXPERTS, and the model's
    own experts are back after the step."""
    model = enable_oscar(_arch(model_type, "cpu"))
    own = None
    if model_type in ROUTED_TYPES:
        model.set_experts_implementation("eager")
        own = model.get_experts_implementation()
    ids = torch.randint(0, 512, (2, 347), generator=torch.Generator().manual_seed(1))
    want = _teacher_forced(model, _cache(2), ids, 330, None)
    breaks = sum(counters["graph_break"].values())
    got = _teacher_forced(model, _cache(2), ids, 330, CompiledLayers(model))
    assert sum(counters["graph_break"].values()) == breaks
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    if own is not None:
        assert model.get_experts_implementation() == own != {"": graph.STATIC_EXPERTS}


# ATen ops whose CUDA kernels hand a device value to the host (what a CUDA graph capture refuses)
_HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "repeat_interleave.Tensor", "bincount"}


def test_static_experts_read_nothing_back_to_the_host():
    """Qwen3-MoE's expert block at decode shape (batch 3, one token), run as a static step runs it: no ATen op that
    reads a device value on the host, and the block's output equals its float64 definition (softmax router, the top
    2 weighted by their probabilities, not renormalised: Qwen3-MoE's default; each chosen expert's SiLU-gated MLP).
    Its own "eager" experts do read the routing back (`nonzero`: the check can fail)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.name().split("::")[1])  # "nonzero", "repeat_interleave.Tensor", ...
            return func(*args, **(kwargs or {}))

    model = _arch("qwen3_moe", "cpu")
    block = model.model.layers[0].mlp
    x = torch.randn(3, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    reads = {}
    for own in ("eager", None):
        if own:
            model.set_experts_implementation(own)
        seen: set[str] = set()
        with static_experts(model) if own is None else contextlib.nullcontext(), Ops(), torch.no_grad():
            out = block(x)
        reads[own] = seen & _HOST_READS
    assert reads["eager"] and not reads[None], reads
    w = {n: p.double() for n, p in block.named_parameters()}
    h = x.double().reshape(3, -1)
    probs = torch.softmax(h @ w["gate.weight"].T, -1)
    assert not model.config.norm_topk_prob
    top, idx = probs.topk(2, -1)
    want = torch.zeros_like(h)
    for t in range(3):
        for j in range(2):
            gate, up = (w["experts.gate_up_proj"][idx[t, j]] @ h[t]).chunk(2)
            want[t] += top[t, j] * (w["experts.down_proj"][idx[t, j]] @ (torch.nn.functional.silu(gate) * up))
    assert (out.double().reshape(3, -1) - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_token_filed_outside_the_op_is_refused_and_hooked_layers_are_not_compiled():
    """Inside a compiled step only the op files tokens: an eager `update` there (what a graph break in the layer
    would run, before the op files the same token again) raises instead of giving wrong logits. A layer with a
    forward of its own (accelerate's hooks) makes the model's layers not compiled, and the forward is kept."""
    model = enable_oscar(_llama(layers=2, dtype=torch.float32))
    cache = _cache(2)
    with torch.no_grad():
        model(torch.randint(0, 512, (1, 330)), cache=cache)
    k = torch.randn(1, 3, 1, 64)
    layers = CompiledLayers(model)
    with pytest.raises(RuntimeError, match="outside its custom op"), layers.step(cache):
        cache.update(k, k.clone(), 0)
    assert not layers.binding().stepping and all("forward" not in m.__dict__ for m in layers.layers)
    hooked = model.model.layers[1]
    hooked.forward = hooked.forward  # an instance forward, as accelerate's add_hook_to_module sets
    assert not layers.usable()
    with pytest.raises(RuntimeError, match="not compiled"), layers.step(cache):
        pass
    assert "forward" in hooked.__dict__


def test_decode_attention_op_schema_and_fake_tensor():
    """torch.library.opcheck: the op declares no input mutation and really mutates none, and its fake implementation
    gives the real output's shape, dtype and strides."""
    model = enable_oscar(_llama(layers=2, dtype=torch.float32))
    cache = _cache(2)
    with torch.no_grad():
        model(torch.randint(0, 512, (1, 330)), cache=cache)  # windows full: a decode step files one token
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 1, 64, generator=g) for h in (9, 3, 3))
    with CompiledLayers(model).step(cache) as step, torch.no_grad():
        step.module = model.model.layers[0].self_attn  # the layer a compiled forward would set
        torch.library.opcheck(torch.ops.oscar_zoo.decode_attention.default, (q, k, v, 0.125, None, None),
                              test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------------------- GPU


class _Follow:
    """A logits processor that makes generate() pick another run's greedy tokens (`tokens` [B, steps], after a
    `prompt`-token prompt) whatever its own logits say, so both runs extend the same history and their raw logits
    (`output_logits`, taken before processors) compare at every step, past any near-tie."""

    def __init__(self, tokens: torch.Tensor, prompt: int):
        self.tokens, self.prompt = tokens, prompt

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        token = self.tokens[:, input_ids.shape[1] - self.prompt, None]
        return torch.full_like(scores, -torch.inf).scatter_(1, token, 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize(("arch", "B"), [("qwen3", 1), ("llama", 1), ("qwen3", 3), ("llama", 3)])
def test_generate_compiled_replay_equals_eager_and_uncompiled(arch, B):
    """generate() on a GPU (float32): 220 greedy tokens from a 400-token prompt (27 demotions). The uncompiled graph
    step equals the eager path bit for bit, tokens and logits. The compiled step follows the eager run's tokens
    (`_Follow`) and its logits stay within 1 % of their largest at every step. Not bit for bit: inductor's fused
    reductions round differently, and a last-bit difference in a key can move it across an INT2 level, which moves
    that step's logits by far more than the round-off (a misfiled token moves every later step's by tens of percent).
    Free-running, the compiled tokens would leave the eager ones at the first near-tie (measured: a top-2 margin of
    1.4e-5 of the largest logit, against round-off differences of 2.8e-4), and nothing after it would compare."""
    model = _qwen3("cuda") if arch == "qwen3" else _llama(device="cuda")
    model = enable_oscar(model.float())
    cfg = model.config
    L, H, Dh = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    ids = torch.randint(0, cfg.vocab_size, (B, 400), generator=torch.Generator().manual_seed(0)).cuda()
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    runs = {}
    for mode in ("eager", "graph", "compiled"):
        enable_oscar(model, compile=mode == "compiled")
        cache = _cache(L, H, Dh)
        follow = [_Follow(runs["eager"][0][:, ids.shape[1]:], ids.shape[1])] if mode == "compiled" else None
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=220, do_sample=False,
                             disable_compile=mode == "eager", output_logits=True, return_dict_in_generate=True,
                             logits_processor=LogitsProcessorList(follow or []), **{cache_kw: cache})  # fmt: skip
        runs[mode] = (out.sequences, torch.stack(out.logits, 1).float())
        if mode != "eager":
            assert decode_graphs(model).replays >= 210
    assert torch.equal(runs["graph"][0], runs["eager"][0]) and torch.equal(runs["graph"][1], runs["eager"][1])
    assert torch.equal(runs["compiled"][0], runs["eager"][0])  # it followed
    diff = (runs["compiled"][1] - runs["eager"][1]).abs().amax(-1)  # [B, steps]
    scale = runs["eager"][1].abs().max()
    assert diff.max() <= 1e-2 * scale, f"step {int(diff.amax(0).argmax())}: {float(diff.max() / scale):.2e}"


def test_the_gpu_architecture_list_is_every_supported_architecture():
    from oscar_zoo.models import ARCHITECTURES

    assert ARCH_TYPES == tuple(sorted(ARCHITECTURES))


def _arch(model_type: str, device: str = "cuda", **config) -> torch.nn.Module:
    """A random 2-layer model of `model_type` with SmolLM2's attention shape (9 q / 3 kv heads, head_dim 64), float32
    (`config`: other settings). Loaded with "sdpa" attention ("eager" for Gemma2, whose attention softcap transformers
    5.25 refuses on sdpa); enable_oscar replaces either."""
    cfg = AutoConfig.for_model(model_type, vocab_size=512, hidden_size=144, intermediate_size=288,
                               num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=D,
                               max_position_embeddings=2048, initializer_range=0.1,
                               **{**ARCH_EXTRA.get(model_type, {}), **config})
    torch.manual_seed(0)
    attn = "eager" if model_type == "gemma2" else "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(device=device, dtype=torch.float32)
    return model.eval()


@pytest.mark.gpu
@pytest.mark.parametrize(("model_type", "dtype"), [(t, torch.float32) for t in ARCH_TYPES]
                         + [("qwen3", torch.bfloat16), ("llama", torch.bfloat16)])
def test_every_supported_architecture_compiles_and_replays_as_eager(model_type, dtype):
    """Every architecture models.py supports: 60 teacher-forced decode steps (7 demotions) at batch 1 through
    DecodeGraphs, captured and replayed, compiled and not. The compiled step gives the eager path's logits within 1 %
    of their largest (float32; 5 % in bfloat16, whose logits alone round at 0.4 %; test above: why not bit for bit),
    and so does the uncompiled capture (Qwen3-MoE's static step runs other experts than its eager one,
    graph.STATIC_EXPERTS; the generate() test below holds the others' capture to bit for bit). Gemma2's logit softcap
    runs inside the decode kernel (before this, its decode read the tiers densely at the host's lengths, and a captured
    step was 11 % of the largest logit off on the H200)."""
    model = enable_oscar(_arch(model_type).to(dtype))
    ids = torch.randint(0, 512, (1, 390), generator=torch.Generator().manual_seed(2)).cuda()
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    runs, breaks = [], sum(counters["graph_break"].values())
    for mode in ("eager", "graph", "compiled"):
        enable_oscar(model, compile=mode == "compiled")
        cache = _cache(2)
        forward = model if mode == "eager" else decode_graphs(model)
        with torch.no_grad():
            out = [model(ids[:, :330], **{cache_kw: cache}).logits[:, -1]]
            for t in range(330, 390):
                out.append(forward(input_ids=ids[:, t : t + 1], use_cache=True, **{cache_kw: cache}).logits[:, -1])
        runs.append(torch.stack(out, 1).float())
    assert decode_graphs(model).replays >= 50
    # no graph break: with one, each layer's attention compiles as a frame of its own, per layer index, and past
    # dynamo's recompile limit (8) runs eagerly
    assert sum(counters["graph_break"].values()) == breaks
    tol = 1e-2 if dtype == torch.float32 else 5e-2
    assert model_type in compiled.COMPILED_TYPES  # every captured architecture runs compiled layers
    for run in runs[1:]:
        assert (run - runs[0]).abs().max() <= tol * runs[0].abs().max()


@pytest.mark.gpu
def test_gemma2_softcap_steps_replay_as_eager_and_a_sliding_window_is_not_passed():
    """Gemma2 with a logit softcap of 2 (random weights' logits are small: at Gemma2's 50 the cap would hardly bend
    them) and centred tiers (each logit gets q·μ_K·M_K back before the cap): generate() of 200 tokens after a
    400-token prompt replays captured steps (compiled layers and not) that give the eager run's tokens and logits,
    the uncompiled capture bit for bit. With a sliding window of 480 tokens, generate() past it raises the eager
    path's error from the graph path too (a replay would attend past the window without a word)."""
    model = enable_oscar(_arch("gemma2", attn_logit_softcapping=2.0))
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 512, (2, 400), generator=torch.Generator().manual_seed(4)).cuda()
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, output_logits=True, return_dict_in_generate=True)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    runs = {}
    for mode in ("eager", "graph", "compiled"):
        enable_oscar(model, compile=mode == "compiled")
        follow = [_Follow(runs["eager"][0][:, ids.shape[1]:], ids.shape[1])] if mode == "compiled" else []
        out = model.generate(ids, max_new_tokens=200, disable_compile=mode == "eager",
                             logits_processor=LogitsProcessorList(follow), **kw,
                             **{cache_kw: _cache(2, centred=True)})  # fmt: skip
        runs[mode] = (out.sequences, torch.stack(out.logits, 1).float())
        if mode != "eager":
            assert decode_graphs(model).replays >= 190
    assert torch.equal(runs["graph"][0], runs["eager"][0]) and torch.equal(runs["graph"][1], runs["eager"][1])
    scale = runs["eager"][1].abs().max()
    assert torch.equal(runs["compiled"][0], runs["eager"][0])
    assert (runs["compiled"][1] - runs["eager"][1]).abs().max() <= 1e-2 * scale

    model = enable_oscar(_arch("gemma2", sliding_window=480))
    model.generation_config.eos_token_id = None
    for mode in ("eager", "graph"):
        enable_oscar(model, compile=False)
        with pytest.raises(NotImplementedError, match="sliding-window layer"):
            model.generate(ids, max_new_tokens=120, disable_compile=mode == "eager", **kw,
                           **{cache_kw: _cache(2)})  # fmt: skip
