"""The two values an `OscarCache` is built from: `CacheSettings` (how tokens are filed: windows, group size, key bits
and blocks, pinning) and `Rotations` (the calibrated tensors of every rotation layer). Both are frozen and hold their
checks in their constructors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..format import layout


@dataclass(frozen=True)
class CacheSettings:
    """How an OscarCache files and keeps tokens (frozen: `dataclasses.replace` makes another; every check is here).

    group_size: dims per scale/zero group (0: the head dim). sink, recent: the BF16 windows (tokens). flush: recent
    rows demoted at a time (None: key_block, else `layout.FLUSH`). pin: history tokens per KV head a prompt keeps BF16
    (docs/format.md §6c). key_block > 0: history keys per channel over blocks of that many tokens, unclipped (§6d;
    needs flush = key_block, values per row, pin 0). key_bits: per rotation layer, 2 or 3 (None: `layout.BITS` each).
    quantize=False keeps the history in BF16 (a test switch: with identity rotations generation then reproduces
    DynamicCache). num_layers: the model's layer count (None: the highest layer id + 1)."""

    group_size: int = 0
    sink: int = layout.SINK
    recent: int = layout.RECENT
    flush: int | None = None
    pin: int = 0
    key_block: int = 0
    key_bits: tuple[int, ...] | None = None
    quantize: bool = True
    num_layers: int | None = None

    def __post_init__(self):
        layout.check_key_block(self.key_block)
        if self.flush is None:
            object.__setattr__(self, "flush", self.key_block or layout.FLUSH)
        if self.key_bits is not None:
            object.__setattr__(self, "key_bits", tuple(int(b) for b in self.key_bits))
            if any(b not in layout.KEY_BITS for b in self.key_bits):
                choices = " or ".join(map(str, layout.KEY_BITS))
                raise ValueError(f"key_bits must be entries of {choices}, got {list(self.key_bits)}")
        sink, recent, flush, pin = self.sink, self.recent, self.flush, self.pin
        if min(sink, recent, pin) < 0 or flush < 1 or max(sink, recent, flush, pin) > layout.MAX_WINDOW:
            raise ValueError(f"need 0 ≤ sink, recent, pin ≤ {layout.MAX_WINDOW} and 1 ≤ flush ≤ {layout.MAX_WINDOW}, "
                             f"got sink={sink} recent={recent} flush={flush} pin={pin}")

    def check_shape(self, L: int, D: int) -> None:
        """The checks that need the rotations' shape: L rotation layers of head dim D."""
        G = layout.resolve_group_size(D, self.group_size)
        if self.key_block and (self.flush != self.key_block or G != D or self.pin):
            raise ValueError(f"keys per channel over {self.key_block}-token blocks need flush = key_block (got "
                             f"{self.flush}), values per row (group_size 0 or {D}, got {self.group_size}) and pin 0 "
                             f"(got {self.pin})")
        if self.key_bits is not None and len(self.key_bits) != L:
            choices = " or ".join(map(str, layout.KEY_BITS))
            raise ValueError(f"key_bits must be {L} entries of {choices}, got {list(self.key_bits)}")

    def layer_key_bits(self, L: int) -> tuple[int, ...]:
        return (layout.BITS,) * L if self.key_bits is None else self.key_bits

    def as_built(self) -> dict[str, int]:
        """The settings a manifest records (`QUANT_KEYS`), as this cache files tokens (pin 0 without
        quantization)."""
        return {"group_size": self.group_size, "sink": self.sink, "recent": self.recent, "flush": self.flush,
                "pin": self.pin if self.quantize else 0, "key_block": self.key_block}


@dataclass(frozen=True)
class Rotations:
    """The calibrated tensors of every rotation layer, checked and normalised on construction: k_rotation, v_rotation
    float32 [L, H, D, D] (H = H_kv per head, or 1 shared per layer); k_clip, v_clip float32 [L, H] (a float: every
    head); layer_ids: the model layer of each entry (default 0..L-1); k_mean, v_mean float32 [L, H, D] (None:
    uncentred, as version-1 artifacts): the centred codec's calibrated means in the model's basis (docs/format.md
    §6a)."""

    k_rotation: Tensor
    v_rotation: Tensor
    k_clip: Tensor | float = layout.DEFAULT_K_CLIP
    v_clip: Tensor | float = layout.DEFAULT_V_CLIP
    layer_ids: Tensor | Sequence[int] | None = None
    k_mean: Tensor | None = None
    v_mean: Tensor | None = None

    def __post_init__(self):
        set_ = self._set
        k_rotation, v_rotation = self.k_rotation.float(), self.v_rotation.float()
        square = k_rotation.dim() == 4 and k_rotation.shape[-1] == k_rotation.shape[-2]
        if not square or v_rotation.shape != k_rotation.shape:
            raise ValueError(
                f"k_rotation/v_rotation must both be [L, H, D, D], got {tuple(k_rotation.shape)} and "
                f"{tuple(v_rotation.shape)}"
            )
        set_(k_rotation=k_rotation, v_rotation=v_rotation)
        L, H, D, _ = k_rotation.shape
        for name in ("k_clip", "v_clip"):
            clip = torch.as_tensor(getattr(self, name), dtype=torch.float32).clone()  # fixed from here on
            clip = clip.expand(L, H) if clip.dim() == 0 else clip
            if clip.shape != (L, H):
                raise ValueError(f"{name} must be a float or [L, H] = [{L}, {H}], got {tuple(clip.shape)}")
            set_(**{name: clip})
        for name in ("k_mean", "v_mean"):
            mean = getattr(self, name)
            if mean is not None:
                mean = torch.as_tensor(mean).float()
                if mean.shape != (L, H, D):
                    raise ValueError(f"{name} must be [L, H, D] = [{L}, {H}, {D}], got {tuple(mean.shape)}")
                set_(**{name: mean})

    @property
    def shape(self) -> tuple[int, int, int]:
        """(L, H, D): rotation layers, heads per layer (H_kv or 1), head dim."""
        L, H, D, _ = self.k_rotation.shape
        return L, H, D

    def ids(self) -> list[int]:
        """The model layer of each entry, checked: L distinct non-negative indices."""
        L = self.shape[0]
        ids = self.layer_ids
        ids = [int(i) for i in (range(L) if ids is None else torch.as_tensor(ids).flatten().tolist())]
        if len(ids) != L or len(set(ids)) != L or min(ids) < 0:
            raise ValueError(f"layer_ids must be {L} distinct non-negative model layer indices, got {ids}")
        return ids

    @property
    def centred(self) -> bool:
        return self.k_mean is not None or self.v_mean is not None

    def _set(self, **fields) -> None:
        """Store normalised values from `__post_init__` (the dataclass is frozen)."""
        for name, value in fields.items():
            object.__setattr__(self, name, value)
