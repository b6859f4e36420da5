"""`oscar-zoo import-oscar K.pt V.pt --model MODEL --out DIR`: reference OSCAR-RotationZoo files -> artifact folder."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated

import typer

from ..console import console, shown
from ..export.oscar_pt import import_oscar_pt, model_identity_for
from .options import Json, Revision


def import_oscar_command(
    k_file: Annotated[Path, typer.Argument(help="k_rotation_qqt_r_h_pbr.pt")],
    v_file: Annotated[Path, typer.Argument(help="v_rotation_sst_r_h_pbr.pt")],
    model: Annotated[str, typer.Option(help="The model the files belong to: `demo`, a local folder, or a Hugging "
                                            "Face id (only its config is read; shapes are checked against it).")],
    out: Annotated[Path, typer.Option(help="Artifact folder to write.")],
    revision: Revision = None,
    group_size: Annotated[int | None, typer.Option(help="Quantization group size recorded in the manifest: 0 (one "
                          "group per row) or a divisor of head_dim; default the reference runtime's 128, or head_dim "
                          "when 128 does not divide it.")] = None,
    json_output: Json = False,
) -> None:
    """Convert the reference implementation's rotation files into an artifact folder (unverified: run `oscar-zoo
    verify`).

    The published pickle dicts are loaded with torch.load(weights_only=True) only; the folder holds one rotation per
    layer with the reference's fixed clips (K 0.96, V 0.92)."""
    identity = model_identity_for(model, revision)
    manifest = import_oscar_pt(k_file, v_file, identity, out, group_size)
    if json_output:
        console.print_json(json.dumps({"out": str(out), "model": manifest.model.id,
                                       "layers": len(manifest.rotation.layer_ids), "head_dim": manifest.model.head_dim,
                                       "artifacts": [a.to_dict() for a in manifest.artifacts]}))
        return
    console.print(f"imported {len(manifest.rotation.layer_ids)} layers of {manifest.model.head_dim}×"
                  f"{manifest.model.head_dim} K and V rotations for {shown(manifest.model.id)} into {shown(out)} "
                  f"(per-layer, clips K {manifest.clip.k_default} / V {manifest.clip.v_default}); next: `oscar-zoo "
                  f"verify {shown(shlex.quote(str(out)))}`", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("import-oscar")(import_oscar_command)
