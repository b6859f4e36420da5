"""Padded batches (a mixin of `cache.OscarLayer`, as `history.QuantizedHistory`): the rows of a batch whose prompts
differ in length, each filed exactly as it would be alone.

transformers batches prompts of different lengths by left padding (`tokenizer(prompts, padding=True,
padding_side="left")`): row b of the first chunk starts with `pads[b]` padding positions, its position ids count from
its first real token, and every later token is real. When such a chunk reaches an empty layer (`update` with `pads`,
which the attention module's hook takes from the chunk's padding mask), the layer becomes *ragged*: each row gets a
view — a batch-1 `OscarLayer` whose storage tensors are row b of the layer's and whose device lengths are element b of
its int32 [B] lengths — with host lengths of its own. Prompt chunks and steps that are not static go through the views
one by one with the row's real tokens only, so every row's sink, pinned tokens, INT2 history (its blocks, clips and
scales) and recent window hold what batch 1 would hold, and demotion comes at the row's own pace. Padding is never
filed, never quantized, never counted in a window.

A single-token step with every row past its windows stays one batched launch per tier: the token is written at each
row's own recent slot (`rotate_op.rotate_rows` reads the slot per row), and only the rows whose recent window is full
demote (`demotes_next` is then the tuple of rows' answers; a CUDA graph is captured per distinct tuple, at most one per
phase of the rows in the `flush` cycle). The decode kernels read every tier length per row already.

The views share the layer's storage: history growth is always the layer's (a view asks the layer, which regrows every
row and re-points the views), and batch operations (`reorder_cache`, `batch_select_indices`, ...) move the views with
their rows. The batch operations transformers calls (`reorder_cache`, `batch_repeat_interleave`,
`batch_select_indices`) and `crop` are here too, for uniform and ragged layers alike."""

from __future__ import annotations

import copy

import torch
from torch import Tensor


class PaddedRows:
    """The ragged part of an `OscarLayer` (needs its storage and length tensors, `_STORAGE`, `_LENGTHS`, host lengths
    and `storage_version`). `rows` is None while every row has the same lengths (the layer's own host lengths then hold
    for all of them); `parent` is the layer a view belongs to (None: not a view)."""

    rows: list | None = None
    pads: list[int] | None = None
    parent: PaddedRows | None = None

    # ------------------------------------------------------------------------------------------- becoming ragged

    def make_rows(self, pads: list[int]) -> None:
        """Split an initialised, empty layer into one view per batch row; row b's first chunk has `pads[b]` leading
        padding positions."""
        self.rows = []
        for b in range(len(pads)):
            row = copy.copy(self)
            row.rows = row.pads = None
            row.parent, row.batch_size = self, 1
            row.n_sink = row.n_hist = row.n_recent = row.n_pinned = 0
            row.staged = row.pending = None
            self.rows.append(row)
        self.pads = list(pads)
        self.bind_rows()

    def pad_more(self, pads: list[int]) -> None:
        """A later prompt chunk with `pads[b]` more leading padding positions (transformers' chunked prefill, when a
        row's padding is longer than a chunk): only rows that hold no token yet may still be padded."""
        for b, (row, pad) in enumerate(zip(self.rows, pads)):
            if pad and row.get_seq_length():
                raise ValueError(f"row {b} of a padded batch has padding after its tokens: padding can only lead a "
                                 f"sequence (pad prompts on the left)")
        self.pads = [a + b for a, b in zip(self.pads, pads)]

    def bind_rows(self) -> None:
        """Point every view at row b of the layer's current storage and lengths (after any of them was replaced)."""
        for b, row in enumerate(self.rows or ()):
            for name in self._STORAGE + self._LENGTHS:
                t = getattr(self, name)
                setattr(row, name, None if t is None else t[b : b + 1])
            row.storage_version = self.storage_version

    # ------------------------------------------------------------------------------------------------- filing

    def file_rows(self, key: Tensor, value: Tensor, pads: list[int]) -> tuple[Tensor, Tensor]:
        """A chunk [B, H, n, D] of a ragged layer filed row by row: row b's last n − pads[b] tokens through its view
        (`update`, batch 1). Returns the rotated chunk [B, H, n, D] (padding positions zero). A prompt chunk's views
        keep their `pending` for the attention, which runs row by row too; a single token's are dropped (the decode
        kernels read every row's tiers in one launch)."""
        k_rot, v_rot = key.new_zeros(key.shape), value.new_zeros(value.shape)
        n = key.shape[2]
        for b, (row, pad) in enumerate(zip(self.rows, pads)):
            if pad < n:
                k_rot[b : b + 1, :, pad:], v_rot[b : b + 1, :, pad:] = row.update(key[b : b + 1, :, pad:],
                                                                                  value[b : b + 1, :, pad:])
            if n == 1:
                row.pending = None
        return k_rot, v_rot

    def write_rows(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """A static single-token step of a ragged layer, batched: the token written at each row's recent slot, then
        the rows whose window is full demote (each at its own history length); the host lengths advance per row."""
        demote = self.demotes_next()
        self.reserve_demotion()  # as `OscarCache.static_step_key` before a capture: same capacity, same splits
        k, v = self._rotate(key, value, write=True)
        self.recent_len.add_(1)
        for row, d in zip(self.rows, demote):
            if d:
                row._demote()
            row.advance_host()
        return k, v

    # ---------------------------------------------------------------------------------------- the host mirror

    def rows_static(self) -> bool:
        return all(row.is_static_step(1) and row.staged is None for row in self.rows)

    def rows_demote_next(self) -> tuple[bool, ...]:
        return tuple(row.demotes_next() for row in self.rows)

    def rows_seq_length(self) -> int:
        """The padded length of the batch (the positions transformers counts: padding included, equal for every row)."""
        return self.pads[0] + self.rows[0].get_seq_length()

    def host_state(self) -> tuple:
        """The host lengths (per row when ragged), as `restore_host_state` takes them back."""
        if self.rows is None:
            return (self.n_sink, self.n_hist, self.n_recent, self.n_pinned)
        return tuple(row.host_state() for row in self.rows)

    def restore_host_state(self, state: tuple) -> None:
        if self.rows is None:
            self.n_sink, self.n_hist, self.n_recent, self.n_pinned = state
        else:
            for row, s in zip(self.rows, state):
                row.restore_host_state(s)
        self.pending = None

    # ------------------------------------------------------------- transformers' batch operations and crop

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens of every row (transformers' convention: ≤ 0; assisted decoding
        rejects draft tokens this way). They must still be BF16: in the recent window, or in the sink while the
        history is empty (INT2 demotion is not reversible); ValueError otherwise, before anything changes."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the number of tokens to remove as a negative number, got {tokens_to_remove}")
        drop = -tokens_to_remove
        if drop == 0 or not self.is_initialized:
            return
        rows = self.rows if self.rows is not None else [self]
        for row in rows:
            bf16 = row.n_recent + (row.n_sink if row.n_hist == row.n_pinned == 0 else 0)
            if self.rows is not None and drop > row.get_seq_length():
                raise ValueError(f"layer {self.layer_idx}: cannot remove the last {drop} tokens: a row holds "
                                 f"{row.get_seq_length()} (the rest of its positions are padding)")
            if row.staged is not None or drop > bf16:
                raise ValueError(f"layer {self.layer_idx}: cannot remove the last {drop} tokens: only the last {bf16} "
                                 f"are still BF16 (the rest are INT2 history, which is not reversible)")
        for row in rows:
            from_recent = min(drop, row.n_recent)
            row.n_recent -= from_recent
            row.n_sink -= drop - from_recent
        self._sync_lengths()

    def _map_storage(self, fn, index: list[int]) -> None:
        """Apply `fn` (a map of the batch axis that takes rows `index`) to every storage tensor."""
        if not self.is_initialized:
            return
        for name in self._STORAGE:
            t = getattr(self, name)
            if t is None:
                continue
            if name == "hist_v" and self.quantize:  # fn maps the batch axis: apply it to the token-major storage
                setattr(self, name, fn(t.transpose(2, 3)).transpose(2, 3))
            else:
                setattr(self, name, fn(t))
        if self.staged is not None:
            self.staged = (fn(self.staged[0]), fn(self.staged[1]))
        self.batch_size = self.sink_k.shape[0]
        self.map_rows(index)
        self._new_lengths()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_storage(lambda t: t.index_select(0, beam_idx.to(t.device)), beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_storage(lambda t: t.repeat_interleave(repeats, dim=0),
                          [b for b in range(self.batch_size) for _ in range(repeats)])

    def batch_select_indices(self, indices: Tensor) -> None:
        self._map_storage(lambda t: t[indices], torch.arange(self.batch_size)[indices.cpu()].tolist())

    def map_rows(self, index: list[int]) -> None:
        """After a batch operation took rows `index` of the storage: the views of those rows, re-pointed."""
        if self.rows is None:
            return
        self.rows = [copy.copy(self.rows[i]) for i in index]
        self.pads = [self.pads[i] for i in index]
        self.bind_rows()
