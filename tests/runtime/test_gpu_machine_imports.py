"""The GPU machines have torch, triton and transformers but not the CLI's other dependencies: the runtime, the
benchmarks and the GPU tests must import with those three alone. A fresh interpreter with the others made unimportable
imports each of them (a module that pulls one in through `evaluation` fails there at import, a GPU call spent)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = ["oscar_zoo.runtime", "oscar_zoo.runtime.compiled", "oscar_zoo.runtime.graph", "benchmarks.bench_generate",
           "benchmarks.bench_prefill", "benchmarks.bench_decode", "benchmarks.bench_quantize",
           "benchmarks.bench_needle", "benchmarks.experiments.needle_mechanism", "benchmarks.experiments.tile_codecs",
           "benchmarks.experiments.probe_compiled_batch", "tests.runtime.test_compiled_step",
           "tests.runtime.test_static_step", "tests.runtime.test_decode_kernels",
           "tests.runtime.test_quantize_pack_kernel"]  # fmt: skip


def test_runtime_benchmarks_and_gpu_tests_import_without_the_cli_dependencies():
    code = (
        "import importlib, sys\n"
        "for name in ('datasets', 'typer', 'rich', 'gguf', 'accelerate'):\n"
        "    sys.modules[name] = None  # `import datasets` now raises ImportError\n"
        f"for name in {MODULES!r}:\n"
        "    importlib.import_module(name)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
