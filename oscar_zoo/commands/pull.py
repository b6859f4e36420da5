"""`oscar-zoo pull NAME|REPO_ID[/SUBDIR]`: download a published artifact folder, checked file by file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..console import console, err_console, shown
from ..hub.base import Hub
from ..hub.publish import pull, resolve_source
from .options import Json


def pull_command(
    source: Annotated[str, typer.Argument(help="A catalog name (see `oscar-zoo list`) or OWNER/REPO\\[/SUBFOLDER].")],
    hub: Annotated[Hub | None, typer.Option("--hub", help="`hf` or `modelscope` (default: hf for a repo id, the "
                                                          "first published location for a catalog name).")] = None,
    revision: Annotated[str | None, typer.Option(help="Branch, tag or commit (default: the catalog's pin or the "
                                                      "default branch).")] = None,
    dest: Annotated[Path | None, typer.Option(help="Destination folder (default: ./<subfolder or repo name>).")]
    = None,
    force_download: Annotated[bool, typer.Option(help="Ignore the hub client's cache.")] = False,
    json_output: Json = False,
) -> None:
    """Download a published artifact folder, pinned to one commit; every sha256 is checked before the destination
    appears.

    The manifest first, then exactly the files it lists. Works offline from the hub cache (HF_HUB_OFFLINE=1)."""
    src = resolve_source(source, hub, revision)
    with err_console.status(f"pulling {src.hub}:{shown(src.repo_id)}") as status:
        result = pull(src, dest, force_download=force_download, progress=lambda msg: status.update(shown(msg)))
    if json_output:
        console.print_json(json.dumps({
            "hub": src.hub, "repo_id": src.repo_id, "subfolder": src.subfolder, "commit": result.commit,
            "catalog_name": src.entry.name if src.entry else None, "dest": str(result.dest),
            "model": result.manifest.model.id,
            "files": [{"path": p, "bytes": b, "sha256": s} for p, b, s in result.files]}))
        return
    table = Table(title=shown(f"{src.hub}:{src.repo_id}/{src.subfolder}".rstrip("/") + f" @ {result.commit[:12]}"))
    table.add_column("file")
    table.add_column("bytes", justify="right")
    table.add_column("sha256")
    for p, b, s in result.files:
        table.add_row(shown(p), f"{b:,}", f"[green]ok[/] {s[:16]}…")
    console.print(table)
    console.print(f"[green]pulled[/] {shown(result.manifest.model.id)} rotations into {shown(result.dest)}")


def register(app: typer.Typer) -> None:
    app.command("pull")(pull_command)
