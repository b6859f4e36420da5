"""`oscar-zoo verify` as one library call: read the artifact folder (or its exported form), load the model it names,
held-out text, teacher forcing and generation (harness.py), the needle grid (needle.py), one report patched with both,
then the plots and the manifest's `verification` when asked. Library code: messages go to `say`, long work to the
progress callback that `progress_scope()` yields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from ..artifacts import check_model_matches, load_artifacts, write_manifest
from ..calibration.data import EVALUATION_PLAYS, load_texts, make_sequences
from ..export.as_exported import as_exported as as_exported_form
from ..models import DEMO, DEMO_HF_ID, DEMO_REVISION, load_model
from .harness import VerifySettings, resolve_backend, run_verification
from .needle import NeedleSettings, default_lengths, run_needle
from .report import VerifyReport

ProgressScope = Callable[[], AbstractContextManager[Callable[..., None]]]


@dataclass(frozen=True)
class VerifyRequest:
    """What `verify` was asked. settings.backend may be "auto" (resolved on the loaded model's device); needle: the
    grid, its lengths () for 1024, 2048, … up to the model's limit (two of them with needle_quick); plot and
    needle_plot: paths `plot.check_plot_path` has settled; write: store the report in the manifest."""

    artifacts: Path
    settings: VerifySettings
    model: str | None = None
    revision: str | None = None
    dataset: str | None = None
    text_field: str | None = None
    split: str | None = None
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    needle: NeedleSettings | None = None
    needle_quick: bool = False
    as_exported: bool = False
    plot: Path | None = None
    needle_plot: Path | None = None
    write: bool = False


def _quiet() -> AbstractContextManager[Callable[..., None]]:
    return contextlib.nullcontext(lambda *a, **k: None)


def verify_artifacts(request: VerifyRequest, say: Callable[[str], None] | None = None,
                     progress_scope: ProgressScope = _quiet) -> VerifyReport:
    """The verify report of `request.artifacts` (pass or fail: the caller decides what a failure means)."""
    start = time.perf_counter()
    say = say or (lambda msg: None)
    artifacts, settings, needle = request.artifacts, request.settings, request.needle
    manifest, rotations = load_artifacts(artifacts)
    exported = as_exported_form(manifest, rotations) if request.as_exported else None
    # what is verified: the artifact, or its exported form (the manifest itself stays the artifact's, for --write)
    used, used_rotations = (manifest, rotations) if exported is None else (exported.manifest, exported.rotations)
    loaded = load_model(*model_to_load(manifest, request.model, request.revision), device=request.device,
                        dtype=request.dtype, progress=say)
    if needle is not None and needle.lengths == ():
        limit = getattr(loaded.model.config, "max_position_embeddings", 8192)
        needle = dataclasses.replace(needle, lengths=default_lengths(limit - needle.new_tokens, request.needle_quick))
    check_model_matches(manifest, loaded.identity)
    settings = dataclasses.replace(settings, backend=resolve_backend(settings.backend,
                                                                     next(loaded.model.parameters()).device))
    texts, source = load_texts(request.dataset, split=request.split, text_field=request.text_field,
                               plays=EVALUATION_PLAYS, default_split="test")
    seqs = make_sequences(loaded.tokenizer, texts, settings.context, settings.sequences, 0, request.seed,
                          dataset=source)
    say(f"verifying {artifacts}{f' ({exported.describe()})' if exported else ''} on {loaded.identity.id}: "
        f"{settings.sequences}×{settings.context} tokens of {source}, backend {settings.backend}")
    with progress_scope() as progress:
        report = run_verification(loaded, used, used_rotations, seqs.input_ids, settings, artifacts=str(artifacts),
                                  dataset=source, progress=progress)
        if needle is not None:
            found = run_needle(loaded, used, used_rotations, _filler(loaded.tokenizer, texts), needle,
                               settings.baselines, progress)
            report = report.model_copy(update={"needle": found, "passed": report.passed and found.passed,
                                               "failures": report.failures + found.failures})
    if exported is not None:
        report = _mark_as_exported(report, exported.describe())
    report = report.model_copy(update={"wall_seconds": round(time.perf_counter() - start, 2)})
    if request.plot is not None:
        from .plot import write_needle_plot, write_plot

        write_plot(report, request.plot)
        if report.needle is not None:
            write_needle_plot(report.needle, report.model, request.needle_plot)
    if request.write:
        write_manifest(artifacts, manifest.model_copy(update={"verification": report.model_dump(mode="json")}))
    return report


def model_to_load(manifest, model: str | None, revision: str | None) -> tuple[str, str | None]:
    """(name, revision) of the model to verify with: `model` when given, else the manifest's (the bundled demo model
    when the manifest names it at its pinned revision)."""
    if model is not None:
        return model, revision
    demo = manifest.model.id == DEMO_HF_ID and manifest.model.revision == DEMO_REVISION
    return (DEMO, revision) if demo else (manifest.model.id, revision or manifest.model.revision)


def _mark_as_exported(report: VerifyReport, description: str) -> VerifyReport:
    """The report flagged `as_exported`, its artifact rows (and the needle grid's) labelled with what export changed."""
    def relabel(methods):
        return [m.model_copy(update={"label": f"{m.label}; {description}"}) if m.kind == "artifact" else m
                for m in methods]

    needle = None if report.needle is None else report.needle.model_copy(
        update={"methods": relabel(report.needle.methods)})
    return report.model_copy(update={"as_exported": True, "methods": relabel(report.methods), "needle": needle})


def _filler(tokenizer, texts: list[str]) -> list[int]:
    """The held-out documents as one token stream (the needle prompts' filler)."""
    return tokenizer("\n\n".join(texts), add_special_tokens=False).input_ids
