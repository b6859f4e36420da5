"""Input checks of the runtime ops (`ops`, `rotate_op`): each raises ValueError with a message that names the argument,
what it is and what was expected. The history and window checks are the decode ops' (`ops.tiered_decode_attention` and
its two halves)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..format import layout


def check(cond: bool, msg) -> None:
    """Raise ValueError(msg) unless cond; `msg` may be a callable, so hot paths do not format messages that pass."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def check_tensor(name: str, t: Tensor, dims: int, dtype: torch.dtype | None = None) -> None:
    check(isinstance(t, Tensor), lambda: f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check(t.dim() == dims, lambda: f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if dtype is not None:
        check(t.dtype == dtype, lambda: f"{name} must be {dtype}, got {t.dtype}")


def check_lengths(name: str, t: Tensor, B: int, device: torch.device) -> Tensor:
    check(isinstance(t, Tensor), lambda: f"{name} must be an integer tensor [B], got {type(t).__name__}")
    check(t.shape == (B,), lambda: f"{name} must have shape [B] = [{B}], got {tuple(t.shape)}")
    check(not t.is_floating_point() and t.dtype != torch.bool,
          lambda: f"{name} must be an integer tensor, got {t.dtype}")
    check(t.device == device, lambda: f"{name} is on {t.device}, expected {device} (the device of q)")
    return (t if t.dtype == torch.int32 else t.to(torch.int32)).contiguous()  # the kernels index lengths[b] densely


def check_q(q: Tensor) -> tuple[int, int, int]:
    check_tensor("q", q, 3)
    check(q.dtype in (torch.bfloat16, torch.float16, torch.float32), lambda: f"q must be bf16/fp16/fp32, got {q.dtype}")
    return tuple(q.shape)


def check_kv(name: str, t: Tensor, q: Tensor, last: tuple[int, ...], dtype: torch.dtype) -> int:
    """t [B, H_kv, T, *last]; returns H_kv."""
    B = q.shape[0]
    check_tensor(name, t, 3 + len(last), dtype)
    check(t.device == q.device, lambda: f"{name} is on {t.device}, expected {q.device} (the device of q)")
    check(t.shape[0] == B, lambda: f"{name} has batch {t.shape[0]}, q has {B}")
    check(tuple(t.shape[3:]) == last, lambda: f"{name} must end in {last}, got shape {tuple(t.shape)}")
    H_kv = t.shape[1]
    check(H_kv > 0 and q.shape[1] % H_kv == 0,
          lambda: f"{name} has {H_kv} KV heads; H_q = {q.shape[1]} must be a multiple")
    return H_kv


def codes_key_bits(codes_k: Tensor, D: int) -> int:
    """The bits of a history's key codes from their packed width: D/4 bytes → 2, 3D/8 (`layout.packed_dim`) → 3."""
    width = codes_k.shape[-1]
    if width == layout.packed_dim(D):
        return layout.BITS
    check(D % 8 == 0 and width == layout.packed_dim(D, 3),
          lambda: f"codes_k must end in {layout.packed_dim(D)} (2-bit keys)"
          + (f" or {layout.packed_dim(D, 3)} (3-bit keys)" if D % 8 == 0 else "")
          + f" bytes for head dim {D}, got shape {tuple(codes_k.shape)}")  # fmt: skip
    return 3


def _check_codes(q, codes_k, codes_v, D: int) -> tuple[int, int]:
    """The history's packed codes (either key layout): K [B, H_kv, T_cap, packed_dim(D, bits)], V [.., D/4] with the
    same leading dims. Returns H_kv and the keys' bits."""
    check(D % layout.CODES_PER_BYTE == 0, lambda: f"head dim {D} must be a multiple of {layout.CODES_PER_BYTE}")
    check_tensor("codes_k", codes_k, 4, layout.CODE_DTYPE)
    key_bits = codes_key_bits(codes_k, D)
    H_kv = check_kv("codes_k", codes_k, q, (layout.packed_dim(D, key_bits),), layout.CODE_DTYPE)
    check_kv("codes_v", codes_v, q, (D // 4,), layout.CODE_DTYPE)
    check(codes_v.shape[:3] == codes_k.shape[:3],
          lambda: f"codes_v {tuple(codes_v.shape)} does not match codes_k {tuple(codes_k.shape)}")  # fmt: skip
    check(key_bits == 2 or codes_k.shape[2] % 2 == 0,
          lambda: f"3-bit codes_k hold rows in pairs (docs/format.md §6b): an even number of rows, got "
                  f"{codes_k.shape[2]}")  # fmt: skip
    return H_kv, key_bits


def validate_int2(q, codes_k, scale_zero_k, codes_v, scale_zero_v, hist_len, key_block: int = 0):
    """Checks the history tier; returns H_kv, the group size G, hist_len as int32 and the keys' bits (2 or 3).
    `key_block` > 0 (keys per channel over blocks of that many tokens, docs/format.md §6d): scale_zero_k is
    [B, H_kv, T_cap / key_block, D, 2] (T_cap = codes_k.shape[2], whole blocks) and the values are per row (G = D)."""
    if key_block:
        return _validate_int2_channel(q, codes_k, scale_zero_k, codes_v, scale_zero_v, hist_len, key_block)
    B, H_q, D = check_q(q)
    H_kv, key_bits = _check_codes(q, codes_k, codes_v, D)
    check_tensor("scale_zero_k", scale_zero_k, 5, layout.SCALE_DTYPE)
    NG = scale_zero_k.shape[-2]
    check(NG > 0 and D % NG == 0, lambda: f"scale_zero_k has {NG} groups, which does not divide head dim {D}")
    for name, sz in (("scale_zero_k", scale_zero_k), ("scale_zero_v", scale_zero_v)):
        check_kv(name, sz, q, (NG, 2), layout.SCALE_DTYPE)
        check(sz.shape[:3] == codes_k.shape[:3],
              lambda: f"{name} {tuple(sz.shape)} does not match codes {tuple(codes_k.shape)}")
    hist_len = check_lengths("hist_len", hist_len, B, q.device)
    return H_kv, D // NG, hist_len, key_bits


def _validate_int2_channel(q, codes_k, scale_zero_k, codes_v, scale_zero_v, hist_len, key_block):
    """`validate_int2` for keys per channel over blocks of `key_block` tokens (§6d); G = D."""
    B, H_q, D = check_q(q)
    check(isinstance(key_block, int), lambda: f"key_block must be an int, got {type(key_block).__name__}")
    layout.check_key_block(key_block)
    H_kv, key_bits = _check_codes(q, codes_k, codes_v, D)
    T_cap = codes_k.shape[2]
    check(T_cap % key_block == 0,
          lambda: f"keys per channel over blocks of {key_block} tokens need a history capacity of whole blocks, "
          f"codes_k has {T_cap} tokens")  # fmt: skip
    for name, sz, want, what in (
        ("scale_zero_k", scale_zero_k, (B, H_kv, T_cap // key_block, D, 2), f"[B, H_kv, T_cap / {key_block}, D, 2]"),
        ("scale_zero_v", scale_zero_v, (B, H_kv, T_cap, 1, 2),
         "[B, H_kv, T_cap, 1, 2] (the values are per row (G = D))"),
    ):
        check_tensor(name, sz, 5, layout.SCALE_DTYPE)
        check(sz.device == q.device, lambda: f"{name} is on {sz.device}, expected {q.device} (the device of q)")
        check(tuple(sz.shape) == want, lambda: f"with key_block = {key_block} (keys per channel) {name} must be "
              f"{what} = {list(want)}, got {tuple(sz.shape)}")  # fmt: skip
    hist_len = check_lengths("hist_len", hist_len, B, q.device)
    return H_kv, D, hist_len, key_bits


def validate_bf16(q, sink_k, sink_v, sink_len, recent_k, recent_v, recent_len):
    B, H_q, D = check_q(q)
    H_kv = None
    for name, t in (("sink_k", sink_k), ("sink_v", sink_v), ("recent_k", recent_k), ("recent_v", recent_v)):
        check_tensor(name, t, 4)
        check(t.is_floating_point(), lambda: f"{name} must be a floating-point tier (bf16), got {t.dtype}")
        h = check_kv(name, t, q, (D,), t.dtype)
        check(H_kv is None or h == H_kv, lambda: f"{name} has {h} KV heads, the other tiers {H_kv}")
        H_kv = h
    dtypes = {t.dtype for t in (sink_k, sink_v, recent_k, recent_v)}
    check(len(dtypes) == 1,
          lambda: f"sink and recent tiers must share one dtype (bf16), got {sorted(map(str, dtypes))}")
    check(sink_v.shape == sink_k.shape, lambda: f"sink_v {tuple(sink_v.shape)} != sink_k {tuple(sink_k.shape)}")
    check(recent_v.shape == recent_k.shape,
          lambda: f"recent_v {tuple(recent_v.shape)} != recent_k {tuple(recent_k.shape)}")
    return check_lengths("sink_len", sink_len, B, q.device), check_lengths("recent_len", recent_len, B, q.device)
