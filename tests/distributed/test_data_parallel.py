"""Data-parallel calibration on CPU with gloo: two or three ranks over shares of the sequences give the single-process
float64 sums (round-off only), and the per-layer work split between them (4 layers: 2/2, or 2/1/1 over three ranks)
gives the single-process rotations (float32 round-off) and the same clips (also with more ranks than layers);
`--nproc 2` through the real entry point writes the single-process artifacts."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from oscar_zoo.artifacts import load_artifacts
from oscar_zoo.calibration.calibration_passes import AccumulatorStore, CalibrationSettings, accumulate, calibrate
from oscar_zoo.calibration.distributed import launch, without_option
from oscar_zoo.models import LoadedModel, arch_info, model_identity
from oscar_zoo.texts import TokenSequences

from ..conftest import tiny_model

WORLD = 2  # the --nproc test
# ranks batch exactly as one process does; centred (not the default) so that the reduced means reach the rotations
SETTINGS = CalibrationSettings(batch_size=2, grid=(0.9, 0.96, 1.0), centring="mean")


def _problem(layers: int = 4):
    model = tiny_model("qwen3", num_hidden_layers=layers)  # seeded: every rank builds the same weights
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (5, 24))  # 4 calibration sequences + 1 held-out
    loaded = LoadedModel(model, None, arch_info(model.config), model_identity("tiny", None, model.config), "memory")
    return loaded, TokenSequences(ids[:4], ids[4:], "random", False)


def _rank(rank: int, world: int, layers: int, port: int, folder: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from oscar_zoo.calibration import distributed

    dp = distributed.from_env("cpu")
    loaded, seqs = _problem(layers)
    noop = lambda *a, **k: None  # noqa: E731
    store = AccumulatorStore(os.path.join(folder, "store", f"rank{rank}-of-{world}"))
    key, value, soft, heldout, ran, (k_mean, v_mean, v_wmean) = accumulate(loaded, seqs, SETTINGS, store, noop, dp)
    assert {int(name.split(".")[0]) for name in heldout} == set(range(rank, layers, world))  # its layers only
    # the same store again through calibrate(): every accumulator is reused, the reduce is redone
    result = calibrate(loaded, seqs, SETTINGS, store_dir=os.path.join(folder, "store"), dp=dp)
    if rank == 0:
        assert result.forward_passes == []
        torch.save({"key": key.sums, "key_w": key.weights, "value": value.sums, "value_w": value.weights,
                    "soft": soft.sums, "k_mean": k_mean.sums, "v_mean": v_mean.sums, "mean_w": k_mean.weights,
                    "v_wmean": v_wmean.sums,
                    "rotations": result.rotations.__dict__, "ran": ran},
                   os.path.join(folder, "rank0.pt"))
    else:
        assert result is None
    distributed.shutdown()
    # the group is gone now, not at interpreter exit (where tearing gloo's threads down can abort the rank); gloo's
    # device loop thread is joined when the last pair lets go of it, which can take a moment after the call returns
    deadline = time.monotonic() + 10
    while (left := _gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, left


def _gloo_threads() -> set[str]:
    names = set()
    for task in os.listdir("/proc/self/task"):
        try:
            names.add(open(f"/proc/self/task/{task}/comm").read().strip())
        except FileNotFoundError:  # the thread ended between the listing and the read
            pass
    return {name for name in names if "gloo" in name or "tcpstore" in name}


@pytest.mark.parametrize("world, layers", [(2, 4), (3, 4), (3, 2)])  # even, uneven, a rank with no layer
def test_gloo_ranks_equal_one_process(tmp_path, world, layers):
    from oscar_zoo.calibration.distributed import _free_port

    mp.start_processes(_rank, args=(world, layers, _free_port(), str(tmp_path)), nprocs=world, start_method="spawn")
    got = torch.load(tmp_path / "rank0.pt")
    assert got["ran"] == ["pass1", "heldout", "pass2"]

    loaded, seqs = _problem(layers)
    key, value, soft, heldout, _, (k_mean, v_mean, v_wmean) = accumulate(loaded, seqs, SETTINGS,
                                                                AccumulatorStore(tmp_path / "single"),
                                                                lambda *a, **k: None)
    for name, ref in (("key", key.sums), ("value", value.sums), ("soft", soft.sums), ("key_w", key.weights),
                      ("value_w", value.weights), ("k_mean", k_mean.sums), ("v_mean", v_mean.sums),
                      ("mean_w", k_mean.weights), ("v_wmean", v_wmean.sums)):
        assert torch.allclose(got[name], ref, rtol=1e-12, atol=1e-14 * ref.abs().max()), name  # float64 round-off
    single = calibrate(loaded, seqs, SETTINGS, store_dir=tmp_path / "single").rotations
    for name in ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "k_mean", "v_mean"):
        a, b = got["rotations"][name], getattr(single, name)
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), (name, (a - b).abs().max())
    for name in ("k_clip", "v_clip"):
        assert torch.equal(got["rotations"][name], getattr(single, name)), name


def test_nproc_option_writes_the_single_process_artifacts(run_cli, tiny_model_dir, tmp_path):
    from oscar_zoo.texts import corpus_dir

    text = tmp_path / "play.txt"
    text.write_text((corpus_dir() / "coriolanus_gut.txt").read_text()[:20000])
    args = ["calibrate", str(tiny_model_dir), "--dataset", str(text), "--tokens", "256", "--seq-len", "64",
            "--heldout", "1", "--batch-size", "2", "--device", "cpu", "--dtype", "float32", "--json"]
    env = {**os.environ, "OSCAR_ZOO_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "oscar_zoo", *args, "--nproc", str(WORLD), "--out",
                           str(tmp_path / "dp")], env=env, capture_output=True, text=True, timeout=900)  # a hang guard
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)  # one JSON document: only rank 0 prints
    assert summary["forward_passes"] == ["pass1", "heldout", "pass2"]
    assert sorted(p.name for p in (tmp_path / "cache" / "calibration").iterdir().__next__().iterdir()) == \
        [f"rank{r}-of-{WORLD}" for r in range(WORLD)]

    os.environ["OSCAR_ZOO_CACHE"] = str(tmp_path / "cache-single")
    try:
        code, _, err = run_cli(*args, "--out", tmp_path / "single")
    finally:
        del os.environ["OSCAR_ZOO_CACHE"]
    assert code == 0, err
    m_dp, r_dp = load_artifacts(tmp_path / "dp")
    m_one, r_one = load_artifacts(tmp_path / "single")
    assert m_dp.calibration.token_ids_sha256 == m_one.calibration.token_ids_sha256
    for name in ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "k_clip", "v_clip"):
        a, b = getattr(r_dp, name), getattr(r_one, name)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (name, (a - b).abs().max())


def test_a_failing_rank_gives_its_exit_code_and_stops_the_others(tmp_path):
    code = launch(2, ["calibrate", str(tmp_path / "no-such-model"), "--device", "cpu"])
    assert code == 2
    assert without_option(["calibrate", "--nproc", "2", "x", "--nproc=3", "--out", "o"], "--nproc") == \
        ["calibrate", "x", "--out", "o"]


@pytest.mark.parametrize("device", ["auto", "cuda", "cpu"])
def test_joining_a_process_group_reads_the_device_for_every_device_option(device, monkeypatch):
    """from_env under torchrun's environment with any --device (a group already joined): the GPU check runs. A
    function-local `import torch.distributed…` once made `torch` unbound there, so every run but --device cpu died
    with UnboundLocalError before joining."""
    from oscar_zoo.calibration import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: False)
    dp = distributed.from_env(device)
    assert (dp.rank, dp.world) == (1, 2)
