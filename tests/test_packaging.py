"""The package as a user installs it: the wheel holds every module and every data file the CLI reads at run time (the
catalog), declares its dependencies and the `oscar-zoo` entry point; its version is pyproject's, CHANGELOG's newest
release and what `oscar-zoo --version` prints."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib.metadata import version
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """`pip wheel --no-deps --no-build-isolation` of a copy of the source tree (the build writes build/ and egg-info
    beside the sources: not into the checkout), with no package index: it builds offline."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "oscar_zoo", source / "oscar_zoo",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp / "dist"), "."], cwd=source, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = (tmp / "dist").glob("oscar_zoo-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def _metadata(archive: zipfile.ZipFile):
    name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    return Parser().parsestr(archive.read(name).decode())


@pytest.mark.build
def test_wheel_holds_every_module_and_the_catalog(wheel):
    names = set(wheel.namelist())
    package = {str(p.relative_to(ROOT)) for p in (ROOT / "oscar_zoo").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert package - names == set(), "missing from the wheel"
    catalog = {n for n in names if n.startswith("oscar_zoo/catalog/")}
    assert catalog and all(n.endswith(".json") for n in catalog)
    assert not any(n.startswith(("tests/", "benchmarks/", "docs/")) for n in names)


@pytest.mark.build
def test_wheel_declares_its_version_dependencies_and_command(wheel):
    meta = _metadata(wheel)
    assert meta["Version"] == PYPROJECT["project"]["version"]
    requires = meta.get_all("Requires-Dist") or []

    def names(requirements) -> set[str]:
        return {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}

    assert names(PYPROJECT["project"]["dependencies"]) <= names(r for r in requires if "extra ==" not in r)
    for extra in PYPROJECT["project"]["optional-dependencies"]:
        assert extra in (meta.get_all("Provides-Extra") or [])
    entry_points = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")))
    assert "oscar-zoo = oscar_zoo.cli:main" in entry_points.decode()


def test_changelog_names_this_version_first():
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", changelog, flags=re.M)
    assert releases and releases[0][0] == PYPROJECT["project"]["version"]
    assert [r[1] for r in releases] == sorted((r[1] for r in releases), reverse=True)


def test_version_option_prints_the_installed_version(run_cli):
    code, out, err = run_cli("--version")
    assert code == 0, err
    assert out.strip() == f"oscar-zoo {version('oscar-zoo')}"
