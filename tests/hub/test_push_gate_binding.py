"""The push gate's rules (docs/hub.md, "The push gate"), one refusal each: a report is bound to the artifact it
verified (the listed files' sha256, the model id, revision and config, the quant/rotation/clip settings), so a report
copied from another artifact, another model or other settings is refused; a report without that binding is refused;
thresholds looser than verify's defaults need --allow-loose-thresholds; a needle grid whose reference answered nothing
is no pass; a report of the exported form is not the artifact's. Each refusal is exit 3 and one line; every one
yields to --allow-unverified. Dry runs: no network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .helpers import make_artifacts, run_cli, verify_report


def _push(art: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli("push", str(art), "zoo/rotations", "--dry-run", *extra)


def _refused(art: Path, *needles: str) -> None:
    code, out, err = _push(art)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 3 and "Traceback" not in err and len(errors) == 1, (code, out, err)
    flat = " ".join(err.split())
    for needle in needles:
        assert needle in flat, (needle, err)
    code, out, err = _push(art, "--allow-unverified")
    assert code == 0 and "would upload" in out, err


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _rewrite(folder: Path, **fields) -> None:
    """Replace top-level manifest fields as a hand edit would (files and their sha256 left as they are)."""
    doc = {**_manifest(folder), **fields}
    (folder / "manifest.json").write_text(json.dumps(doc))


@pytest.fixture(autouse=True)
def _no_token(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)


def test_a_bound_report_verify_would_write_passes(tmp_path):
    art = tmp_path / "art"
    manifest = make_artifacts(art)
    binding = manifest.verification["binding"]
    assert binding["files"] == {"rotations.safetensors": manifest.artifacts[0].sha256}
    assert binding["model_id"] == "org/Tiny-Llama" and binding["model_revision"] == "abc123"
    code, out, err = _push(art)
    assert code == 0 and "would upload" in out, err


def test_a_report_copied_from_other_rotations_is_refused(tmp_path):
    source, target = tmp_path / "a", tmp_path / "b"
    make_artifacts(source, seed=0)
    make_artifacts(target, seed=1)  # same model and settings, other rotations
    _rewrite(target, verification=_manifest(source)["verification"])
    verified, held = (_manifest(f)["artifacts"][0]["sha256"][:12] for f in (source, target))
    _refused(target, "the verification report is not bound to this artifact",
             f"rotations.safetensors: verified {verified}, the folder holds {held}")


def test_a_report_copied_from_another_model_is_refused(tmp_path):
    source, target = tmp_path / "a", tmp_path / "b"
    make_artifacts(source, model_id="org/Tiny-Llama")
    make_artifacts(target, model_id="org/Other-Llama")  # the same rotations (same seed), another model
    assert _manifest(source)["artifacts"] == _manifest(target)["artifacts"]
    _rewrite(target, verification=_manifest(source)["verification"])
    _refused(target, "model: verified 'org/Tiny-Llama', the manifest has 'org/Other-Llama'")


def test_a_report_of_other_settings_is_refused(tmp_path):
    """The manifest's windows edited after verify ran: the report measured sink 64, the folder now says 16."""
    art = tmp_path / "art"
    make_artifacts(art)
    doc = _manifest(art)
    _rewrite(art, quant={**doc["quant"], "sink": 16})
    _refused(art, "quant/rotation/clip settings: verified")


def test_a_report_that_records_no_binding_is_refused(tmp_path):
    art = tmp_path / "art"
    make_artifacts(art, bind=False)
    _refused(art, "not bound to this artifact (the report does not record which artifact it verified)",
             "oscar-zoo verify")


def test_an_edited_report_with_huge_thresholds_needs_allow_loose_thresholds(tmp_path):
    """KL 5 judged by thresholds of 1e9: consistent with itself and bound, but looser than the defaults."""
    from oscar_zoo.format.verification import Thresholds

    art = tmp_path / "art"
    make_artifacts(art, verification=verify_report(kl=5.0, top1=0.1, ppl_increase=3.0, thresholds=Thresholds(
        max_ppl_increase=1e9, max_kl=1e9, min_top1=0.0)))
    _refused(art, "verified with thresholds looser than verify's defaults: Δ PPL ≤ 1e+11 % (default 10 %); KL ≤ "
             "1e+09 (default 0.1); top-1 ≥ 0 % (default 82 %)", "--allow-loose-thresholds")
    code, out, err = _push(art, "--allow-loose-thresholds")
    assert code == 0 and "would upload" in out, err


def _needle(reference: float, artifact: float, min_relative: float = 0.9, passed: bool = True) -> dict:
    from oscar_zoo.format.verification import NeedleMethod, NeedleReport

    def row(name, kind, overall):
        return NeedleMethod(name=name, label=name, kind=kind, accuracy=[[overall]], overall=overall,
                            answers=["x"] * 4)

    return NeedleReport(lengths=[1024], depths=[0.5], trials=4, seed=0, needle="n", question="q", sink=64,
                        recent=256, methods=[row("bf16", "reference", reference), row("oscar", "artifact", artifact)],
                        min_relative_accuracy=min_relative, passed=passed, failures=[], wall_seconds=1.0,
                        keys=["12345"] * 4).to_dict()


@pytest.mark.parametrize("passed", [True, False])  # as verify wrote it before the rule, and as it writes it now
def test_a_needle_grid_whose_reference_answered_nothing_is_no_pass(tmp_path, passed):
    art = tmp_path / "art"
    report = {**verify_report(), "needle": _needle(0.0, 0.0, passed=passed), "passed": passed}
    make_artifacts(art, verification=report)
    _refused(art, "failed its verification: needle: the reference answered none of the 4 prompts, so there is "
             "nothing to compare the artifact with")


def test_a_needle_gate_turned_off_counts_as_a_loose_threshold(tmp_path):
    art = tmp_path / "art"
    make_artifacts(art, verification={**verify_report(), "needle": _needle(0.0, 0.0, min_relative=0.0)})
    _refused(art, "looser than verify's defaults: needle ≥ 0 × BF16 (default 0.9)")
    code, out, err = _push(art, "--allow-loose-thresholds")
    assert code == 0, err


def test_a_report_of_the_exported_form_is_refused(tmp_path):
    art = tmp_path / "art"
    make_artifacts(art, verification={**verify_report(), "as_exported": True})
    _refused(art, "measured the exported form (--as-exported), not the artifact")
