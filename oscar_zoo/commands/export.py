"""`oscar-zoo export ARTIFACTS --format oscar-pt|sglang --out DIR`: the reference implementation's `.pt` files, plus
for sglang the environment and server flags its runtime reads."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated

import typer

from ..console import console, err_console, shown
from ..export.oscar_pt import export_oscar_pt
from ..format import layout
from ..format.layout import Choice
from .options import ArtifactsArg, Json


class Format(Choice):
    OSCAR_PT = "oscar-pt"
    SGLANG = "sglang"


def export_command(
    artifacts: ArtifactsArg,
    format: Annotated[Format, typer.Option("--format", help="`oscar-pt`: the two reference .pt files; `sglang`: "
                                                            "those plus sglang.env and launch_sglang.sh.")],
    out: Annotated[Path, typer.Option(help="Output folder.")],
    average_heads: Annotated[bool, typer.Option(help="Allow per-head artifacts: average each layer's heads and "
                                                     "re-orthogonalise (polar factor). Quality may drop.")] = False,
    accept_degraded: Annotated[bool, typer.Option(help="Allow centred artifacts (quant.centring mean), 3-bit keys "
                                                       "(quant.key_bits) and pinned tokens (quant.pin): the exported "
                                                       "form has no means, INT2 keys everywhere and pins nothing. "
                                                       "Quality drops.")] = False,
    json_output: Json = False,
) -> None:
    """Write the reference implementation's rotation files (`--format oscar-pt`) or its SGLang deployment (`--format
    sglang`).

    The files are `k_rotation_qqt_r_h_pbr.pt` and `v_rotation_sst_r_h_pbr.pt` (one rotation per layer)."""
    # every refusal comes before anything is written, and all the files land together or none do
    result = export_oscar_pt(artifacts, out, average_heads, accept_degraded, sglang=format == Format.SGLANG)
    measure = f"measure the exported form with `oscar-zoo verify {shlex.quote(str(artifacts))} --as-exported`"
    warnings = []
    if result.manifest.centred:
        warnings.append("the artifacts are centred (k_mean/v_mean); the exported .pt files carry no means, so the "
                        f"reference runtime stores uncentred rows with clips searched for centred ones: {measure}, or "
                        "verify an uncentred calibration (--centring none), before serving this export")
    if max(result.manifest.key_bits) > layout.BITS:
        warnings.append(f"{result.manifest.key_bits.count(3)} of {len(result.manifest.key_bits)} layers keep "
                        "3-bit keys in these artifacts; the reference runtime quantizes every key to INT2, so "
                        f"long-context retrieval drops in those layers: {measure} before serving this export")
    if result.manifest.key_block:
        warnings.append(f"these artifacts code history keys per channel over {result.manifest.key_block}-token "
                        "blocks; the reference runtime codes them per row, so long-context retrieval drops: "
                        f"{measure} before serving this export")
    if result.manifest.pin:
        warnings.append(f"these artifacts pin {result.manifest.pin} history tokens per KV head in BF16; the reference "
                        f"runtime pins none, so retrieval from long prompts drops: {measure} before serving this "
                        "export")
    if result.averaged:
        warnings.append(f"per-head rotations were averaged per layer and re-orthogonalised (polar decomposition); "
                        f"inter-head agreement mean |diag(R_0ᵀ R_h)|: K {result.k_agreement:.3f}, V "
                        f"{result.v_agreement:.3f} (1.0 = identical heads; low values mean the shared rotation "
                        f"fits some heads poorly: {measure} before serving)")
    doc = {"format": format.value, "k_rotation": str(result.k_path), "v_rotation": str(result.v_path),
           "averaged_heads": result.averaged, "head_agreement": {"k": result.k_agreement, "v": result.v_agreement}}
    if result.sglang is not None:
        model = result.manifest.model.id
        settings, env_path, sh_path = result.sglang.settings, result.sglang.env_path, result.sglang.launch_script
        if max(settings.clip_spread) > 1e-6:
            warnings.append(f"clip ratios vary per layer/head (max deviation from the median K "
                            f"{settings.clip_spread[0]:.3f}, V {settings.clip_spread[1]:.3f}); the reference runtime "
                            f"takes one ratio each, the median is used ({measure})")
        doc.update(env=settings.env, flags=settings.flags, env_file=str(env_path), launch_script=str(sh_path),
                   launch_command=settings.launch_command(model))
    doc["warnings"] = warnings
    for w in warnings:
        err_console.print(f"[yellow]warning:[/] {shown(w)}", highlight=False, soft_wrap=True)
    if json_output:
        console.print_json(json.dumps(doc))
        return
    console.print(f"wrote {shown(result.k_path)}")
    console.print(f"wrote {shown(result.v_path)}")
    if format == Format.SGLANG:
        console.print(f"wrote {shown(doc['env_file'])} and {shown(doc['launch_script'])}; serve with:")
        console.print(f"  {shown(shlex.quote(str(sh_path)))}   (or, in {shown(out)}: set -a; . ./sglang.env; set +a; "
                      f"{shown(doc['launch_command'])})", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
