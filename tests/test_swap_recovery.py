"""An artifact folder replaced by a swap that is killed at any step is recovered by the next run: the folder the user
last had complete is at its path (the old one until the new one was moved in, the new one after), and nothing else
of the killed run is left beside it. The killed run is `oscar-zoo import-oscar … --out D` in a subprocess that
`os._exit`s at the chosen step of the swap; the next run is `oscar-zoo inspect D` (a reader) and then the same
import again (a writer). A process id reused by a live process never makes a write to D fail."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from oscar_zoo.artifacts import load_artifacts
from oscar_zoo.export.oscar_pt import K_FILE, V_FILE

from .hub.helpers import random_rotations, run_cli, save_tiny_llama

L, D, H_KV = 3, 16, 2
KILLED = 9  # the killed run's exit status

# The killed run: import-oscar through the real entry point, with os.replace / shutil.rmtree watched while the swap
# into --out runs; it exits (no cleanup, no finally blocks) at STEP:
#   staged      the new folder is complete, the swap has not started
#   set-aside   the old folder has been renamed away, the new one is not in place yet
#   moved-in    the new folder is in place, the old one not yet deleted
#   half-gone   the old folder is being deleted: one of its files is gone
KILL_AT = textwrap.dedent("""
    import os, shutil, sys
    from oscar_zoo import artifacts, cli

    step, dest = sys.argv[1], os.path.realpath(sys.argv[2])
    real_replace, real_rmtree, real_swap = os.replace, shutil.rmtree, artifacts.swap_into_place

    def replace(src, dst, *a, **kw):
        if os.fspath(src) == dest and step == "set-aside":
            real_replace(src, dst, *a, **kw)
            os._exit(9)
        real_replace(src, dst, *a, **kw)
        if os.fspath(dst) == dest and step == "moved-in":
            os._exit(9)

    def rmtree(path, *a, **kw):
        if step == "half-gone" and os.path.basename(os.fspath(path)).startswith("." + os.path.basename(dest) + "."):
            os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
            os._exit(9)
        return real_rmtree(path, *a, **kw)

    def swap(new, dst):
        if step == "staged":
            os._exit(9)
        os.replace, shutil.rmtree = replace, rmtree
        try:
            real_swap(new, dst)
        finally:
            os.replace, shutil.rmtree = real_replace, real_rmtree

    artifacts.swap_into_place = swap
    sys.argv = ["oscar-zoo", *sys.argv[3:]]
    cli.main()
""")
STEPS = {"staged": "old", "set-aside": "old", "moved-in": "new", "half-gone": "new"}


@pytest.fixture
def model_dir(tmp_path):
    return save_tiny_llama(tmp_path / "tiny-llama", L, H_KV, D)


def reference_files(folder, seed):
    """A K and V `.pt` pair in the published form, with rotations that depend on `seed`; returns the K rotations."""
    folder.mkdir(parents=True, exist_ok=True)
    k, v = random_rotations(L, 1, D, seed=seed)[:, 0], random_rotations(L, 1, D, seed=seed + 100)[:, 0]
    for name, objective, rot in ((K_FILE, "qqt_r_h_pbr", k), (V_FILE, "sst_r_h_pbr", v)):
        torch.save({"format_version": 1, "objective": objective, "source_grouping": "layer",
                    "layers": {i: {"layer_id": i, "rotation": rot[i].clone(), "eigenvalues": torch.arange(D) * 1.0}
                               for i in range(L)}}, folder / name)
    return k


def import_args(ref, model_dir, dest):
    return ["import-oscar", str(ref / K_FILE), str(ref / V_FILE), "--model", str(model_dir), "--out", str(dest)]


def leftovers(dest):
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}."))


def one_line_ok(code, err):
    assert code == 0 and "Traceback" not in err and "error:" not in err, err


@pytest.mark.parametrize("step", list(STEPS))
def test_a_swap_killed_at_each_step_is_recovered_by_the_next_run(step, tmp_path, model_dir):
    dest = tmp_path / "art"
    old_k = reference_files(tmp_path / "old", seed=1)
    new_k = reference_files(tmp_path / "new", seed=2)
    one_line_ok(*run_cli(*import_args(tmp_path / "old", model_dir, dest))[::2])

    killed = subprocess.run([sys.executable, "-c", KILL_AT, step, str(dest),
                             *import_args(tmp_path / "new", model_dir, dest)], capture_output=True, text=True)
    assert killed.returncode == KILLED, killed.stderr
    assert leftovers(dest), "the kill left nothing to recover: the step was not reached"

    code, out, err = run_cli("inspect", str(dest))  # a reader first: the folder is there, whole
    one_line_ok(code, err)
    expected = old_k if STEPS[step] == "old" else new_k
    assert torch.equal(load_artifacts(dest)[1].k_rotation[:, 0], expected)
    assert sorted(p.name for p in dest.iterdir()) == ["manifest.json", "rotations.safetensors"]

    code, _, err = run_cli(*import_args(tmp_path / "new", model_dir, dest))  # then a writer
    one_line_ok(code, err)
    assert torch.equal(load_artifacts(dest)[1].k_rotation[:, 0], new_k)
    assert leftovers(dest) == []


@pytest.mark.parametrize("step", list(STEPS))
def test_a_writer_recovers_a_killed_swap_too(step, tmp_path, model_dir):
    """The next run is a writer straight away: its own folder lands at D, and nothing of the killed run is left."""
    dest = tmp_path / "art"
    reference_files(tmp_path / "old", seed=1)
    reference_files(tmp_path / "new", seed=2)
    third_k = reference_files(tmp_path / "third", seed=3)
    one_line_ok(*run_cli(*import_args(tmp_path / "old", model_dir, dest))[::2])
    killed = subprocess.run([sys.executable, "-c", KILL_AT, step, str(dest),
                             *import_args(tmp_path / "new", model_dir, dest)], capture_output=True, text=True)
    assert killed.returncode == KILLED, killed.stderr

    code, _, err = run_cli(*import_args(tmp_path / "third", model_dir, dest))
    one_line_ok(code, err)
    assert torch.equal(load_artifacts(dest)[1].k_rotation[:, 0], third_k)
    assert leftovers(dest) == []


def test_a_reused_process_id_never_blocks_a_write(tmp_path, model_dir):
    """A folder set aside under the old naming (`.D.old-PID`) by a run whose process id a live process now has (this
    one): writing D replaces it as usual, and that folder, which may be someone's, is left alone."""
    dest = tmp_path / "art"
    reference_files(tmp_path / "old", seed=1)
    new_k = reference_files(tmp_path / "new", seed=2)
    one_line_ok(*run_cli(*import_args(tmp_path / "old", model_dir, dest))[::2])
    stale = tmp_path / f".art.old-{os.getpid()}"
    stale.mkdir()
    (stale / "manifest.json").write_text("{}")
    code, _, err = run_cli(*import_args(tmp_path / "new", model_dir, dest))
    one_line_ok(code, err)
    assert torch.equal(load_artifacts(dest)[1].k_rotation[:, 0], new_k)
    assert (stale / "manifest.json").read_text() == "{}"
    assert leftovers(dest) == [stale.name]


def test_an_old_style_set_aside_folder_of_a_dead_process_is_put_back(tmp_path, model_dir):
    """The same state under the naming of older versions (`.D.old-PID`, D missing, the process gone) is put back."""
    dest = tmp_path / "art"
    old_k = reference_files(tmp_path / "old", seed=1)
    one_line_ok(*run_cli(*import_args(tmp_path / "old", model_dir, dest))[::2])
    dead = subprocess.Popen(["true"])
    dead.wait()
    os.rename(dest, tmp_path / f".art.old-{dead.pid}")
    code, _, err = run_cli("inspect", str(dest))
    one_line_ok(code, err)
    assert torch.equal(load_artifacts(dest)[1].k_rotation[:, 0], old_k)
    assert leftovers(dest) == []


def test_a_live_runs_set_aside_folder_is_left_alone(tmp_path, model_dir):
    """While a swap runs, its set-aside folder (made by a live process: this one) is never touched by a reader."""
    from oscar_zoo.artifacts import _owner_tag

    dest = tmp_path / "art"
    reference_files(tmp_path / "old", seed=1)
    one_line_ok(*run_cli(*import_args(tmp_path / "old", model_dir, dest))[::2])
    aside = tmp_path / f".art.{_owner_tag()}.abc123.old"
    os.rename(dest, aside)
    code, _, err = run_cli("inspect", str(dest))
    assert code == 2 and "does not exist" in err, err
    assert aside.is_dir() and not dest.exists()
