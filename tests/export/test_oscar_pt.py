"""import-oscar / export: the reference OSCAR-RotationZoo `.pt` schema in and out, refusals, and sglang settings."""

from __future__ import annotations

import io
import json
import pickle
import shlex

import pytest
import torch

from oscar_zoo.artifacts import load_artifacts
from oscar_zoo.export.oscar_pt import K_FILE, V_FILE, average_heads, head_agreement, oscar_pt_bytes
from oscar_zoo.format.layout import Centring

from ..hub.helpers import make_artifacts, random_rotations, run_cli, save_tiny_llama

L, D, H_KV = 3, 16, 2


@pytest.fixture
def model_dir(tmp_path):
    return save_tiny_llama(tmp_path / "tiny-llama", L, H_KV, D)


def _reference_files(folder, layers=L, d=D, str_keys=False):
    """Synthetic files in the published schema (dict keyed by layer id, fp32 rotation + ascending eigenvalues)."""
    folder.mkdir(parents=True, exist_ok=True)
    k, v = random_rotations(layers, 1, d, seed=1)[:, 0], random_rotations(layers, 1, d, seed=2)[:, 0]
    eig = torch.sort(torch.rand(layers, d), dim=-1).values
    for name, objective, rot in ((K_FILE, "qqt_r_h_pbr", k), (V_FILE, "sst_r_h_pbr", v)):
        torch.save({"format_version": 1, "objective": objective, "source_grouping": "layer",
                    "layers": {(str(i) if str_keys else i): {"layer_id": i, "rotation": rot[i], "eigenvalues": eig[i]}
                               for i in range(layers)}}, folder / name)
    return folder / K_FILE, folder / V_FILE, k, v


def test_import_reference_files(model_dir, tmp_path):
    k_file, v_file, k, v = _reference_files(tmp_path / "ref", str_keys=True)
    code, out, err = run_cli("import-oscar", str(k_file), str(v_file), "--model", str(model_dir), "--out",
                             str(tmp_path / "art"), "--json")
    assert code == 0, err
    manifest, rot = load_artifacts(tmp_path / "art")
    assert manifest.rotation.granularity.value == "per-layer" and manifest.verification is None
    assert (manifest.clip.k_default, manifest.clip.v_default) == (0.96, 0.92)
    assert torch.equal(rot.k_rotation[:, 0], k) and torch.equal(rot.v_rotation[:, 0], v)
    assert torch.all(rot.k_clip == 0.96) and torch.all(rot.v_clip == 0.92)
    assert manifest.quant.group_size == D  # 128 does not divide head_dim 16
    assert K_FILE in manifest.calibration.dataset


def test_paths_with_markup_are_printed_as_written(model_dir, tmp_path):
    """Folder names that read as rich markup (`[/]` closes nothing, `[red]` would vanish) are printed as they are,
    after the files are written: exit 0, never a markup error."""
    k_file, v_file, _, _ = _reference_files(tmp_path / "ref")
    out = tmp_path / "a[/]b[red]"
    code, stdout, err = run_cli("import-oscar", str(k_file), str(v_file), "--model", str(model_dir), "--out", str(out))
    assert code == 0, err
    assert f"into {out} " in " ".join(stdout.split()) and f"verify {shlex.quote(str(out))}" in " ".join(stdout.split())
    art = tmp_path / "x[/]art[red]"
    make_artifacts(art, L=L, H_kv=H_KV, D=D, spread=0.05)
    code, _, err = run_cli("export", str(art), "--format", "oscar-pt", "--out", str(tmp_path / "pt"), "--average-heads")
    assert code == 0, err
    assert f"oscar-zoo verify {shlex.quote(str(art))} --as-exported" in " ".join(err.split())


def test_an_out_inside_an_artifact_folder_is_refused(model_dir, tmp_path):
    k_file, v_file, _, _ = _reference_files(tmp_path / "ref")
    make_artifacts(tmp_path / "art", L=L, H_kv=H_KV, D=D)
    code, _, err = run_cli("import-oscar", str(k_file), str(v_file), "--model", str(model_dir), "--out",
                           str(tmp_path / "art" / "sub"))
    assert code == 2 and "which is an oscar-zoo artifact folder" in err, err
    assert not (tmp_path / "art" / "sub").exists()


def test_non_tensor_pickle_is_refused(model_dir, tmp_path):
    k_file, v_file, _, _ = _reference_files(tmp_path / "ref")
    evil = tmp_path / "evil.pt"

    class Payload:  # any non-tensor object: weights_only=True refuses to build it
        def __reduce__(self):
            return (print, ("this must never run",))

    with open(evil, "wb") as f:
        pickle.dump({"format_version": 1, "objective": "qqt_r_h_pbr", "layers": {0: Payload()}}, f)
    code, out, err = run_cli("import-oscar", str(evil), str(v_file), "--model", str(model_dir), "--out",
                             str(tmp_path / "art"))
    assert code == 4 and "refused" in err and "this must never run" not in out + err
    lists = tmp_path / "lists.pt"  # loadable with weights_only, but not tensors
    torch.save({"format_version": 1, "objective": "qqt_r_h_pbr", "source_grouping": "layer",
                "layers": {i: {"layer_id": i, "rotation": [[1.0]], "eigenvalues": [1.0]} for i in range(L)}}, lists)
    code, _, err = run_cli("import-oscar", str(lists), str(v_file), "--model", str(model_dir), "--out",
                           str(tmp_path / "art"))
    assert code == 4 and "must be tensors" in err
    code, _, err = run_cli("import-oscar", str(v_file), str(k_file), "--model", str(model_dir), "--out",
                           str(tmp_path / "art"))
    assert code == 4 and "swapped" in err
    assert not (tmp_path / "art").exists()


def test_shape_mismatches_are_errors(model_dir, tmp_path):
    k_file, v_file, _, _ = _reference_files(tmp_path / "wide", d=32)
    code, _, err = run_cli("import-oscar", str(k_file), str(v_file), "--model", str(model_dir), "--out",
                           str(tmp_path / "a"))
    assert code == 4 and "head_dim 16" in err
    k_file, v_file, _, _ = _reference_files(tmp_path / "short", layers=L - 1)
    code, _, err = run_cli("import-oscar", str(k_file), str(v_file), "--model", str(model_dir), "--out",
                           str(tmp_path / "a"))
    assert code == 4 and "lacks layers [2]" in err
    code, _, err = run_cli("import-oscar", str(k_file), str(v_file), "--model", str(tmp_path / "nope"), "--out",
                           str(tmp_path / "a"))
    assert code == 2


def test_export_import_round_trip(model_dir, tmp_path):
    make_artifacts(tmp_path / "art", granularity="per-layer", L=L, H_kv=H_KV, D=D)
    code, out, err = run_cli("export", str(tmp_path / "art"), "--format", "oscar-pt", "--out", str(tmp_path / "pt"))
    assert code == 0, err
    raw = torch.load(tmp_path / "pt" / K_FILE, weights_only=True)
    assert raw["format_version"] == 1 and raw["objective"] == "qqt_r_h_pbr" and sorted(raw["layers"]) == [0, 1, 2]
    assert raw["layers"][1]["rotation"].dtype == torch.float32 and raw["layers"][1]["rotation"].shape == (D, D)
    code, _, err = run_cli("import-oscar", str(tmp_path / "pt" / K_FILE), str(tmp_path / "pt" / V_FILE), "--model",
                           str(model_dir), "--out", str(tmp_path / "back"))
    assert code == 0, err
    _, original = load_artifacts(tmp_path / "art")
    _, back = load_artifacts(tmp_path / "back")
    for name in ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "layer_ids"):
        assert torch.equal(getattr(original, name), getattr(back, name)), name


def test_per_head_export_needs_average_heads_and_warns(tmp_path):
    make_artifacts(tmp_path / "art", L=L, H_kv=H_KV, D=D, spread=0.05)
    code, _, err = run_cli("export", str(tmp_path / "art"), "--format", "oscar-pt", "--out", str(tmp_path / "pt"))
    assert code == 2 and "--average-heads" in err
    code, out, err = run_cli("export", str(tmp_path / "art"), "--format", "oscar-pt", "--out", str(tmp_path / "pt"),
                             "--average-heads", "--json")
    assert code == 0, err
    assert "inter-head agreement" in err and "polar" in err
    doc = json.loads(out)
    assert 0.5 < doc["head_agreement"]["k"] < 1.0
    rot = torch.load(tmp_path / "pt" / K_FILE, weights_only=True)["layers"][0]["rotation"].double()
    assert (rot.T @ rot - torch.eye(D, dtype=torch.float64)).abs().max() < 1e-5  # averaged, yet a rotation


def test_centred_export_needs_accept_degraded_and_warns(tmp_path):
    """A centred artifact (schema 2, k_mean/v_mean) has no faithful .pt form: export refuses it (exit 2, one line, no
    files) unless --accept-degraded, then writes the rotations unchanged (the means dropped) and says so."""
    import dataclasses

    from oscar_zoo.artifacts import write_artifacts

    from ..hub.helpers import make_manifest, make_rotations

    manifest = make_manifest(granularity="per-layer", L=L, H_kv=H_KV, D=D)
    manifest = manifest.replace(quant=manifest.quant.replace(centring=Centring.MEAN))
    rot = make_rotations(manifest)
    rot = dataclasses.replace(rot, k_mean=torch.randn(L, 1, D), v_mean=torch.randn(L, 1, D))
    write_artifacts(tmp_path / "art", manifest, rot)
    for fmt in ("oscar-pt", "sglang"):
        code, _, err = run_cli("export", str(tmp_path / "art"), "--format", fmt, "--out", str(tmp_path / fmt))
        assert code == 2 and "centred codec" in err and "--accept-degraded" in err and "Traceback" not in err, err
        assert not (tmp_path / fmt).exists()
    code, out, err = run_cli("export", str(tmp_path / "art"), "--format", "oscar-pt", "--out", str(tmp_path / "pt"),
                             "--accept-degraded", "--json")
    assert code == 0, err
    assert any("carry no means" in w for w in json.loads(out)["warnings"])
    raw = torch.load(tmp_path / "pt" / K_FILE, weights_only=True)
    assert torch.equal(raw["layers"][1]["rotation"], rot.k_rotation[1, 0])


def test_average_heads_properties():
    R = random_rotations(2, 3, 8, seed=5)
    same = R[:, :1].expand(2, 3, 8, 8)
    assert head_agreement(same) == pytest.approx(1.0)
    assert torch.allclose(average_heads(same), R[:, 0], atol=1e-5)  # identical heads: the average is that rotation
    M = average_heads(R).double()
    assert (M.transpose(-1, -2) @ M - torch.eye(8, dtype=torch.float64)).abs().max() < 1e-5


def test_sglang_settings(tmp_path):
    make_artifacts(tmp_path / "art", granularity="per-layer", L=L, H_kv=H_KV, D=D)
    code, out, err = run_cli("export", str(tmp_path / "art"), "--format", "sglang", "--out", str(tmp_path / "sg"),
                             "--json")
    assert code == 0, err
    doc = json.loads(out)
    env = doc["env"]
    assert env["SGLANG_ENABLE_MIXED_KV_WINDOWS"] == "1"
    assert (env["SGLANG_MIXED_KV_PREFIX_TOKENS"], env["SGLANG_MIXED_KV_RECENT_TOKENS"]) == ("64", "256")
    assert (env["SGLANG_OSCAR_K_CLIP_RATIO"], env["SGLANG_OSCAR_V_CLIP_RATIO"]) == ("0.96", "0.92")
    assert env["SGLANG_OSCAR_K_ROTATION_PATH"] == K_FILE  # relative to sglang.env's folder
    assert doc["flags"][:4] == ["--kv-cache-dtype", "int2", "--kv-cache-quant-group-size", str(D)]
    text = (tmp_path / "sg" / "sglang.env").read_text()
    assert "SGLANG_OSCAR_V_ROTATION_PATH=" in text and "SGLANG_OSCAR_ABSORB_V_ROTATION=1" in text
    script = (tmp_path / "sg" / "launch_sglang.sh").read_text()
    assert "exec python -m sglang.launch_server --model-path org/Tiny-Llama --kv-cache-dtype int2" in script
    for name in (K_FILE, V_FILE):
        assert torch.load(tmp_path / "sg" / name, weights_only=True)["format_version"] == 1


def test_sglang_window_refusal_writes_nothing(tmp_path):
    """Windows the reference runtime cannot page (sink 60 is not a multiple of 8): exit 2 before the .pt files exist."""
    from oscar_zoo.artifacts import write_artifacts

    from ..hub.helpers import make_manifest, make_rotations

    manifest = make_manifest(granularity="per-layer", L=L, H_kv=H_KV, D=D)
    manifest = manifest.replace(quant=manifest.quant.replace(sink=60))
    write_artifacts(tmp_path / "art", manifest, make_rotations(manifest))
    code, _, err = run_cli("export", str(tmp_path / "art"), "--format", "sglang", "--out", str(tmp_path / "sg"))
    assert code == 2 and "multiples of 8" in err and "Traceback" not in err, err
    assert not (tmp_path / "sg").exists()


def test_uniform_clips_with_five_digits_are_not_a_spread(tmp_path):
    """sglang.env holds 4 significant digits; a uniform 0.96875 is written as 0.9688 and is not 'varying' clips."""
    import dataclasses

    from oscar_zoo.artifacts import write_artifacts

    from ..hub.helpers import make_manifest, make_rotations

    manifest = make_manifest(granularity="per-layer", L=L, H_kv=H_KV, D=D)
    rot = dataclasses.replace(make_rotations(manifest), k_clip=torch.full((L, 1), 0.96875))
    write_artifacts(tmp_path / "art", manifest, rot)
    code, out, err = run_cli("export", str(tmp_path / "art"), "--format", "sglang", "--out", str(tmp_path / "sg"),
                             "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["env"]["SGLANG_OSCAR_K_CLIP_RATIO"] == "0.9688"
    assert not any("vary" in w for w in doc["warnings"]), doc["warnings"]


def test_sglang_files_survive_moving_the_export_folder(tmp_path):
    import os
    import shutil
    import subprocess

    make_artifacts(tmp_path / "art", granularity="per-layer", L=L, H_kv=H_KV, D=D)
    assert run_cli("export", str(tmp_path / "art"), "--format", "sglang", "--out", str(tmp_path / "sg"))[0] == 0
    moved = tmp_path / "elsewhere" / "served"
    moved.parent.mkdir()
    shutil.move(tmp_path / "sg", moved)
    env_text = (moved / "sglang.env").read_text()
    assert str(tmp_path / "sg") not in env_text and "relative to the folder holding this file" in env_text
    # the env file, sourced in its folder (the documented working directory): the paths resolve to the moved files
    shown = subprocess.run(["bash", "-c", "set -a; . ./sglang.env; set +a; "
                            "realpath \"$SGLANG_OSCAR_K_ROTATION_PATH\" \"$SGLANG_OSCAR_V_ROTATION_PATH\""],
                           cwd=moved, capture_output=True, text=True, check=True).stdout.split()
    assert shown == [str((moved / K_FILE).resolve()), str((moved / V_FILE).resolve())]
    # the launch script, run from anywhere: absolute paths into its own (moved) folder
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text('#!/bin/sh\necho "$SGLANG_OSCAR_K_ROTATION_PATH" "$SGLANG_OSCAR_V_ROTATION_PATH"\n')
    (fake / "python").chmod(0o755)
    ran = subprocess.run([str(moved / "launch_sglang.sh")], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert ran.stdout.split() == [str(moved.resolve() / K_FILE), str(moved.resolve() / V_FILE)]


def test_write_then_read_accepts_int_and_str_keys(tmp_path):
    from oscar_zoo.export.oscar_pt import read_oscar_pt

    R = random_rotations(2, 1, 8)[:, 0]
    (tmp_path / "k.pt").write_bytes(oscar_pt_bytes("qqt_r_h_pbr", [3, 7], R, torch.zeros(2, 8)))
    got = read_oscar_pt(tmp_path / "k.pt", "qqt_r_h_pbr")
    assert got.layer_ids == [3, 7] and torch.equal(got.rotation, R)


# -- values and malformed files (issue 16) ----------------------------------------------------------------------------
def _save_pair(folder, k_layers, v_layers=None, k_extra=None, v_extra=None):
    """Write a K and a V file with the given `layers` dicts (V defaults to a valid copy of the published form)."""
    folder.mkdir(parents=True, exist_ok=True)
    if v_layers is None:
        v = random_rotations(L, 1, D, seed=2)[:, 0]
        v_layers = {i: {"layer_id": i, "rotation": v[i], "eigenvalues": torch.arange(D, dtype=torch.float32)}
                    for i in range(L)}
    for name, objective, layers, extra in ((K_FILE, "qqt_r_h_pbr", k_layers, k_extra),
                                           (V_FILE, "sst_r_h_pbr", v_layers, v_extra)):
        doc = {"format_version": 1, "objective": objective, "source_grouping": "layer", "layers": layers}
        torch.save({**doc, **(extra or {})}, folder / name)
    return folder / K_FILE, folder / V_FILE


def _k_layers(change=None):
    k = random_rotations(L, 1, D, seed=1)[:, 0].clone()
    if change is not None:
        change(k)
    return {i: {"layer_id": i, "rotation": k[i], "eigenvalues": torch.arange(D, dtype=torch.float32)}
            for i in range(L)}


def _import(model_dir, tmp_path, k_file, v_file):
    code, out, err = run_cli("import-oscar", str(k_file), str(v_file), "--model", str(model_dir), "--out",
                             str(tmp_path / "art"))
    lines = err.strip().splitlines()
    if code:
        assert lines and lines[0].startswith("error:") and len(lines) <= 2 and "Traceback" not in err, err
        assert not (tmp_path / "art").exists()
    return code, out, err


@pytest.mark.parametrize("change, words", [
    (lambda k: k.mul_(1.01), "not orthogonal"),  # scaled
    (lambda k: k[1].copy_(torch.randn(D, D)), "rotation at layer 1 head 0 (index [1, 0]) is not orthogonal"),
    (lambda k: k[2].zero_(), "rotation at layer 2"),
    (lambda k: k[0].add_(1e-3 * torch.randn(D, D)), "not orthogonal"),
    (lambda k: k[1, 2].fill_(float("nan")), "rotation at layer 1 head 0 (index [1, 0, 2, 0]) holds nan"),
    (lambda k: k[0, 0, 0].fill_(float("inf")), "holds inf"),
], ids=["scaled", "Gaussian", "zeros", "perturbed", "NaN", "Inf"])
def test_import_refuses_matrices_that_are_not_rotations(model_dir, tmp_path, change, words):
    k_file, v_file = _save_pair(tmp_path / "ref", _k_layers(change))
    code, out, err = _import(model_dir, tmp_path, k_file, v_file)
    assert code == 4 and K_FILE in err and words in err and "next: verify" not in out, err


def test_import_refuses_nan_eigenvalues(model_dir, tmp_path):
    layers = _k_layers()
    layers[1]["eigenvalues"] = torch.full((D,), float("nan"))
    code, _, err = _import(model_dir, tmp_path, *_save_pair(tmp_path / "ref", layers))
    assert code == 4 and "eigenvalues at layer 1" in err


def test_minimal_reference_form_is_accepted(model_dir, tmp_path):
    """What the reference runtime itself reads: `{"layers": {i: {"rotation": …}}}` (no version, objective,
    eigenvalues or layer_id), str keys allowed."""
    k, v = random_rotations(L, 1, D, seed=1)[:, 0], random_rotations(L, 1, D, seed=2)[:, 0]
    (tmp_path / "ref").mkdir()
    torch.save({"layers": {i: {"rotation": k[i]} for i in range(L)}}, tmp_path / "ref" / "k.pt")
    torch.save({"layers": {str(i): {"rotation": v[i]} for i in range(L)}}, tmp_path / "ref" / "v.pt")
    code, _, err = _import(model_dir, tmp_path, tmp_path / "ref" / "k.pt", tmp_path / "ref" / "v.pt")
    assert code == 0, err
    _, rot = load_artifacts(tmp_path / "art")
    assert torch.equal(rot.k_rotation[:, 0], k) and torch.equal(rot.v_rotation[:, 0], v)
    assert torch.all(rot.k_eigenvalues == 0)  # unknown: the file has none
    code, _, err = run_cli("inspect", str(tmp_path / "art"))
    assert code == 0, err


def test_hadamard_method_files_are_not_called_swapped(model_dir, tmp_path):
    """The reference script's `--method hadamard` writes the same Sylvester Hadamard matrix as K and V rotation."""
    H = torch.ones(1, 1)
    while H.shape[0] < D:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    H = H / D**0.5
    (tmp_path / "ref").mkdir()
    for name in (K_FILE, V_FILE):
        torch.save({"format_version": 1, "objective": "hadamard", "source_grouping": "layer",
                    "layers": {i: {"layer_id": i, "rotation": H.clone(), "eigenvalues": torch.ones(D)}
                               for i in range(L)}}, tmp_path / "ref" / name)
    code, out, err = _import(model_dir, tmp_path, tmp_path / "ref" / K_FILE, tmp_path / "ref" / V_FILE)
    assert code == 0 and "swapped" not in err, err
    manifest, rot = load_artifacts(tmp_path / "art")
    assert torch.equal(rot.k_rotation, rot.v_rotation) and "'hadamard' / 'hadamard'" in manifest.calibration.dataset


def test_duplicate_int_and_str_layer_keys_are_named(model_dir, tmp_path):
    layers = _k_layers()
    layers["0"] = dict(layers[0])
    code, _, err = _import(model_dir, tmp_path, *_save_pair(tmp_path / "ref", layers))
    assert code == 4 and "layer 0 appears twice, under the keys 0 and '0'" in err, err


def test_paths_that_are_not_files_are_usage_errors(model_dir, tmp_path):
    _, v_file = _save_pair(tmp_path / "ref", _k_layers())
    (tmp_path / "folder.pt").mkdir()
    code, _, err = _import(model_dir, tmp_path, tmp_path / "folder.pt", v_file)
    assert code == 2 and "is a directory" in err and "does not exist" not in err, err
    code, _, err = _import(model_dir, tmp_path, tmp_path / "missing.pt", v_file)
    assert code == 2 and "does not exist" in err


def _layers_with(**entry):
    layers = _k_layers()
    layers[1] = {**layers[1], **entry}
    return layers


MALFORMED = {  # name -> (bytes of the K file, or a callable writing it; words of the message)
    "text file": (b"hello, I am a text file\nnot a tensor\n", "was refused"),
    "empty file": (b"", "was refused"),
    "JSON": (b'{"layers": {}}', "was refused"),
    "truncated zip": (lambda p: p.write_bytes(_good_bytes()[: len(_good_bytes()) // 2]), "was refused"),
    "zip without data": (lambda p: p.write_bytes(_good_bytes()[-200:]), "was refused"),
    "list at top": (lambda p: torch.save([1, 2], p), "top level is list"),
    "layers a list": (lambda p: torch.save({"layers": [torch.eye(D)]}, p), "'layers' is missing"),
    "no layers": (lambda p: torch.save({"format_version": 1}, p), "'layers' is missing"),
    "format_version 2": (lambda p: torch.save({"format_version": 2, "layers": _k_layers()}, p), "format_version 2"),
    "format_version '1'": (lambda p: torch.save({"format_version": "1", "layers": _k_layers()}, p),
                           "format_version '1'"),
    "objective a tensor": (lambda p: torch.save({"objective": torch.ones(2), "layers": _k_layers()}, p),
                           "objective is a Tensor"),
    "swapped": (lambda p: torch.save({"objective": "sst_r_h_pbr", "layers": _k_layers()}, p), "swapped"),
    "per-head grouping": (lambda p: torch.save({"source_grouping": "head", "layers": _k_layers()}, p),
                          "source_grouping 'head'"),
    "key not a number": (lambda p: torch.save({"layers": {"x": _k_layers()[0]}}, p), "layer key 'x'"),
    "negative key": (lambda p: torch.save({"layers": {-1: _k_layers()[0]}}, p), "layer key -1"),
    "float key": (lambda p: torch.save({"layers": {1.0: _k_layers()[0]}}, p), "layer key 1.0"),
    "entry a tensor": (lambda p: torch.save({"layers": {0: torch.eye(D)}}, p), "holds Tensor, not a dict"),
    "rotation missing": (lambda p: torch.save({"layers": _layers_with(rotation=None)}, p), "must be tensors"),
    "rotation 1-D": (lambda p: torch.save({"layers": _layers_with(rotation=torch.ones(D))}, p), "expected [D, D]"),
    "rotation empty": (lambda p: torch.save({"layers": {0: {"rotation": torch.ones(0, 0)}}}, p), "expected [D, D]"),
    "rotation int": (lambda p: torch.save({"layers": _layers_with(rotation=torch.eye(D, dtype=torch.int64))}, p),
                     "is a int64 tensor"),
    "rotation on meta": (lambda p: torch.save({"layers": _layers_with(rotation=torch.eye(D, device="meta"))}, p),
                         "on device meta"),
    "rotation complex": (lambda p: torch.save({"layers": _layers_with(rotation=torch.eye(D, dtype=torch.cfloat))},
                                              p), "complex64"),
    "eigenvalues wrong size": (lambda p: torch.save({"layers": _layers_with(eigenvalues=torch.ones(D + 1))}, p),
                               "eigenvalues [17]"),
    "eigenvalues a list": (lambda p: torch.save({"layers": _layers_with(eigenvalues=[1.0] * D)}, p),
                           "must be tensors"),
    "layer_id mismatch": (lambda p: torch.save({"layers": _layers_with(layer_id=2)}, p), "holds layer_id 2"),
    "layer_id a string": (lambda p: torch.save({"layers": _layers_with(layer_id="x")}, p), "holds layer_id 'x'"),
    "layer_id a matrix": (lambda p: torch.save({"layers": _layers_with(layer_id=torch.ones(2, 2))}, p),
                          "holds layer_id tensor"),
    "mixed head dims": (lambda p: torch.save({"layers": {0: {"rotation": torch.eye(D)},
                                                         1: {"rotation": torch.eye(8)}}}, p), "different head dims"),
    "wrong head dim": (lambda p: torch.save({"layers": {i: {"rotation": torch.eye(8)} for i in range(L)}}, p),
                       "head_dim 16"),
    "a layer too many": (lambda p: torch.save({"layers": {i: {"rotation": torch.eye(D)} for i in range(L + 1)}}, p),
                         "has layers [3]"),
}


def _good_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save({"layers": _k_layers()}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_reference_files_are_exit_4(model_dir, tmp_path, case):
    make, words = MALFORMED[case]
    _, v_file = _save_pair(tmp_path / "ref", _k_layers())
    k_file = tmp_path / "bad.pt"
    if isinstance(make, bytes):
        k_file.write_bytes(make)
    else:
        make(k_file)
    code, _, err = _import(model_dir, tmp_path, k_file, v_file)
    assert code == 4 and words in err, err
