"""Kernel test setup (the kernels were imported in interpreter mode by tests/conftest.py on CPU-only machines).
Kernel tests request the `device` fixture: "cpu" (interpreter, skipped when CUDA exists) or "cuda" (marked gpu)."""


import pytest
import torch

from oscar_zoo.runtime import dispatch

from ..conftest import INTERPRETER


@pytest.fixture(params=[pytest.param("cpu", id="interp"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")])
def device(request, monkeypatch):
    """Where a kernel test runs: the CPU Triton interpreter or the GPU."""
    if request.param == "cpu":
        if not INTERPRETER:
            pytest.skip("interpreter tests run on CPU-only machines (this one has CUDA: see the cuda copies)")
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "alloc", _poisoned_alloc)
    return torch.device(request.param)


@pytest.fixture
def decode_calls(monkeypatch):
    """A list that grows by one at every `ops.tiered_decode_attention` call the attention function makes (the call
    itself runs unchanged): tests check that decode steps went through the INT2 tiered decode."""
    from oscar_zoo.runtime import attention

    calls = []
    real = attention.ops.tiered_decode_attention
    monkeypatch.setattr(attention.ops, "tiered_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _poisoned_alloc(shape, dtype, device):
    """Output buffers filled with garbage (NaN / 0xAB bytes) so that any element a kernel fails to write shows."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.view(torch.uint8).fill_(0xAB).view(dtype) if t.element_size() == 1 else t.fill_(0xAB)


@pytest.fixture
def fewest_programs():
    """Model-level tests under the interpreter, whose subject is not how a launch splits its work: one merge program
    per row instead of ~merge_programs, and one rotate program per head instead of one per 32 output columns (the
    interpreter pays per program; the split merge and the column-block rotation keep their own interpreter tests in
    test_decode_kernels.py and test_rotate_kernel.py)."""
    from dataclasses import replace

    from oscar_zoo.runtime import config

    with config.use(replace(config.current(), merge_programs=1, rotate_block_e=1 << 30)):
        yield
