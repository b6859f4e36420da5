"""An artifact as `oscar-zoo export` deploys it to the reference runtime, for `oscar-zoo verify --as-exported`.

The reference SGLang runtime takes one rotation per layer, no means, and one clip ratio for all K and one for all V.
`as_exported` turns loaded artifacts into that form with export's own code: per-head rotations become each layer's
`average_heads` polar factor, shared by every KV head (the .pt files export writes); k_mean/v_mean are dropped and
the codec is uncentred (the .pt format has no means); every (layer, head) clip becomes the median K or V ratio that
`export --format sglang` writes to `sglang.env` (`reference_clip_ratios`); 3-bit keys become INT2 (the reference
runtime's only codec), keeping their clip of 1.0 in the medians' input; keys per channel (§6d) become keys per row
(their clips of 1.0 likewise), demoted `layout.FLUSH` at a time. Not modelled: the reference runtime's
float32 scales (oscar-zoo's cache stores float16 ones), and whatever else differs in its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..artifacts import Rotations
from ..format import layout
from ..format.layout import Centring
from ..format.schema import ClipMode, Granularity, Manifest
from .oscar_pt import is_per_head, layer_rotations
from .sglang import reference_clip_ratios


@dataclass(frozen=True)
class ExportedForm:
    manifest: Manifest  # per-layer, centring "none", fixed clips at the two ratios; otherwise the artifact's
    rotations: Rotations  # [L, 1, …]: one rotation and clip per layer, no means
    averaged: bool  # the heads were averaged (a per-head artifact)
    uncentred: bool  # the artifact's means were dropped (a centred artifact)
    int2_keys: bool  # the artifact's 3-bit keys became INT2
    unpinned: bool  # the artifact's pinned tokens are not pinned
    per_row_keys: bool  # the artifact's per-channel keys are coded per row
    k_clip: float
    v_clip: float

    def describe(self) -> str:
        """What the transform changed, for the report's artifact label."""
        parts = ["heads averaged per layer (polar factor)" if self.averaged else "one rotation per layer",
                 "means dropped" if self.uncentred else "no means",
                 *(["3-bit keys served as INT2"] if self.int2_keys else []),
                 *(["no pinned tokens"] if self.unpinned else []),
                 *(["per-channel keys coded per row"] if self.per_row_keys else []),
                 f"one clip K {self.k_clip:g} / V {self.v_clip:g} (medians)"]
        return "as exported: " + ", ".join(parts)


def as_exported(manifest: Manifest, r: Rotations) -> ExportedForm:
    """`r` (loaded with `manifest`) in the form `export --format oscar-pt|sglang` deploys."""
    per_head = is_per_head(manifest, r)
    L = r.k_rotation.shape[0]
    k_rot, v_rot = layer_rotations(r, per_head)  # [L, D, D], as export writes them
    k_ratio, v_ratio = reference_clip_ratios(r.k_clip, r.v_clip)
    rotations = Rotations(
        k_rotation=k_rot.unsqueeze(1).contiguous(), v_rotation=v_rot.unsqueeze(1).contiguous(),  # [L, 1, D, D]
        k_eigenvalues=r.k_eigenvalues.mean(dim=1, keepdim=True),  # informational, as export writes them
        v_eigenvalues=r.v_eigenvalues.mean(dim=1, keepdim=True),
        k_clip=torch.full((L, 1), k_ratio), v_clip=torch.full((L, 1), v_ratio),
        layer_ids=r.layer_ids.clone(), k_mean=None, v_mean=None)
    exported = manifest.replace(
        rotation=manifest.rotation.replace(granularity=Granularity.PER_LAYER),
        quant=manifest.quant.replace(centring=Centring.NONE, key_bits=None, pin=None, key_block=None,
                                     flush=layout.FLUSH if manifest.key_block else manifest.quant.flush),
        clip=manifest.clip.replace(mode=ClipMode.FIXED, grid=[], k_default=k_ratio, v_default=v_ratio,
                                   objective="the medians export --format sglang writes"),
        verification=None)
    return ExportedForm(exported, rotations, per_head, r.k_mean is not None, max(manifest.key_bits) > 2,
                        manifest.pin > 0, manifest.key_block > 0, k_ratio, v_ratio)
