"""OscarCache: the OSCAR three-tier KV cache (BF16 sink, INT2 history, BF16 recent) as a transformers `Cache`.

Storage follows `format/layout.py`; all tiers hold rotated keys/values (k·M_K, v·M_V), centred when the artifacts carry
means (k·M_K − μ_K·M_K, v·M_V − μ_V·M_V: docs/format.md §6a). `update` rotates (and centres) and files the new
tokens, demoting the oldest recent tokens into the INT2 history with `ops.quantize_pack`; the attention function in
`attention.py` reads the tiers back (decode through `ops.tiered_decode_attention`). Use with
`model.generate(..., cache=OscarCache.from_folder(path))` on a model switched to attn_implementation="oscar".

A cache is built from two values: `Rotations` (the calibrated tensors of every rotation layer, checked on
construction) and `CacheSettings` (how tokens are filed: windows, group size, key bits and blocks, pinning; frozen, its
constructor holds the checks). `OscarCache.from_folder(path, **overrides)` reads both from an artifact folder.
The cache knows nothing of attention or compilation: the model's `binding.OscarBinding` tells it (`binding`).

A single-token decode step is *static*: every tensor it touches keeps its address and shape, tier lengths live on the
device (int32 [B], updated in place) and writes are indexed by them, so the step can be captured as a CUDA graph
(`graph.py`). The host keeps a mirror of the lengths (Python ints, advanced by the same rule, never read back).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from ..format import layout, reference
from ..format.io import Artifact, read_artifact
from ..format.validate import check_mean
from . import ops, rotate_op
from .cache_settings import CacheSettings, Rotations
from .history import HISTORY_CHUNK, QuantizedHistory, new_storage_version
from .pinning import PinnedTokens
from .rotation import Rotation, fingerprint
from .rows import PaddedRows

CACHE_ARGS = ("cache", "past_key_values")  # what transformers 5.x calls the cache argument of a model or its attention


@dataclass
class Pending:
    """What `update` hands to the attention function of the same layer: the rotated chunk it returned, and, for a
    multi-token chunk after earlier tokens, those tokens as their tiers presented them before the chunk followed by the
    chunk's own K/V, [B, H, past_len + n, D] each in the chunk's dtype (`OscarLayer.dense_kv`)."""

    key: Tensor
    past: tuple[Tensor, Tensor] | None
    past_len: int


class OscarLayer(PaddedRows, PinnedTokens, QuantizedHistory, CacheLayerMixin):
    """One attention layer's tiers. The rows of a batch share the layer's host lengths until a padded prompt makes
    them differ; each row then has its own (`rows.PaddedRows`)."""

    is_compileable = True  # the decode step is static (see the module docstring); generate() then uses graph.py
    is_sliding = False
    is_croppable = True  # the last tokens, while they are in the BF16 recent window (`crop`)
    _STORAGE = ("sink_k", "sink_v", "hist_k", "hist_v", "sz_k", "sz_v", "recent_k", "recent_v")
    _LENGTHS = ("sink_len", "hist_len", "recent_len")

    def __init__(self, rotation: Rotation | None, layer_idx: int, settings: CacheSettings = CacheSettings()):
        super().__init__()
        self.rotation, self.layer_idx, self.settings = rotation, layer_idx, settings
        self.group_size = settings.group_size
        self.key_block = settings.key_block  # > 0: history keys per channel over blocks of this many tokens (§6d)
        self.v_fingerprint = fingerprint(rotation.v) if rotation is not None else None  # identifies M_V for folds
        self.sink, self.recent, self.flush, self.quantize = settings.sink, settings.recent, settings.flush, \
            settings.quantize
        self.pin = settings.pin if settings.quantize else 0  # history tokens per KV head a prompt pins in BF16 (§6c)
        self.n_sink = self.n_hist = self.n_recent = self.n_pinned = 0
        self.staged: tuple[Tensor, Tensor] | None = None  # a prompt chunk's rows bound for the history, until pinned
        self.storage_version = new_storage_version()  # renewed whenever a storage tensor is replaced (a captured
        # step must be re-captured)
        self.pending: Pending | None = None
        self.pair_offsets: Tensor | None = None  # 3-bit keys: `reference.pair_offsets` of a history row
        self.next_pads: list[int] | None = None  # the leading padding of each row of the next chunk (`expect_padding`)
        self.v_folded = False  # the model's v_proj/o_proj carry M_V (attention.fold_value_rotation): values arrive
        # rotated and outputs leave un-rotated, so neither is done here
        self._per_query_head: dict[int, tuple[Tensor, Tensor, Tensor | None]] = {}

    # ------------------------------------------------------------------------------------------------ allocation

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        if self.rotation is None:
            raise ValueError(
                f"model layer {self.layer_idx} has no OSCAR rotation (its layer_ids do not include it): build the "
                f"cache from artifacts calibrated for this model, covering every attention layer"
            )
        B, H, _, D = key_states.shape
        H_rot, D_rot = self.rotation.k.shape[0], self.rotation.k.shape[-1]
        if D_rot != D or H_rot not in (1, H):
            raise ValueError(
                f"layer {self.layer_idx}: rotation shape [{H_rot}, {D_rot}, {D_rot}] does not fit keys with {H} KV "
                f"heads of head_dim {D}: the artifacts were made for another model"
            )
        G = layout.resolve_group_size(D, self.group_size)
        self.device = key_states.device
        self.rotation = self.rotation.to(self.device)
        self._per_query_head = {}
        bf16 = dict(dtype=layout.TIER_DTYPE, device=self.device)
        self.sink_k = torch.zeros(B, H, self.sink + self.pin, D, **bf16)  # the sink, then the pinned tokens
        self.sink_v = torch.zeros(B, H, self.sink + self.pin, D, **bf16)
        self.recent_k = torch.zeros(B, H, self.recent + self.flush, D, **bf16)
        self.recent_v = torch.zeros(B, H, self.recent + self.flush, D, **bf16)
        if self.quantize:  # codes [B, H, T_cap, packed] (K: packed_dim(D, k_bits); V: D/4, token-major) + float16
            # scale/zero [B, H, T_cap, D/G, 2]
            self.hist_k = layout.history_codes(B, H, HISTORY_CHUNK, D, self.device, bits=self.rotation.k_bits)
            # where a 3-bit key row's bytes sit in its pair (docs/format.md §6b), made here, outside any capture
            self.pair_offsets = reference.pair_offsets(self.hist_k.shape[-1], self.device) \
                if self.rotation.k_bits == 3 else None
            self.hist_v = layout.history_codes(B, H, HISTORY_CHUNK, D, self.device, tokens_contiguous=True)
            k_pairs = (HISTORY_CHUNK // self.key_block, D) if self.key_block else (HISTORY_CHUNK, D // G)  # §6d
            self.sz_k = torch.zeros(B, H, *k_pairs, 2, dtype=layout.SCALE_DTYPE, device=self.device)
            self.sz_v = torch.zeros(B, H, HISTORY_CHUNK, D // G, 2, dtype=layout.SCALE_DTYPE, device=self.device)
        else:  # test switch: history kept in BF16 [B, H, T_cap, D], no scale/zero
            self.hist_k = torch.zeros(B, H, HISTORY_CHUNK, D, **bf16)
            self.hist_v = torch.zeros(B, H, HISTORY_CHUNK, D, **bf16)
            self.sz_k = self.sz_v = None
        self.batch_size = B
        self.is_initialized = True
        self.rows = self.pads = None
        self._new_lengths()

    def _host_tier_lengths(self) -> tuple[int, int, int]:
        """The lengths of the three tiers the decode kernels read: the BF16 sink tier holds the pinned tokens too."""
        return self.n_sink + self.n_pinned, self.n_hist, self.n_recent

    def _new_lengths(self) -> None:
        """(Re)allocate the int32 [B] per-tier lengths the decode kernels read, from the host mirror."""
        for name, n in zip(self._LENGTHS, self._host_tier_lengths()):
            setattr(self, name, torch.full((self.batch_size,), n, dtype=torch.int32, device=self.device))
        self.storage_version = new_storage_version()
        if self.rows is not None:
            self.bind_rows()
            self._sync_lengths()

    def _sync_lengths(self) -> None:
        """Write the host mirror into the device lengths, in place (their addresses stay valid for a captured step)."""
        if self.rows is not None:
            for row in self.rows:
                row._sync_lengths()
            return
        for name, n in zip(self._LENGTHS, self._host_tier_lengths()):
            getattr(self, name).fill_(n)

    def per_query_head(self, n_q_heads: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """(M_K, M_Vᵀ) per query head [H_q, D, D] (shared: [1, D, D]) and μ_V·M_V per query head [H_q, D] (shared:
        [1, D]; None when uncentred), made once per layer and head count."""
        if n_q_heads not in self._per_query_head:
            rot = self.rotation
            mk = rot.per_query_head(rot.k, n_q_heads).contiguous()
            mvt = rot.per_query_head(rot.v, n_q_heads).transpose(-1, -2).contiguous()
            mu_v = None
            if rot.v_mean is not None:
                mu_v = rot.v_mean if rot.v_mean.shape[0] == 1 else rot.v_mean.repeat_interleave(
                    n_q_heads // rot.v_mean.shape[0], dim=0)
                mu_v = mu_v.contiguous()
            self._per_query_head[n_q_heads] = (mk, mvt, mu_v)
        return self._per_query_head[n_q_heads]

    # ------------------------------------------------------------------------------------------------- writing

    def expect_padding(self, pads: list[int] | None) -> None:
        """The next chunk's rows start with pads[b] padding positions (left padding; None: none)."""
        self.next_pads = pads

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Rotate (and centre, `reference.rotate_centred`) the new K/V [B, H_kv, n, D], file them into the tiers, and
        return the rotated chunk as the tiers hold it (in the input dtype, unquantized: a chunk attends to its own exact
        K/V). Leaves a `Pending` for this layer's attention. A chunk announced as padded (`expect_padding`) must be
        the first, or (chunked prefill) pad only rows that hold no token yet; from then on every row is filed as it
        would be alone (`rows.PaddedRows`)."""
        pads, self.next_pads = self.next_pads, None
        if not self.is_initialized or (self.get_seq_length() == 0 and key_states.shape[0] != self.batch_size):
            self.lazy_initialization(key_states, value_states)  # an empty (new or reset) cache takes any batch size
        if key_states.shape[0] != self.batch_size:
            raise ValueError(f"batch size changed from {self.batch_size} to {key_states.shape[0]} within one cache")
        if pads is not None and self.rows is not None:
            self.pad_more(pads)  # a later chunk of a padded prompt (chunked prefill) still padding some rows
        elif pads is not None:
            if self.get_seq_length() > 0:
                raise ValueError("a padded chunk after earlier tokens: padding can only lead a sequence (pad prompts "
                                 "on the left, and start each padded batch with an empty cache)")
            self.make_rows(pads)
        if self.rows is not None:
            n, past_len = key_states.shape[2], self.get_seq_length()
            if n == 1 and self.rows_static():
                k_rot, v_rot = self.write_rows(key_states, value_states)
            else:
                k_rot, v_rot = self.file_rows(key_states, value_states, pads or [0] * self.batch_size)
            self.pending = Pending(k_rot, None, past_len)
            return k_rot, v_rot
        if self.staged is not None and key_states.shape[2] == 1:  # a decode step after a prompt whose attention never
            self.pin_tokens(None)  # chose (K/V filed by `update` alone): the rows go to the history, unpinned
        n, past_len = key_states.shape[2], self.get_seq_length()
        past = None
        if self.is_static_step(n):
            # room for the next two demotions, every step (as `OscarCache.static_step_key` before a capture): the eager
            # and the captured step run on the same capacity, and so the same splits
            self.reserve_demotion()
            k_rot, v_rot = self.write_token(key_states, value_states, self.demotes_next())
            self.advance_host()
        else:
            k_rot, v_rot = self._rotate(key_states, value_states)
            # a later chunk: every earlier token and the chunk's own K/V in one buffer of the chunk's dtype (what its
            # attention reads), written before the chunk is filed (filing demotes recent rows into the INT2 history)
            past = self.dense_kv(k_rot.dtype, (k_rot, v_rot)) if n > 1 and past_len > 0 else None
            self._append(k_rot.to(layout.TIER_DTYPE), v_rot.to(layout.TIER_DTYPE), multi=n > 1)
        self.pending = Pending(k_rot, past, past_len)
        return k_rot, v_rot

    def _rotate(self, key: Tensor, value: Tensor, write: bool = False) -> tuple[Tensor, Tensor]:
        """k·M_K − μ_K·M_K and v·M_V − μ_V·M_V [B, H_kv, n, D] in the input dtype (`reference.rotate_centred`). One
        token goes through `rotate_op.rotate_rows` (one launch each, the same rows whether or not the step is static);
        `write` also files it at recent slot `recent_len` (read on the device; the batch shares one length)."""
        rot = self.rotation
        m_v = None if self.v_folded else rot.v
        if key.shape[2] != 1:
            return rotate_op.rotate_chunk(key, rot.k, rot.k_mean), rotate_op.rotate_chunk(value, m_v, rot.v_mean)
        slot = self.recent_len if write else None
        k = rotate_op.rotate_rows(key[:, :, 0], rot.k, rot.k_mean, dest=self.recent_k if write else None, slot=slot)
        v = rotate_op.rotate_rows(value[:, :, 0], m_v, rot.v_mean, dest=self.recent_v if write else None, slot=slot)
        return k.unsqueeze(2), v.unsqueeze(2)

    def bind_value_fold(self, fold: str | None) -> None:
        """Told by the attention module before each call: the fingerprint of the M_V folded into its weights (None:
        not folded). Only the rotation this layer holds may be folded; another one would mix two value bases."""
        if fold is not None and fold != self.v_fingerprint:
            raise ValueError(
                f"layer {self.layer_idx}: the model's v_proj/o_proj carry another value rotation than this "
                f"OscarCache's; fold_value_rotation with this cache's rotations, or reload the model"
            )
        self.v_folded = fold is not None
        for row in self.rows or ():  # a padded batch's row views rotate and un-rotate by the same switch
            row.v_folded = self.v_folded

    def take_pending(self, key: Tensor) -> Pending:
        """The update this layer's attention call belongs to, consumed. Raises if there is none, or if the key the
        attention got is not the one `update` returned (a model that copies or casts it would read the wrong keys)."""
        pending, self.pending = self.pending, None
        if pending is None:
            raise RuntimeError(
                f"OscarCache layer {self.layer_idx} was not updated before its attention ran: the cache's layers do "
                f"not match the model's (build the cache for this model, one entry per attention layer, in model order)"
            )
        if key is not pending.key:
            raise RuntimeError(
                f"layer {self.layer_idx}: the key reaching attention is not the one OscarCache.update returned (the "
                f"model copied or cast it); OSCAR needs the rotated key as returned, so this model is not supported"
            )
        return pending

    def is_static_step(self, n: int) -> bool:
        """True when a chunk of `n` tokens is a static decode step: one token, sink full, recent tier past its window
        (so each step writes one recent slot, and every `flush`-th step demotes the oldest `flush` rows), in every
        row."""
        if self.rows is not None:
            return n == 1 and self.rows_static()
        return n == 1 and self.n_sink == self.sink and self.n_recent >= self.recent

    def demotes_next(self) -> bool | tuple[bool, ...]:
        """Whether the next static step demotes (ragged: per row)."""
        if self.rows is not None:
            return self.rows_demote_next()
        return self.n_recent + 1 >= self.recent + self.flush

    def reserve_demotion(self) -> None:
        """Grow the history now for the rows the next two demotions write (a captured step never allocates; the step
        that captures both step kinds ahead of their turn may itself demote, and still finds room for the next)."""
        hist = max(row.n_hist for row in self.rows) if self.rows is not None else self.n_hist
        self._ensure_history(hist + 2 * self.flush)

    def write_token(self, key: Tensor, value: Tensor, demote: bool) -> tuple[Tensor, Tensor]:
        """The static decode write (device work only): the new key and value [B, H, 1, D] are rotated, centred and
        written to recent slot `recent_len` (one launch each); with `demote` the oldest `flush` recent rows are
        quantized onto the history at row `hist_len` and the window shifts down. Returns the rotated rows."""
        k, v = self._rotate(key, value, write=True)
        self.recent_len.add_(1)
        if demote:
            self._demote()
        return k, v

    def _demote(self) -> None:
        """The oldest `flush` recent rows quantized (clip → INT2 → pack) onto the history at row `hist_len`; the recent
        window shifts down by `flush`. The step reserved the rows first (`reserve_demotion`)."""
        F, W = self.flush, self.recent
        rows = self.hist_len[:1].long() + torch.arange(F, device=self.device)  # [F] history rows written
        for tier, hist, sz in ((self.recent_k, self.hist_k, self.sz_k), (self.recent_v, self.hist_v, self.sz_v)):
            if self.quantize:
                keys = hist is self.hist_k
                codes, scale_zero = self._quantize(tier[:, :, :F], keys)
                self._file_codes(keys, rows, codes)
                # per-channel keys: one block of pairs, at block hist_len / key_block (F = key_block)
                sz.index_copy_(2, rows[:1] // self.key_block if keys and self.key_block else rows, scale_zero)
            else:
                hist.index_copy_(2, rows, tier[:, :, :F])
            tier[:, :, :W] = tier[:, :, F : F + W].clone()
        self.recent_len.sub_(F)
        self.hist_len.add_(F)

    def advance_host(self) -> None:
        """Advance the host mirror of the lengths by one static decode step (what `write_token` did on the device)."""
        if self.rows is not None:
            for row in self.rows:
                row.advance_host()
            return
        demote = self.demotes_next()
        self.n_recent += 1 - (self.flush if demote else 0)
        self.n_hist += self.flush if demote else 0

    def file_rotated(self, k: Tensor, v: Tensor) -> None:
        """File already-rotated (and centred) BF16 rows [B, H, n, D] of a prompt chunk as `update` files them, without
        rotating and without an attention call (a benchmark fills a long context this way); with `pin` the chunk's
        history rows wait in `staged` until `pin_tokens`. Initialise the layer first (`lazy_initialization`)."""
        self._append(k.to(layout.TIER_DTYPE), v.to(layout.TIER_DTYPE), multi=True)

    def _append(self, k: Tensor, v: Tensor, multi: bool) -> None:
        """Sink first (positions < sink), then recent; demote the oldest recent tokens into the history: a multi-token
        chunk leaves exactly `recent` of them, a single token triggers a demotion of `flush` at recent + flush."""
        take = min(k.shape[2], self.sink - self.n_sink)
        if take > 0:
            self.sink_k[:, :, self.n_sink : self.n_sink + take] = k[:, :, :take]
            self.sink_v[:, :, self.n_sink : self.n_sink + take] = v[:, :, :take]
            self.n_sink += take
            k, v = k[:, :, take:], v[:, :, take:]
        m = k.shape[2]
        if m > 0:
            total = self.n_recent + m
            full = total > self.recent and (multi or total >= self.recent + self.flush)
            n_demote = total - self.recent if full else 0
            if self.key_block:  # per-channel keys: the history takes whole blocks (the rest wait in the recent tier)
                n_demote -= n_demote % self.key_block
            if n_demote == 0:
                self.recent_k[:, :, self.n_recent : total] = k
                self.recent_v[:, :, self.n_recent : total] = v
            else:
                all_k = torch.cat([self.recent_k[:, :, : self.n_recent], k], dim=2)  # [B, H, total, D]
                all_v = torch.cat([self.recent_v[:, :, : self.n_recent], v], dim=2)
                if multi and self.pin:  # a prompt chunk: its attention chooses the pinned tokens first (`pin_tokens`);
                    # rows of earlier chunks no attention has seen yet wait with them, in position order
                    staged = (all_k[:, :, :n_demote], all_v[:, :, :n_demote])
                    if self.staged is not None:
                        staged = tuple(torch.cat([old, new], dim=2) for old, new in zip(self.staged, staged))
                    self.staged = staged
                else:
                    self._append_history(all_k[:, :, :n_demote], all_v[:, :, :n_demote])
                self.recent_k[:, :, : total - n_demote] = all_k[:, :, n_demote:]
                self.recent_v[:, :, : total - n_demote] = all_v[:, :, n_demote:]
                total -= n_demote
            self.n_recent = total
        self._sync_lengths()

    def dense_kv(self, dtype: torch.dtype = torch.float32, extra: tuple[Tensor, Tensor] | None = None
                 ) -> tuple[Tensor, Tensor]:
        """All cached tokens as the tiers present them (rotated, and centred when the cache has means), rows still
        waiting to be pinned as the INT2 history would hold them, K, V [B, H, T, D] in `dtype`; in position order but
        for the pinned tokens, which follow the sink. `extra` (a chunk's own K, V [B, H, n, D]) follows them in the
        same buffers. Each tier is written once into its slice: the history dequantized straight into `dtype`
        (`ops.dequantize_into`: float32 values rounded once), no float32 copy of the whole and no concatenation."""
        n_sink = self.n_sink + self.n_pinned
        staged = self._staged_as_history() if self.staged is not None else None
        rows = [(self.sink_k[:, :, :n_sink], self.sink_v[:, :, :n_sink]), staged,
                (self.recent_k[:, :, : self.n_recent], self.recent_v[:, :, : self.n_recent]), extra]
        B, H, _, D = self.sink_k.shape
        T = self.n_hist + sum(r[0].shape[2] for r in rows if r is not None)
        k, v = (torch.empty(B, H, T, D, dtype=dtype, device=self.sink_k.device) for _ in range(2))
        hist, at = slice(0, self.n_hist), n_sink + self.n_hist
        if self.quantize:
            blocks = self.n_hist // self.key_block if self.key_block else self.n_hist
            codes_k = reference.read_history_rows(self.hist_k, self.n_hist, self.rotation.k_bits)
            ops.dequantize_into(k[:, :, n_sink:at], codes_k, self.sz_k[:, :, :blocks], self.rotation.k_bits,
                                self.key_block)
            ops.dequantize_into(v[:, :, n_sink:at], self.hist_v[:, :, hist], self.sz_v[:, :, hist])
        else:  # (the BF16-history test switch)
            k[:, :, n_sink:at], v[:, :, n_sink:at] = self.hist_k[:, :, hist], self.hist_v[:, :, hist]
        k[:, :, :n_sink], v[:, :, :n_sink] = rows[0]
        for part in rows[1:]:  # after the history: staged rows, the recent tier, `extra`
            if part is not None:
                n = part[0].shape[2]
                k[:, :, at : at + n], v[:, :, at : at + n] = part
                at += n
        return k, v

    def tier_args(self) -> tuple[Tensor, ...]:
        """The tier tensors in `ops.tiered_decode_attention` order, after q and before sm_scale."""
        return (
            self.sink_k, self.sink_v, self.sink_len,
            self.hist_k, self.sz_k, self.hist_v, self.sz_v, self.hist_len,
            self.recent_k, self.recent_v, self.recent_len,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------ transformers API

    def get_seq_length(self) -> int:
        if self.rows is not None:
            return self.rows_seq_length()
        staged = self.staged[0].shape[2] if self.staged is not None else 0
        return self.n_sink + self.n_pinned + self.n_hist + self.n_recent + staged

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.n_sink = self.n_hist = self.n_recent = self.n_pinned = 0
        self.pending = self.staged = self.next_pads = None
        self.rows = self.pads = None
        if self.is_initialized:
            self._sync_lengths()

    def offload(self):
        raise NotImplementedError("OscarCache does not support offloading")

    def memory_bytes(self) -> int:
        """Bytes allocated by this layer's cache tensors (tiers, history capacity included, lengths, and a 3-bit
        layer's pair offsets)."""
        if not self.is_initialized:
            return 0
        names = self._STORAGE + self._LENGTHS + ("pair_offsets",)
        return sum(getattr(self, n).nbytes for n in names if getattr(self, n) is not None)


class OscarCache(Cache):
    """The OSCAR INT2 KV cache for `model.generate(..., past_key_values=cache)` (attn_implementation="oscar"), built
    from `Rotations` (the calibrated tensors) and `CacheSettings`:

        cache = OscarCache.from_folder("artifacts/")                    # an artifact folder (manifest settings)
        cache = OscarCache.from_folder("artifacts/", recent=512)        # a setting overridden
        cache = OscarCache(Rotations(k_rotation, v_rotation, k_clip, v_clip), CacheSettings(pin=32))

    One cache holds one context. Passed to a second `generate()`, it continues from the tokens it already holds (as
    transformers' DynamicCache does): the second prompt is read as a continuation of the first context, with no
    warning. Build a new cache for each independent generation (`from_folder` is cheap; storage is allocated on first
    use), or empty this one first with `cache.reset()`."""

    def __init__(self, rotations: Rotations, settings: CacheSettings = CacheSettings()):
        if not isinstance(rotations, Rotations) or not isinstance(settings, CacheSettings):
            raise TypeError("OscarCache(rotations, settings) takes a Rotations and a CacheSettings; "
                            "OscarCache.from_tensors(k_rotation, v_rotation, ..., **settings) builds both")
        L, H, D = rotations.shape
        settings.check_shape(L, D)
        ids = rotations.ids()
        for name in ("k_mean", "v_mean"):
            if getattr(rotations, name) is not None:
                check_mean(name, getattr(rotations, name), ids)
        n_layers = settings.num_layers if settings.num_layers is not None else max(ids) + 1
        if max(ids) >= n_layers:
            raise ValueError(f"layer_ids {ids} reach past num_layers={n_layers}")
        key_bits, by_layer = settings.layer_key_bits(L), {lid: i for i, lid in enumerate(ids)}
        layers = []
        for idx in range(n_layers):
            i = by_layer.get(idx)
            rot = None
            if i is not None:
                mu_k, mu_v = (None if m is None else reference.rotate_mean(m[i], r[i]) for m, r in
                              ((rotations.k_mean, rotations.k_rotation), (rotations.v_mean, rotations.v_rotation)))
                rot = Rotation(rotations.k_rotation[i], rotations.v_rotation[i], rotations.k_clip[i].reshape(H, 1),
                               rotations.v_clip[i].reshape(H, 1), mu_k, mu_v, k_bits=key_bits[i])
            layers.append(OscarLayer(rot, idx, settings))
        super().__init__(layers=layers)
        self.rotations, self.settings = rotations, settings
        self.quantize = settings.quantize
        self.centred = rotations.centred
        self.binding = None  # the model's binding.OscarBinding, told by its attention modules before each update
        self.read_from_artifact = False  # from_artifact/from_folder: the means meet the model's bounds (binding.admit)
        self.kernels_ready = False  # set by attention.warm_up at the first call on a GPU

    @property
    def quant_settings(self) -> dict[str, int]:
        """The settings as built, in a manifest's terms (`CacheSettings.as_built`)."""
        return self.settings.as_built()

    @classmethod
    def from_tensors(cls, k_rotation: Tensor, v_rotation: Tensor, k_clip: Tensor | float = layout.DEFAULT_K_CLIP,
                     v_clip: Tensor | float = layout.DEFAULT_V_CLIP, layer_ids: Tensor | Sequence[int] | None = None,
                     *, k_mean: Tensor | None = None, v_mean: Tensor | None = None, **settings) -> OscarCache:
        """`OscarCache(Rotations(k_rotation, …, v_mean), CacheSettings(**settings))`."""
        return cls(Rotations(k_rotation, v_rotation, k_clip, v_clip, layer_ids, k_mean, v_mean),
                   CacheSettings(**settings))

    @classmethod
    def from_artifact(cls, art: Artifact, **overrides) -> OscarCache:
        """Build from an artifact as `read_artifact` returns it: its tensors, and its settings with keyword
        overrides winning (any `CacheSettings` field). The model is not known here: its means are held to the model's
        bounds when a model first uses the cache (`binding.OscarBinding.admit`, `format.model_bounds`)."""
        t = art.tensors
        rotations = Rotations(t["k_rotation"], t["v_rotation"], t["k_clip"], t["v_clip"], t["layer_ids"],
                              t.get("k_mean"), t.get("v_mean"))
        cache = cls(rotations, CacheSettings(**{**art.settings, **overrides}))
        cache.read_from_artifact = True
        return cache

    @classmethod
    def from_folder(cls, path: str | Path, **overrides) -> OscarCache:
        """Build from an artifact folder, read by the one reader every command uses (`read_artifact`): the
        manifest's listed files' sizes and sha256, `rotations.safetensors` (k/v_rotation, k/v_eigenvalues, k/v_clip,
        layer_ids; k/v_mean in centred folders) against the format and the manifest, every value (finite, orthogonal,
        clips in (0, 1]), and manifest.json's quant.{group_size, sink, recent, flush, pin, key_bits, key_block};
        keyword overrides (any `CacheSettings` field) win. Anything it refuses raises a ValueError with the message
        the CLI prints. A folder without manifest.json is read with the tensors' values checked and the layout
        defaults. The model match is `oscar_zoo.artifacts`'s; the means meet the model's bounds (the largest key and
        value norm each layer can produce) when a model first uses the cache."""
        return cls.from_artifact(read_artifact(path), **overrides)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        binding = self.binding
        if binding is not None and binding.stepping:  # a compiled decode step runs
            if torch.compiler.is_compiling():  # the step's custom op files the token
                return key_states, value_states
            binding.check_filing()
        bound = binding.take_layer() if binding is not None else None
        if (args or kwargs) and bound != layer_idx:  # a model's attention module (it passes its cache kwargs) that
            # enable_oscar's hook did not mark as running "oscar" attention (`OscarBinding.enter`)
            raise ValueError(
                f"model layer {layer_idx} is not running \"oscar\" attention: call "
                f"oscar_zoo.runtime.attention.enable_oscar(model) before using an OscarCache"
            )
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"model layer {layer_idx} is beyond the {len(self.layers)} layers this OscarCache was built for: the "
                f"artifacts were made for another model"
            )
        return self.layers[layer_idx].update(key_states, value_states)

    # ------------------------------------------------------------------------------- the static decode step

    def reserve(self, tokens: int) -> None:
        """Size every initialised layer's INT2 history for a context of `tokens` now (after prefill), so decoding up to
        it never reallocates (and a captured decode step is never re-captured). ValueError unless `tokens` is an
        integer ≥ 0."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"reserve(tokens): expected a number of tokens ≥ 0, got {tokens!r}")
        for layer in self.layers:
            layer.reserve(tokens)

    def static_step_key(self) -> tuple | None:
        """What identifies the next single-token decode step as a static (capturable) one: (demotes, this cache's
        identity with each layer's storage version and value fold); None when it is not static (a layer uninitialised,
        sink or recent window still filling, BF16 history switch). A captured step replays fixed addresses and a fixed
        fold, so a deep copy (same versions, other tensors) and a cache whose values were folded into o_proj since
        must not match it. Reserves the history rows the next two demotions need first, whether or not this step
        demotes, so neither step kind allocates and both can be captured against the same storage (`rehearsal`)."""
        live = [layer for layer in self.layers if layer.rotation is not None]
        if not live or not all(layer.is_initialized and layer.quantize and layer.is_static_step(1)
                               and layer.staged is None for layer in live):  # staged rows: the eager step files them
            return None
        demote = {layer.demotes_next() for layer in live}
        if len(demote) != 1:
            return None
        for layer in live:
            layer.reserve_demotion()
        return (demote.pop(), (id(self),) + tuple((layer.storage_version, layer.v_folded) for layer in live))

    @contextlib.contextmanager
    def rehearsal(self, demote: bool) -> Iterator[None]:
        """The host mirror set so that the next static step demotes (`demote`) or does not, inside the block; restored
        on exit. `graph.DecodeGraphs` captures a step kind this way before it first comes: a capture runs the step's
        Python (which reads the mirror) and never its device work, and a static step reads the tier lengths on the
        device, so the tiers and their lengths are untouched. Equal-length rows only: a padded batch's rows demote on
        their own schedules."""
        saved = self.host_lengths()
        try:
            for layer in self.layers:
                if layer.is_initialized:
                    if layer.rows is not None:
                        raise ValueError("rehearsal: a padded batch's rows demote on their own schedules")
                    layer.n_recent = layer.recent + (layer.flush - 1 if demote else 0)
            yield
        finally:
            self.restore_host_lengths(saved)

    def host_lengths(self) -> list[tuple]:
        return [layer.host_state() for layer in self.layers]

    def restore_host_lengths(self, lengths: list[tuple]) -> None:
        """Put back the host mirror (after capturing a step, which runs the Python once but the device work never)."""
        for layer, state in zip(self.layers, lengths):
            layer.restore_host_state(state)

    def advance_host(self) -> None:
        """The host side of one replayed static decode step (the device side is the graph)."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.advance_host()

    def memory_bytes(self) -> int:
        """Bytes actually allocated by the cache tensors of all layers (history capacity included)."""
        return sum(layer.memory_bytes() for layer in self.layers)

    def bytes_per_token_per_layer(self) -> float:
        """Allocated bytes per cached token per initialised layer (K and V, all KV heads and batch rows together)."""
        live = [layer for layer in self.layers if layer.is_initialized]
        tokens = self.get_seq_length(live[0].layer_idx) if live else 0
        return self.memory_bytes() / (tokens * len(live)) if tokens else 0.0
