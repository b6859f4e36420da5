"""benchmarks/bench_calibrate_scaling.py on CPU: two gloo ranks under torchrun and one plain process give the same
reduced float64 targets and eigenvalues (round-off only) and the same rotations, and `--compare` reports it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "benchmarks.bench_calibrate_scaling"]  # run from tmp_path: PYTHONPATH holds the repository
# 8 sequences of 32 tokens, batch 2: each of two ranks batches exactly the pairs one process batches
TINY = ["--device", "cpu", "--threads", "1", "--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "16", "--vocab", "256", "--tokens", "256", "--seq-len", "32",
        "--batch-size", "2", "--heldout", "1"]


def _run(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    # timeout: a hang guard, not a measurement
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_two_gloo_ranks_match_one_process(tmp_path):
    out = tmp_path / "out"
    two = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *SCRIPT,
                *TINY, "--out", str(out), "--tag", "w2"], tmp_path)
    one = _run([sys.executable, *SCRIPT, *TINY, "--out", str(out), "--tag", "w1"], tmp_path)
    assert "| world |" in one.stdout.splitlines()[-3]  # the table last
    lines = two.stdout.splitlines()
    assert "| world |" in lines[-7] and "| rank |" in lines[-4]  # then one row per rank
    assert [line.split("|")[1].strip() for line in lines[-2:]] == ["0", "1"]

    r1, r2 = (json.loads((out / f"scaling_{t}.json").read_text()) for t in ("w1", "w2"))
    assert (r1["world_size"], r2["world_size"]) == (1, 2)
    assert r2["backend"] == "gloo" and r1["backend"] is None
    assert r1["tokens"] == r2["tokens"] == 256
    for r in (r1, r2):
        assert r["wall_s"] > 0 and abs(r["tokens_per_s"] * r["wall_s"] / 256 - 1) < 1e-2
        phases = {"pass 1/2: key target", "pass 2/2: value target", "rotations", "clip search"}
        assert phases <= set(r["phases_rank0_s"])
    assert [g["rank"] for g in r2["ranks"]] == [0, 1]

    cmp = _run([sys.executable, *SCRIPT, "--compare", str(out / "scaling_w1.safetensors"),
                str(out / "scaling_w2.safetensors"), "--out", str(out)], tmp_path)
    assert "| key_target | float64 |" in cmp.stdout
    rows = json.loads((out / "scaling_compare.json").read_text())
    for name in ("key_target", "value_target", "key_eigenvalues64", "value_eigenvalues64"):  # float64 round-off
        assert rows[name]["dtype"] == "float64" and rows[name]["max_rel_diff"] < 1e-12, (name, rows[name])
    for name in ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "k_clip", "v_clip"):
        assert rows[name]["max_abs_diff"] < 1e-5, (name, rows[name])  # float32 tensors from those targets

    from safetensors.torch import load_file

    t1 = load_file(out / "scaling_w1.safetensors")
    assert t1["key_target"].dtype == torch.float64 and t1["key_target"].shape == (2, 2, 16, 16)
    assert t1["k_rotation"].shape == (2, 2, 16, 16) and torch.isfinite(t1["v_eigenvalues"]).all()


def test_device_map_mode_builds_per_module_and_runs(tmp_path):
    """The --device-map path (meta build, per-module materialisation, accelerate dispatch) on host devices."""
    out = tmp_path / "out"
    _run([sys.executable, *SCRIPT, *TINY, "--layers", "3", "--device-map", "auto", "--out", str(out)], tmp_path)
    r = json.loads((out / "scaling_devmap.json").read_text())
    assert r["mode"] == "device-map" and r["world_size"] == 1 and r["tokens_per_s"] > 0
    assert set(r["device_map"]) == {"model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1",
                                    "model.layers.2", "model.norm", "lm_head"}
    from safetensors.torch import load_file

    t = load_file(out / "scaling_devmap.safetensors")
    assert all(torch.isfinite(v).all() for v in t.values())
    assert (t["key_eigenvalues64"] > -1e-12).all()  # a second moment is positive semi-definite


def test_predict_from_one_and_two_gpu_reports(tmp_path):
    """A constructed pair of reports with known phases: capture 8 s on one GPU and 4.4 s on two (efficiency 8/8.8),
    per-layer work 3 s over 5 layers, held-out 0.5 s and 0.2 s of the rest at two GPUs."""
    def report(world, wall, phases):
        return {"world_size": world, "wall_s": wall, "config": {"num_hidden_layers": 5}, "phases_rank0_s": phases}

    one = report(1, 12.0, {"pass 1/2: key target": 5.0, "pass 2/2: value target": 3.0, "held-out capture": 0.5,
                           "rotations": 1.0, "clip search": 2.0})
    two = report(2, 7.6, {"pass 1/2: key target": 2.6, "pass 2/2: value target": 1.8, "held-out capture": 0.5,
                          "rotations": 0.6, "clip search": 1.9})  # Σ = 7.4: 0.2 s outside the phases
    (tmp_path / "one.json").write_text(json.dumps(one))
    (tmp_path / "two.json").write_text(json.dumps(two))
    _run([sys.executable, *SCRIPT, "--predict", str(tmp_path / "one.json"), str(tmp_path / "two.json"),
          "--gpus", "4", "8", "--out", str(tmp_path)], tmp_path)
    rows = {r["gpus"]: r for r in json.loads((tmp_path / "scaling_predict.json").read_text())}
    eff = 8.0 / 8.8
    for n, share in ((4, 2 / 5), (8, 1 / 5)):  # the largest layer share: ⌈5/4⌉ = 2 and ⌈5/8⌉ = 1 of 5 layers
        expect = 8.0 / (n * eff) + 3.0 * share + 0.5 + 0.2
        assert abs(rows[n]["wall_s"] - expect) < 1e-3, (n, rows[n], expect)
        assert abs(rows[n]["speedup"] - 12.0 / expect) < 1e-2
