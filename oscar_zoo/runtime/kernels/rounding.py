"""float32 → a tensor's element type, rounded to nearest even on every backend.

The Triton interpreter truncates float32 to bfloat16 (it keeps the high 16 bits), while the GPU rounds to nearest
even; kernels whose output is bfloat16 round through this helper, so the CPU tests run the same arithmetic as the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(y, DTYPE: tl.constexpr):
    """y float32 → DTYPE: bfloat16 by round-to-nearest-even on the bits (NaN stays NaN), any other type by `.to`."""
    if DTYPE == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(y == y, rounded, 0x7FC0)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(DTYPE)
