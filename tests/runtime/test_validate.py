"""The one check of rotation tensors (`format.validate`): every value a runtime must not use is refused with a
ValueError naming the tensor, layer and head, NaN included (a comparison written `err > tol` lets NaN through)."""

from __future__ import annotations

import pytest
import torch

from oscar_zoo.format import reference
from oscar_zoo.format.validate import ORTHOGONALITY_TOL, check_rotation_tensors

L, H, D = 3, 2, 16


def _tensors(**changes) -> dict[str, torch.Tensor]:
    rot = torch.stack([reference.random_orthogonal(D, seed=i) for i in range(2 * L * H)]).float()
    t = {"k_rotation": rot[: L * H].reshape(L, H, D, D), "v_rotation": rot[L * H :].reshape(L, H, D, D),
         "k_eigenvalues": torch.rand(L, H, D), "v_eigenvalues": torch.rand(L, H, D),
         "k_clip": torch.full((L, H), 0.96), "v_clip": torch.full((L, H), 0.92),
         "layer_ids": torch.tensor([0, 5, 7], dtype=torch.int32)}
    return {**t, **changes}


def _poke(name: str, index: tuple, value: float) -> dict[str, torch.Tensor]:
    t = _tensors()
    bad = t[name].clone()
    bad[index] = value
    return {**t, name: bad}


def test_valid_tensors_pass():
    check_rotation_tensors(_tensors())


@pytest.mark.parametrize("name, index, value, words", [
    ("k_rotation", (1, 1, 3, 4), float("nan"), "k_rotation at layer 5 head 1"),
    ("v_rotation", (2, 0, 0, 0), float("inf"), "v_rotation at layer 7 head 0"),
    ("k_eigenvalues", (0, 1, 2), float("-inf"), "k_eigenvalues at layer 0 head 1"),
    ("k_clip", (1, 0), float("nan"), "k_clip at layer 5 head 0"),
    ("v_clip", (2, 1), 1.5, "v_clip at layer 7 head 1 (index [2, 1]) is 1.5"),
    ("k_clip", (0, 0), 0.0, "k_clip at layer 0 head 0"),
    ("v_clip", (0, 1), -0.25, "in (0, 1]"),
])
def test_poisoned_values_are_refused(name, index, value, words):
    with pytest.raises(ValueError, match="must be finite|in \\(0, 1\\]") as exc:
        check_rotation_tensors(_poke(name, index, value))
    assert words in str(exc.value)


@pytest.mark.parametrize("make, words", [
    (lambda M: M * 1.01, "not orthogonal"),  # scaled
    (lambda M: M + 1e-3 * torch.randn_like(M), "not orthogonal"),  # perturbed
    (lambda M: torch.randn_like(M), "not orthogonal"),  # Gaussian
    (lambda M: torch.zeros_like(M), "not orthogonal"),
])
def test_non_orthogonal_rotations_are_refused(make, words):
    t = _tensors()
    bad = t["v_rotation"].clone()
    bad[1, 1] = make(bad[1, 1])
    with pytest.raises(ValueError, match=words) as exc:
        check_rotation_tensors({**t, "v_rotation": bad})
    assert "v_rotation at layer 5 head 1" in str(exc.value)


def test_nan_cannot_pass_the_orthogonality_comparison():
    """Without the finiteness check first, the orthogonality check alone must refuse NaN too."""
    from oscar_zoo.format.validate import check_orthogonal

    M = _tensors()["k_rotation"].clone()
    M[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="nan"):
        check_orthogonal("k_rotation", M, [0, 5, 7])
    check_orthogonal("k_rotation", _tensors()["k_rotation"], [0, 5, 7])
    assert ORTHOGONALITY_TOL <= 1e-4


@pytest.mark.parametrize("changes, words", [
    ({"layer_ids": torch.tensor([0, 5, 5], dtype=torch.int32)}, "layer 5 twice"),
    ({"layer_ids": torch.tensor([0, -1, 7], dtype=torch.int32)}, "layer index -1"),
    ({"layer_ids": torch.tensor([0, 1 << 20, 7], dtype=torch.int32)}, "outside"),
    ({"layer_ids": torch.tensor([0.0, 5.0, 7.0])}, "integer dtype"),
    ({"layer_ids": torch.tensor([0, 5], dtype=torch.int32)}, "layer_ids has shape [2]"),
    ({"k_clip": torch.full((L, H + 1), 0.9)}, "k_clip has shape"),
    ({"v_rotation": torch.zeros(L, H, D, D + 1)}, "v_rotation has shape"),
    ({"k_rotation": torch.zeros(L, H, D)}, "k_rotation has shape"),
    ({"k_eigenvalues": torch.rand(L, H, D + 1)}, "k_eigenvalues has shape"),
    ({"k_clip": torch.ones(L, H, dtype=torch.int32)}, "floating dtype"),
    ({"extra": torch.zeros(1)}, "unexpected extra"),
])
def test_inconsistent_tensors_are_refused(changes, words):
    with pytest.raises(ValueError) as exc:
        check_rotation_tensors(_tensors(**changes))
    assert words in str(exc.value)


def test_missing_tensor_is_named():
    t = _tensors()
    del t["v_eigenvalues"]
    with pytest.raises(ValueError, match="lacks v_eigenvalues"):
        check_rotation_tensors(t)
