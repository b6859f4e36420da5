"""The bounds a model puts on an artifact's values: how long a key or value its attention can produce is
(`mean_bounds`), and so how long the centred codec's means `k_mean` / `v_mean` (docs/format.md §6a) can be, the mean of
such vectors. `check_means_fit` refuses means beyond them: IntegrityError (exit 4) naming the tensor, layer, head, the
norm and the bound. `validate.check_mean` bounds a mean by the format alone (2^14); this one by the model, applied
wherever the model is at hand (verify, and the runtime when a cache meets a model). Imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .integrity import IntegrityError

# The families whose bound is derived below (every one oscar-zoo supports: models.ARCHITECTURES, tested alike), and
# the offset their RMSNorm adds to its stored weight: Gemma's multiplies by (1 + w), the others by w. A family missing
# here gets no model bound (its norm and attention have not been checked against the derivation); the format's holds.
NORM_OFFSET = {"llama": 0.0, "mistral": 0.0, "qwen2": 0.0, "qwen3": 0.0, "qwen3_moe": 0.0, "gemma": 1.0,
               "gemma2": 1.0}

# What `check_means_fit` allows beyond the derived bound: a bfloat16 model rounds the normalised input (twice, in
# Llama's norm), the projection's output and RoPE's cos/sin, products and sum, each by at most 2^-8 relative, so a
# vector can exceed the real-arithmetic bound by up to ~8·2^-8 ≈ 3%. A calibrated mean sits far below it anyway (a mean
# over many directions, never all along the top singular vector: SmolLM2's are ≥ 3.5× below).
RELATIVE_SLACK, ABSOLUTE_SLACK = 1.03, 1e-3

Bounds = dict[tuple[int, int], tuple[float, float]]  # (model layer, KV head) → (key bound, value bound)


def mean_bounds(model: torch.nn.Module) -> Bounds:
    """(layer, KV head) → (largest key norm, largest value norm) `model`'s attention can produce, for every decoder
    layer whose parts are where the derivation needs them ({} for a family outside NORM_OFFSET).

    Derivation, for the pre-norm decoders of NORM_OFFSET (Llama, Mistral, Qwen2/3, Qwen3-MoE, Gemma/Gemma2): attention
    reads n = γ ⊙ x / rms(x), rms(x) = sqrt(mean(x²) + ε), with γ the input norm's effective weight (w, or 1 + w for
    Gemma). ‖x / rms(x)‖₂ ≤ sqrt(hidden) (= up to ε, which only makes it smaller), so head h's value
    v = W_v,h·n + b_v,h = (W_v,h·diag γ)·(x / rms(x)) + b_v,h has

        ‖v‖₂ ≤ σ_max(W_v,h·diag γ)·sqrt(hidden) + ‖b_v,h‖₂    (≤ σ_max(W_v,h)·max|γ|·sqrt(hidden) + ‖b_v,h‖₂).

    Keys the same with W_k, b_k. With a per-head k_norm (Qwen3) the key is k_norm's output γ_k ⊙ z / rms(z) of the
    projection z, so ‖k‖₂ ≤ max|γ_k|·sqrt(head_dim) instead: the projection's bound does not hold there (normalising
    lengthens a short z), nor does the smaller of the two. RoPE rotates pairs of coordinates (norm kept) and multiplies
    by its `attention_scaling` (1 but for YaRN-style scaling): the key bound takes that factor. The means are stored in
    the model's basis (docs/format.md §6a: the orthogonal rotation M is applied at run time, and nothing scales them),
    and a mean of vectors is no longer than the longest of them, so each bound holds for its (layer, head) mean, and
    the largest of a layer's for a per-layer mean (the mean over its heads). σ_max in float64 on the CPU, per KV head.

    Skipped (no entry): a layer without `self_attn.{k_proj,v_proj}` plain nn.Linear layers, an `input_layernorm`
    weight or a `head_dim`, and weights not in memory (offloaded to the meta device)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    offset = NORM_OFFSET.get(model_type) if isinstance(model_type, str) else None
    if offset is None:
        return {}
    scalings = [getattr(m, "attention_scaling", None) for m in model.modules()]  # RoPE's, 1 but for YaRN-style
    rope = max([1.0, *(float(s) for s in scalings if isinstance(s, (int, float)))])
    bounds: Bounds = {}
    for block in model.modules():
        attn, norm = getattr(block, "self_attn", None), getattr(block, "input_layernorm", None)
        projections = (getattr(attn, "k_proj", None), getattr(attn, "v_proj", None))
        D, layer = getattr(attn, "head_dim", None), getattr(attn, "layer_idx", None)
        if not (isinstance(D, int) and D > 0 and isinstance(layer, int) and _usable(getattr(norm, "weight", None))
                and all(isinstance(p, torch.nn.Linear) and _usable(p.weight)
                        and p.in_features == norm.weight.numel() and p.out_features % D == 0 for p in projections)):
            continue
        gamma = norm.weight.detach().to("cpu", torch.float64) + offset  # [hidden]: the effective weight
        k_bound, v_bound = (_head_bounds(p, gamma, D) for p in projections)  # [H_kv] each
        k_norm = getattr(getattr(attn, "k_norm", None), "weight", None)
        if _usable(k_norm) and k_norm.numel() == D:  # Qwen3: each head's key is normalised again, which replaces
            gain = (k_norm.detach().to("cpu", torch.float64) + offset).abs().max().item()  # (not tightens) k_proj's
            k_bound = torch.full_like(k_bound, gain * math.sqrt(D))
        for h, (kb, vb) in enumerate(zip((k_bound * rope).tolist(), v_bound.tolist())):
            bounds[(layer, h)] = (kb, vb)
    return bounds


def _usable(weight: object) -> bool:
    return isinstance(weight, Tensor) and weight.is_floating_point() and weight.device.type != "meta"


def _head_bounds(proj: torch.nn.Linear, gamma: Tensor, D: int) -> Tensor:
    """σ_max(W_h·diag γ)·sqrt(hidden) + ‖b_h‖₂ per head h of `proj` (weight [H·D, hidden]) → float64 [H]."""
    W = proj.weight.detach().to("cpu", torch.float64)
    H = W.shape[0] // D
    Wg = (W * gamma).view(H, D, -1)  # [H, D, hidden]: W_h·diag γ
    bound = torch.linalg.matrix_norm(Wg, ord=2) * math.sqrt(gamma.numel())
    if proj.bias is not None:
        bound = bound + proj.bias.detach().to("cpu", torch.float64).view(H, D).norm(dim=-1)
    return bound


def check_means_fit(bounds: Bounds, k_mean: Tensor | None, v_mean: Tensor | None, layer_ids: Sequence[int]) -> None:
    """Every (layer, head) mean [L, H, D] within its bound (`mean_bounds`, times RELATIVE_SLACK plus ABSOLUTE_SLACK):
    per head when H is the model's KV heads, the largest of the layer's bounds when H = 1 (a per-layer artifact).
    Layers without bounds, and a head count that is neither (the model match's to name), are not judged here.
    IntegrityError, one line naming the tensor, layer, head, its norm and the bound, otherwise."""
    for which, (name, mean) in enumerate((("k_mean", k_mean), ("v_mean", v_mean))):
        if mean is None:
            continue
        norms = torch.linalg.vector_norm(mean.detach().double().cpu(), dim=-1)  # [L, H]
        H = norms.shape[1]
        for i, layer in enumerate(layer_ids):
            heads = [b[which] for b in _layer_bounds(bounds, layer)]
            if not heads or H not in (1, len(heads)):
                continue
            for h in range(H):
                limit = (heads[h] if H == len(heads) else max(heads)) * RELATIVE_SLACK + ABSOLUTE_SLACK
                norm = norms[i, h].item()
                if not norm <= limit:  # NaN fails
                    what = "key" if which == 0 else "value"
                    raise IntegrityError(
                        f"{name} layer {layer}{f' head {h}' if H == len(heads) else ' (per layer)'}: ‖μ‖ = {norm:.4g} "
                        f"exceeds {limit:.4g}, the largest {what} norm this model's layer can produce",
                        "the means were not calibrated on this model, or were altered: re-calibrate or re-download")


def _layer_bounds(bounds: Bounds, layer: int) -> list[tuple[float, float]]:
    """The bounds of `layer`'s heads 0, 1, … in order ([] when it has none)."""
    out = []
    while (layer, len(out)) in bounds:
        out.append(bounds[(layer, len(out))])
    return out


def check_means_against_model(model: torch.nn.Module, k_mean: Tensor | None, v_mean: Tensor | None,
                              layer_ids: Sequence[int]) -> None:
    """`check_means_fit` with `model`'s bounds (nothing to do for an uncentred artifact: no weights are read)."""
    if k_mean is None and v_mean is None:
        return
    check_means_fit(mean_bounds(model), k_mean, v_mean, layer_ids)
