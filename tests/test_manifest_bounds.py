"""Manifest fields have bounds from the format, applied by one check for the schema (inspect, verify, export, push)
and the runtime's reader (`OscarCache.from_folder`): BF16 windows that calibrate would refuse, a flush past the
largest key block, calibration counts and wall time no calibration produces, and, in a folder without manifest.json,
tensors of another dtype or layer ids that would make the cache build layers nothing vouches for. Each is exit 4 with
one line from the commands and a ValueError from the runtime, before anything is allocated."""

from __future__ import annotations

import json
import os

import pytest
import torch

from oscar_zoo.hub.zoo import ZooModel
from oscar_zoo.runtime.cache import OscarCache

from .hub.helpers import make_artifacts, random_rotations, run_cli


def _edit(folder, **changes):
    doc = json.loads((folder / "manifest.json").read_text())
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        doc[section][key] = value
    (folder / "manifest.json").write_text(json.dumps(doc))


CASES = {  # manifest change -> words of the message (the schema's and the runtime reader's)
    "sink 2^20": ({"quant.sink": 1 << 20}, "expected fewer than 32,768"),
    "sink + recent = 32768": ({"quant.sink": 0, "quant.recent": 32768}, "expected fewer than 32,768"),
    "pin 40000": ({"quant.pin": 40000}, "expected fewer than 32,768"),
    "flush 100000": ({"quant.flush": 100000}, "flush 100000: expected at most 256"),
}
RECORD = {  # the calibration record: the schema's (the runtime does not read it)
    "tokens 2^62": ({"calibration.tokens": 1 << 62}, "calibration.tokens"),
    "num_layers 2^62": ({"model.num_layers": 1 << 62}, "model.num_layers"),
    "num_kv_heads 2^20": ({"model.num_kv_heads": 1 << 20}, "model.num_kv_heads"),
    "wall_seconds 1e308": ({"calibration.wall_seconds": 1e308}, "calibration.wall_seconds"),
    "negative tokens": ({"calibration.tokens": -1}, "calibration.tokens"),
    "tokens not sequences × seq_len": ({"calibration.tokens": 1025}, "sequences × seq_len"),
}


def _exit_4(folder, words):
    for args in (["inspect", str(folder)], ["inspect", str(folder), "--json"]):
        code, out, err = run_cli(*args)
        lines = err.strip().splitlines()
        assert code == 4 and lines and lines[0].startswith("error:") and words in lines[0], (args, err)
        assert len(lines) <= 2 and "Traceback" not in err and not out


@pytest.mark.parametrize("case", sorted(CASES))
def test_windows_beyond_the_format_are_refused_by_the_schema_and_the_runtime(case, tmp_path):
    changes, words = CASES[case]
    make_artifacts(tmp_path / "art")
    _edit(tmp_path / "art", **changes)
    _exit_4(tmp_path / "art", words)
    with pytest.raises(ValueError, match=words):
        OscarCache.from_folder(tmp_path / "art")


@pytest.mark.parametrize("case", sorted(RECORD))
def test_calibration_records_beyond_any_calibration_are_refused(case, tmp_path):
    changes, words = RECORD[case]
    make_artifacts(tmp_path / "art")
    _edit(tmp_path / "art", **changes)
    _exit_4(tmp_path / "art", words)


def test_the_largest_windows_calibrate_writes_still_load(tmp_path):
    make_artifacts(tmp_path / "art")
    _edit(tmp_path / "art", **{"quant.sink": 64, "quant.recent": 32767 - 64})
    code, _, err = run_cli("inspect", str(tmp_path / "art"))
    assert code == 0, err
    assert OscarCache.from_folder(tmp_path / "art").quant_settings["recent"] == 32767 - 64


def _bare_folder(folder, L=2, H=2, D=16, ids=None, mean_dtype=None):
    from safetensors.torch import save_file

    folder.mkdir()
    tensors = {"k_rotation": random_rotations(L, H, D), "v_rotation": random_rotations(L, H, D, seed=1),
               "k_eigenvalues": torch.rand(L, H, D), "v_eigenvalues": torch.rand(L, H, D),
               "k_clip": torch.full((L, H), 0.96), "v_clip": torch.full((L, H), 0.92),
               "layer_ids": torch.tensor(ids if ids is not None else list(range(L)), dtype=torch.int32)}
    if mean_dtype is not None:
        tensors |= {"k_mean": torch.zeros(L, H, D, dtype=mean_dtype), "v_mean": torch.zeros(L, H, D)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "rotations.safetensors"))
    return folder


def test_without_a_manifest_tensors_keep_the_format_dtypes(tmp_path):
    with pytest.raises(ValueError, match="k_mean has dtype float16, the format stores float32"):
        OscarCache.from_folder(_bare_folder(tmp_path / "f16", mean_dtype=torch.float16))
    assert OscarCache.from_folder(_bare_folder(tmp_path / "f32", mean_dtype=torch.float32)).centred


def test_without_a_manifest_layer_ids_do_not_build_layers_nothing_vouches_for(tmp_path):
    with pytest.raises(ValueError, match="layer_ids reach layer 99 with 2 rotation layers"):
        OscarCache.from_folder(_bare_folder(tmp_path / "far", ids=[0, 99]))
    (tmp_path / "far" / "manifest.json").write_text(json.dumps({"quant": {"sink": 16}}))  # settings: no model either
    with pytest.raises(ValueError, match="reach layer 99"):
        OscarCache.from_folder(tmp_path / "far")
    assert len(OscarCache.from_folder(_bare_folder(tmp_path / "every-other", ids=[1, 3])).layers) == 4


def test_the_runtime_reader_holds_layer_ids_to_the_manifests_model(tmp_path):
    """The schema refuses ids past model.num_layers; the runtime's reader, which does not use the schema, too."""
    import hashlib

    from safetensors.torch import load_file, save_file

    make_artifacts(tmp_path / "art")
    path = tmp_path / "art" / "rotations.safetensors"
    tensors = load_file(str(path))
    tensors["layer_ids"] = torch.tensor([0, 99], dtype=torch.int32)
    save_file(tensors, str(path))
    doc = json.loads((tmp_path / "art" / "manifest.json").read_text())
    doc["rotation"]["layer_ids"] = [0, 99]
    doc["artifacts"][0].update(sha256=hashlib.sha256(path.read_bytes()).hexdigest(), bytes=path.stat().st_size)
    (tmp_path / "art" / "manifest.json").write_text(json.dumps(doc))
    _exit_4(tmp_path / "art", "layer_ids")
    with pytest.raises(ValueError, match=r"rotation.layer_ids must lie in \[0, model.num_layers\)"):
        OscarCache.from_folder(tmp_path / "art")


def test_a_zoo_entry_bits_per_element_is_bounded():
    entry = dict(subfolder="a", model_id="m", granularity="per-head", manifest_sha256="0" * 64,
                 verification="unverified", updated="t")
    assert ZooModel(**entry, bits_per_element_128k=2.5).bits_per_element_128k == 2.5
    with pytest.raises(ValueError, match="less than or equal to 64"):
        ZooModel(**entry, bits_per_element_128k=1e308)


def test_a_rotations_size_the_tensors_cannot_take_is_refused_before_any_hashing(tmp_path, monkeypatch):
    """A rotations.safetensors longer than the tensors the manifest describes can take, listed at its real size (so
    the size check alone passes: a 20 GB file would be hashed for minutes), is exit 4 before a byte is hashed, in
    every reader: the commands and `OscarCache.from_folder`."""
    from oscar_zoo.format import io

    folder = tmp_path / "art"
    manifest = make_artifacts(folder)
    most = io.rotations_size_range(manifest)[1]
    os.truncate(folder / "rotations.safetensors", most + (1 << 20))  # sparse: a MiB past the largest it can be
    doc = json.loads((folder / "manifest.json").read_text())
    doc["artifacts"][0]["bytes"] = most + (1 << 20)
    (folder / "manifest.json").write_text(json.dumps(doc))
    monkeypatch.setattr(io, "sha256_file", lambda path: pytest.fail(f"{path} was hashed"))
    _exit_4(folder, "but the tensors it describes take")
    with pytest.raises(ValueError, match="but the tensors it describes take"):
        OscarCache.from_folder(folder)


def test_an_unreadable_rotations_file_is_said_as_a_read(tmp_path, monkeypatch):
    """A listed file that cannot be read (permissions: the suite may run as root, so the OS error is raised here)
    is exit 4 naming the read, not a write failure with a disk-space hint."""
    import errno

    from oscar_zoo.format import io

    folder = tmp_path / "art"
    make_artifacts(folder)

    def denied(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(io, "sha256_file", denied)
    _exit_4(folder, "rotations.safetensors cannot be read (Permission denied)")
