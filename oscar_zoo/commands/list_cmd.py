"""`oscar-zoo list`: the bundled zoo catalog (or $OSCAR_ZOO_CATALOG) as a table or JSON."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from ..console import console, shown
from ..hub.catalog import load_catalog
from ..hub.zoo import bpe_128k, verification_summary
from .options import Json


def list_command(json_output: Json = False) -> None:
    """Show every catalogued rotation set: model, granularity, bits per element at 128K, verification, location."""
    entries = load_catalog()
    if json_output:
        console.print_json(json.dumps([{
            "name": e.name, "model": e.manifest.model.id, "granularity": e.manifest.rotation.granularity.value,
            "bits_per_element_128k": bpe_128k(e.manifest),
            "verification": verification_summary(e.manifest.verification),
            "manifest_sha256": e.manifest_sha256,
            "locations": [loc.to_dict() for loc in e.locations]} for e in entries]))
        return
    table = Table(title="oscar-zoo catalog")
    for col, justify in (("name", "left"), ("model", "left"), ("granularity", "left"), ("bits/elem @128K", "right"),
                         ("verification", "left"), ("pull from", "left")):
        table.add_column(col, justify=justify, no_wrap=col in ("name", "model", "verification"))
    for e in entries:
        where = "\n".join(shown(f"{loc.hub}:{loc.spec}")
                          + ("" if loc.published else " [yellow](planned, not published)[/]") for loc in e.locations)
        table.add_row(shown(e.name), shown(e.manifest.model.id), e.manifest.rotation.granularity.value,
                      f"{bpe_128k(e.manifest):.2f}", shown(verification_summary(e.manifest.verification)), where)
    console.print(table)
    if not entries:
        console.print("the catalog is empty")


def register(app: typer.Typer) -> None:
    app.command("list")(list_command)
