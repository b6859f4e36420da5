"""A compiled decode step: the model's own work (norms, projections, RoPE, MLP, residuals) fused by inductor
(`torch.compile`) around the OSCAR work, which runs as one opaque custom op per layer.

`oscar_zoo::decode_attention(query, key, value, scaling, softcap, sliding_window)` is the whole cache side of one
layer's decode step — filing the token (`OscarCache.update`: rotation, tier write, the every-`flush`-steps demotion)
and the tiered attention (q·M_K, the INT2 decode and merge, o·M_Vᵀ) — exactly as the eager step runs it. Dynamo never
traces into it: its host-side state (the length mirror, the demotion schedule) stays Python. The op reads the cache and
the layer from the step that is running (`CompiledLayers.step`, through the model's `binding.OscarBinding`: a context
manager that restores on exit, so nothing lives past the step), not from its arguments, so one compiled graph serves
every layer of a model. While a step traces, `OscarCache.update` and the binding hook step aside
(`OscarBinding.stepping`), and the "oscar" attention function hands its arguments to the op, which runs the binding's
attention function eagerly.

Compilation is `dynamic=False`: one graph per layer class and batch shape; the tier lengths live on the device, so a
later step or a demotion step reuses it. `graph.DecodeGraphs` runs the warm-up step and the capture through
`CompiledLayers.step`, so the compiled kernels are what the CUDA graph replays (the model types of `COMPILED_TYPES`,
up to `CompiledLayers.MAX_SHAPES` batch shapes).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Iterator

import torch
from torch import Tensor

from .binding import OscarBinding, Step, binding_of, running_step


@torch.library.custom_op("oscar_zoo::decode_attention", mutates_args=())
def decode_attention(query: Tensor, key: Tensor, value: Tensor, scaling: float, softcap: float | None,
                     sliding_window: int | None) -> Tensor:
    """File this step's key/value [B, H_kv, 1, D] into the running layer of the running step's OscarCache and attend
    query [B, H_q, 1, D] over its tiers; returns [B, 1, H_q, D] in query's dtype (what the attention function returns).
    The layer is the step's state, not an argument, so that one compiled graph serves every layer."""
    step = running_step()
    cache, module, binding = step.cache, step.module, step.binding
    query, key, value = eager_layout(query), eager_layout(key), eager_layout(value)
    kwargs = binding.enter(module, cache)  # what the pre-hook does in an eager call
    step.filing = True
    try:
        key, value = cache.update(key, value, module.layer_idx, {})
    finally:
        step.filing = False
    out, _ = binding.attend(module, query, key, value, None, scaling=scaling, softcap=softcap,
                            sliding_window=sliding_window, **kwargs)
    return out.contiguous()  # the layout the fake promises (the decode kernel's batch-major o may be strided)


def eager_layout(t: Tensor) -> Tensor:
    """t [B, H, n, D] laid out as transformers' eager attention gets it (a transpose of a contiguous [B, n, H, D]): the
    layout the runtime's kernels were written for; inductor may pick another for the op's inputs."""
    B, H, n, D = t.shape
    want = (n * H * D, D, H * D, 1)
    if all(s == w for s, w, size in zip(t.stride(), want, t.shape) if size > 1):
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@decode_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, scaling: float, softcap: float | None,
      sliding_window: int | None) -> Tensor:
    B, H_q, n, D = query.shape
    return query.new_empty(B, n, H_q, D)


# model types whose compiled step is checked against the eager step (tests/runtime/test_compiled_step.py; Qwen3-MoE
# with its experts as graph.STATIC_EXPERTS, which dynamo traces whole; Gemma2 with its logit softcap inside the decode
# kernel)
COMPILED_TYPES = frozenset({"gemma", "gemma2", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe"})


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that hold one attention module with a `layer_idx` as `self_attn` (a transformers decoder layer)."""
    return [m for m in model.modules() if hasattr(getattr(m, "self_attn", None), "layer_idx")]


class CompiledLayers:
    """The decoder layers' forward compiled by inductor (one compiled function per layer class, shared by its layers),
    used only inside `step` (prefill, CPU runs and steps that are not static stay eager). Compiles lazily on the first
    step; reports the time it took once."""

    MAX_SHAPES = 32  # batch shapes compiled per model; later ones run eager layers (each shape is one dynamo entry)

    def __init__(self, model: torch.nn.Module, types: frozenset[str] = COMPILED_TYPES):
        self.layers = decoder_layers(model)
        self.types = types  # the model types compiled (a probe passes others to try them)
        self.model_type = getattr(model.config, "model_type", None)
        self.compiled: dict[type, object] = {}  # made on the first step (torch.compile is lazy; dynamo imports are not)
        self.compile_seconds: float | None = None
        self.shapes: set[tuple] = set()  # the input shapes compiled so far

    def admit(self, shape: tuple) -> bool:
        """Whether a step of this input shape runs compiled: a shape seen before, or a new one within MAX_SHAPES."""
        if shape not in self.shapes and len(self.shapes) < self.MAX_SHAPES:
            self.shapes.add(shape)
        return shape in self.shapes

    def usable(self) -> bool:
        """The model type is one of `types` (COMPILED_TYPES) and no layer has a forward of its own (accelerate's
        device-map and offload hooks set one: the class's forward, compiled, would skip them)."""
        return self.model_type in self.types and not any("forward" in m.__dict__ for m in self.layers)

    @contextlib.contextmanager
    def step(self, cache) -> Iterator[Step]:
        """Run the model's layers compiled, with `cache` as the one the custom op files into; restores on exit."""
        if not self.usable():
            raise RuntimeError(f"{self.model_type} layers with forwards of their own are not compiled (usable())")
        binding = self.binding()
        for cls in {type(m) for m in self.layers} - self.compiled.keys():
            self.compiled[cls] = torch.compile(cls.forward, dynamic=False)
        # one dynamo entry per batch shape on the layer class's forward, which other models of the class share: past
        # dynamo's default limit (8) a frame would run eagerly and file its token outside the op (check_filing)
        limit = max(torch._dynamo.config.recompile_limit, 2 * self.MAX_SHAPES)
        first = self.compile_seconds is None
        t0 = time.perf_counter()
        with binding.compiled(cache) as run:
            for layer in self.layers:
                layer.forward = functools.partial(self._layer, run, layer)
            try:
                with torch._dynamo.config.patch(recompile_limit=limit):
                    yield run
            finally:
                for layer in self.layers:
                    del layer.forward  # the class's forward again
        if first:
            self.compile_seconds = time.perf_counter() - t0
            print(f"oscar-zoo: compiled the decode step in {self.compile_seconds:.1f} s (torch.compile, inductor; "
                  f"later processes reuse inductor's on-disk cache)", file=sys.stderr)

    def binding(self) -> OscarBinding:
        """The model's binding (`attention.enable_oscar` makes it)."""
        binding = binding_of(self.layers[0].self_attn) if self.layers else None
        if binding is None:
            raise RuntimeError("compiled decode steps need the model switched to \"oscar\" first (enable_oscar)")
        return binding

    def _layer(self, run: Step, layer: torch.nn.Module, *args, **kwargs):
        run.module = layer.self_attn  # the op's layer
        return self.compiled[type(layer)](layer, *args, **kwargs)
