"""Push's verification gate trusts only a report that `oscar-zoo verify --write` stored: its schema, its metrics
re-checked against the thresholds it states, and `passed` agreeing with them; the report's binding to its artifact,
the needle grid's empty reference and more refusals are in test_push_gate_binding.py. Dry runs: no network."""

import pytest

from .helpers import make_artifacts, run_cli, verify_report


def _tampered() -> dict:
    report = verify_report()
    report["methods"][1]["kl"] = 0.5  # above the report's max_kl 0.1, `passed` left true
    return report


@pytest.mark.parametrize("verification, words", [
    ({}, "manifest.verification is not a report written by `oscar-zoo verify` (field model: Field required"),
    ({"passed": True}, "is not a report written by `oscar-zoo verify`"),
    ({"passed": True, "kl": 0.01, "top1": 0.99}, "is not a report written by `oscar-zoo verify`"),
    (verify_report(kl=0.5), "failed its verification: mean KL 0.5 is not ≤ 0.1"),
    (_tampered(), "the verification report says it passed, but its own metrics say otherwise (mean KL 0.5"),
    (verify_report(passed=False), "says it failed, but its own metrics say otherwise (every threshold is met)"),
    (None, "has not been verified"),
])
def test_push_refuses_what_verify_did_not_pass(tmp_path, monkeypatch, verification, words):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    art = tmp_path / "art"
    make_artifacts(art, verification=verification)
    code, _, err = run_cli("push", str(art), "zoo/rotations", "--dry-run")
    assert code == 3, err
    assert words in " ".join(err.split()) and "Traceback" not in err, err
    assert "oscar-zoo verify" in err or "re-calibrate" in err
    code, out, err = run_cli("push", str(art), "zoo/rotations", "--dry-run", "--allow-unverified")
    assert code == 0 and "would upload" in out, err


def test_push_accepts_a_report_verify_wrote(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    art = tmp_path / "art"
    make_artifacts(art, verification=verify_report())
    code, out, err = run_cli("push", str(art), "zoo/rotations", "--dry-run")
    assert code == 0 and "would upload" in out, err


def test_the_bundled_catalog_report_passes_the_gate():
    from oscar_zoo.hub.catalog import load_catalog
    from oscar_zoo.hub.zoo import report_verdict, verification_summary

    for entry in load_catalog():
        report, why = entry.manifest.report()
        assert report is not None and report.passed and report_verdict(report) == [], why
        assert verification_summary(entry.manifest.verification) == "✓ +1.3 % PPL, KL 0.019"


def test_loosened_thresholds_are_refused_unless_allowed_and_then_shown(tmp_path, monkeypatch):
    """A report judged by thresholds looser than verify's defaults is consistent, but push refuses it (exit 3) unless
    --allow-loose-thresholds; then the summary (zoo index, `list`) and the model card say which thresholds it used
    and that they are not the defaults."""
    from oscar_zoo.format.schema import Manifest
    from oscar_zoo.format.verification import Thresholds
    from oscar_zoo.hub.card import render_model_card
    from oscar_zoo.hub.zoo import verification_summary

    monkeypatch.delenv("HF_TOKEN", raising=False)
    loose = verify_report(kl=0.4, ppl_increase=0.5, thresholds=Thresholds(max_ppl_increase=10, max_kl=1, min_top1=0))
    default = verify_report()
    art = tmp_path / "art"
    manifest = make_artifacts(art, verification=loose)
    code, out, err = run_cli("push", str(art), "zoo/rotations", "--dry-run")
    assert code == 3 and "Traceback" not in err, err
    assert "thresholds looser than verify's defaults: Δ PPL ≤ 1000 % (default 10 %); KL ≤ 1 (default 0.1); top-1 ≥ " \
           "0 % (default 82 %)" in " ".join(err.split()) and "--allow-loose-thresholds" in err, err
    code, out, err = run_cli("push", str(art), "zoo/rotations", "--dry-run", "--allow-loose-thresholds")
    assert code == 0, err
    summary = verification_summary(loose)
    assert summary == "✓ +50.0 % PPL, KL 0.4 (non-default thresholds: Δ PPL ≤ 1000 %, KL ≤ 1, top-1 ≥ 0 %)"
    assert verification_summary(default) == "✓ +2.1 % PPL, KL 0.012"
    card = render_model_card(manifest, "zoo/rotations", "", "hf")
    assert "Δ PPL ≤ 1000 %, KL ≤ 1, top-1 ≥ 0 % (**not** verify's defaults)" in " ".join(card.split())
    plain = render_model_card(Manifest.from_dict({**manifest.to_dict(), "verification": default}),
                              "zoo/rotations", "", "hf")
    assert "Δ PPL ≤ 10 %, KL ≤ 0.1, top-1 ≥ 82 % (verify's defaults)" in " ".join(plain.split())
