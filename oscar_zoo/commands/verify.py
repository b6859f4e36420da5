"""`oscar-zoo verify ARTIFACTS`: BF16 vs the artifact's INT2 cache and baselines on held-out text; table or JSON,
optional plot, optional report in the manifest; exit 3 when the artifact misses a threshold."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..artifacts import check_model_matches, load_artifacts, write_manifest
from ..calibration.data import EVALUATION_PLAYS, load_texts, make_sequences
from ..console import console, err_console, progress_reporter
from ..errors import InputError, VerificationFailed
from ..evaluation.baselines import BASELINES, DEFAULT_BASELINES
from ..evaluation.harness import DEFAULT_THRESHOLDS, VerifySettings, resolve_backend, run_verification
from ..evaluation.report import Thresholds, VerifyReport
from ..models import DEMO, DEMO_HF_ID, DEMO_REVISION, load_model
from .options import ArtifactsArg, Dataset, Device, Dtype, Json, Revision, Split, TextField


def verify_command(
    artifacts: ArtifactsArg,
    model: Annotated[str | None, typer.Option(help="Model to verify with (default: the one the manifest names; "
                                                   "`demo` for the bundled SmolLM2).")] = None,
    revision: Revision = None,
    dataset: Dataset = None,
    text_field: TextField = None,
    split: Split = "test",
    context: Annotated[int, typer.Option(help="Tokens per teacher-forced sequence.")] = 2048,
    sequences: Annotated[int, typer.Option(help="Held-out sequences.")] = 8,
    baselines: Annotated[str, typer.Option(help=f"Comma-separated baselines from {', '.join(BASELINES)}, or `none`.")]
    = ",".join(DEFAULT_BASELINES),
    score_from: Annotated[int | None, typer.Option(help="First position of the past-window metrics (default: sink + "
                                                        "recent, the first that reads an INT2 key).")] = None,
    generate: Annotated[int, typer.Option(help="Greedy tokens compared with BF16 through the runtime cache "
                                               "(0: skip).")] = 32,
    backend: Annotated[str, typer.Option(help="auto (Triton on a GPU, torch reference on CPU), triton or torch.")]
    = "auto",
    seed: Annotated[int, typer.Option(help="Seed for the document order.")] = 0,
    device: Device = "auto",
    dtype: Dtype = "bfloat16",
    max_ppl_increase: Annotated[float, typer.Option(help="Largest relative perplexity increase past the windows.")]
    = DEFAULT_THRESHOLDS.max_ppl_increase,
    max_kl: Annotated[float, typer.Option(help="Largest mean KL(BF16 ‖ INT2) per token past the windows.")]
    = DEFAULT_THRESHOLDS.max_kl,
    min_top1: Annotated[float, typer.Option(help="Smallest top-1 agreement with BF16 past the windows.")]
    = DEFAULT_THRESHOLDS.min_top1,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG: per-layer attention error and KL by position.")]
    = None,
    write: Annotated[bool, typer.Option("--write", help="Store the report in the manifest's `verification`.")]
    = False,
    json_output: Json = False,
) -> None:
    """Verify ARTIFACTS: how close INT2 attention with these rotations stays to BF16 (exit 3 below thresholds)."""
    start = time.perf_counter()
    for name, value in (("--context", context), ("--sequences", sequences)):
        if value <= 0:
            raise InputError(f"{name} must be positive, got {value}")
    chosen = tuple(b.strip() for b in baselines.split(",") if b.strip() and b.strip() != "none")
    unknown = [b for b in chosen if b not in BASELINES]
    if unknown:
        raise InputError(f"unknown baseline(s) {', '.join(unknown)}", f"choose from {', '.join(BASELINES)}, or none")

    manifest, rotations = load_artifacts(artifacts)
    say = (lambda msg: None) if json_output else (lambda msg: err_console.print(f"[dim]{msg}[/]"))
    name, rev = model, revision
    if name is None:
        demo = manifest.model.id == DEMO_HF_ID and manifest.model.revision == DEMO_REVISION
        name, rev = (DEMO, None) if demo else (manifest.model.id, revision or manifest.model.revision)
    loaded = load_model(name, revision=rev, device=device, dtype=dtype, progress=say)
    check_model_matches(manifest, loaded.identity)
    resolved = resolve_backend(backend, next(loaded.model.parameters()).device)
    texts, source = load_texts(dataset, split=split, text_field=text_field, plays=EVALUATION_PLAYS)
    seqs = make_sequences(loaded.tokenizer, texts, context, sequences, 0, seed, dataset=source)
    say(f"verifying {artifacts} on {loaded.identity.id}: {sequences}×{context} tokens of {source}, backend {resolved}")
    settings = VerifySettings(context=context, sequences=sequences, baselines=chosen, backend=resolved,
                              positions_from=score_from, generate_tokens=generate,
                              thresholds=Thresholds(max_ppl_increase=max_ppl_increase, max_kl=max_kl,
                                                    min_top1=min_top1))
    with progress_reporter(enabled=not json_output) as report_progress:
        report = run_verification(loaded, manifest, rotations, seqs.input_ids, settings, artifacts=str(artifacts),
                                  dataset=source, progress=report_progress)
    report = report.model_copy(update={"wall_seconds": round(time.perf_counter() - start, 2)})
    if plot is not None:
        from ..evaluation.plot import write_plot

        write_plot(report, plot)
    if write:
        write_manifest(artifacts, manifest.model_copy(update={"verification": report.model_dump(mode="json")}))
    if json_output:
        console.print_json(report.model_dump_json())
    else:
        _print(report, plot, write, artifacts)
    if not report.passed:
        raise VerificationFailed(f"{artifacts} missed the thresholds: {'; '.join(report.failures)}",
                                 "see the table; do not publish these rotations as verified")


SHORT = {"bf16": "BF16", "oscar": "OSCAR", "naive": "naive INT2", "clip-only": "clip-only INT2",
         "hadamard": "Hadamard INT2", "kivi": "KIVI-2-style"}


def _print(report: VerifyReport, plot: Path | None, write: bool, artifacts: Path) -> None:
    cut = report.positions_from
    table = Table(title=f"{report.model}: INT2 KV cache vs BF16 · {report.sequences}×{report.context} held-out tokens "
                        f"· sink {report.sink}, recent {report.recent}, group {report.group_size}")
    for col in ("method", "bits/elem", "PPL", f"PPL ≥{cut}", f"KL ≥{cut}", f"top-1 ≥{cut}", "attn err", "greedy"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for m in report.methods:
        ref = m.kind == "reference"
        err = "—" if ref else f"{sum(m.layer_error) / len(m.layer_error):.3f}"
        past = f"{m.ppl_past_windows:.2f}" + ("" if ref else f" ({100 * m.ppl_increase:+.1f}%)")
        table.add_row(SHORT.get(m.name, m.name), f"{m.bits_per_element:.2f}", f"{m.ppl:.2f}", past, f"{m.kl:.4f}",
                      f"{100 * m.top1:.1f}%", err, _generation(m), style="bold" if m.kind == "artifact" else None)
    console.print(table)
    for m in report.methods:
        bits = (f"K {m.bits_per_element_k:.2f} / V {m.bits_per_element_v:.2f} bits"
                if m.bits_per_element_k != m.bits_per_element_v else "")
        console.print(f"  {SHORT.get(m.name, m.name)}: {m.label}{f'; {bits}' if bits else ''}", highlight=False)
    console.print(
        f"bits/elem: mean of K and V at {report.context} tokens, BF16 windows and float16 scale/zero included. "
        f"≥{cut}: positions whose attention reads INT2 keys ({report.tokens_scored:,} tokens); Δ vs BF16 in brackets. "
        f"attn err: mean over layers of ‖o − o_bf16‖/‖o_bf16‖ (sequence 1, same inputs, queries ≥{cut}).",
        highlight=False)
    gen = next((m.generation for m in report.methods if m.kind != "reference" and m.generation is not None), None)
    if gen is not None:
        console.print(f"greedy: {gen.new_tokens} tokens after a {gen.prompt_tokens}-token held-out prompt through the "
                      "runtime (OscarCache + `oscar` attention: exact prefill, decode over the INT2 tiers), compared "
                      "with BF16's; KIVI has no runtime here.", highlight=False)
    t = report.thresholds
    verdict = "[bold green]PASS[/]" if report.passed else "[bold red]FAIL[/]: " + "; ".join(report.failures)
    console.print(f"thresholds (OSCAR): Δ PPL ≥{cut} ≤ {100 * t.max_ppl_increase:.0f}%, KL ≤ {t.max_kl}, top-1 ≥ "
                  f"{100 * t.min_top1:.0f}% → {verdict} · backend {report.backend} on {report.device} · "
                  f"{report.wall_seconds:.0f} s", highlight=False)
    if plot is not None:
        console.print(f"[green]wrote[/] {plot}")
    if write:
        console.print(f"[green]stored[/] the report in {artifacts}/manifest.json (verification)")


def _generation(m) -> str:
    g = m.generation
    if g is None:
        return "—"
    if m.kind == "reference":
        return f"{g.new_tokens} tok"
    if g.first_divergence is None:
        return f"same {g.new_tokens}/{g.new_tokens}"
    return f"differs @{g.first_divergence}"


def register(app: typer.Typer) -> None:
    app.command("verify")(verify_command)
