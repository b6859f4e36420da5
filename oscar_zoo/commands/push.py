"""`oscar-zoo push ARTIFACTS REPO_ID`: publish an artifact folder (listed files + manifest + model card) in one
commit."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..console import console, err_console, shown
from ..hub.base import Hub
from ..hub.publish import plan_push, push
from .options import ArtifactsArg, Json

HubOption = Annotated[Hub, typer.Option("--hub", help="Where to publish: `hf` (Hugging Face Hub) or `modelscope`.")]


def push_command(
    artifacts: ArtifactsArg,
    repo_id: Annotated[str, typer.Argument(help="Target repo, OWNER/NAME; created if missing.")],
    hub: HubOption = Hub.HF,
    path_in_repo: Annotated[str | None, typer.Option(help="Subfolder for this model in a zoo repo (default: the "
                                                          "model's name; pass \"\" for the repo root).")] = None,
    private: Annotated[bool, typer.Option(help="Create the repo private (an existing repo keeps its "
                                               "setting).")] = False,
    revision: Annotated[str | None, typer.Option(help="Branch to commit to (created if missing; default: the repo's "
                                                      "default branch).")] = None,
    dry_run: Annotated[bool, typer.Option(help="Check the artifacts and show what would be uploaded; no network.")]
    = False,
    allow_unverified: Annotated[bool, typer.Option(help="Publish artifacts that `oscar-zoo verify` has not passed.")]
    = False,
    allow_loose_thresholds: Annotated[bool, typer.Option(
        "--allow-loose-thresholds", help="Accept a verification judged by thresholds looser than verify's defaults "
                                         "(the card and zoo.json show them).")] = False,
    json_output: Json = False,
) -> None:
    """Upload exactly the files the manifest lists, its manifest and a generated model card, and update zoo.json."""
    with tempfile.TemporaryDirectory(prefix="oscar-zoo-push-") as tmp:
        plan = plan_push(artifacts, repo_id, hub, path_in_repo, revision, allow_unverified, Path(tmp),
                         allow_loose_thresholds=allow_loose_thresholds)
        rows = plan.rows()
        if not dry_run:
            with err_console.status("pushing") as status:
                push(plan, private, Path(tmp), progress=lambda msg: status.update(shown(msg)))
    target = f"{hub}:{repo_id}/{plan.subfolder}".rstrip("/")
    if json_output:
        console.print_json(json.dumps({
            "hub": hub, "repo_id": repo_id, "subfolder": plan.subfolder, "revision": revision, "dry_run": dry_run,
            "commit": plan.commit, "url": plan.url or None, "manifest_sha256": plan.manifest_sha256,
            "files": [{"path": p, "bytes": b, "sha256": s} for p, b, s in rows] + [{"path": "zoo.json"}],
            "zoo": plan.zoo_models}))
        return
    table = Table(title=f"{'would upload' if dry_run else 'uploaded'} to {target}"
                        + ("" if dry_run else f" @ {plan.commit[:12]}"))
    table.add_column("path in repo")
    table.add_column("bytes", justify="right")
    table.add_column("sha256")
    for p, b, s in rows:
        table.add_row(p, f"{b:,}", s[:16] + "…")
    table.add_row("zoo.json" + (" (+ README.md zoo card)" if plan.subfolder else ""), "", "merged with the repo's copy")
    console.print(table)
    if dry_run:
        console.print("dry run: nothing was uploaded")
    else:
        zoo = ", ".join(shown(m) for m in plan.zoo_models)
        console.print(f"[green]pushed[/] {shown(plan.manifest.model.id)} → {shown(plan.url)}  (zoo: {zoo})")


def register(app: typer.Typer) -> None:
    app.command("push")(push_command)
