"""Every module of the package has a name of its own: no two share a file name (each package's `__init__.py` and
the one `__main__.py` aside), so a name in a traceback, an import or a search names one file."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_BY_DESIGN = {"__init__.py", "__main__.py"}


def shared_names(package: Path) -> dict[str, list[str]]:
    """File name → the modules under `package` that carry it, for every name carried more than once."""
    by_name = defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        if path.name not in SHARED_BY_DESIGN:
            by_name[path.name].append(str(path.relative_to(package.parent)))
    return {name: paths for name, paths in by_name.items() if len(paths) > 1}


def test_no_two_modules_share_a_name():
    shared = shared_names(ROOT / "oscar_zoo")
    assert not shared, "modules that share a name (rename one of each):\n" + "\n".join(
        f"{name}: {', '.join(paths)}" for name, paths in sorted(shared.items()))


def test_the_check_sees_a_shared_name(tmp_path):
    for rel in ("pkg/__init__.py", "pkg/a/__init__.py", "pkg/a/x.py", "pkg/b/x.py", "pkg/b/y.py", "pkg/__main__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert shared_names(tmp_path / "pkg") == {"x.py": ["pkg/a/x.py", "pkg/b/x.py"]}
