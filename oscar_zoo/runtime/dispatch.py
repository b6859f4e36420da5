"""Where an op runs and what it launches with, shared by every host wrapper (`ops`, `quantize_ops`, `rotate_op`):
kernel or reference, the kernel table, the output buffers, and the device facts the launch settings depend on.

Kernels run on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (the tests); everything else, and every
machine without Triton, uses the pure-PyTorch reference (`oscar_zoo.format.reference`). Triton is imported only by
`kernels()`, so importing this module needs only torch."""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from . import kernels as _kernel_package
from .config import RuntimeConfig


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
    if not triton_available():
        return False
    return t.is_cuda or (t.device.type == "cpu" and interpret())


def kernels() -> _kernel_package.KernelTable:
    """The kernel table (`kernels.KernelTable`; imports Triton on first use)."""
    return _kernel_package.load()


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

    return tl.float32 if interpret() else tl.bfloat16


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
    if not (cfg.pdl and t.is_cuda) or interpret() or torch.version.hip is not None:
        return False
    return capability_major(device_index(t.device)) >= 9


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
