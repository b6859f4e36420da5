"""`verify --plot PATH` is checked before any model work (a name matplotlib cannot write, an existing folder, a path
under a file: exit 2, one line, nothing loaded, nothing written), and the line after a run names the file actually
written (`--plot NAME` writes NAME.png), made atomically with its missing folders. Real artifact folder (imported
for the suite's tiny random Llama), real CLI."""

from __future__ import annotations

import shutil

import pytest
import torch

from oscar_zoo.export.oscar_pt import K_FILE, V_FILE

L, D = 2, 64  # tiny_model_dir's geometry


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_model_dir):
    """Per-layer identity rotations for tiny_model_dir, imported through the CLI (its model identity, exactly)."""
    from .hub.helpers import run_cli

    folder = tmp_path_factory.mktemp("plot-artifacts")
    for name, objective in ((K_FILE, "qqt_r_h_pbr"), (V_FILE, "sst_r_h_pbr")):
        torch.save({"format_version": 1, "objective": objective, "source_grouping": "layer",
                    "layers": {i: {"layer_id": i, "rotation": torch.eye(D), "eigenvalues": torch.arange(D) * 1.0}
                               for i in range(L)}}, folder / name)
    code, _, err = run_cli("import-oscar", str(folder / K_FILE), str(folder / V_FILE), "--model",
                           str(tiny_model_dir), "--out", str(folder / "art"))
    assert code == 0, err
    return folder / "art"


def _verify(artifacts, model_dir, play_text, *extra):
    return ("verify", artifacts, "--model", model_dir, "--dataset", play_text, "--context", "384", "--sequences",
            "1", "--generate", "0", "--baselines", "none", "--device", "cpu", "--dtype", "float32", "--max-kl", "99",
            "--min-top1", "0", "--max-ppl-increase", "99", *extra)


def _assert_refused(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err and "AssertionError" not in out + err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: --plot"), err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def test_a_format_matplotlib_cannot_write_is_refused_up_front(run_cli, artifacts, tiny_model_dir, play_text,
                                                              tmp_path, verify_loads_no_model):
    plot = tmp_path / "plot.xyz"
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--plot", plot))
    _assert_refused(code, out, err, str(plot), ".xyz")
    assert ".png" in err and ".pdf" in err  # the hint lists what matplotlib can write
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("xelatex") is not None, reason="pgf is writable where LaTeX is installed")
def test_a_format_listed_but_not_writable_here_is_refused_up_front(run_cli, artifacts, tiny_model_dir, play_text,
                                                                   tmp_path, verify_loads_no_model):
    """matplotlib lists pgf, but writing it needs xelatex: found out by rendering a tiny figure, before the run."""
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--plot", tmp_path / "plot.pgf"))
    _assert_refused(code, out, err, ".pgf", "xelatex")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_is_refused_up_front(run_cli, artifacts, tiny_model_dir, play_text, tmp_path,
                                                verify_loads_no_model):
    folder = tmp_path / "plots"
    folder.mkdir()
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--plot", folder))
    _assert_refused(code, out, err, str(folder), "is a folder")
    assert str(folder / "verify.png") in err  # the hint: a file in it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots"] and not any(folder.iterdir())  # no plots.png
    # NAME whose NAME.png is a folder, and a needle heatmap that would land on a folder: refused too
    (tmp_path / "curves.png").mkdir()
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--plot", tmp_path / "curves"))
    _assert_refused(code, out, err, "is a folder", str(tmp_path / "curves.png"))
    (tmp_path / "v-needle.png").mkdir()
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--plot", tmp_path / "v.png",
                                      "--needle"))
    _assert_refused(code, out, err, "needle heatmap", "v-needle.png", "is a folder")
    assert not (tmp_path / "v.png").exists()


def test_a_path_under_a_file_is_refused_up_front(run_cli, artifacts, tiny_model_dir, play_text, tmp_path,
                                                 verify_loads_no_model):
    (tmp_path / "notes").write_text("mine")
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--plot", tmp_path / "notes" / "p.png"))
    _assert_refused(code, out, err, "which is a file")
    assert (tmp_path / "notes").read_text() == "mine"


def test_the_file_written_is_the_file_reported(run_cli, artifacts, tiny_model_dir, play_text, tmp_path):
    """`--plot DIR/NAME` (no extension, DIR missing) writes DIR/NAME.png, says so, and leaves no temp file; a .svg
    name writes SVG (the extension picks the format)."""
    plot = tmp_path / "new" / "sub" / "curves"
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--plot", plot))
    assert code == 0, err
    written = plot.with_name("curves.png")
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {written}\n" in out
    assert sorted(p.name for p in written.parent.iterdir()) == ["curves.png"]
    svg = tmp_path / "curves.svg"
    code, out, err = run_cli(*_verify(artifacts, tiny_model_dir, play_text, "--plot", svg))
    assert code == 0, err
    assert b"<svg" in svg.read_bytes()[:2000] and f"wrote {svg}\n" in out


def test_a_negative_generate_count_is_refused(run_cli, tmp_path):
    code, out, err = run_cli("verify", tmp_path / "no-artifacts", "--generate", "-1")
    assert code == 2 and "--generate must be ≥ 0" in err and "Traceback" not in err, err
