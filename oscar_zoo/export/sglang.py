"""Settings for the OSCAR reference runtime (the SGLang fork): the environment variables and server flags it reads,
written next to the exported `.pt` files as a sourceable `sglang.env` and a launch script.

The rotation paths in `sglang.env` are relative to the folder holding it (the export folder can be moved or copied
to a server): the server must run with that folder as its working directory. `launch_sglang.sh` needs no such care:
it makes them absolute from its own location.

The reference runtime takes ONE clip ratio for all K (and one for all V) and stores fp32 scales; oscar-zoo's per
(layer, head) searched clips are summarised by their median, and the caller is told when they vary.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from ..artifacts import atomic_write_text, usual_mode
from ..errors import InputError
from ..manifest import Manifest

PAGE = 8  # the reference forces page size = INT2 page = flush interval = 8; sink and recent must be multiples


@dataclass(frozen=True)
class SglangSettings:
    env: dict[str, str]
    flags: list[str]
    clip_spread: tuple[float, float]  # largest |clip - median| over K and over V (0 when uniform)

    def launch_command(self, model: str) -> str:
        return " ".join(["python -m sglang.launch_server", "--model-path", shlex.quote(model), *self.flags])


PATH_VARS = ("SGLANG_OSCAR_K_ROTATION_PATH", "SGLANG_OSCAR_V_ROTATION_PATH")


def check_windows(manifest: Manifest) -> None:
    """The reference runtime's page rule for the BF16 windows (refused before anything is written)."""
    q = manifest.quant
    for name, value in (("sink", q.sink), ("recent", q.recent)):
        if value % PAGE:
            raise InputError(f"the reference runtime needs {name} window sizes that are multiples of {PAGE}; the "
                             f"manifest has {value}", f"re-calibrate with --{name} {value - value % PAGE or PAGE}")


def sglang_settings(manifest: Manifest, k_clip: torch.Tensor, v_clip: torch.Tensor, k_path: Path,
                    v_path: Path, base: Path) -> SglangSettings:
    """The environment and flags; the rotation paths relative to `base` (the folder `sglang.env` is written to)."""
    check_windows(manifest)
    q = manifest.quant
    k_ratio, v_ratio = reference_clip_ratios(k_clip, v_clip)
    env = {
        "SGLANG_ENABLE_MIXED_KV_WINDOWS": "1",
        "SGLANG_MIXED_KV_PREFIX_TOKENS": str(q.sink),
        "SGLANG_MIXED_KV_RECENT_TOKENS": str(q.recent),
        "SGLANG_MIXED_KV_HP_DTYPE": "bfloat16",
        "SGLANG_MIXED_KV_SCALE_DTYPE": "float32",  # what the reference's scripts run; oscar-zoo's runtime uses fp16
        "SGLANG_MIXED_KV_HP_MAX_SPLITS": "8",
        "SGLANG_OSCAR_K_ROTATION_PATH": _relative(k_path, base),
        "SGLANG_OSCAR_V_ROTATION_PATH": _relative(v_path, base),
        "SGLANG_OSCAR_K_CLIP_RATIO": f"{k_ratio:.4g}",
        "SGLANG_OSCAR_V_CLIP_RATIO": f"{v_ratio:.4g}",
        "SGLANG_OSCAR_ABSORB_V_ROTATION": "1",
        "SGLANG_LLOYD_MAX": "1" if q.codebook == "lloyd-max" else "0",
    }
    flags = ["--kv-cache-dtype", "int2", "--kv-cache-quant-group-size", str(q.group_size),
             "--prefill-attention-backend", "fa3", "--decode-attention-backend", "triton"]
    # spread around the exact median (the 4-digit rounding written above is not a variation between heads)
    spread = ((k_clip - k_clip.median()).abs().max().item(), (v_clip - v_clip.median()).abs().max().item())
    return SglangSettings(env, flags, spread)


def reference_clip_ratios(k_clip: torch.Tensor, v_clip: torch.Tensor) -> tuple[float, float]:
    """The one K and one V clip ratio the reference runtime takes for per (layer, head) clips: their medians
    (`torch.median`: the lower of the two middle values for an even count), as `sglang.env` writes them (4 significant
    digits). `verify --as-exported` quantizes with these."""
    return float(f"{k_clip.median().item():.4g}"), float(f"{v_clip.median().item():.4g}")


def _relative(path: Path, base: Path) -> str:
    return os.path.relpath(Path(path).resolve(), Path(base).resolve())


def write_sglang_files(out: Path, settings: SglangSettings, model: str) -> tuple[Path, Path]:
    """`sglang.env` (KEY=VALUE, `set -a; . sglang.env`; rotation paths relative to its folder) and
    `launch_sglang.sh` (exports with those paths made absolute from the script's own folder + the server command)."""
    out = Path(out)
    header = ["# OSCAR reference runtime (SGLang fork) settings written by `oscar-zoo export --format sglang`",
              f"# model: {model}"]
    env_note = ["# The rotation paths below are relative to the folder holding this file: start the server with",
                "# this folder as its working directory (cd here first), or use launch_sglang.sh beside it, which",
                "# makes them absolute wherever the folder is moved."]
    env_lines = [*header, *env_note, *(f"{k}={shlex.quote(v)}" for k, v in settings.env.items())]
    env_path, sh_path = out / "sglang.env", out / "launch_sglang.sh"
    atomic_write_text(env_path, "\n".join(env_lines) + "\n")
    exports = [f'export {k}="$here"/{shlex.quote(v)}' if k in PATH_VARS else f"export {k}={shlex.quote(v)}"
               for k, v in settings.env.items()]
    script = ["#!/usr/bin/env bash", *header, "set -euo pipefail",
              "here=\"$(cd \"$(dirname \"${BASH_SOURCE[0]}\")\" && pwd)\"  # the rotation paths are relative to it",
              *exports, f'exec {settings.launch_command(model)} "$@"']
    atomic_write_text(sh_path, "\n".join(script) + "\n")
    usual_mode(sh_path, executable=True)
    return env_path, sh_path
