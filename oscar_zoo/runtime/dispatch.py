"""Where an op runs and what it launches with, shared by every host wrapper (`ops`, `quantize_ops`, `rotate_op`):
kernel or reference, the kernel table, the output buffers, and the device facts the launch settings depend on.

Kernels run on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (the tests); everything else, and every
machine without Triton, uses the pure-PyTorch reference (`oscar_zoo.format.reference`). Triton is imported only by
`kernels()`, so importing this module needs only torch.

`stand_in(StandIn(table))` plans every launch of a block for a GPU while the tensors stay on the CPU, and hands it to
the table's stand-ins instead of the kernels: the SASS tools (benchmarks/experiments/kernel_sass.py, quantize_sass.py)
capture a launch exactly as a GPU run makes it and compile it for sm_90 on a machine without one."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Iterator

import torch
from torch import Tensor

from . import kernels as _kernel_package
from .config import RuntimeConfig


@dataclasses.dataclass(frozen=True)
class StandIn:
    """Launches planned for a GPU of `sm_count` SMs (an H100 or H200: 132) and handed to `kernels`' stand-ins (objects
    indexed by the grid, as a @triton.jit kernel is, whose call records the launch) of compute capability
    `capability`."""

    kernels: _kernel_package.KernelTable
    sm_count: int = 132
    capability: int = 9  # the compute capability's major version (9: sm_90, which takes programmatic dependent launch)


_STAND_IN: contextvars.ContextVar[StandIn | None] = contextvars.ContextVar("oscar_stand_in", default=None)


@contextlib.contextmanager
def stand_in(target: StandIn) -> Iterator[StandIn]:
    """Within the block (this thread or task), every op takes its kernel path on any tensor, plans its launch for
    `target`'s GPU and calls `target.kernels` instead of the Triton kernels; restored on exit."""
    token = _STAND_IN.set(target)
    try:
        yield target
    finally:
        _STAND_IN.reset(token)


def interpret() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET=1: kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_kernel(t: Tensor) -> bool:
    """Kernels run on CUDA tensors, and on CPU tensors when TRITON_INTERPRET=1; everything else uses the reference."""
    if _STAND_IN.get() is not None:
        return True
    if not triton_available():
        return False
    return t.is_cuda or (t.device.type == "cpu" and interpret())


def kernels() -> _kernel_package.KernelTable:
    """The kernel table (`kernels.KernelTable`; imports Triton on first use), or a `stand_in` block's stand-ins."""
    target = _STAND_IN.get()
    return target.kernels if target is not None else _kernel_package.load()


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer a kernel writes (the kernel tests replace this to poison outputs before the kernels run)."""
    return torch.empty(shape, dtype=dtype, device=device)


def last_contiguous(t: Tensor, inner: int) -> Tensor:
    """The kernels index the innermost `inner` dims densely; copy only if they are not."""
    expected = 1
    for d in range(1, inner + 1):
        if t.shape[-d] > 1 and t.stride(-d) != expected:
            return t.contiguous()
        expected *= t.shape[-d]
    return t


def dot_dtype():
    """bf16 tensor-core dots on the GPU; fp32 under the interpreter (its bf16 arithmetic is wrong)."""
    import triton.language as tl

    return tl.float32 if interpret() and _STAND_IN.get() is None else tl.bfloat16


def gpu_plan(device: torch.device) -> bool:
    """Whether a launch on `device` is planned for a GPU (tiles, splits): CUDA tensors, and any inside `stand_in`."""
    return device.type == "cuda" or _STAND_IN.get() is not None


def sm_count_of(device: torch.device) -> int:
    """The SMs a GPU launch on `device` is planned for (a `stand_in` block: its `sm_count`)."""
    target = _STAND_IN.get()
    return target.sm_count if target is not None else sm_count(device_index(device))


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl(t: Tensor, cfg: RuntimeConfig) -> bool:
    """Programmatic dependent launch (sm_90+, `cfg.pdl`): the decode and merge kernels are launched before the kernel
    ahead of them ends and wait for it on the device (`griddepcontrol.wait` before their first load), which hides a
    launch gap per kernel; CUDA graphs keep the dependency."""
    target = _STAND_IN.get()
    if target is not None:
        return cfg.pdl and target.capability >= 9
    if not (cfg.pdl and t.is_cuda) or interpret() or torch.version.hip is not None:
        return False
    return capability_major(device_index(t.device)) >= 9


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
