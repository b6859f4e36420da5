"""The one check of OSCAR rotation tensors before any runtime uses them: names, dtypes and shapes consistent, layer ids
distinct and non-negative, every value finite (the centred codec's means too, and bounded: `check_mean`), rotations
orthogonal, clip ratios in (0, 1].

Every artifact folder is read by `artifact.read_artifact`, which calls `check_rotation_tensors`; the reference `.pt`
reader uses `check_rotation` on its per-layer matrices. Comparisons are written so that NaN fails them
(`not err < tol`, never `err > tol`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from .layout import MAX_MODEL_DIM

ROTATION_NAMES = ("k_rotation", "v_rotation")
EIGENVALUE_NAMES = ("k_eigenvalues", "v_eigenvalues")
CLIP_NAMES = ("k_clip", "v_clip")
TENSOR_NAMES = (*ROTATION_NAMES, *EIGENVALUE_NAMES, *CLIP_NAMES, "layer_ids")  # rotations.safetensors, schema 1
MEAN_NAMES = ("k_mean", "v_mean")  # schema 2 adds these (the centred codec, docs/format.md §6a); both or neither

# max |MᵀM − I| (float64 product of the stored float32 matrices). A float32 rotation of any head_dim in use (≤ 512) is
# orthogonal to 1e-6 or better; a rotation scaled by 1.0001 is already off by 2e-4, a random matrix by far more.
ORTHOGONALITY_TOL = 1e-4


def check_rotation_tensors(tensors: Mapping[str, Tensor], tol: float = ORTHOGONALITY_TOL) -> None:
    """Raise ValueError, naming the tensor (and layer and head), unless `tensors` holds exactly the format's tensors:
    k/v_rotation float [L, H, D, D] orthogonal, k/v_eigenvalues float [L, H, D] finite, k/v_clip float [L, H] in
    (0, 1], layer_ids integer [L] distinct and ≥ 0 (L, H, D ≥ 1), and, in schema-2 files, k/v_mean float [L, H, D]
    finite."""
    names = check_tensor_names(tensors)
    for name in names:
        if not isinstance(tensors[name], Tensor):
            raise ValueError(f"{name} is a {type(tensors[name]).__name__}, not a tensor")
    k = tensors["k_rotation"]
    if k.dim() != 4 or k.shape[-1] != k.shape[-2] or 0 in k.shape:
        raise ValueError(f"k_rotation has shape {list(k.shape)}, expected [L, H, D, D] with L, H, D ≥ 1")
    L, H, D, _ = k.shape
    shapes = {"k_rotation": (L, H, D, D), "v_rotation": (L, H, D, D), "k_eigenvalues": (L, H, D),
              "v_eigenvalues": (L, H, D), "k_clip": (L, H), "v_clip": (L, H), "layer_ids": (L,),
              **{name: (L, H, D) for name in MEAN_NAMES if name in names}}
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name} has shape {list(tensors[name].shape)}, expected {list(shape)} (k_rotation is "
                             f"{list(k.shape)} = [L, H, D, D])")
    layer_ids = check_layer_ids(tensors["layer_ids"])
    for name in (*ROTATION_NAMES, *EIGENVALUE_NAMES, *CLIP_NAMES):
        check_finite(name, tensors[name], layer_ids)
    for name in MEAN_NAMES:
        if name in names:
            check_mean(name, tensors[name], layer_ids)
    for name in ROTATION_NAMES:
        check_orthogonal(name, tensors[name], layer_ids, tol)
    for name in CLIP_NAMES:
        check_clips(name, tensors[name], layer_ids)


def check_tensor_names(tensors: Mapping[str, object]) -> tuple[str, ...]:
    """Exactly the format's tensor names, no more, no fewer: schema 1's, or schema 1's and both means (schema 2).
    Returns the names present; ValueError naming what is missing or extra."""
    expected = (*TENSOR_NAMES, *MEAN_NAMES) if any(n in tensors for n in MEAN_NAMES) else TENSOR_NAMES
    missing = [n for n in expected if n not in tensors]
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        parts = ([f"lacks {', '.join(missing)}"] if missing else []) + ([f"has unexpected {', '.join(extra)}"]
                                                                         if extra else [])
        raise ValueError(f"the rotation tensors {' and '.join(parts)} (expected exactly {', '.join(TENSOR_NAMES)}, "
                         f"and {' and '.join(MEAN_NAMES)} in a centred, schema-2 file)")
    return expected


def check_rotation(name: str, M: Tensor, layer_ids: list[int], tol: float = ORTHOGONALITY_TOL) -> None:
    """One rotation per (layer, head): M float [L, H, D, D], finite and orthogonal; raises ValueError naming `name`."""
    check_finite(name, M, layer_ids)
    check_orthogonal(name, M, layer_ids, tol)


def check_layer_ids(layer_ids: Tensor) -> list[int]:
    """layer_ids: an integer tensor [L] of distinct non-negative model layer indices; returns them as a list."""
    if layer_ids.dtype == torch.bool or layer_ids.is_floating_point() or layer_ids.is_complex():
        raise ValueError(f"layer_ids has dtype {str(layer_ids.dtype).removeprefix('torch.')}, expected an integer "
                         "dtype (int32)")
    ids = [int(i) for i in layer_ids.flatten().tolist()]
    outside = [i for i in ids if not 0 <= i < MAX_MODEL_DIM]
    if outside:
        raise ValueError(f"layer_ids holds layer index {outside[0]}, outside [0, {MAX_MODEL_DIM})")
    seen: set[int] = set()
    for i in ids:
        if i in seen:
            raise ValueError(f"layer_ids holds layer {i} twice")
        seen.add(i)
    return ids


def check_finite(name: str, t: Tensor, layer_ids: list[int]) -> None:
    """t float [L, ...] (L = len(layer_ids)): no NaN or ±Inf anywhere; the message names the first bad layer, head."""
    _check_float(name, t)
    bad = ~torch.isfinite(t)
    if bad.any():
        index = [int(i) for i in bad.nonzero()[0].tolist()]
        value = t[tuple(index)].item()
        raise ValueError(f"{name} {_where(index, layer_ids)} holds {value} (every value must be finite)")


MEAN_NORM_MAX = 2.0**14  # ‖μ‖₂ per (layer, head); see check_mean


def check_mean(name: str, mean: Tensor, layer_ids: list[int]) -> None:
    """A centred codec's mean [L, H, D]: finite, and ‖μ‖₂ ≤ 2^14 per (layer, head). The history stores x·M − μ·M
    with float16 scales and zero points (at most 65,504), and every element of the rotated mean μ·M is at most ‖μ‖₂
    (M orthogonal), so a mean within the bound leaves the rows' own range room; one far beyond it (a finite 1e6 does)
    makes the history's float16 zero points infinite and every later attention output NaN. A mean of a real model's
    keys or values is orders of magnitude below the bound. ValueError naming the layer and head otherwise. Where the
    model is known (verify, the runtime's binding) the means are held to its own, far tighter bound as well:
    `model_bounds.check_means_fit`."""
    check_finite(name, mean, layer_ids)
    norms = torch.linalg.vector_norm(mean.double(), dim=-1)
    bad = ~(norms <= MEAN_NORM_MAX)
    if bad.any():
        index = [int(i) for i in bad.nonzero()[0].tolist()]
        raise ValueError(f"{name} {_where(index, layer_ids)} has norm {norms[tuple(index)].item():.4g}, beyond "
                         f"{MEAN_NORM_MAX:g} (its rotated rows would overflow the history's float16 zero points)")


def check_orthogonal(name: str, M: Tensor, layer_ids: list[int], tol: float = ORTHOGONALITY_TOL) -> None:
    """M float [L, H, D, D]: max |MᵀM − I| < tol for every (layer, head), NaN failing; message names the worst."""
    _check_float(name, M)
    if M.dim() != 4 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"{name} has shape {list(M.shape)}, expected [L, H, D, D]")
    M64 = M.double()
    eye = torch.eye(M.shape[-1], dtype=torch.float64)
    err = (M64.transpose(-1, -2) @ M64 - eye).abs().amax(dim=(-2, -1))  # [L, H]; NaN propagates
    ok = err < tol
    if not ok.all():
        bad = (~ok).nonzero()
        worst = bad[torch.nan_to_num(err[~ok], nan=float("inf")).argmax()].tolist()
        raise ValueError(f"{name} {_where(worst, layer_ids)} is not orthogonal: max |MᵀM − I| = "
                         f"{err[tuple(worst)].item():.3g}, must be < {tol:g} (a rotation matrix is needed, not a "
                         f"scaled, perturbed or arbitrary one)")


def check_clips(name: str, clip: Tensor, layer_ids: list[int]) -> None:
    """clip float [L, H]: every ratio in (0, 1] (NaN fails); the message names the first bad layer and head."""
    _check_float(name, clip)
    ok = (clip > 0) & (clip <= 1)
    if not ok.all():
        index = [int(i) for i in (~ok).nonzero()[0].tolist()]
        raise ValueError(f"{name} {_where(index, layer_ids)} is {clip[tuple(index)].item()}; clip ratios must lie "
                         "in (0, 1]")


def _check_float(name: str, t: Tensor) -> None:
    if not t.is_floating_point():
        raise ValueError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}, expected a floating dtype "
                         "(float32)")


def _where(index: list[int], layer_ids: list[int]) -> str:
    """[i, h, ...] -> 'at layer 5 head 1 (entry [2, 1, ...])': the model layer that entry i holds, and its head."""
    if not index:
        return ""
    layer = layer_ids[index[0]] if index[0] < len(layer_ids) else index[0]
    head = f" head {index[1]}" if len(index) > 1 else ""
    return f"at layer {layer}{head} (index {index})"
