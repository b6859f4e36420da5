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
