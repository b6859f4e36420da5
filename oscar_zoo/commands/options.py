"""Options shared by several commands, as `Annotated` aliases (one definition each)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ModelArg = Annotated[str, typer.Argument(help="Hugging Face id, local folder, .gguf file, or `demo` (bundled "
                                              "SmolLM2-135M-Instruct).")]
Revision = Annotated[str | None, typer.Option(help="Model revision (branch, tag or commit) for a Hugging Face id.")]
Device = Annotated[str, typer.Option(help="`auto` (GPU if present), `cpu`, `cuda`, `cuda:N`.")]
Dtype = Annotated[str, typer.Option(help="Model dtype: auto (bfloat16 on a GPU or a CPU with native bfloat16 — "
                                          "AVX512-BF16 or AMX —, else float32), bfloat16, float16 or float32.")]
Dataset = Annotated[str | None, typer.Option(help="HF dataset id (`name` or `name:config`), or a local "
                                                  "text/json/jsonl/parquet file or folder. Default: bundled plays.")]
TextField = Annotated[str | None, typer.Option(help="Dataset column holding the text (default: `text`, else the "
                                                    "first string column).")]
Split = Annotated[str | None, typer.Option(help="Dataset split for a Hugging Face dataset id (default: train for "
                                                "calibrate, test for verify).")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")]
ArtifactsArg = Annotated[Path, typer.Argument(help="Artifact folder (holds manifest.json).")]

