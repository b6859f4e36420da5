"""THE OSCAR INT2 KV-cache format: bit width, packing order, scale dtype, tier sizes, flush interval.

Everything that defines how a cached row is stored lives here as data, so the reference (`reference.py`), the Triton
kernels and the cache all read one definition. Shape letters: B batch, T tokens, H_kv KV heads, D head dim, G group.

Storage of one layer's cache (K and V alike), chosen for the decode kernels: every (batch, KV head) owns a contiguous
run of tokens, so a tile of BLOCK_T tokens is one coalesced read of BLOCK_T·D/4 bytes.
    sink        bfloat16 [B, H_kv, SINK, D]            first SINK positions, full precision
    codes       uint8    [B, H_kv, T_cap, D/4]         INT2 history, "quartered" packing (see `pack_codes`);
                                                       V's codes are stored token-major (`history_codes`),
                                                       3-bit keys' rows in pairs (`reference.store_pairs`)
    scale_zero  float16  [B, H_kv, T_cap, D/G, 2]      per group: (scale, zero), interleaved
    recent      bfloat16 [B, H_kv, RECENT+FLUSH, D]    last RECENT..RECENT+FLUSH-1 positions, full precision
plus int32 [B] lengths per tier. All tiers hold *rotated* keys/values (k·M_K, v·M_V).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BITS = 2
LEVELS = 2**BITS - 1  # largest code: 3
KEY_BITS = (2, 3)  # bit widths a layer's history keys may use (values always use BITS); docs/format.md §6b
CODES_PER_BYTE = 8 // BITS  # 4
# the stored dtypes, torch's (read as layout.CODE_DTYPE …; `__getattr__` imports torch at the first read, so the
# format's records and the commands that need no tensor start without it)
_DTYPES = {
    "CODE_DTYPE": "uint8",
    "SCALE_DTYPE": "float16",  # scale and zero are stored as float16 (the paper's 2.28 bits/element)
    "TIER_DTYPE": "bfloat16",  # sink and recent tiers
}

SINK = 64  # first positions kept full precision
RECENT = 256  # last positions kept full precision
FLUSH = 8  # tokens demoted together from the recent tier into the history
MAX_WINDOW = 1 << 20  # sink, recent and flush are each at most this many tokens (a larger one is a damaged
# manifest, not a setting: the tiers are allocated at that size for every layer and sequence)
MAX_MODEL_DIM = 1 << 16  # the most layers, heads or head dims a model may have (none has nearly this many): a cache
# and a calibration allocate state per layer and head, and a layer id is below the layer count
MAX_WINDOWS = 32768  # a manifest's BF16 tiers, sink + pin + recent, hold fewer tokens than this: beyond it a 32K
# context keeps no INT2 history, and every layer would allocate that many BF16 rows per KV head (`check_windows`)

# Keys per channel over token blocks (docs/format.md §6d): a float16 scale/zero per channel and block of KEY_BLOCK
# consecutive history tokens; the history then holds whole blocks and demotes one block at a time (flush = block).
KEY_BLOCKS = (16, 32, 64, 128, 256)  # block sizes a cache accepts (powers of two dividing the history's growth chunk)
DEFAULT_KEY_BLOCK = 64  # per head dim: max(64, D) (`default_key_block`)

DEFAULT_K_CLIP = 0.96
DEFAULT_V_CLIP = 0.92

# Scale floor (docs/format.md §6). The plain rule is scale = max(max − min, 1e-8) / 3. With float16 storage that breaks
# on (near-)constant rows: a tiny scale underflows to 0 and zero = −min/scale overflows to inf. We floor the range at
# amax·2^-12 (so |zero| ≤ 3·2^12, exactly representable magnitude in float16) and at 3·2^-14 (so scale is a normal
# float16). Rows whose range is above both floors — every row of real K/V data we have seen — quantize exactly by the
# plain rule.
RANGE_REL_FLOOR = 2.0**-12
RANGE_ABS_FLOOR = 3 * 2.0**-14


class Choice(str, Enum):
    """A closed vocabulary of strings: members compare, hash, print and format as their values (a plain `str` Enum
    formats as `Class.MEMBER` in f-strings from Python 3.11 on)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Centring(Choice):
    """How history rows are stored (docs/format.md §6a): "none" as x·M; "mean" as x·M − μ·M with the calibrated
    means k_mean, v_mean. The vocabulary's one declaration: the manifest, the calibration and the runtime use it."""

    NONE = "none"
    MEAN = "mean"


PIN_WINDOW = 32  # the prompt's last queries whose attention chooses them
PIN_POOL = 7  # a token's score is the largest of its neighbours' within this window (a needle is several tokens)


def resolve_group_size(head_dim: int, group_size: int = 0) -> int:
    """Group size G for rows of `head_dim` (0 = one group per row); G must divide D and leave whole bytes."""
    G = head_dim if group_size in (0, None) else group_size
    if head_dim % CODES_PER_BYTE or G <= 0 or head_dim % G:
        raise ValueError(
            f"group_size {G} does not fit head_dim {head_dim}: D must be a multiple of {CODES_PER_BYTE} and G a "
            f"divisor of D (0 = one group per row)"
        )
    return G


def packed_dim(head_dim: int, bits: int = BITS) -> int:
    """Bytes per packed row of `head_dim` codes of `bits` bits: the low two bits quartered (D/4 bytes), then for 3-bit
    codes the third bit of every dim as a bit plane (D/8 bytes; `reference.pack_codes`)."""
    check_bits(bits)
    return head_dim // CODES_PER_BYTE + (head_dim // 8 if bits == 3 else 0)


def check_bits(bits: int) -> int:
    if bits not in KEY_BITS:
        raise ValueError(f"a cached row holds {' or '.join(map(str, KEY_BITS))}-bit codes, not {bits}")
    return bits


def history_codes(B: int, H: int, T_cap: int, head_dim: int, device, tokens_contiguous: bool = False,
                  bits: int = BITS) -> torch.Tensor:
    """A zeroed history [B, H, T_cap, packed_dim(D, bits)]. tokens_contiguous (the cache's V codes, INT2 only):
    stored as [B, H, D/4, T_cap] and returned as its transposed view, so each packed column of consecutive tokens is
    contiguous. The decode kernel contracts P·V over tokens with the codes as the tensor-core operand whose reduction
    axis is then contiguous in memory, as K's is (bytes of consecutive dims): no byte gathers. Readers index the view;
    only strides differ."""
    import torch

    dtype = _torch_dtype("CODE_DTYPE")
    if tokens_contiguous:
        return torch.zeros(B, H, packed_dim(head_dim), T_cap, dtype=dtype, device=device).transpose(2, 3)
    return torch.zeros(B, H, T_cap, packed_dim(head_dim, bits), dtype=dtype, device=device)


def check_windows(sink: int, recent: int, flush: int, pin: int = 0, key_block: int = 0) -> None:
    """The tiers a manifest may prescribe (docs/format.md §7): each window within [0, MAX_WINDOW] (flush ≥ 1), the
    BF16 tiers sink + pin + recent below MAX_WINDOWS (what `calibrate` accepts), and flush at most the largest key
    block (`KEY_BLOCKS`; per row, calibrate writes FLUSH): the recent tier holds recent + flush rows of every layer.
    The one check of these bounds for the manifest schema and the runtime's reader; ValueError otherwise."""
    if min(sink, recent, pin) < 0 or flush < 1 or max(sink, recent, flush, pin) > MAX_WINDOW:
        raise ValueError(f"need 0 ≤ sink, recent, pin ≤ {MAX_WINDOW} and 1 ≤ flush ≤ {MAX_WINDOW}, "
                         f"got sink={sink} recent={recent} flush={flush} pin={pin}")
    if not sink + pin + recent < MAX_WINDOWS:
        raise ValueError(f"sink + pin + recent = {sink} + {pin} + {recent} tokens: expected fewer than "
                         f"{MAX_WINDOWS:,} (beyond that a 32K context keeps no INT2 history, and every layer "
                         "allocates that many BF16 rows per KV head)")
    if flush > max(KEY_BLOCKS[-1], key_block):
        raise ValueError(f"flush {flush}: expected at most {KEY_BLOCKS[-1]} tokens demoted at a time (the largest "
                         "key block; calibrate writes 8 per row)")


def check_key_block(key_block: int) -> int:
    """0 (keys per row) or a block size of KEY_BLOCKS (keys per channel over blocks of that many tokens)."""
    if key_block != 0 and key_block not in KEY_BLOCKS:
        raise ValueError(f"key_block must be 0 (keys per row) or one of {', '.join(map(str, KEY_BLOCKS))}, "
                         f"got {key_block}")
    return key_block


def default_key_block(head_dim: int) -> int:
    """The per-channel key block for `head_dim`: as many tokens as dims from 64 on (one float16 pair per channel and
    block costs 32/block bits per element: 0.5 at D = 64, 0.25 at D = 128)."""
    return min(max(DEFAULT_KEY_BLOCK, head_dim), KEY_BLOCKS[-1])


def bits_per_element(context: int, group_size: int, sink: int = SINK, recent: int = RECENT,
                     bits: float = BITS, pin: int = 0, key_block: int = 0) -> float:
    """Average bits per cached element at `context` tokens (docs/format.md §7) of rows coded with `bits` bits (a
    mean over layers may be fractional), float16 scale and zero per group of G dims — or, `key_block` > 0 (keys per
    channel, §6d), per channel and block of `key_block` tokens; `pin` pinned tokens are BF16 like the windows (a
    prompt pins them from what would be history)."""
    if context <= 0:
        raise ValueError(f"context must be positive, got {context}")
    full = min(context, sink + recent + pin)
    quant = context - full
    scale_bits = 2 * 16 / (key_block or group_size)
    return (quant * (bits + scale_bits) + full * 16) / context


def kv_bits_per_element(context: int, group_size: int, sink: int = SINK, recent: int = RECENT,
                        key_bits: Sequence[int] = (), pin: int = 0, key_block: int = 0) -> float:
    """The mean of K's and V's bits per element (`bits_per_element`): keys at the mean of `key_bits`, the bits of each
    layer's history keys (empty: BITS in every layer; per channel over `key_block`-token blocks when > 0), values at
    BITS per row. 2-bit keys with key_block = 0 is `bits_per_element` itself. The history holds whole key blocks;
    the ≤ key_block − 1 tokens waiting in the recent tier beyond `recent` are counted as history (an upper bound of
    the history's share)."""
    mean_key_bits = sum(key_bits) / len(key_bits) if key_bits else BITS
    k = bits_per_element(context, group_size, sink, recent, mean_key_bits, pin, key_block)
    return (k + bits_per_element(context, group_size, sink, recent, pin=pin)) / 2


def bytes_per_token(head_dim: int, group_size: int, bits: int = BITS) -> int:
    """Bytes of one history row (one token, one KV head, K or V): packed codes + float16 scale/zero per group."""
    return packed_dim(head_dim, bits) + 2 * 2 * (head_dim // group_size)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def log2_int(n: int) -> int:
    return int(math.log2(n))


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, _DTYPES[name])


def __getattr__(name: str):
    if name in _DTYPES:
        globals()[name] = dtype = _torch_dtype(name)  # kept: later reads are plain attribute reads
        return dtype
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
