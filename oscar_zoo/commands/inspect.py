"""`oscar-zoo inspect ARTIFACTS`: the manifest, a full integrity check, and bits per element by context."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from ..artifacts import load_artifacts
from ..calibration.rotation_fit import spectrum_ratio
from ..console import console, shown
from .options import ArtifactsArg, Json

CONTEXTS = (1024, 2048, 4096, 8192, 32768, 65536, 131072)


def inspect_command(artifacts: ArtifactsArg, json_output: Json = False) -> None:
    """Show what an artifact folder holds, check every checksum and shape (exit 4 on any mismatch)."""
    manifest, rotations = load_artifacts(artifacts)
    m, q = manifest.model, manifest.quant
    bpe = {c: manifest.bits_at(c) for c in CONTEXTS}
    if json_output:
        console.print_json(json.dumps({"manifest": manifest.to_dict(), "integrity": "ok",
                                       "bits_per_element": {str(c): round(v, 4) for c, v in bpe.items()}}))
        return
    c = manifest.calibration
    console.print(f"[bold]{shown(m.id)}[/]{f' @ {shown(m.revision)}' if m.revision else ''} · "
                  f"{shown(m.architecture)} · {m.num_layers} layers · {m.num_q_heads} query / {m.num_kv_heads} KV "
                  f"heads · head_dim {m.head_dim}")
    console.print(f"rotation {manifest.rotation.composition} {manifest.rotation.granularity.value}, value target "
                  f"{manifest.rotation.value_target.value}, mixing {shown(manifest.rotation.hadamard)}; clip "
                  f"{manifest.clip.mode.value}; {manifest.codec}, group {q.group_size}, sink {q.sink}, recent "
                  f"{q.recent}, pinned {manifest.pin}; "
                  f"{'centred (K/V means removed)' if manifest.centred else 'uncentred'} · schema "
                  f"{manifest.schema_version}")
    console.print(f"calibrated on {c.tokens:,} tokens of {shown(c.dataset)} ({c.sequences}×{c.seq_len}, token sha256 "
                  f"{shown(c.token_ids_sha256[:12])}…) in {c.wall_seconds:.1f} s, {shown(c.created)}")
    for f in manifest.artifacts:
        console.print(f"[green]ok[/] {shown(f.path)}  {f.bytes:,} bytes  sha256 {shown(f.sha256[:16])}…")
    ks = spectrum_ratio(rotations.k_eigenvalues).mean(-1)
    vs = spectrum_ratio(rotations.v_eigenvalues).mean(-1)
    console.print(f"K λmax/λmean: median {ks.median():.1f}, max {ks.max():.1f} · V: median {vs.median():.1f}, "
                  f"max {vs.max():.1f} · K clip mean {rotations.k_clip.mean():.3f}, V clip mean "
                  f"{rotations.v_clip.mean():.3f}")
    table = Table(title="bits per element (K and V, incl. BF16 windows, pinned tokens and float16 scale/zero)")
    table.add_column("context", justify="right")
    table.add_column("bits/element", justify="right")
    table.add_column("vs BF16", justify="right")
    for ctx, v in bpe.items():
        table.add_row(f"{ctx:,}", f"{v:.3f}", f"{16 / v:.2f}× smaller")
    console.print(table)
    console.print("verification: " + ("none yet (run `oscar-zoo verify`)" if manifest.verification is None
                                      else "stored in the manifest"))


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_command)
