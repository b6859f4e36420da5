"""CUDA-graph decode for OscarCache: capture one single-token decode step of the whole model once, replay it after.

A static decode step (`OscarLayer.is_static_step`: sink full, recent window full) touches only tensors of fixed
address and shape and reads the tier lengths on the device, so it can be captured. Two graphs exist per batch shape:
the plain step and the every-`flush`-steps step that also demotes (the host knows which comes next from its mirror of
the lengths; it never reads the device). The first static step runs uncaptured (it compiles the decoder layers
(compiled.py) and makes the per-layer constants; the kernels were built during prefill), then both kinds are
captured at once, the demoting one by rehearsal (`OscarCache.rehearsal`), and every later step is a replay: no
capture lands mid-generation. A history reallocation (growth past its reserve, by a quarter of the history at a time)
or another cache drops the graphs, and the next step runs eagerly and captures both again;
`OscarCache.reserve(tokens)` after prefill avoids that. A padded batch (rows demoting on their own schedules) captures
each pattern of demoting rows at its second occurrence instead.

`install(model)` routes transformers' `generate()` through this: OscarCache is a compileable cache, so on a GPU
generate() asks `model.get_compiled_call()` for its decode forward, and gets a `DecodeGraphs` (other caches get the
model's own compiled call). Prefill, CPU runs and steps that are not static stay eager, through the same code, and so
do the steps of a model with sliding-window layers once the context would pass the window (the eager step refuses
it: OSCAR covers full-attention layers; a replay would attend past the window without a word).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .cache import CACHE_ARGS
from .compiled import CompiledLayers

_STATIC_INPUTS = ("input_ids", "position_ids", "cache_position")  # tensors copied into the graph's inputs per step
_EAGER_FLAGS = ("output_attentions", "output_hidden_states")  # outputs a replay does not give back
# model types with routed experts. transformers' default experts read the routing on the host (Qwen3-MoE's "eager"
# experts loop over `nonzero()`: on an H200 the capture failed; "grouped_mm" falls back to a loop over
# `offsets.tolist()` where its kernel does not apply, e.g. compiled in float32), so a static step runs them as
# "batched_mm": each token's routed experts' weights gathered by index on the device, the same shapes every step —
# what a CUDA graph holds and dynamo traces whole. Prefill keeps the model's own experts. A transformers without
# experts implementations (4.x) leaves these models' steps eager.
ROUTED_TYPES = frozenset({"qwen3_moe"})
STATIC_EXPERTS = "batched_mm"
# what DecodeGraphs reads of a cache that offers a static step
STATIC_STEP_PROTOCOL = ("static_step_key", "host_lengths", "restore_host_lengths", "advance_host", "get_seq_length",
                        "rehearsal")


class DecodeGraphs:
    """Callable like the model (keyword arguments, as generate() calls it); replays captured decode steps of caches
    that offer a static step (OscarCache; the protocol is STATIC_STEP_PROTOCOL); every other call goes to `fallback`."""

    def __init__(self, model: torch.nn.Module, fallback=None, compile: bool = True):
        self.model = model
        self.fallback = fallback or model.__call__
        self.compiled = CompiledLayers(model) if compile else None  # the layers a static step runs (None: eager)
        self.experts = STATIC_EXPERTS  # routed experts' implementation in a static step (a probe tries others)
        self.graphs: dict[tuple, _Step] = {}
        self.warm: set[tuple] = set()  # step kinds run eagerly once (layers compiled, constants made) or captured ahead
        self.versions: tuple | None = None  # the cache, storage versions and value folds the graphs were captured for
        self.pool = None
        self.replays = self.captures = 0

    def __call__(self, *args, **kwargs):
        cache = next((kwargs[n] for n in CACHE_ARGS if kwargs.get(n) is not None), None)
        if not hasattr(cache, "static_step_key"):
            return self.fallback(*args, **kwargs)
        key = None if args else cache.static_step_key()
        kind = None if key is None else self._step_kind(kwargs, cache)
        if kind is None:
            return self.model(*args, **kwargs)
        demote, versions = key
        if versions != self.versions:  # storage moved (or another cache): the captured addresses are stale
            self.reset()  # a step of the new storage runs eagerly first (lazy per-layer tensors made outside)
            self.versions = versions
        kind = (demote,) + kind
        if kind not in self.warm:
            self.warm.add(kind)
            step = _Step(kwargs)  # the arguments the capture will pass: compiled layers see the same guards
            step.load(kwargs, cache)
            with self._layers(cache, kwargs):
                out = self.model(**{**kwargs, **step.inputs})
                if isinstance(demote, bool):
                    self._capture_ahead(cache, kwargs, kind)
            return out
        step = self.graphs.get(kind)
        if step is None:
            with self._layers(cache, kwargs):
                step = self.graphs[kind] = self._capture(cache, kwargs)
        step.load(kwargs, cache)
        step.graph.replay()
        cache.advance_host()
        self.replays += 1
        return step.output(cache)

    @contextlib.contextmanager
    def _layers(self, cache, kwargs: dict):
        """The decoder layers a static step runs: compiled (the OSCAR work as a custom op) for the model types of
        `compiled.COMPILED_TYPES` (up to `CompiledLayers.MAX_SHAPES` batch shapes), else eager; routed experts as
        `experts` (STATIC_EXPERTS unless set otherwise)."""
        layers = self.compiled
        with static_experts(self.model, self.experts):
            if layers is None or not layers.usable() or not layers.admit(tuple(kwargs["input_ids"].shape)):
                yield
            else:
                with layers.step(cache):
                    yield

    def reset(self) -> None:
        """Drop every captured graph and its memory pool (the next static step warms up and captures again)."""
        self.graphs.clear()
        self.warm.clear()
        self.pool = None
        self.versions = None

    def _step_kind(self, kwargs: dict, cache) -> tuple | None:
        """(input shape, the non-tensor arguments) when the call is one token per sequence on a GPU within the model's
        sliding window (if any), else None."""
        if getattr(self.model.config, "model_type", None) in ROUTED_TYPES and not hasattr(
                self.model, "set_experts_implementation"):
            return None
        ids = kwargs.get("input_ids")
        if not (isinstance(ids, Tensor) and ids.is_cuda and ids.dim() == 2 and ids.shape[1] == 1):
            return None
        if any(kwargs.get(flag) for flag in _EAGER_FLAGS):
            return None
        window = getattr(self.model.config, "sliding_window", None)  # None where no layer slides (Qwen's switch off)
        if isinstance(window, int) and cache.get_seq_length() + 1 > window:
            return None
        others = []
        for name, value in kwargs.items():
            if name in _STATIC_INPUTS or name in CACHE_ARGS or value is None:
                continue
            if isinstance(value, Tensor):
                return None  # an attention mask or embeddings: not part of a captured step
            others.append((name, repr(value)))
        return (tuple(ids.shape), tuple(sorted(others)))

    def _capture_ahead(self, cache, kwargs: dict, kind: tuple) -> None:
        """Capture both kinds of `kind`'s step, the plain and the demoting one, right after its first (eager) run, so
        that no capture lands mid-generation: the demoting kind through `cache.rehearsal` (the host mirror set as
        before a demotion; the kernels it launches were built during prefill, `attention.warm_up`, and the compiled
        layers are the plain step's: the demotion runs inside the OSCAR op). A kind that cannot come (`flush` 1: every
        step demotes) or whose rehearsal would move the storage is left to come on its own."""
        for demote in (False, True):
            ahead = (demote,) + kind[1:]
            if ahead in self.graphs:
                continue
            with cache.rehearsal(demote):
                key = cache.static_step_key()
                if key is None or key != (demote, self.versions):
                    continue
                self.graphs[ahead] = self._capture(cache, kwargs)
            self.warm.add(ahead)

    def _capture(self, cache, kwargs: dict) -> _Step:
        step = _Step(kwargs)  # its input values are loaded before each replay
        lengths = cache.host_lengths()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step.keep(self.model(**{**kwargs, **step.inputs}))
        cache.restore_host_lengths(lengths)  # capture ran the Python once; the device work runs at replay
        self.pool = graph.pool()
        step.graph = graph
        self.captures += 1
        return step


@contextlib.contextmanager
def static_experts(model: torch.nn.Module, implementation: str = STATIC_EXPERTS):
    """Run `model`'s routed experts (ROUTED_TYPES) as `implementation` inside the block; restores the model's own."""
    if getattr(model.config, "model_type", None) not in ROUTED_TYPES:
        yield
        return
    own = model.get_experts_implementation()
    model.set_experts_implementation(implementation)
    try:
        yield
    finally:
        model.set_experts_implementation(own)


class _Step:
    """One captured step: its static input tensors, the graph, and the logits buffer it writes. It keeps no
    reference to the cache (a cache dropped by the user is freed; its graphs are never replayed again: the step key
    holds the cache's identity and storage versions, and a new cache's versions are new)."""

    def __init__(self, kwargs: dict):
        ids = kwargs["input_ids"]
        self.inputs = {n: kwargs[n].clone() for n in _STATIC_INPUTS if isinstance(kwargs.get(n), Tensor)}
        self.inputs.setdefault("position_ids", torch.zeros_like(ids))  # else the length would be baked into the graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None
        self.out_type = None
        self.cache_field: str | None = None

    def load(self, kwargs: dict, cache) -> None:
        for name, static in self.inputs.items():
            given = kwargs.get(name)
            if given is not None:
                static.copy_(given)
            else:  # position ids of the next token: the host mirror of the length
                static.fill_(cache.get_seq_length())

    def keep(self, out) -> None:
        """Remember what the captured forward returned: its type, its logits buffer and the name of its cache field."""
        self.out_type, self.logits = type(out), out.logits
        self.cache_field = next((n for n in CACHE_ARGS if out.get(n) is not None), None)

    def output(self, cache):
        """The step's output: logits copied out of the graph's buffer (the next replay overwrites it), and the cache."""
        fields = {"logits": self.logits.clone()}
        if self.cache_field is not None:
            fields[self.cache_field] = cache
        return self.out_type(**fields)


def decode_graphs(model: torch.nn.Module) -> DecodeGraphs | None:
    """The `DecodeGraphs` `install` gave `model` (None: none): its `replays` and `captures` counts, its `compiled`
    layers (`CompiledLayers`, None when compile is off; `compile_seconds`), and the callable itself, which runs a step
    as generate() does."""
    return getattr(model, "_oscar_graphs", None)


def install(model: torch.nn.Module, compile: bool | None = None) -> None:
    """Make `model.get_compiled_call` (what generate() uses for decode steps with a compileable cache on a GPU) return
    a `DecodeGraphs` that replays OscarCache steps (their layers compiled unless `compile` is False; None: as set
    before, compiled the first time) and hands every other cache to the model's own compiled call."""
    installed = getattr(model, "_oscar_graphs", None)
    if installed is not None:
        if compile is not None and (installed.compiled is not None) != compile:
            installed.compiled = CompiledLayers(model) if compile else None
            installed.reset()
        return
    if not hasattr(model, "get_compiled_call"):
        return
    own = type(model).get_compiled_call
    graphs = DecodeGraphs(model, compile=compile is not False)
    model._oscar_graphs = graphs

    def get_compiled_call(compile_config=None):
        graphs.fallback = lambda *a, **kw: own(model, compile_config)(*a, **kw)
        return graphs

    model.get_compiled_call = get_compiled_call
