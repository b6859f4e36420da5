"""The Triton kernels, named in one table (`KernelTable`). Importing this package needs only the standard library:
`load()` imports Triton and the kernel modules on first use (push, pull and list run without Triton)."""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class KernelTable:
    """Every @triton.jit entry point the host wrappers launch, by name (launched as `kernel[grid](...)`)."""

    quantize_pack: object  # kernels/quantize_pack.py: rows → clip → INT2/3-bit codes, packed (optionally rotated first)
    round_thresholds: tuple[float, ...]  # the rounding thresholds quantize_pack takes as launch arguments
    quantize_pack_channel: object  # kernels/quantize_channel.py: keys per channel over token blocks
    decode: object  # kernels/decode.py: split-K attention over the sink, INT2 history and recent tiers
    merge: object  # kernels/merge.py: the exact softmax merge of the splits
    rotate_rows: object  # kernels/rotate.py: x·M − μ·M per head, optionally filed into a tier slot
    block_query: object  # kernels/block_query.py: each key block's q·s as int8 operands
    dequant: object  # kernels/dequant.py: packed history rows → floats


@functools.lru_cache(maxsize=None)
def load() -> KernelTable:
    """The kernel table (imports Triton and the kernel modules, once)."""
    from . import block_query, decode, dequant, merge, quantize_channel, quantize_pack, rotate

    return KernelTable(
        quantize_pack=quantize_pack._quantize_pack_kernel, round_thresholds=quantize_pack.ROUND_THRESHOLDS,
        quantize_pack_channel=quantize_channel._quantize_pack_channel_kernel, decode=decode._decode_kernel,
        merge=merge._merge_kernel, rotate_rows=rotate._rotate_rows_kernel, block_query=block_query._block_query_kernel,
        dequant=dequant._dequant_kernel,
    )
