#!/usr/bin/env bash
# Here, before the GPU calls: what `gpu_run.sh needle` needs, in the ignored folder .cache (the GPU machine takes at
# most 64 MiB of files per call, the demo model's bfloat16 weights are 269 MB):
#   .cache/needle/models/SmolLM2-135M-Instruct-bf16   config, tokenizer and the weights' sha256 (not the weights)
#   .cache/needle/texts   every haystack's files (evaluation/haystacks.py: the plays, the poems, the docstrings)
#   .cache/w/partNN       the weights, xz-compressed, in parts of at most 60,000,000 bytes (three for the demo model)
# Needs `make demo` (or any earlier run) to have converted the model. The GPU machine needs no package beyond torch,
# triton and transformers for the needle mode.
# Usage: bash benchmarks/needle_weights.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
model=$($PY -c "from oscar_zoo.models import ensure_demo_model; print(ensure_demo_model())")
mkdir -p .cache/needle/models/SmolLM2-135M-Instruct-bf16 .cache/needle/texts .cache/w
cp "$model"/*.json .cache/needle/models/SmolLM2-135M-Instruct-bf16/
cp "$model"/*.jinja .cache/needle/models/SmolLM2-135M-Instruct-bf16/ 2>/dev/null || true
sha256sum "$model/model.safetensors" | cut -c1-64 > .cache/needle/models/SmolLM2-135M-Instruct-bf16/sha256
$PY -m benchmarks.bench_needle --write-texts .cache/needle/texts > /dev/null  # every haystack's files
rm -f .cache/w/part??
xz -6 -T0 -c "$model/model.safetensors" | split -b 60000000 -d - .cache/w/part
ls -l .cache/w .cache/needle/models/SmolLM2-135M-Instruct-bf16
