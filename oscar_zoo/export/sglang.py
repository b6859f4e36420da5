"""Settings for the OSCAR reference runtime (the SGLang fork): the environment variables and server flags it reads,
written next to the exported `.pt` files as a sourceable `sglang.env` and a launch script.

The rotation paths in `sglang.env` are relative to the folder holding it (the export folder can be moved or copied
to a server): the server must run with that folder as its working directory. `launch_sglang.sh` needs no such care:
it makes them absolute from its own location.

The reference runtime takes ONE clip ratio for all K (and one for all V) and stores fp32 scales; oscar-zoo's per
(layer, head) searched clips are summarised by their median, and the caller is told when they vary.

Both files are shell: every value in them is `shlex.quote`d, and a value with a control or line-breaking character
(a manifest's `model.id` with a newline would start a command of its own) is refused (IntegrityError, exit 4) before
anything is written; comment lines show any other unprintable character escaped (`\\u202e`).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError, IntegrityError
from ..format.schema import Manifest, line_breaker
from .staging import write_export_files

ENV_FILE, LAUNCH_SCRIPT = "sglang.env", "launch_sglang.sh"
PAGE = 8  # the reference forces page size = INT2 page = flush interval = 8; sink and recent must be multiples


@dataclass(frozen=True)
class SglangSettings:
    env: dict[str, str]
    flags: list[str]
    clip_spread: tuple[float, float]  # largest |clip - median| over K and over V (0 when uniform)

    def launch_command(self, model: str) -> str:
        """The server command line (each word `shlex.quote`d); IntegrityError for a model id that no shell line may
        carry (`shell_word`)."""
        words = [shell_word("model.id", model), *(shell_word("server flag", f) for f in self.flags)]
        return " ".join(["python -m sglang.launch_server", "--model-path", *words])


_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def shell_word(what: str, value: str) -> str:
    """`value` as one `shlex.quote`d shell word. A control, line-breaking or bidi-override character
    (`manifest.line_breaker`) is refused (IntegrityError, exit 4): inside quotes bash would keep it, but it has no place
    in a model id or setting, and a newline would split the line for every other reader of the file. `what` names the
    value for the message (e.g. the manifest field)."""
    bad = line_breaker(value)
    if bad is not None:
        raise IntegrityError(f"{what} {_shown(value)} holds {ascii(bad)}, a control, line-break or bidi-override "
                             "character, which cannot be written into a shell file", "fix the manifest")
    return shlex.quote(value)


def shell_comment(text: str) -> str:
    """`text` for a `# …` line: every unprintable character (control, format such as bidi overrides, separators)
    written as its escape, so the comment stays one line and shows what is there."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def _shown(value: str) -> str:
    text = ascii(value)
    return text if len(text) <= 80 else text[:79] + "…"


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


def sglang_file_texts(settings: SglangSettings, model: str) -> dict[str, str]:
    """The content of `sglang.env` (KEY=VALUE, `set -a; . sglang.env`; rotation paths relative to its folder) and
    `launch_sglang.sh` (exports with those paths made absolute from the script's own folder + the server command).
    Every value is checked and quoted (`shell_word`), the model id in the comments escaped (`shell_comment`)."""
    launch = settings.launch_command(model)  # refuses an id with a control character before anything is built
    env = {}
    for key, value in settings.env.items():
        if not _ENV_NAME.fullmatch(key):
            raise IntegrityError(f"{key!r} is not a shell variable name")
        env[key] = shell_word(key, value)
    header = ["# OSCAR reference runtime (SGLang fork) settings written by `oscar-zoo export --format sglang`",
              f"# model: {shell_comment(model)}"]
    env_note = ["# The rotation paths below are relative to the folder holding this file: start the server with",
                "# this folder as its working directory (cd here first), or use launch_sglang.sh beside it, which",
                "# makes them absolute wherever the folder is moved."]
    env_lines = [*header, *env_note, *(f"{k}={v}" for k, v in env.items())]
    exports = [f'export {k}="$here"/{v}' if k in PATH_VARS else f"export {k}={v}" for k, v in env.items()]
    script = ["#!/usr/bin/env bash", *header, "set -euo pipefail",
              "here=\"$(cd \"$(dirname \"${BASH_SOURCE[0]}\")\" && pwd)\"  # the rotation paths are relative to it",
              *exports, f'exec {launch} "$@"']
    return {ENV_FILE: "\n".join(env_lines) + "\n", LAUNCH_SCRIPT: "\n".join(script) + "\n"}


def write_sglang_files(out: Path, settings: SglangSettings, model: str) -> tuple[Path, Path]:
    """Write `sglang_file_texts` into `out`, both or neither (`staging.write_export_files`; the launch script
    executable). Returns their paths under `out` as given."""
    texts = sglang_file_texts(settings, model)
    write_export_files(out, {name: text.encode() for name, text in texts.items()}, executable={LAUNCH_SCRIPT})
    return Path(out) / ENV_FILE, Path(out) / LAUNCH_SCRIPT
