"""Values no runtime may use (NaN/Inf, clips outside (0, 1], non-orthogonal rotations, non-finite or unmatched means of
the centred codec), re-checksummed so that only
validation can catch them: refused with exit 4 by every command that reads an artifact folder, and by
`OscarCache.from_folder` (the same reader) with an IntegrityError, a ValueError, of the same message; nothing is
exported. So are files changed behind the manifest's sha256."""

from __future__ import annotations

import pytest
import torch

from oscar_zoo.errors import IntegrityError
from oscar_zoo.runtime.cache import OscarCache

from .hub.helpers import make_artifacts, random_rotations, rewrite_rotations, run_cli

L, H_KV, D = 3, 2, 16


def _poisoned(name: str, index: tuple, value: float):
    def change(folder):
        from safetensors.torch import load_file

        t = load_file(str(folder / "rotations.safetensors"))[name].clone()
        t[index] = value
        rewrite_rotations(folder, **{name: t})
    return change


def _centred(*, k_mean=True, v_mean=True, manifest=True, poison: tuple | None = None):
    """Make the folder a centred (schema-2) one: means added to the tensors and/or quant.centring "mean" in the
    manifest; `poison` = (name, index, value) written into one mean."""
    def change(folder):
        import json

        means = {"k_mean": torch.randn(L, 1, D), "v_mean": torch.randn(L, 1, D)}
        if poison:
            means[poison[0]][poison[1]] = poison[2]
        rewrite_rotations(folder, **{n: t for n, t, keep in zip(means, means.values(), (k_mean, v_mean)) if keep})
        if manifest:
            doc = json.loads((folder / "manifest.json").read_text())
            doc["quant"]["centring"] = "mean"
            (folder / "manifest.json").write_text(json.dumps(doc))
    return change


POISONS = {
    "mean NaN": (_centred(poison=("k_mean", (1, 0, 3), float("nan"))), "k_mean at layer 1 head 0"),
    "mean Inf": (_centred(poison=("v_mean", (2, 0, 0), float("-inf"))), "v_mean at layer 2 head 0"),
    # finite but far beyond any key/value mean: the history's float16 zero points would overflow (NaN outputs)
    "mean huge": (_centred(poison=("k_mean", (1, 0, 5), 1e6)), "k_mean at layer 1 head 0 (index [1, 0]) has norm"),
    "means, manifest uncentred": (_centred(manifest=False), "carries k_mean/v_mean but the manifest"),
    "manifest centred, no means": (_centred(k_mean=False, v_mean=False), "lacks k_mean/v_mean but the manifest"),
    "one mean only": (_centred(v_mean=False), "lacks v_mean"),
    "rotation NaN": (_poisoned("k_rotation", (1, 0, 2, 3), float("nan")), "k_rotation at layer 1 head 0"),
    "rotation Inf": (_poisoned("v_rotation", (2, 0, 0, 0), float("inf")), "v_rotation at layer 2 head 0"),
    "eigenvalue NaN": (_poisoned("v_eigenvalues", (0, 0, 1), float("nan")), "v_eigenvalues at layer 0"),
    "clip NaN": (_poisoned("k_clip", (1, 0), float("nan")), "k_clip at layer 1 head 0"),
    "clip above 1": (_poisoned("v_clip", (0, 0), 1.25), "v_clip at layer 0 head 0"),
    "clip 0": (_poisoned("k_clip", (2, 0), 0.0), "k_clip at layer 2 head 0"),
    "clip below 0": (_poisoned("k_clip", (0, 0), -0.5), "in (0, 1]"),
    "scaled rotation": (lambda f: rewrite_rotations(f, k_rotation=random_rotations(L, 1, D) * 1.01),
                        "is not orthogonal: max |MᵀM − I| = 0.0201"),
    "Gaussian rotation": (lambda f: rewrite_rotations(f, v_rotation=torch.randn(L, 1, D, D)), "not orthogonal"),
    "duplicate layer ids": (lambda f: rewrite_rotations(f, layer_ids=torch.tensor([0, 1, 1], dtype=torch.int32)),
                            "layer_ids differ from the manifest"),
    "float64 clips": (lambda f: rewrite_rotations(f, k_clip=torch.full((L, 1), 0.96, dtype=torch.float64)),
                      "dtype float64"),
}


@pytest.fixture(params=sorted(POISONS))
def poisoned(request, tmp_path):
    folder = tmp_path / "art"
    make_artifacts(folder, granularity="per-layer", L=L, H_kv=H_KV, D=D)
    change, words = POISONS[request.param]
    change(folder)
    return folder, words


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert lines and lines[0].startswith("error:") and len(lines) <= 2 and "Traceback" not in err, err
    return lines[0]


def test_every_reader_refuses_with_exit_4(poisoned, tmp_path):
    folder, words = poisoned
    for args in (["inspect", folder], ["inspect", folder, "--json"], ["export", folder, "--format", "sglang", "--out",
                 tmp_path / "sg"], ["export", folder, "--format", "oscar-pt", "--out", tmp_path / "pt"],
                 ["verify", folder], ["push", folder, "org/repo", "--dry-run", "--allow-unverified"]):
        code, out, err = run_cli(*map(str, args))
        assert code == 4, (args, out, err)
        assert words in _one_line_error(err), (args, err)
    assert not (tmp_path / "sg").exists() and not (tmp_path / "pt").exists()


def test_from_folder_refuses_as_the_cli_does(poisoned):
    """One reader: `OscarCache.from_folder` refuses every poisoned folder with an IntegrityError (a ValueError) whose
    message is the very line the CLI prints."""
    folder, words = poisoned
    code, _, err = run_cli("inspect", str(folder))
    with pytest.raises(IntegrityError) as exc:
        OscarCache.from_folder(folder)
    assert isinstance(exc.value, ValueError) and words in exc.value.message
    assert code == 4 and _one_line_error(err) == f"error: {exc.value.message}"


def _tamper(folder):
    """Change one byte of k_eigenvalues in rotations.safetensors (the lowest mantissa byte of its first value: still a
    finite eigenvalue, so only the sha256 can tell), leaving the manifest as it was."""
    import json
    import struct

    path = folder / "rotations.safetensors"
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    start = 8 + n + json.loads(raw[8:8 + n])["k_eigenvalues"]["data_offsets"][0]
    raw[start] ^= 0x01
    path.write_bytes(bytes(raw))


def test_tampered_rotations_are_refused_by_the_runtime_too(tmp_path):
    """A rotations.safetensors whose bytes changed while the manifest's sha256 did not: the tensors alone are valid
    (the runtime's value checks pass them), yet `from_folder` refuses the folder as the CLI does."""
    from safetensors.torch import load_file

    from oscar_zoo.format.validate import check_rotation_tensors

    folder = tmp_path / "art"
    make_artifacts(folder, L=L, H_kv=H_KV, D=D)
    before = {k: v.clone() for k, v in load_file(str(folder / "rotations.safetensors")).items()}  # not a mapped view
    _tamper(folder)
    after = load_file(str(folder / "rotations.safetensors"))
    assert not torch.equal(before["k_eigenvalues"], after["k_eigenvalues"])
    check_rotation_tensors(after)  # nothing but the checksum can catch it
    code, _, err = run_cli("inspect", str(folder))
    assert code == 4 and "sha256" in err and "does not match the manifest's" in err
    with pytest.raises(IntegrityError, match="rotations.safetensors sha256 .* does not match the manifest's") as exc:
        OscarCache.from_folder(folder)
    assert _one_line_error(err) == f"error: {exc.value.message}"


def test_resized_rotations_are_refused_by_the_runtime_too(tmp_path):
    folder = tmp_path / "art"
    make_artifacts(folder, L=L, H_kv=H_KV, D=D)
    path = folder / "rotations.safetensors"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes() + b" ")  # one byte more: the size recorded in the manifest catches it first
    code, _, err = run_cli("inspect", str(folder))
    with pytest.raises(IntegrityError, match=f"has {size + 1} bytes, the manifest says {size}") as exc:
        OscarCache.from_folder(folder)
    assert code == 4 and _one_line_error(err) == f"error: {exc.value.message}"


def test_honest_artifacts_still_load(tmp_path):
    make_artifacts(tmp_path / "art", L=L, H_kv=H_KV, D=D)
    code, _, err = run_cli("inspect", str(tmp_path / "art"))
    assert code == 0, err
    cache = OscarCache.from_folder(tmp_path / "art")
    assert len(cache.layers) == L


def test_a_file_passed_as_the_artifact_folder_says_so(tmp_path):
    make_artifacts(tmp_path / "art", L=L, H_kv=H_KV, D=D)
    code, _, err = run_cli("inspect", str(tmp_path / "art" / "manifest.json"))
    assert code == 2 and "is a file, not an artifact folder" in err and "does not exist" not in err


def test_inspect_prints_manifest_text_without_terminal_escapes(tmp_path):
    """Strings from a manifest reach the terminal with control characters escaped and rich markup taken literally
    (a model id with a control character is refused outright: test_manifest_input)."""
    import json

    folder = tmp_path / "art"
    make_artifacts(folder, L=L, H_kv=H_KV, D=D)
    doc = json.loads((folder / "manifest.json").read_text())
    doc["model"]["id"] = "org/m[bold red]owned[/]"
    doc["calibration"]["dataset"] = "text\x07\x1b]0;title\x07"
    (folder / "manifest.json").write_text(json.dumps(doc))
    code, out, err = run_cli("inspect", str(folder))
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out
    assert "org/m[bold red]owned[/]" in out and "text\\x07\\x1b]0;title\\x07" in out
