"""Write paths under a file-size limit (`ulimit -f`, RLIMIT_FSIZE): the OSError it raises (EFBIG; Python ignores
SIGXFSZ) is exit 2 with one line naming the file and the reason, never a traceback, and the destination is left as it
was (absent here). Driven in-process with the soft limit lowered for the command alone."""

from __future__ import annotations

import contextlib
import resource

import pytest

from .export.test_oscar_pt import _reference_files
from .hub.helpers import make_artifacts, run_cli

LIMIT = 1024  # bytes: below every artifact file these commands write, above nothing they must write first


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def refused(result, dest):
    code, out, err = result
    assert code == 2, (out, err)
    assert "Traceback" not in err and "largest size allowed" in err, err
    lines = err.strip().splitlines()  # calibrate's progress lines come first
    assert [line.split(":")[0] for line in lines[-2:]] == ["error", "hint"], err
    assert sum(line.startswith("error:") for line in lines) == 1, err
    assert not dest.exists(), sorted(dest.rglob("*"))


def test_import_oscar_under_a_file_size_limit(tmp_path):
    from transformers import LlamaConfig

    model = tmp_path / "tiny-llama"
    LlamaConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=2, head_dim=16, vocab_size=64).save_pretrained(model)
    k_file, v_file, _, _ = _reference_files(tmp_path / "ref")
    with file_size_limit(LIMIT):
        result = run_cli("import-oscar", str(k_file), str(v_file), "--model", str(model), "--out", str(tmp_path / "a"))
    refused(result, tmp_path / "a")


@pytest.mark.parametrize("fmt", ["oscar-pt", "sglang"])
def test_export_under_a_file_size_limit(tmp_path, fmt):
    make_artifacts(tmp_path / "art", granularity="per-layer", L=3, H_kv=2, D=16)
    with file_size_limit(LIMIT):
        result = run_cli("export", str(tmp_path / "art"), "--format", fmt, "--out", str(tmp_path / "pt"))
    refused(result, tmp_path / "pt")


def test_calibrate_under_a_file_size_limit(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_ZOO_CACHE", str(tmp_path / "cache"))
    with file_size_limit(LIMIT):
        result = run_cli("calibrate", str(tiny_model_dir), "--device", "cpu", "--tokens", "256", "--seq-len", "64",
                         "--clip", "fixed", "--out", str(tmp_path / "art"))
    refused(result, tmp_path / "art")
