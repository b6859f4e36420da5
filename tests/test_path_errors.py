"""Paths the operating system cannot look up (a loop of symbolic links, a name longer than the file system allows)
given as a destination or as an artifact argument: exit 2 and one error line naming the path, never a traceback,
and nothing written."""

import pytest

LONG = "x" * 300  # NAME_MAX is 255 on the usual Linux file systems


def _one_line_exit_2(result):
    code, out, err = result
    assert code == 2, err
    assert "Traceback" not in err
    assert [line.split(":")[0] for line in err.strip().splitlines()] == ["error", "hint"], err


@pytest.mark.parametrize("kind", ["symlink loop", "name too long"])
def test_unusable_destination_paths_are_input_errors(run_cli, tiny_model_dir, tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    if kind == "symlink loop":
        (tmp_path / "a").symlink_to("b")
        (tmp_path / "b").symlink_to("a")
        dest = "a"
    else:
        dest = LONG
    before = sorted(p.name for p in tmp_path.iterdir())
    _one_line_exit_2(run_cli("calibrate", tiny_model_dir, "--device", "cpu", "--tokens", "256", "--seq-len", "64",
                             "--out", dest))
    _one_line_exit_2(run_cli("pull", "org/repo", "--dest", dest))
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_destination_inside_an_artifact_folder_is_an_input_error(run_cli, tiny_model_dir, tmp_path):
    """An artifact folder holds its manifest's files and nothing else: calibrate and pull refuse to write a folder
    inside one (as export does, and import-oscar: tests/export/test_oscar_pt.py), and it is left as it was."""
    from .hub.helpers import make_artifacts

    art = tmp_path / "art"
    make_artifacts(art)
    before = sorted(p.name for p in art.iterdir())
    for args in (["calibrate", str(tiny_model_dir), "--device", "cpu", "--tokens", "256", "--seq-len", "64", "--out"],
                 ["pull", "org/repo", "--dest"]):
        result = run_cli(*args, str(art / "sub" / "inner"))
        _one_line_exit_2(result)
        assert f"lies inside {art}, which is an oscar-zoo artifact folder" in " ".join(result[2].split())
    assert sorted(p.name for p in art.iterdir()) == before


def test_an_artifact_argument_with_a_name_too_long_is_an_input_error(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _one_line_exit_2(run_cli("inspect", LONG))
    _one_line_exit_2(run_cli("export", LONG, "--format", "oscar-pt", "--out", "exported"))
    assert not (tmp_path / "exported").exists()


@pytest.mark.parametrize("command", [[], ["calibrate"], ["verify"], ["inspect"], ["push"], ["pull"], ["list"],
                                     ["export"], ["import-oscar"]])  # fmt: skip
def test_every_command_has_help(run_cli, command):
    """`--help` exits 0 and prints the usage line (pull's help once read `[/SUBFOLDER]` as a closing markup tag and
    crashed with exit 1)."""
    code, out, err = run_cli(*command, "--help")
    assert code == 0, err
    assert "Usage:" in out
    if command == ["pull"]:
        assert "OWNER/REPO[/SUBFOLDER]" in out
