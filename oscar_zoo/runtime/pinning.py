"""Pinned tokens (docs/format.md §6c): the history rows a prompt chunk moves out of the recent window wait in
`staged` until the chunk's attention has scored them (`reference.pin_scores`); the `pin` highest per KV head and batch
row then stay BF16 in the sink tier after the sink, the rest go to the INT2 history. A mixin of `cache.OscarLayer`,
whose tiers, lengths and `_append_history` it uses."""

from __future__ import annotations

import torch
from torch import Tensor

from ..format import layout, reference
from . import ops


class PinnedTokens:
    """The pinning part of an `OscarLayer` (needs its sink_k/sink_v, sink, pin, n_pinned, staged, rotation,
    group_size, `_append_history` and `_sync_lengths`)."""

    def pin_tokens(self, scores_of=None) -> None:
        """File the rows a prompt chunk moved out of the recent window (`staged`): among them and the tokens pinned so
        far, the `pin` per KV head and batch row that `scores_of(candidate keys)` → [B, H, c] ranks highest stay BF16
        in the sink tier (in position order), the rest are quantized onto the history in position order. Keys are
        position-encoded before they are cached, so where a token sits in the tiers does not change its logits.
        `scores_of` None (no queries seen): the pinned tokens stay, the staged rows go to the history."""
        k_new, v_new = self.staged
        self.staged = None
        lo, P = self.sink, self.n_pinned
        cand_k = torch.cat([self.sink_k[:, :, lo : lo + P], k_new], dim=2)  # [B, H, c, D]
        cand_v = torch.cat([self.sink_v[:, :, lo : lo + P], v_new], dim=2)
        B, H, c, D = cand_k.shape
        if scores_of is None:  # keep the P pinned tokens (the first candidates)
            keep, rank = P, torch.arange(c, 0, -1, device=cand_k.device, dtype=torch.float32).expand(B, H, c)
        else:
            keep, rank = min(self.pin, c), scores_of(cand_k)
        chosen = torch.zeros(B, H, c, dtype=torch.bool, device=cand_k.device)
        chosen.scatter_(2, rank.topk(keep, dim=-1).indices, True)
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)  # chosen first, each part in order
        pick = lambda t, idx: t.gather(2, idx[..., None].expand(-1, -1, -1, D))  # noqa: E731
        self.sink_k[:, :, lo : lo + keep] = pick(cand_k, order[..., :keep])
        self.sink_v[:, :, lo : lo + keep] = pick(cand_v, order[..., :keep])
        self.n_pinned = keep
        if c > keep:
            self._append_history(pick(cand_k, order[..., keep:]), pick(cand_v, order[..., keep:]))
        self._sync_lengths()

    def _staged_as_history(self) -> tuple[Tensor, Tensor]:
        """The staged rows quantized and read back exactly as `_append_history` would store them (fp32): until the
        next chunk's attention pins, a chunk reading them sees what it would see without pinning."""
        rot = self.rotation
        out = []
        for rows, clip, min_clip, bits in ((self.staged[0], rot.k_clip, rot.k_min_clip, rot.k_bits),
                                           (self.staged[1], rot.v_clip, rot.v_min_clip, layout.BITS)):
            codes, scale_zero = ops.quantize_pack(rows, clip, self.group_size, min_ratio=min_clip, bits=bits)
            out.append(reference.dequantize_unpack(codes, scale_zero, bits))
        return out[0], out[1]
