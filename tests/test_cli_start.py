"""The CLI's start: `oscar-zoo --help`, `--version` and `list` import neither torch nor transformers (each command's
module is imported when that command runs, and the format's records hold no tensor), run here in a fresh interpreter
where importing either fails; a command is still found, shown and suggested by name."""

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from oscar_zoo.cli import _command
from oscar_zoo.commands import COMMANDS

WITHOUT_TORCH = """
import sys
sys.modules["torch"] = sys.modules["transformers"] = None  # importing either raises ImportError
sys.argv = ["oscar-zoo", *sys.argv[1:]]
from oscar_zoo.cli import main
main()
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args], capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, cwd=Path(__file__).resolve().parents[1])


def test_help_lists_every_command_without_torch():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("│ ") and "Commands" not in line
              and not line.split()[1].startswith("-")]
    assert listed == list(COMMANDS)
    for _, summary in COMMANDS.values():
        assert summary in proc.stdout


def test_version_and_list_run_without_torch():
    proc = _run("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("oscar-zoo "), proc.stderr
    proc = _run("list", "--json")
    assert proc.returncode == 0, proc.stderr
    assert {entry["name"] for entry in json.loads(proc.stdout)}  # the bundled catalog, read without torch


def test_a_command_module_is_imported_when_its_command_is_resolved():
    proc = _run("inspect", "--help")  # its module holds tensors: the import is what fails here
    assert proc.returncode != 0 and "torch" in proc.stderr


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_resolves_with_its_own_help(run_cli, name):
    code, out, _ = run_cli(name, "--help")
    assert code == 0
    assert f"oscar-zoo {name}" in out  # its own usage line, not the group's listing
    first = " ".join(inspect.cleandoc(_command(name).help).split("\n\n")[0].split())
    assert first == COMMANDS[name][1]  # the listing's line is the first paragraph of the command's own help


def test_a_mistyped_command_is_suggested(run_cli):
    code, _, err = run_cli("pul")
    assert code == 2 and "Did you mean 'pull'?" in err
