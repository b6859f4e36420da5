"""Phase timing for bench_generate: CUDA-event (or wall-clock) time per named piece of a decode step (attention
kernels, rotations, cache filing), taken by wrapping those functions for the duration of a timed run.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from oscar_zoo.format import reference
from oscar_zoo.runtime import cache as cache_mod, ops, rotate_op

from .bf16_caches import GraphBF16Layer, PreallocLayer, bf16_split_attention


class PhaseTimer:
    """CUDA-event (or wall-clock on CPU) time per named phase, outermost calls only. On a host-bound step the GPU
    waits on launches, so a phase's time is what it adds to the step's wall time, launch cost included."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.records: list[tuple[str, object, object]] = []
        self.depth = 0

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
            if self.cuda:
                start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                end = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
                if self.cuda:
                    end.record()
                self.records.append((name, start, end))
                self.depth -= 1

        return timed

    def totals_ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for name, s, e in self.records:
            out[name] = out.get(name, 0.0) + (s.elapsed_time(e) if self.cuda else (e - s) * 1e3)
        return out


@contextmanager
def patched(targets):
    """Temporarily replace (object, attribute) pairs: targets = [(obj, attr, new)]."""
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in targets]
    for obj, attr, new in targets:
        setattr(obj, attr, new)
    try:
        yield
    finally:
        for obj, attr, old in saved:
            setattr(obj, attr, old)


def phase_targets(timer: PhaseTimer, kind: str):
    """The pieces of a decode step to time. OSCAR: the tiered attention kernels, the rotations (q, and the output when
    o_proj does not un-rotate), the cache filing (the new k/v rotated, centred and written to the recent tier, every
    8th step the demotion: clip → INT2 → pack). BF16: sdpa and the cache
    update (DynamicCache: a cat that copies the whole layer cache every step)."""
    if kind == "oscar":
        return [
            (ops, "tiered_decode_attention", timer.wrap("attention kernels", ops.tiered_decode_attention)),
            (reference, "rotate", timer.wrap("rotation", reference.rotate)),
            (rotate_op, "rotate_rows", timer.wrap("rotation", rotate_op.rotate_rows)),
            (cache_mod.OscarLayer, "write_token",
             timer.wrap("cache write + demotion", cache_mod.OscarLayer.write_token)),
        ]
    from transformers.integrations import sdpa_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if kind == "bf16graph":
        attn_name, attn_fn, cls = "bf16graph", bf16_split_attention, GraphBF16Layer
    else:
        import transformers.cache_utils as cu

        cls = {"dynamic": cu.DynamicLayer, "static": cu.StaticLayer, "prealloc": PreallocLayer}.get(kind)
        cls = cls or cu.QuantizedLayer  # a peer: its update dequantizes the history (+ the flush every 128 steps)
        attn_name, attn_fn = "sdpa", sdpa_attention.sdpa_attention_forward
    fn = timer.wrap("attention kernels", attn_fn)
    return [(cls, "update", timer.wrap("cache write", cls.update)),
            (ALL_ATTENTION_FUNCTIONS, "_local_mapping", {**ALL_ATTENTION_FUNCTIONS._local_mapping, attn_name: fn})]
