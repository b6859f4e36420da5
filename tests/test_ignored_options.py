"""Options that would do nothing in the combination given are refused before any work (exit 2, one line naming the
option and why, no traceback), never silently ignored. Each case ran to exit 0 with the option dropped before."""

from __future__ import annotations

import pytest

from .export.test_oscar_pt import _reference_files


def _refused(result, *words):
    code, out, err = result
    assert code == 2, (out, err)
    assert "Traceback" not in err and sum(line.startswith("error:") for line in err.splitlines()) == 1, err
    for word in words:
        assert word in err, (word, err)


CALIBRATE = [
    (("--key-block", "0", "--k-clip", "0.5"), ("--k-clip 0.5", "--clip fixed")),
    (("--key-block", "0", "--clip", "search", "--v-clip", "0.7"), ("--v-clip 0.7", "--clip fixed")),
    (("--k-clip", "0.5"), ("--k-clip 0.5", "keys per channel", "--key-block 0")),  # per-channel keys are unclipped
    (("--clip", "search"), ("--clip search", "keys per channel", "--key-block 0")),
    (("--pin", "8"), ("--pin 8", "whole token blocks", "--key-block 0")),
    (("--offload-folder", "OFF"), ("--offload-folder", "--device-map")),
    (("--device-map", "auto", "--device", "cpu"), ("--device cpu", "--device-map auto")),
    (("--device-map", "auto", "--max-memory", "disk=100GiB"), ("--max-memory", "disk")),
    (("--nproc", "2", "--device", "cuda:1"), ("--device cuda:1", "CUDA_VISIBLE_DEVICES")),
    (("--revision", "main"), ("--revision main", "demo model")),
    (("--split", "validation"), ("--split validation", "bundled plays")),
    (("--text-field", "body"), ("--text-field body", "bundled plays")),
]


@pytest.mark.parametrize("extra,words", CALIBRATE, ids=[" ".join(c[0]) for c in CALIBRATE])
def test_calibrate_refuses_options_that_would_be_ignored(run_cli, tmp_path, monkeypatch, extra, words):
    monkeypatch.setenv("OSCAR_ZOO_CACHE", str(tmp_path / "cache"))
    extra = tuple(str(tmp_path / "off") if x == "OFF" else x for x in extra)
    _refused(run_cli("calibrate", "demo", "--out", tmp_path / "art", *extra), *words)
    assert not (tmp_path / "art").exists() and not (tmp_path / "off").exists()


def test_calibrate_nproc_under_torchrun_must_match_its_world(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    _refused(run_cli("calibrate", "demo", "--out", tmp_path / "art", "--nproc", "4"), "--nproc 4", "WORLD_SIZE 2")


def test_calibrate_refuses_more_processes_than_cores_and_a_device_torch_does_not_name(run_cli, tmp_path):
    """Before any work: --nproc past this machine's cores would launch them all (100,000 tried to), and a device
    name torch does not parse was a traceback."""
    _refused(run_cli("calibrate", "demo", "--out", tmp_path / "art", "--nproc", "100000"), "--nproc 100000",
             "one process per CPU core")
    _refused(run_cli("calibrate", "demo", "--out", tmp_path / "art", "--device", "foo"), "'foo' is not a device name")


def test_revision_and_split_with_local_sources(run_cli, tiny_model_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("words " * 400)
    _refused(run_cli("calibrate", tiny_model_dir, "--revision", "v1", "--out", tmp_path / "a"), "--revision v1",
             "local folder")
    _refused(run_cli("calibrate", tiny_model_dir, "--dataset", text, "--split", "test", "--out", tmp_path / "a"),
             "--split test", "local path")


def test_verify_refuses_a_revision_of_the_demo_model_and_a_split_of_the_plays(run_cli, tmp_path):
    from oscar_zoo.artifacts import write_artifacts
    from oscar_zoo.models import DEMO_HF_ID, DEMO_REVISION

    from .hub.helpers import make_manifest, make_rotations

    m = make_manifest(model_id=DEMO_HF_ID)
    m = m.replace(model=m.model.replace(revision=DEMO_REVISION))
    write_artifacts(tmp_path / "art", m, make_rotations(m))  # names the demo model: verify loads `demo` for it
    _refused(run_cli("verify", tmp_path / "art", "--split", "train"), "--split train", "bundled plays")
    _refused(run_cli("verify", tmp_path / "art", "--revision", "main"), "--revision main", "demo model")
    _refused(run_cli("verify", tmp_path / "art", "--model", "demo", "--revision", "main"), "--revision main",
             "demo model")


def test_import_oscar_refuses_a_group_size_that_does_not_divide_and_a_demo_revision(run_cli, tmp_path):
    k_file, v_file, _, _ = _reference_files(tmp_path / "ref")
    base = ("import-oscar", str(k_file), str(v_file), "--out", str(tmp_path / "a"))
    _refused(run_cli(*base, "--model", "demo", "--revision", "v2"), "--revision v2", "demo model")
    _refused(run_cli(*base, "--model", "demo", "--group-size", "48"), "--group-size 48", "head_dim 64")
    assert not (tmp_path / "a").exists()
