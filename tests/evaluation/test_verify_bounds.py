"""`verify` bounds what it is asked by the model and by sane maxima, and checks what can be checked before the work
starts: needle grids and greedy lengths past their maxima, contexts and prompts past the model's positions, an
unwritable --write folder, thresholds no run can meet; --plot names that are no file or an existing file; a folder
replaced while `verify --write` ran; a needle grid whose reference answered nothing (no pass); messages in verify's
own terms. Each refusal is the command as a user types it: exit code and one line, no traceback, nothing written.

Fixtures: the suite's 2-layer random Llama (`tiny_model_dir`, 4,096 positions) with per-layer rotations imported
through the CLI; tiny contexts, no baselines, CPU."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from oscar_zoo.export.oscar_pt import K_FILE, V_FILE

L, D = 2, 64  # tiny_model_dir's geometry


def _import(folder, tiny_model_dir, rotation) -> None:
    from ..hub.helpers import run_cli

    src = folder.parent / f"{folder.name}-pt"
    src.mkdir()
    for name, objective in ((K_FILE, "qqt_r_h_pbr"), (V_FILE, "sst_r_h_pbr")):
        torch.save({"format_version": 1, "objective": objective, "source_grouping": "layer",
                    "layers": {i: {"layer_id": i, "rotation": rotation, "eigenvalues": torch.arange(D) * 1.0}
                               for i in range(L)}}, src / name)
    code, _, err = run_cli("import-oscar", str(src / K_FILE), str(src / V_FILE), "--model", str(tiny_model_dir),
                           "--out", str(folder))
    assert code == 0, err


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_model_dir):
    """Per-layer identity rotations for tiny_model_dir (its model identity, exactly)."""
    folder = tmp_path_factory.mktemp("bounds") / "art"
    _import(folder, tiny_model_dir, torch.eye(D))
    return folder


@pytest.fixture(scope="module")
def other_artifacts(tmp_path_factory, tiny_model_dir):
    """Another artifact folder for the same model: a random orthogonal rotation (other bytes, other sha256)."""
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    folder = tmp_path_factory.mktemp("bounds-other") / "art"
    _import(folder, tiny_model_dir, q.float())
    return folder


def _verify(artifacts, model_dir, play_text, *extra):
    return ("verify", artifacts, "--model", model_dir, "--dataset", play_text, "--context", "384", "--sequences",
            "1", "--generate", "0", "--baselines", "none", "--device", "cpu", "--dtype", "float32", "--max-kl", "0.1",
            "--min-top1", "0.82", "--max-ppl-increase", "0.1", *extra)


@pytest.fixture
def no_evaluation(monkeypatch):
    """verify may load the model (to read its positions) but must not read held-out text or run anything."""
    from oscar_zoo.evaluation import verification_run

    def refuse(*args, **kwargs):
        raise AssertionError("verify started the evaluation before checking its options")

    monkeypatch.setattr(verification_run, "load_texts", refuse)


def _one_line(code: int, out: str, err: str, expected_code: int, *needles: str) -> str:
    assert code == expected_code, (code, out, err)
    assert "Traceback" not in out + err and "AssertionError" not in out + err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    flat = " ".join(err.split())
    for needle in needles:
        assert needle in flat, (needle, err)
    return flat


# -- unbounded work --------------------------------------------------------------------------------------------------
def test_a_needle_grid_past_its_maximum_is_refused_before_the_model_loads(run_cli, artifacts, tiny_model_dir,
                                                                          play_text, verify_loads_no_model):
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--needle-trials", "100000000"))
    _one_line(code, out, err, 2, "the needle grid has", "at most 1,024", "--needle-trials")
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--needle-lengths", "300,400",
                                      "--needle-depths", ",".join(["0.5"] * 300), "--needle-trials", "2"))
    _one_line(code, out, err, 2, "2 lengths × 300 depths × 2 trials = 1,200 prompts")


def test_a_needle_grid_builds_its_prompts_one_batch_at_a_time(tiny_model_dir, artifacts, play_text, monkeypatch):
    """The library call: prompts are built as they run (a batch at a time), not all before the first; the same
    prompts in the same order as before."""
    from oscar_zoo.artifacts import load_artifacts
    from oscar_zoo.errors import InputError
    from oscar_zoo.evaluation import needle
    from oscar_zoo.models import load_model

    with pytest.raises(InputError, match="at most 1,024"):
        needle.NeedleSettings(lengths=(300,), trials=100_000_000)
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    manifest, rotations = load_artifacts(artifacts)
    filler = loaded.tokenizer(play_text.read_text(), add_special_tokens=False).input_ids
    built, seen = [], []
    build, answer = needle.build_prompt, needle._answer

    def counting_build(*args, **kwargs):
        built.append(1)
        return build(*args, **kwargs)

    def recording_answer(*args, **kwargs):
        seen.append(len(built))
        return answer(*args, **kwargs)

    monkeypatch.setattr(needle, "build_prompt", counting_build)
    monkeypatch.setattr(needle, "_answer", recording_answer)
    settings = needle.NeedleSettings(lengths=(260,), depths=(0.5,), trials=5, batch=2)
    report = needle.run_needle(loaded, manifest, rotations, filler, settings, baselines=())
    assert len(built) == 5 and len(report.keys) == 5
    assert seen == [2, 2, 4, 4, 5, 5]  # BF16 and OSCAR per batch: never more prompts built than the batch in hand


def test_generate_past_its_maximum_is_refused_before_the_model_loads(run_cli, artifacts, tiny_model_dir, play_text,
                                                                     verify_loads_no_model):
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--generate", "100000000"))
    _one_line(code, out, err, 2, "--generate 100,000,000 is more than 4,096 greedy tokens")


@pytest.mark.parametrize("context, generate, words", [
    ("4000", "200", "--context 4,000 + --generate 200 greedy tokens reach past the model's 4,096 positions"),
    ("5000", "0", "--context 5,000 exceeds the model's 4,096 positions"),
])
def test_a_context_past_the_models_positions_is_refused_before_the_evaluation(run_cli, artifacts, tiny_model_dir,
                                                                               play_text, no_evaluation, context,
                                                                               generate, words):
    args = [a if a not in ("384",) else context for a in _verify(artifacts, tiny_model_dir, play_text)]
    args[args.index("--generate") + 1] = generate
    code, out, err = run_cli(*args)
    _one_line(code, out, err, 2, words)


# -- late checks -----------------------------------------------------------------------------------------------------
def test_needle_lengths_past_the_model_are_refused_before_the_evaluation(run_cli, artifacts, tiny_model_dir,
                                                                         play_text, no_evaluation):
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--needle-lengths", "100000"))
    _one_line(code, out, err, 2, "--needle-lengths 100000", "exceeds the model's 4,096 positions",
              "use --needle-lengths up to 4089")


def test_needle_lengths_past_the_held_out_text_are_refused_before_the_evaluation(run_cli, artifacts, tiny_model_dir,
                                                                                 play_text, monkeypatch):
    from oscar_zoo.evaluation import verification_run

    monkeypatch.setattr(verification_run, "run_verification", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("verify ran the model before checking the needle text")))
    tiny = play_text.parent / "tiny.txt"
    tiny.write_text(play_text.read_text()[:3000])
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, tiny, "--needle-lengths", "4000"))
    _one_line(code, out, err, 2, "--needle-lengths 4000: the held-out text has")


@pytest.mark.parametrize("option, value, words", [
    ("--max-kl", "-1", "--max-kl must be finite and ≥ 0, got -1"),
    ("--max-kl", "nan", "--max-kl must be finite and ≥ 0, got nan"),
    ("--max-ppl-increase", "inf", "--max-ppl-increase must be finite and > -1, got inf"),
    ("--max-ppl-increase", "-1", "--max-ppl-increase must be finite and > -1, got -1"),
    ("--min-top1", "1.5", "--min-top1 must be finite and in [0, 1], got 1.5"),
])
def test_thresholds_no_run_can_meet_are_refused_before_the_model_loads(run_cli, artifacts, tiny_model_dir,
                                                                       play_text, verify_loads_no_model, option, value,
                                                                       words):
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, option, value))
    _one_line(code, out, err, 2, words)


@pytest.mark.parametrize("option, value, words", [
    ("--baselines", "naive,naive", "has a name twice"),
    ("--baselines", ",", "has an empty name"),
    ("--baselines", "none,naive", "has `none` among names"),
    ("--needle-lengths", "1024,,2048", "--needle-lengths must be a comma-separated list of numbers"),
    ("--needle-depths", "0.2,", "--needle-depths must be a comma-separated list of numbers"),
    ("--dataset", "", "--dataset is empty"),
])
def test_lists_with_empty_or_repeated_items_are_refused_before_the_model_loads(run_cli, artifacts, tiny_model_dir,
                                                                              play_text, verify_loads_no_model,
                                                                              option, value, words):
    """An item left out or given twice is a mistake to name, not one to skip (they ran the whole evaluation); an
    empty --dataset read the current folder."""
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, option, value))
    _one_line(code, out, err, 2, words)


def test_write_to_a_read_only_folder_is_refused_before_the_model_loads(run_cli, artifacts, tiny_model_dir,
                                                                       play_text, tmp_path, monkeypatch,
                                                                       verify_loads_no_model):
    folder = tmp_path / "art"
    shutil.copytree(artifacts, folder)
    folder.chmod(0o555)  # as root the bits do not stop writes: the OS is asked through os.access, faked here
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(folder) and mode & os.W_OK
                        else real_access(p, mode))
    try:
        code, out, err = run_cli(*_verify(folder, tiny_model_dir, play_text, "--write"))
    finally:
        folder.chmod(0o755)
    _one_line(code, out, err, 2, "--write", f"cannot write in {folder}")


# -- --plot ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [".", "./", "", "/", "plots/", "plots/.."])
def test_a_plot_name_that_is_no_file_is_refused(run_cli, artifacts, tiny_model_dir, play_text, tmp_path,
                                                monkeypatch, verify_loads_no_model, name):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--plot", name))
    flat = _one_line(code, out, err, 2, "--plot")
    assert "is a folder" in flat or "names a folder" in flat, err
    assert list(tmp_path.iterdir()) == []


def test_an_existing_plot_file_is_kept_unless_overwrite_plot(run_cli, artifacts, tiny_model_dir, play_text,
                                                             tmp_path):
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"my own picture")
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--max-kl", "99", "--min-top1", "0",
                                      "--max-ppl-increase", "99", "--plot", mine))
    _one_line(code, out, err, 2, f"--plot {mine} already exists", "--overwrite-plot")
    assert mine.read_bytes() == b"my own picture"
    (tmp_path / "curves-needle.png").write_bytes(b"mine too")  # the needle heatmap beside a new --plot name
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--plot", tmp_path / "curves.png",
                                      "--needle"))
    _one_line(code, out, err, 2, "its needle heatmap", "curves-needle.png already exists")
    assert not (tmp_path / "curves.png").exists()
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--max-kl", "99", "--min-top1", "0",
                                      "--max-ppl-increase", "99", "--plot", mine, "--overwrite-plot"))
    assert code == 0, err
    assert mine.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- a folder replaced while verify --write runs ---------------------------------------------------------------------
@pytest.mark.parametrize("what", ["folder", "rotations"])
def test_a_folder_replaced_during_write_is_named_so_and_kept(run_cli, artifacts, other_artifacts, tiny_model_dir,
                                                             play_text, tmp_path, monkeypatch, what):
    """While the evaluation runs, the folder is swapped for another artifact (as calibrate or pull would), or only
    its rotations file is: the report is not stored, the error says the folder changed, what it now holds stays."""
    from oscar_zoo.evaluation import verification_run

    folder = tmp_path / "art"
    shutil.copytree(artifacts, folder)
    run = verification_run.run_verification

    def replacing(*args, **kwargs):
        report = run(*args, **kwargs)
        if what == "folder":
            folder.rename(tmp_path / "old")
            shutil.copytree(other_artifacts, folder)
        else:
            shutil.copyfile(other_artifacts / "rotations.safetensors", folder / "rotations.safetensors")
        return report

    monkeypatch.setattr(verification_run, "run_verification", replacing)
    code, out, err = run_cli(*_verify(folder, tiny_model_dir, play_text, "--max-kl", "99", "--min-top1", "0",
                                      "--max-ppl-increase", "99", "--write"))
    flat = _one_line(code, out, err, 4, "while verify ran", "the report was not stored")
    assert "damaged" not in flat
    assert ("was replaced" in flat) if what == "folder" else ("rotations.safetensors changed" in flat)
    now = json.loads((folder / "manifest.json").read_text())
    source = other_artifacts if what == "folder" else artifacts
    assert now == json.loads((source / "manifest.json").read_text())  # what the folder now holds, untouched
    assert now["verification"] is None


def test_write_binds_the_report_to_what_it_verified(run_cli, artifacts, tiny_model_dir, play_text, tmp_path):
    from oscar_zoo.artifacts import read_manifest
    from oscar_zoo.format.verification import binding_of

    folder = tmp_path / "art"
    shutil.copytree(artifacts, folder)
    code, out, err = run_cli(*_verify(folder, tiny_model_dir, play_text, "--max-kl", "99", "--min-top1", "0",
                                      "--max-ppl-increase", "99", "--write"))
    assert code == 0, err
    manifest = read_manifest(folder)
    assert manifest.verification["binding"] == binding_of(manifest).to_dict()


# -- a needle gate with nothing to compare against -------------------------------------------------------------------
def test_a_needle_grid_whose_reference_answers_nothing_is_no_pass(run_cli, artifacts, tiny_model_dir, play_text):
    """The random model answers no passkey, in FP32 or INT2: "OSCAR 0 % vs FP32 0 %" is exit 3, not a pass."""
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--max-kl", "99", "--min-top1", "0",
                                      "--max-ppl-increase", "99", "--needle-lengths", "300", "--needle-depths",
                                      "0.5", "--needle-trials", "1"))
    _one_line(code, out, err, 3, "needle: the reference answered none of the 1 prompts")
    assert "answered none: nothing to compare with, no pass" in " ".join(out.split())


def test_the_needle_rule_in_the_library():
    from oscar_zoo.format.verification import needle_gate

    assert needle_gate(0.0, 0.0, 0.9, 12) == ["needle: the reference answered none of the 12 prompts, so there is "
                                              "nothing to compare the artifact with"]
    assert needle_gate(0.0, 0.0, 0.0, 12) == []  # --min-needle-accuracy 0: no gate
    assert needle_gate(0.5, 0.45, 0.9, 12) == [] and needle_gate(0.5, 0.4, 0.9, 12) != []


# -- messages in verify's terms --------------------------------------------------------------------------------------
def test_too_little_held_out_text_is_said_in_verifys_terms(run_cli, artifacts, tiny_model_dir, play_text):
    code, out, err = run_cli(*[a if a != "1" else "500" for a in _verify(artifacts, tiny_model_dir, play_text)])
    flat = _one_line(code, out, err, 2, "sequences of 384 tokens; 500 are needed (--sequences 500 at --context 384)",
                     "lower --sequences or --context")
    assert "calibration" not in flat and "--tokens" not in flat and "--seq-len" not in flat


def test_a_failed_write_names_verifys_options(run_cli, artifacts, tiny_model_dir, play_text, tmp_path,
                                              monkeypatch):
    import errno
    import tempfile

    folder = tmp_path / "art"
    shutil.copytree(artifacts, folder)
    real = tempfile.mkstemp

    def full(*args, **kwargs):
        if kwargs.get("prefix", "").startswith((".manifest.json", ".p.png")):
            raise OSError(errno.ENOSPC, "No space left on device", str(kwargs.get("dir")))
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", full)
    loose = ("--max-kl", "99", "--min-top1", "0", "--max-ppl-increase", "99")
    for extra, names in ((("--write",), "--write"), (("--plot", tmp_path / "p.png"), "--plot")):
        code, out, err = run_cli(*_verify(folder, tiny_model_dir, play_text, *loose, *extra))
        flat = _one_line(code, out, err, 2, "the disk is full", names)
        assert "--out" not in flat and "--dest" not in flat, err


def test_help_shows_no_bool_type_beside_flags(run_cli):
    for command in ("verify", "push", "calibrate", "pull", "export", "inspect", "list", "import-oscar"):
        code, out, err = run_cli(command, "--help")
        assert code == 0 and "<bool>" not in out, (command, out)
    code, out, err = run_cli("verify", "--help")
    assert "--write" in out and "--overwrite-plot" in out
