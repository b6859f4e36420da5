"""`OscarBinding`: everything the "oscar" attention calls of one model share, in one object — which module's cache
update comes next, whether a compiled decode step runs (its cache and the layer running), and the kernel builds
`attention.warm_up` has rehearsed for the model.

`attention.enable_oscar` makes one per model and keeps it on the model's attention modules
(`attention_binding.bind`); the attention function and the forward pre-hook find it there (`binding_of(module)`),
and a cache learns it from the hook (`OscarCache.binding`). A compiled step is scoped: `with binding.compiled(cache)`
marks it running for the block and restores on exit. Its custom op, which has only tensors for arguments, finds the
step through `running_step()`, a context variable the same block sets and resets — nothing lives past the step.

A cache read from an artifact folder meets the model here first: its means are held to the model's bounds then
(`format.model_bounds`, once per cache and binding)."""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator

import torch

from ..attention_binding import bound_value
from ..format.model_bounds import Bounds, check_means_fit, mean_bounds
from .cache import CACHE_ARGS, OscarCache

ATTN_IMPLEMENTATION = "oscar"


class Step:
    """A compiled decode step in progress: its binding and cache, the attention module of the layer running now, and
    whether the custom op is inside its own cache update."""

    def __init__(self, binding: OscarBinding, cache: OscarCache):
        self.binding, self.cache = binding, cache
        self.module: torch.nn.Module | None = None
        self.filing = False


_RUNNING: contextvars.ContextVar[Step | None] = contextvars.ContextVar("oscar_compiled_step", default=None)


def running_step() -> Step:
    """The compiled step running in this thread or task (what the custom op files into and attends over)."""
    step = _RUNNING.get()
    if step is None:
        raise RuntimeError("oscar_zoo::decode_attention ran outside a compiled decode step (CompiledLayers.step)")
    return step


class OscarBinding:
    """The state one model's "oscar" attention calls share (see the module docstring). `attend` is the attention
    function a compiled step's op runs eagerly (`attention.oscar_attention`)."""

    def __init__(self, attend: Callable | None = None, model: torch.nn.Module | None = None):
        self.attend = attend
        self._model = weakref.ref(model) if model is not None else None  # weak: the binding lives on the model
        self._mean_bounds: Bounds | None = None  # `mean_bounds(model)`, computed for the first centred artifact
        self.next_layer: int | None = None  # the "oscar" module whose cache update comes next (set by `enter`)
        self.step: Step | None = None  # the compiled step running now
        self.stepping = False  # `step is not None`, as a plain bool: dynamo guards on it while it traces a step
        self.rehearsed: set[tuple] = set()  # the kernel builds `warm_up` ran for this model (`attention._build_key`)

    def enter(self, module: torch.nn.Module, cache: object) -> dict:
        """An attention module is called with `cache`: when it is an OscarCache, check that it fits the model, tell
        its layer the module's value fold, and, when the module runs "oscar" attention, mark its update as the next
        one (`OscarCache.update` refuses any other). Returns the keyword arguments the attention function gets."""
        if not isinstance(cache, OscarCache):
            return {}
        n_model = getattr(getattr(module, "config", None), "num_hidden_layers", None)
        if isinstance(n_model, int) and len(cache.layers) > n_model:  # fewer: cache.update names the mismatch
            raise ValueError(
                f"this OscarCache has {len(cache.layers)} layers and the model {n_model}: the artifacts were made for "
                f"another model"
            )
        if module.layer_idx < len(cache.layers):
            cache.layers[module.layer_idx].bind_value_fold(getattr(module, "_oscar_v_fold", None))
        if cache.binding is not self:  # the cache meets this model: once, before its first update here
            self.admit(cache)
        cache.binding = self
        if getattr(module.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:  # not switched back since
            self.next_layer = module.layer_idx
        return {"oscar_cache": cache}

    def admit(self, cache: OscarCache) -> None:
        """A cache read from an artifact (`OscarCache.from_artifact`, `from_folder`) with means: each within the
        largest key / value norm the model can produce (`model_bounds.check_means_fit`; IntegrityError, a ValueError,
        naming the tensor, layer and head otherwise). Means a caller passed itself (`from_tensors`) are its own."""
        if not (cache.read_from_artifact and cache.centred):
            return
        model = self._model() if self._model is not None else None
        if model is None:
            return
        if self._mean_bounds is None:
            self._mean_bounds = mean_bounds(model)
        r = cache.rotations
        check_means_fit(self._mean_bounds, r.k_mean, r.v_mean, r.ids())

    def take_layer(self) -> int | None:
        """The layer whose update `enter` announced, consumed (`OscarCache.update`)."""
        layer, self.next_layer = self.next_layer, None
        return layer

    @contextlib.contextmanager
    def compiled(self, cache: OscarCache) -> Iterator[Step]:
        """A compiled decode step with `cache` as the one the custom op files into, for the block; restores on exit
        (steps nest)."""
        if cache.binding is not self:
            self.admit(cache)
        step, outer = Step(self, cache), self.step
        token = _RUNNING.set(step)
        self.step, self.stepping = step, True
        cache.binding = self
        try:
            yield step
        finally:
            self.step, self.stepping = outer, outer is not None
            _RUNNING.reset(token)

    def check_filing(self) -> None:
        """Called by a cache's `update` run eagerly inside a compiled step: only the op may file a token there. Anything
        else is a graph break in a decoder layer that ran the update outside the op, and the op would file the same
        token a second time: refused, rather than wrong logits."""
        if self.step is not None and not self.step.filing:
            raise RuntimeError(
                "a compiled decode step filed a token outside its custom op (dynamo broke the decoder layer's graph): "
                "turn compilation off with enable_oscar(model, compile=False)"
            )


def binding_of(module: torch.nn.Module) -> OscarBinding | None:
    """The binding `enable_oscar` gave `module`'s model (None: not enabled, or a stand-in module)."""
    value = bound_value(module)
    return value if isinstance(value, OscarBinding) else None


def cache_argument(kwargs: dict) -> object | None:
    """The cache a model or attention module was called with (transformers 5.x: `cache`, earlier `past_key_values`)."""
    return next((kwargs[name] for name in CACHE_ARGS if kwargs.get(name) is not None), None)
