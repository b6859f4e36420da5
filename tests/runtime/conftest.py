"""Kernel test setup: on a CPU-only machine the Triton kernels are imported in interpreter mode (TRITON_INTERPRET=1 must
be set before `triton.jit` decorates them), then the variable is restored so other tests keep the reference path.
Kernel tests request the `device` fixture: "cpu" (interpreter, skipped when CUDA exists) or "cuda" (marked gpu)."""

import importlib
import os

import pytest
import torch

from oscar_zoo.runtime import ops

INTERPRETER = not torch.cuda.is_available()
if INTERPRETER and importlib.util.find_spec("triton") is not None:
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module("oscar_zoo.runtime.kernels.quantize_pack")
        importlib.import_module("oscar_zoo.runtime.kernels.decode_int2")
        importlib.import_module("oscar_zoo.runtime.kernels.decode_bf16")
        importlib.import_module("oscar_zoo.runtime.kernels.merge")
    finally:
        if _saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = _saved


@pytest.fixture(params=[pytest.param("cpu", id="interp"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")])
def device(request, monkeypatch):
    """Where a kernel test runs: the CPU Triton interpreter or the GPU."""
    if request.param == "cpu":
        if not INTERPRETER:
            pytest.skip("interpreter tests run on CPU-only machines (this one has CUDA: see the cuda copies)")
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ops, "_alloc", _poisoned_alloc)
    return torch.device(request.param)


def _poisoned_alloc(shape, dtype, device):
    """Output buffers filled with garbage (NaN / 0xAB bytes) so that any element a kernel fails to write shows."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(0xAB)
