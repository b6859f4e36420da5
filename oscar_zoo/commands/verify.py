"""`oscar-zoo verify ARTIFACTS`: BF16 vs the artifact's INT2 cache and baselines on held-out text; table or JSON,
optional plot, optional report in the manifest; exit 3 when the artifact misses a threshold."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ..console import console, err_console, progress_reporter, shown
from ..errors import InputError, SettingError, VerificationFailed
from ..evaluation.needle import (
    DEFAULT_DEPTHS,
    QUICK_DEPTHS,
    NeedleProtocol,
    NeedleSettings,
    check_batch,
    paired_against_reference,
)
from ..evaluation.registry import BASELINES, DEFAULT_BASELINES, SHORT, check_baselines
from ..evaluation.verification_passes import DEFAULT_THRESHOLDS, MAX_GENERATE, VerifySettings
from ..evaluation.verification_run import VerifyRequest, verify_artifacts
from ..export.as_exported import as_exported as exported_form
from ..format.verification import DEFAULT_MIN_NEEDLE_ACCURACY, NeedleReport, Thresholds, VerifyReport
from ..texts import check_dataset_options
from .options import ArtifactsArg, Dataset, Device, Dtype, Json, Revision, Split, TextField


def verify_command(
    artifacts: ArtifactsArg,
    model: Annotated[str | None, typer.Option(help="Model to verify with (default: the one the manifest names; "
                                                   "`demo` for the bundled SmolLM2).")] = None,
    revision: Revision = None,
    dataset: Dataset = None,
    text_field: TextField = None,
    split: Split = None,
    context: Annotated[int, typer.Option(help="Tokens per teacher-forced sequence.")] = 2048,
    sequences: Annotated[int, typer.Option(help="Held-out sequences.")] = 8,
    baselines: Annotated[str, typer.Option(help=f"Comma-separated baselines from {', '.join(BASELINES)}, or "
                                               "`none`. hf-*: transformers' QuantizedCache with its defaults (extra "
                                               "`peers`).")]
    = ",".join(DEFAULT_BASELINES),
    score_from: Annotated[int | None, typer.Option(help="First position of the past-window metrics (default: sink + "
                                                        "recent, the first that reads an INT2 key).")] = None,
    generate: Annotated[int, typer.Option(help=f"Greedy tokens compared with BF16 through the runtime cache (0: "
                                               f"skip; at most {MAX_GENERATE:,}, and --context plus these within "
                                               "the model's positions).")] = 32,
    backend: Annotated[str, typer.Option(help="auto (Triton on a GPU, torch reference on CPU), triton or torch.")]
    = "auto",
    seed: Annotated[int, typer.Option(help="Seed for the document order.")] = 0,
    device: Device = "auto",
    dtype: Dtype = "auto",
    max_ppl_increase: Annotated[float, typer.Option(help="Largest relative perplexity increase past the windows.")]
    = DEFAULT_THRESHOLDS.max_ppl_increase,
    max_kl: Annotated[float, typer.Option(help="Largest mean KL(BF16 ‖ INT2) per token past the windows.")]
    = DEFAULT_THRESHOLDS.max_kl,
    min_top1: Annotated[float, typer.Option(help="Smallest top-1 agreement with BF16 past the windows.")]
    = DEFAULT_THRESHOLDS.min_top1,
    plot: Annotated[str | None, typer.Option(help="Write a plot: per-layer attention error and KL by position "
                                                  "(the extension picks the format: .png, .pdf, .svg, …; none: "
                                                  ".png; with --needle also NAME-needle.EXT). Checked before the "
                                                  "run; an existing file is refused without --overwrite-plot.")]
    = None,
    overwrite_plot: Annotated[bool, typer.Option("--overwrite-plot", help="Let --plot replace existing files.")]
    = False,
    write: Annotated[bool, typer.Option("--write", help="Store the report in the manifest's `verification`.")]
    = False,
    needle: Annotated[bool, typer.Option("--needle", help="Also run passkey retrieval at long context through the "
                                                          "runtime (BF16, OSCAR, and the baselines with a "
                                                          "cache: naive, clip-only, Hadamard, hf-*). Any --needle-* "
                                                          "or --min-needle-accuracy option implies it.")] = False,
    needle_lengths: Annotated[str | None, typer.Option(help="Comma-separated prompt lengths in tokens (default: "
                                                            "1024, 2048, … and the model's limit less the answer).")]
    = None,
    needle_depths: Annotated[str | None, typer.Option(help="Comma-separated needle depths in [0, 1] (default: "
                                                           "0.2,0.5,0.8).")] = None,
    needle_trials: Annotated[int | None, typer.Option(help="Prompts per (length, depth) cell (default 2; 1 with "
                                                            "--needle-quick).")] = None,
    needle_quick: Annotated[bool, typer.Option("--needle-quick", help="A small grid: two lengths (1024 and the "
                                                                      "largest ≤ 4096), two depths, one trial.")]
    = False,
    min_needle_accuracy: Annotated[float | None, typer.Option(help="Smallest needle accuracy of the artifact "
                                                                   "relative to BF16's (exit 3 below; default "
                                                                   "0.9).")] = None,
    needle_protocol: Annotated[NeedleProtocol | None, typer.Option(
        help="follow-up (default): the context is cached first and the question reads it through the INT2 tiers, "
             "first answer token included (a question about a cached document); prompt: context and question are "
             "one prompt, as model.generate(prompt, past_key_values=cache) runs it (the prompt attends to its own "
             "exact K/V).")] = None,
    needle_batch: Annotated[int | None, typer.Option(help="Prompts of one length run together as the rows of one "
                                                          "batch (default 1): the same prompts, the same answers "
                                                          "up to round-off, faster. Not with the hf-hqq "
                                                          "baselines.")] = None,
    as_exported: Annotated[bool, typer.Option("--as-exported", help="Verify the form `oscar-zoo export` deploys "
                                                                    "to the reference runtime: per-head rotations "
                                                                    "averaged per layer, means dropped, the median "
                                                                    "K and V clips. Not with --write.")] = False,
    json_output: Json = False,
) -> None:
    """Verify ARTIFACTS: how close INT2 attention with these rotations stays to BF16 (exit 3 below thresholds)."""
    if as_exported and write:
        raise InputError("--write stores the artifact's own verification; an --as-exported report describes the "
                         "exported form, not the artifact, and is not written to the manifest",
                         "drop --write, and keep the report with --json > FILE")
    for name, value in (("--context", context), ("--sequences", sequences)):
        if value <= 0:
            raise InputError(f"{name} must be positive, got {value}")
    if generate < 0:
        raise InputError(f"--generate must be ≥ 0 (0 skips the generation check), got {generate}")
    if generate > MAX_GENERATE:
        raise InputError(f"--generate {generate:,} is more than {MAX_GENERATE:,} greedy tokens",
                         f"use --generate up to {MAX_GENERATE:,} (the teacher-forced metrics carry the verdict)")
    _check_thresholds(max_ppl_increase, max_kl, min_top1)
    chosen = _baseline_names(baselines)
    check_baselines(chosen)  # before the model loads: an unknown name, a missing package
    check_dataset_options(dataset, split, text_field)
    # a needle option given alone asks for the grid: it implies --needle rather than being ignored
    needle = needle or needle_quick or any(v is not None for v in (needle_lengths, needle_depths, needle_trials,
                                                                   min_needle_accuracy, needle_protocol,
                                                                   needle_batch))
    needle_plot = None
    if plot is not None:  # a name matplotlib cannot write, or a folder, is refused now, not after the whole run
        from ..evaluation.plot import check_plot_path

        plot = check_plot_path(plot, overwrite=overwrite_plot)
        if needle:
            needle_plot = check_plot_path(_needle_plot_path(plot), needle_of=plot, overwrite=overwrite_plot)

    needle_settings = _needle_settings(needle_lengths, needle_depths, needle_trials, needle_quick,
                                       min_needle_accuracy, seed, needle_protocol, needle_batch) if needle else None
    if needle_settings is not None:
        check_batch(needle_settings.batch, chosen)
    settings = VerifySettings(context=context, sequences=sequences, baselines=chosen, backend=backend,
                              positions_from=score_from, generate_tokens=generate,
                              thresholds=Thresholds(max_ppl_increase=max_ppl_increase, max_kl=max_kl,
                                                    min_top1=min_top1))
    request = VerifyRequest(artifacts, settings, model=model, revision=revision, dataset=dataset,
                            text_field=text_field, split=split, seed=seed, device=device, dtype=dtype,
                            needle=needle_settings, needle_quick=needle_quick,
                            as_exported=exported_form if as_exported else None, plot=plot,
                            needle_plot=needle_plot, write=write)
    say = (lambda msg: None) if json_output else (lambda msg: err_console.print(f"[dim]{shown(msg)}[/]"))
    try:
        report = verify_artifacts(request, say, lambda: progress_reporter(enabled=not json_output))
    except SettingError as exc:  # a library setting, spelled as this command's option (seq_len is --context here)
        raise exc.spelled(lambda name: "--context" if name == "seq_len" else "--" + name.replace("_", "-")) from None
    if json_output:
        console.print_json(report.to_json())
    else:
        _print(report, [p for p in (plot, needle_plot if report.needle is not None else None) if p is not None],
               write, artifacts)
    if not report.passed:
        what = f"{artifacts}{' as exported' if as_exported else ''}"
        raise VerificationFailed(f"{what} missed the thresholds: {'; '.join(report.failures)}",
                                 "see the table; do not publish these rotations as verified")


def _check_thresholds(max_ppl_increase: float, max_kl: float, min_top1: float) -> None:
    """InputError before any work for a threshold no measurement can meet or that cannot be stored: not finite, a
    --max-kl below 0 (KL never is), a --max-ppl-increase at or below -1 (perplexity stays positive; a negative one
    above -1 asks for an improvement), a --min-top1 outside [0, 1]."""
    for option, value, ok, where in (("--max-ppl-increase", max_ppl_increase, max_ppl_increase > -1, "> -1"),
                                     ("--max-kl", max_kl, max_kl >= 0, "≥ 0"),
                                     ("--min-top1", min_top1, 0 <= min_top1 <= 1, "in [0, 1]")):
        if not (math.isfinite(value) and ok):
            raise InputError(f"{option} must be finite and {where}, got {value:g}",
                             "see docs/verify.md, Thresholds (the defaults: `oscar-zoo verify --help`)")


def _parse_list(option: str, value: str, kind):
    if not value.strip():
        raise InputError(f"{option} is empty")
    try:  # an empty item ("1024,,2048") is a number left out, not one to skip
        return tuple(kind(x) for x in value.split(","))
    except ValueError:
        raise InputError(f"{option} must be a comma-separated list of numbers, got {value[:200]!r}") from None


def _needle_settings(lengths, depths, trials, quick, min_accuracy, seed, protocol, batch) -> NeedleSettings:
    trials = (1 if quick else 2) if trials is None else trials
    min_accuracy = DEFAULT_MIN_NEEDLE_ACCURACY if min_accuracy is None else min_accuracy
    if trials <= 0:
        raise InputError(f"--needle-trials must be positive, got {trials}")
    if not 0 <= min_accuracy <= 1:
        raise InputError(f"--min-needle-accuracy must be in [0, 1], got {min_accuracy}")
    parsed_lengths = _parse_list("--needle-lengths", lengths, int) if lengths else ()
    if any(n < 256 for n in parsed_lengths):
        raise InputError(f"--needle-lengths must be ≥ 256 tokens, got {lengths}")
    parsed_depths = _parse_list("--needle-depths", depths, float) if depths else (QUICK_DEPTHS if quick
                                                                                  else DEFAULT_DEPTHS)
    if any(not 0 <= d <= 1 for d in parsed_depths):
        raise InputError(f"--needle-depths must lie in [0, 1], got {depths}")
    return NeedleSettings(lengths=parsed_lengths, depths=parsed_depths, trials=trials, seed=seed,
                          min_relative_accuracy=min_accuracy,
                          protocol=(protocol or NeedleProtocol.FOLLOW_UP).value, batch=1 if batch is None else batch)


def _needle_plot_path(plot: Path) -> Path:
    """Where the needle heatmap goes beside the --plot file (whose extension `check_plot_path` has settled)."""
    return plot.with_name(f"{plot.stem}-needle{plot.suffix}")


def _short(m) -> str:
    """A method's row name; the reference's is the dtype its label names (BF16, or FP32 where that ran)."""
    return m.label.split(" ")[0] if m.kind == "reference" else SHORT.get(m.name, m.name)


def _print(report: VerifyReport, plots: list[Path], write: bool, artifacts: Path) -> None:
    cut = report.positions_from
    table = Table(title=f"{report.model}: INT2 KV cache vs BF16 · {report.sequences}×{report.context} held-out tokens "
                        f"· sink {report.sink}, recent {report.recent}, group {report.group_size}")
    for col in ("method", "bits/elem", "PPL", f"PPL ≥{cut}", f"KL ≥{cut}", f"top-1 ≥{cut}", "attn err", "greedy"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for m in report.methods:
        ref = m.kind == "reference"
        err = "—" if ref else f"{sum(m.layer_error) / len(m.layer_error):.3f}"
        past = f"{m.ppl_past_windows:.2f}" + ("" if ref else f" ({100 * m.ppl_increase:+.1f}%)")
        table.add_row(_short(m), f"{m.bits_per_element:.2f}", f"{m.ppl:.2f}", past, f"{m.kl:.4f}",
                      f"{100 * m.top1:.1f}%", err, _generation(m), style="bold" if m.kind == "artifact" else None)
    console.print(table)
    if report.as_exported:
        console.print("[bold]as exported[/]: the OSCAR row is the form `oscar-zoo export` deploys to the reference "
                      "runtime (one rotation per layer, no means, one K and one V clip), not the artifact itself",
                      highlight=False)
    for m in report.methods:
        bits = (f"K {m.bits_per_element_k:.2f} / V {m.bits_per_element_v:.2f} bits"
                if m.bits_per_element_k != m.bits_per_element_v else "")
        console.print(f"  {_short(m)}: {m.label}{f'; {bits}' if bits else ''}", highlight=False)
    console.print(
        f"bits/elem: mean of K and V at {report.context} tokens, BF16 windows and float16 scale/zero included (HF "
        f"QuantizedCache: counted from the bytes it holds, residual window included). "
        f"≥{cut}: positions whose attention reads INT2 keys ({report.tokens_scored:,} tokens); Δ vs BF16 in brackets. "
        f"attn err: mean over layers of ‖o − o_bf16‖/‖o_bf16‖ (sequence 1, same inputs, queries ≥{cut}).",
        highlight=False)
    _print_kl_by_distance(report)
    gen = next((m.generation for m in report.methods if m.kind != "reference" and m.generation is not None), None)
    if gen is not None:
        console.print(f"greedy: {gen.new_tokens} tokens after a {gen.prompt_tokens}-token held-out prompt through the "
                      "runtime (OscarCache + `oscar` attention: exact prefill, decode over the INT2 tiers), compared "
                      "with BF16's (HF: generate() with that QuantizedCache); KIVI has no runtime here.",
                      highlight=False)
    if report.needle is not None:
        _print_needle(report.needle)
    t = report.thresholds
    verdict = "[bold green]PASS[/]" if report.passed else "[bold red]FAIL[/]: " + "; ".join(report.failures)
    console.print(f"thresholds (OSCAR): Δ PPL ≥{cut} ≤ {100 * t.max_ppl_increase:.0f}%, KL ≤ {t.max_kl}, top-1 ≥ "
                  f"{100 * t.min_top1:.0f}% → {verdict} · backend {report.backend} on {report.device} · "
                  f"{report.wall_seconds:.0f} s", highlight=False)
    for path in plots:  # the files written, as named on disk (`--plot x` wrote x.png)
        console.print(f"[green]wrote[/] {escape(str(path))}", highlight=False, soft_wrap=True)
    if write:
        console.print(f"[green]stored[/] the report in {artifacts}/manifest.json (verification)")


def distance_buckets(positions_from: int, context: int, bin_size: int) -> list[tuple[int, int]]:
    """Position buckets past the windows on the report's bins, doubling: [320, 640), [640, 1280), … to the context
    (scoring from position 0 starts at the first bin's end; none when the windows reach the context)."""
    edges = [max(bin_size, -(-positions_from // bin_size) * bin_size)]
    if edges[0] >= context:
        return []
    while edges[-1] * 2 < context:
        edges.append(edges[-1] * 2)
    return list(zip(edges, edges[1:] + [context]))


def _print_kl_by_distance(report: VerifyReport) -> None:
    """Mean KL per bucket of positions (from the report's per-bin means): error against how far back the INT2
    history reaches."""
    buckets = distance_buckets(report.positions_from, report.context, report.bin_size)
    if not buckets:
        return
    ref = next((_short(m) for m in report.methods if m.kind == "reference"), "BF16")
    table = Table(title=f"KL vs {ref} by position (the INT2 history grows with the position)")
    table.add_column("method")
    for a, b in buckets:
        table.add_column(f"{a:,}–{b:,}", justify="right")
    for m in report.methods:
        if m.kind == "reference" or not m.kl_by_position:
            continue
        cells = []
        for a, b in buckets:
            bins = [k for i, k in enumerate(m.kl_by_position) if a <= i * report.bin_size < b]
            cells.append(f"{sum(bins) / len(bins):.4f}" if bins else "—")
        table.add_row(_short(m), *cells, style="bold" if m.kind == "artifact" else None)
    console.print(table)


_PATHS = {NeedleProtocol.FOLLOW_UP: "context prefilled, question as a second chunk reading the tiers",
          NeedleProtocol.PROMPT: "context and question as one prompt, later answer tokens reading the tiers"}


def _print_needle(needle: NeedleReport) -> None:
    table = Table(title=f"needle retrieval through the runtime ({needle.protocol} protocol) · accuracy per length "
                        f"(rows) × depth (columns) · {needle.trials} trial(s) per cell")
    table.add_column("method")
    table.add_column("length", justify="right")
    for d in needle.depths:
        table.add_column(f"{d:g}", justify="right")
    table.add_column("all", justify="right")
    for m in needle.methods:
        for i, length in enumerate(needle.lengths):
            row_all = sum(m.accuracy[i]) / len(m.accuracy[i])
            table.add_row(_short(m) if i == 0 else "", f"{length:,}",
                          *(f"{100 * a:.0f}%" for a in m.accuracy[i]), f"{100 * row_all:.0f}%",
                          style="bold" if m.kind == "artifact" else None, end_section=i == len(needle.lengths) - 1)
    console.print(table)
    short = {m.name: _short(m) for m in needle.methods}
    ref = next(short[m.name] for m in needle.methods if m.kind == "reference")  # BF16, or FP32 where that ran
    bf16, art = needle.method("bf16").overall, next(m for m in needle.methods if m.kind == "artifact").overall
    rule = (f"pass: ≥ {needle.min_relative_accuracy:g} × {ref}" if needle.min_relative_accuracy else "no gate")
    if needle.min_relative_accuracy and not bf16 > 0:
        rule += f"; {ref} answered none: nothing to compare with, no pass"
    console.print(f"needle: OSCAR {100 * art:.1f}% vs {ref} {100 * bf16:.1f}% ({rule}) · {_PATHS[needle.protocol]}, "
                  f"answer decoded greedily · {needle.wall_seconds:.0f} s", highlight=False)
    for name, length, d in paired_against_reference(needle):  # same prompts: the difference is paired
        console.print(f"  {short[name]} at {length:,}: {100 * d.it:.1f}% vs {ref} {100 * d.ref:.1f}% over {d.n} "
                      f"prompts, {100 * d.diff:+.1f} points [95 %: {100 * d.lo:+.1f}, {100 * d.hi:+.1f}] · only "
                      f"{ref} {d.ref_only}, only {short[name]} {d.it_only}", highlight=False)


def _generation(m) -> str:
    g = m.generation
    if g is None:
        return "—"
    if m.kind == "reference":
        return f"{g.new_tokens} tok"
    if g.first_divergence is None:
        return f"same {g.new_tokens}/{g.new_tokens}"
    return f"differs @{g.first_divergence}"


def _baseline_names(value: str) -> tuple[str, ...]:
    """--baselines: `none`, or names separated by commas, each once (an empty item, a repeat or `none` among names is
    a mistake, not something to skip)."""
    names = [name.strip() for name in value.split(",")]
    if names == ["none"]:
        return ()
    problem = ("an empty name" if "" in names else "`none` among names" if "none" in names else
               "a name twice" if len(set(names)) < len(names) else None)
    if problem:
        raise InputError(f"--baselines {value[:200]!r} has {problem}",
                         f"pass names from {', '.join(BASELINES)} separated by commas, each once, or none")
    return tuple(names)


def register(app: typer.Typer) -> None:
    app.command("verify")(verify_command)
