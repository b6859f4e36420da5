"""Every file in the catalog (repo-root `manifests/`, a symlink to the packaged `oscar_zoo/catalog/`) validates,
is in canonical form, and is what `oscar-zoo list` shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oscar_zoo.hub.catalog import load_catalog, parse_entry

from .helpers import run_cli

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
FILES = sorted(MANIFESTS.glob("*.json"))


def test_catalog_folder_is_the_packaged_one():
    assert MANIFESTS.resolve() == (Path(__file__).resolve().parents[2] / "oscar_zoo" / "catalog").resolve()
    assert FILES, "the catalog is empty"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_catalog_file_validates_and_is_canonical(path):
    text = path.read_text()
    entry = parse_entry(text, str(path))  # schema (extra=forbid), versions, manifest sha256
    assert entry.to_json() == text, "not in canonical form (sorted keys, indent 2, trailing newline)"
    assert path.name == f"{entry.name}.json"
    assert all(loc.published or loc.revision is None for loc in entry.locations)


def test_list_shows_the_bundled_catalog(hub_env):
    names = [e.name for e in load_catalog()]
    code, out, err = run_cli("list", "--json")
    assert code == 0, err
    assert [e["name"] for e in json.loads(out)] == names
    code, out, _ = run_cli("list")
    assert code == 0 and "SmolLM2-135M-Instruct" in out


def test_invalid_catalog_entries_are_integrity_errors(tmp_path, monkeypatch, hub_env):
    entry = json.loads(FILES[0].read_text())
    entry["unexpected"] = 1
    (tmp_path / "bad.json").write_text(json.dumps(entry))
    monkeypatch.setenv("OSCAR_ZOO_CATALOG", str(tmp_path))
    code, _, err = run_cli("list")
    assert code == 4 and "unexpected" in err
    entry.pop("unexpected")
    entry["manifest"]["calibration"]["seed"] += 1  # manifest no longer matches its recorded sha256
    (tmp_path / "bad.json").write_text(json.dumps(entry))
    code, _, err = run_cli("list")
    assert code == 4 and "manifest_sha256" in err


@pytest.mark.parametrize("kind", ["folder", "dangling symlink", "symlink loop"])
def test_unreadable_catalog_entries_are_integrity_errors(kind, tmp_path, monkeypatch, hub_env):
    """A `*.json` in a private catalog that is not a readable file is refused like a malformed entry: one line naming
    it, exit 4 (not a traceback), for `list` and `pull NAME` alike; it is not skipped either."""
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    (catalog / "a-good.json").write_bytes(FILES[0].read_bytes())
    bad = catalog / "entry.json"
    if kind == "folder":
        bad.mkdir()
    elif kind == "dangling symlink":
        bad.symlink_to(tmp_path / "missing.json")
    else:
        bad.symlink_to("entry.json")
    monkeypatch.setenv("OSCAR_ZOO_CATALOG", str(catalog))
    good = json.loads(FILES[0].read_text())["name"]
    for args in (["list"], ["list", "--json"], ["pull", good, "--dest", str(tmp_path / "d")]):
        code, out, err = run_cli(*args)
        assert code == 4, (args, err)
        assert err.startswith(f"error: catalog entry {bad} is ") and "Traceback" not in err
        assert len(err.splitlines()) == 2 and err.splitlines()[1] == f"hint: fix or remove {bad}"
        assert out == "" and not (tmp_path / "d").exists()
