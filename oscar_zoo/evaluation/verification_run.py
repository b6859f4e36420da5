"""`oscar-zoo verify` as one library call: read the artifact folder (or the form a deployment serves, through the
transform the caller passes: the command passes `export.as_exported` for `--as-exported`), load the model it names,
held-out text, teacher forcing and generation (verification_passes.py), the needle grid (needle.py), one report
patched with both, then the plots and the manifest's `verification` when asked. Library code: messages go to `say`,
long work to the progress callback that `progress_scope()` yields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..artifacts import (
    Rotations,
    artifact_folder,
    check_file,
    check_model_matches,
    check_writable,
    load_artifacts,
    read_manifest,
    write_manifest,
)
from ..errors import InputError, IntegrityError
from ..format.model_bounds import check_means_against_model
from ..format.records import MANIFEST_MAX_BYTES
from ..format.schema import MANIFEST_NAME, Manifest
from ..format.verification import VerifyReport, binding_of
from ..models import DEMO, DEMO_HF_ID, DEMO_REVISION, load_model
from ..texts import EVALUATION_PLAYS, load_texts, make_sequences
from .needle import NeedleSettings, check_filler, check_lengths, default_lengths, run_needle
from .verification_passes import VerifySettings, check_positions, model_positions, resolve_backend, run_verification

ProgressScope = Callable[[], AbstractContextManager[Callable[..., None]]]


class DeployedForm(Protocol):
    """An artifact as a deployment serves it, verified in place of the artifact (`export.as_exported` gives one)."""

    manifest: Manifest
    rotations: Rotations

    def describe(self) -> str:
        """What the deployment changed, for the report's artifact label."""
        ...


Deployment = Callable[[Manifest, Rotations], DeployedForm]


@dataclass(frozen=True)
class VerifyRequest:
    """What `verify` was asked. settings.backend may be "auto" (resolved on the loaded model's device); needle: the
    grid, its lengths () for 1024, 2048, … up to the model's limit (two of them with needle_quick); plot and
    needle_plot: paths `plot.check_plot_path` has settled; write: store the report in the manifest; as_exported: the
    transform to the deployed form that is verified instead of the artifact (the report is flagged `as_exported`)."""

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
    as_exported: Deployment | None = None
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
    if request.write:  # a folder the report cannot be stored in is refused now, not after the whole run
        check_writable(artifact_folder(artifacts), f"--write (stores the report in {artifacts}/{MANIFEST_NAME})")
    manifest, rotations = load_artifacts(artifacts)
    exported = request.as_exported(manifest, rotations) if request.as_exported is not None else None
    # what is verified: the artifact, or its exported form (the manifest itself stays the artifact's, for --write)
    used, used_rotations = (manifest, rotations) if exported is None else (exported.manifest, exported.rotations)
    loaded = load_model(*model_to_load(manifest, request.model, request.revision), device=request.device,
                        dtype=request.dtype, progress=say)
    limit = model_positions(loaded.model)
    if needle is not None and needle.lengths == ():
        needle = dataclasses.replace(needle, lengths=default_lengths((limit or 8192) - needle.new_tokens,
                                                                     request.needle_quick))
    check_model_matches(manifest, loaded.identity)
    # the artifact's means (centred codec), each within the largest key / value norm this model's layer can produce
    check_means_against_model(loaded.model, rotations.k_mean, rotations.v_mean, rotations.layer_ids.tolist())
    check_positions(settings, limit)  # the model's bounds, before any held-out text or model work
    if needle is not None:
        check_lengths(needle, limit)
    settings = dataclasses.replace(settings, backend=resolve_backend(settings.backend,
                                                                     next(loaded.model.parameters()).device))
    texts, source = load_texts(request.dataset, split=request.split, text_field=request.text_field,
                               plays=EVALUATION_PLAYS, default_split="test")
    seqs = _held_out(loaded.tokenizer, texts, settings, request.seed, source)
    filler = None
    if needle is not None:
        filler = _filler(loaded.tokenizer, texts)
        check_filler(loaded.tokenizer, filler, needle)
    say(f"verifying {artifacts}{f' ({exported.describe()})' if exported else ''} on {loaded.identity.id}: "
        f"{settings.sequences}×{settings.context} tokens of {source}, backend {settings.backend}")
    with progress_scope() as progress:
        report = run_verification(loaded, used, used_rotations, seqs.input_ids, settings, artifacts=str(artifacts),
                                  dataset=source, progress=progress)
        if needle is not None:
            found = run_needle(loaded, used, used_rotations, filler, needle, settings.baselines, progress)
            report = report.replace(needle=found, passed=report.passed and found.passed,
                                    failures=report.failures + found.failures)
    if exported is not None:
        report = _mark_as_exported(report, exported.describe())
    report = report.replace(wall_seconds=round(time.perf_counter() - start, 2),
                            binding=binding_of(manifest))  # what was verified: the artifact's files
    if request.plot is not None:
        from .plot import write_needle_plot, write_plot

        with _advice("free space, or pick another --plot path"):
            write_plot(report, request.plot)
            if report.needle is not None:
                write_needle_plot(report.needle, report.model, request.needle_plot)
    if request.write:
        store_report(artifacts, manifest, report)
    return report


@contextlib.contextmanager
def _advice(advice: str):
    """A write failure (full disk, no permission: an InputError from `artifacts.atomic_write_bytes`) with advice that
    names verify's own options."""
    try:
        yield
    except InputError as exc:
        raise InputError(exc.message, advice) from None


def store_report(folder: Path, verified, report: VerifyReport) -> None:
    """Store `report` as the `verification` of the artifact folder `folder` whose manifest was `verified`: only if the
    folder still holds that manifest and its files (a folder replaced or rewritten while verify ran keeps what it now
    holds, and the error says so: IntegrityError, exit 4); the report must fit a manifest (InputError, exit 2)."""
    advice = f"run `oscar-zoo verify {folder} --write` again on the folder as it is now"
    try:
        now = read_manifest(folder)
    except (InputError, IntegrityError) as exc:
        raise IntegrityError(f"{folder} changed while verify ran ({exc.message}); the report was not stored",
                             advice) from None
    if now != verified:
        raise IntegrityError(f"{folder} was replaced while verify ran: its {MANIFEST_NAME} is no longer the one "
                             "verified; the report was not stored and the folder was left as it is", advice)
    updated = verified.replace(verification=report.to_dict())
    size = len(updated.to_json().encode())
    if size > MANIFEST_MAX_BYTES:
        raise InputError(f"the report makes {MANIFEST_NAME} {size:,} bytes, more than a manifest may hold "
                         f"({MANIFEST_MAX_BYTES:,}); it was not stored", "keep the report with --json > FILE, or "
                         "verify with fewer --baselines, a shorter --context or a smaller needle grid")
    for art in verified.artifacts:
        try:
            check_file(Path(folder) / art.path, art)
        except IntegrityError:
            raise IntegrityError(f"{Path(folder) / art.path} changed while verify ran: it is no longer the file that "
                                 "was verified; the report was not stored", advice) from None
    with _advice(f"free space, or make {folder} writable (or drop --write and keep the report with --json > FILE)"):
        write_manifest(folder, updated)


def _held_out(tokenizer, texts: list[str], settings: VerifySettings, seed: int, source: str):
    """`settings.sequences` held-out sequences of `settings.context` tokens; too little text is an InputError in
    verify's terms (its options, no calibration split)."""
    try:
        return make_sequences(tokenizer, texts, settings.context, settings.sequences, 0, seed, dataset=source)
    except InputError as exc:
        if "held-out)" not in exc.message:
            raise
        found = exc.message.split(";")[0].replace("the dataset gives", "the held-out text gives")
        raise InputError(f"{found}; {settings.sequences} are needed (--sequences {settings.sequences} at --context "
                         f"{settings.context})",
                         "lower --sequences or --context, or pass more text with --dataset") from None


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
        return [m.replace(label=f"{m.label}; {description}") if m.kind == "artifact" else m for m in methods]

    needle = None if report.needle is None else report.needle.replace(methods=relabel(report.needle.methods))
    return report.replace(as_exported=True, methods=relabel(report.methods), needle=needle)


def _filler(tokenizer, texts: list[str]) -> list[int]:
    """The held-out documents as one token stream (the needle prompts' filler)."""
    return tokenizer("\n\n".join(texts), add_special_tokens=False).input_ids
