"""`--dtype auto`, the default of calibrate and verify: bfloat16 where it is native (a GPU; a CPU whose torch
dispatches AVX512 kernels and has AVX512-BF16 or AMX), float32 elsewhere — where bfloat16 would run several times
slower than float32. The manifest records what ran and verify's reference row is named by it."""

from __future__ import annotations

import json

import pytest
import torch

from oscar_zoo import models


@pytest.mark.parametrize("capability, bf16, amx, want", [
    ("AVX512", True, False, torch.bfloat16), ("AVX512", False, True, torch.bfloat16),
    ("AVX512", False, False, torch.float32), ("AVX2", True, True, torch.float32),
    ("DEFAULT", False, False, torch.float32)])
def test_auto_picks_bfloat16_only_where_it_is_native(monkeypatch, capability, bf16, amx, want):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert models.resolve_dtype("auto", "cpu") is want
    assert models.resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16  # a GPU: always bfloat16
    assert models.resolve_dtype("float16", "cpu") is torch.float16  # an explicit dtype is kept


def test_the_capability_torch_reports_is_what_decides(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 (torch's own switch) makes torch run its AVX2 kernels, which emulate bfloat16: auto
    follows what torch will run, not only the CPU's flags."""
    import subprocess
    import sys

    code = "import torch; from oscar_zoo.models import resolve_dtype; print(resolve_dtype('auto', 'cpu'))"
    out = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "ATEN_CPU_CAPABILITY": "avx2"},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "torch.float32"


def test_calibrate_and_verify_default_to_auto(run_cli, tiny_model_dir, tmp_path, monkeypatch):
    """With no --dtype, a CPU without native bfloat16 (simulated) calibrates and verifies in float32, the manifest
    says so, and verify's reference row is FP32, not BF16."""
    monkeypatch.setattr(models, "native_cpu_bfloat16", lambda: False)
    monkeypatch.setenv("OSCAR_ZOO_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "art"
    code, _, err = run_cli("calibrate", tiny_model_dir, "--device", "cpu", "--tokens", "256", "--seq-len", "64",
                           "--heldout", "1", "--clip", "fixed", "--out", out)
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["calibration"]["dtype"] == "float32"
    text = tmp_path / "heldout.txt"
    text.write_text("All the world's a stage, and all the men and women merely players. " * 200)
    code, stdout, err = run_cli("verify", out, "--model", tiny_model_dir, "--dataset", text, "--context", "400",
                                "--sequences", "1", "--generate", "0", "--baselines", "none", "--device", "cpu",
                                "--max-kl", "99", "--min-top1", "0", "--max-ppl-increase", "99", "--json")
    assert code == 0, err
    reference = json.loads(stdout)["methods"][0]
    assert reference["name"] == "bf16" and reference["label"] == "FP32 (reference)"
