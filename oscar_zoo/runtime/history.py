"""The INT2 history of `cache.OscarLayer` (a mixin, as `pinning.PinnedTokens`): its storage growth and the rows it
files and reads back — keys per row (docs/format.md §6, §6b) or per channel over token blocks (§6d), values per row.
Needs the layer's hist_k/hist_v/sz_k/sz_v, pair_offsets, n_hist, rotation, group_size, key_block, quantize and
storage_version."""

from __future__ import annotations

import torch
from torch import Tensor

from ..format import layout, reference
from . import ops

HISTORY_CHUNK = 256  # the INT2 history grows in multiples of this many tokens (and by ≥ 1/4 of its size)


def new_storage_version() -> object:
    """A token naming one set of a layer's storage tensors: a new object, so it never equals another (across caches
    too) while anything that compares it (`graph.DecodeGraphs`) holds it."""
    return object()


class QuantizedHistory:
    """The history part of an `OscarLayer`."""

    def _ensure_history(self, needed: int) -> None:
        if self.parent is not None:  # a row's view (`rows.PaddedRows`): the layer grows every row
            self.parent._ensure_history(needed)
            return
        cap = self.hist_k.shape[2]
        if needed <= cap:
            return
        new_cap = -(-max(needed, cap + cap // 4) // HISTORY_CHUNK) * HISTORY_CHUNK
        for name in ("hist_k", "hist_v", "sz_k", "sz_v"):
            old = getattr(self, name)
            if old is None:
                continue
            new = self._like(name, old, new_cap)
            new[:, :, : old.shape[2]] = old  # (every row's live part, whatever its length)
            setattr(self, name, new)
        self.storage_version = new_storage_version()
        self.bind_rows()

    def _like(self, name: str, t: Tensor, T_cap: int) -> Tensor:
        """Zeroed storage for tier `name` shaped as t with T_cap tokens, in the tier's layout (V's codes
        token-major)."""
        if self.quantize and name == "hist_v":
            D = t.shape[3] * layout.CODES_PER_BYTE
            return layout.history_codes(t.shape[0], t.shape[1], T_cap, D, t.device, tokens_contiguous=True)
        if self.quantize and name == "sz_k" and self.key_block:
            T_cap //= self.key_block
        return torch.zeros(t.shape[:2] + (T_cap,) + t.shape[3:], dtype=t.dtype, device=t.device)

    def reserve(self, tokens: int) -> None:
        """Grow the INT2 history now so that a context of `tokens` needs no reallocation later (no re-capture)."""
        if self.is_initialized:
            self._ensure_history(max(0, tokens - self.sink - self.recent))

    def _quantize(self, rows: Tensor, keys: bool) -> tuple[Tensor, Tensor]:
        """Rotated BF16 rows [B, H, m, D] of K (`keys`) or V as the history stores them: packed codes and scale/zero
        pairs. Keys per channel (§6d) over blocks of `key_block` tokens (m whole blocks), unclipped; otherwise per row,
        clip → quantize (keys at the layer's bits, values INT2) → pack."""
        rot = self.rotation
        if keys and self.key_block:
            return ops.quantize_pack_channel(rows, self.key_block, rot.k_bits)
        if keys:
            return ops.quantize_pack(rows, rot.k_clip, self.group_size, min_ratio=rot.k_min_clip, bits=rot.k_bits)
        return ops.quantize_pack(rows, rot.v_clip, self.group_size, min_ratio=rot.v_min_clip)

    def _file_codes(self, keys: bool, rows: Tensor, codes: Tensor) -> None:
        """Packed rows [B, H, m, W] of K (`keys`; 3-bit ones in pairs, docs/format.md §6b) or V onto the history at
        rows `rows` ([m] int64, on the device: a captured step's too)."""
        if keys:
            reference.write_history_rows(self.hist_k, rows, codes, self.rotation.k_bits, self.pair_offsets)
        else:
            self.hist_v.index_copy_(2, rows, codes)

    def _append_history(self, k: Tensor, v: Tensor) -> None:
        """Quantize already-rotated BF16 rows [B, H, m, D] (no rotation; `_quantize`) onto the history."""
        m = k.shape[2]
        self._ensure_history(self.n_hist + m)
        rows = slice(self.n_hist, self.n_hist + m)
        if self.quantize:
            k_pairs = slice(self.n_hist // self.key_block, (self.n_hist + m) // self.key_block) if self.key_block \
                else rows
            codes, self.sz_k[:, :, k_pairs] = self._quantize(k, True)
            self._file_codes(True, torch.arange(self.n_hist, self.n_hist + m, device=codes.device), codes)
            self.hist_v[:, :, rows], self.sz_v[:, :, rows] = self._quantize(v, False)
        else:
            self.hist_k[:, :, rows], self.hist_v[:, :, rows] = k, v
        self.n_hist += m

    # ------------------------------------------------------------------------------------------------- reading

    def history(self) -> tuple[Tensor, Tensor]:
        """The live history rows as fp32 K, V [B, H, n_hist, D] (dequantized when quantized)."""
        rows = slice(0, self.n_hist)
        if not self.quantize:
            return self.hist_k[:, :, rows].float(), self.hist_v[:, :, rows].float()
        bits = self.rotation.k_bits
        codes_k = reference.read_history_rows(self.hist_k, self.n_hist, bits)
        if self.key_block:
            blocks = slice(0, self.n_hist // self.key_block)
            k = reference.dequantize_unpack_channel(codes_k, self.sz_k[:, :, blocks], bits)
        else:
            k = reference.dequantize_unpack(codes_k, self.sz_k[:, :, rows], bits)
        v = reference.dequantize_unpack(self.hist_v[:, :, rows], self.sz_v[:, :, rows])
        return k, v
