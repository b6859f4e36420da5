"""Every string a manifest, a verify report, a catalog entry or a zoo index can carry, set to hostile text (terminal
escape sequences, C1 controls, bidi overrides, rich markup, 1 MB strings): no command writes a control sequence to the
terminal, rich markup is printed as written, and no generated card (model card, zoo README) carries a raw control
character or live Markdown/markup from it. A field the schema refuses is exit 4 with one line, escaped too."""

from __future__ import annotations

import json
import re

import pytest

from oscar_zoo.format.schema import Manifest
from oscar_zoo.hub.card import render_model_card, render_zoo_card
from oscar_zoo.hub.zoo import ZooIndex, ZooModel

from .hub.helpers import make_artifacts, run_cli

MARK = "[bold red]MARK[/]"
HOSTILE = {
    "escapes": "\x1b]0;pwned\x07\x1b[2J\x1b[31m" + MARK + "\r\x08\x00\x7f",
    "c1-bidi": "\x9b2J\x85\u202eevil\u2066\u2028" + MARK,
    "1 MB": "A" * 1_000_000 + "\x1b[2J" + MARK,
}
# what a terminal or a renderer acts on: C0 controls but newline and tab, DEL, C1, separators, bidi overrides/isolates
UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _string_leaves(node, path=()):
    """(path, is_key) of every string in a JSON document: values, and the keys of free-form objects."""
    if isinstance(node, dict):
        for k, v in node.items():
            if path and path[-1] in ("versions",):
                yield (*path, k), True
            yield from _string_leaves(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _string_leaves(v, (*path, i))
    elif isinstance(node, str):
        yield path, False


def _set(doc, path, is_key, value):
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    if is_key:
        parent[value] = parent.pop(path[-1])
    else:
        parent[path[-1]] = value


def assert_terminal_safe(text: str, where) -> None:
    assert not UNSAFE.search(text), (where, UNSAFE.search(text))
    if "MARK" in text:  # shown at all: shown as written, not as markup (rich may wrap a long line anywhere)
        assert "[boldred]MARK[/]" in re.sub(r"\s", "", text), (where, text[-400:])
    assert "Traceback" not in text, where


def assert_card_safe(card: str, where) -> None:
    assert not UNSAFE.search(card), (where, UNSAFE.search(card))
    body = card.split("---\n", 2)[2] if card.startswith("---\n") else card
    outside_code = re.sub(r"`[^`\n]*`", "", re.sub(r"(?s)```.*?```", "", body))  # code shows text as written
    assert "[bold red]" not in outside_code, where  # `[` escaped: no link or markup from the value


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good") / "art"
    make_artifacts(folder)
    return folder, json.loads((folder / "manifest.json").read_text())


def _manifest_cases(doc):
    return [(path, is_key) for path, is_key in _string_leaves(doc) if path[0] not in ("schema_version", "tool")]


def test_every_manifest_and_report_string_is_escaped_in_inspect_and_cards(good, tmp_path):
    folder, doc = good
    cases = _manifest_cases(doc)
    assert len(cases) > 30 and any(p[0] == "verification" for p, _ in cases)  # the report's fields are in
    seen_refused = seen_accepted = 0
    for (path, is_key) in cases:
        for name, value in HOSTILE.items():
            if name == "1 MB" and path[0] == "verification" and path[-1] not in ("name", "label", "dataset"):
                continue  # a few 1 MB report fields stand for all (each run parses a 1 MB document)
            bad = json.loads(json.dumps(doc))
            _set(bad, path, is_key, value)
            target = tmp_path / "art"
            if not target.exists():
                target.mkdir()
                for f in folder.iterdir():
                    (target / f.name).write_bytes(f.read_bytes())
            text = json.dumps(bad, ensure_ascii=False)
            (target / "manifest.json").write_text(text, encoding="utf-8")
            where = (".".join(map(str, path)), name)
            for args in (["inspect", str(target)], ["inspect", str(target), "--json"]):
                code, out, err = run_cli(*args)
                assert code in (0, 4), (where, args, err[-400:])
                assert_terminal_safe(out + err, (where, args))
                if code == 4:
                    lines = err.strip().splitlines()
                    assert len(lines) <= 2 and lines[0].startswith("error:"), (where, err[:400])
                    seen_refused += 1
                else:
                    seen_accepted += 1
                if args[-1] == "--json" and code == 0:  # the JSON still says exactly what the file holds
                    assert json.loads(out)["manifest"][path[0]] == bad[path[0]], where
            try:
                manifest = Manifest.from_json(text.encode())
            except Exception:  # noqa: BLE001 - refused by the schema: nothing to render
                continue
            assert_card_safe(render_model_card(manifest, "zoo/r", "sub", "hf"), where)
    assert seen_refused and seen_accepted


def _catalog_entry():
    from oscar_zoo.hub.catalog import load_catalog

    return json.loads(load_catalog()[0].to_json())


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_every_catalog_string_is_escaped_in_list_and_pull(name, tmp_path, monkeypatch):
    from oscar_zoo.hub.catalog import manifest_sha256

    value = HOSTILE[name]
    entry = _catalog_entry()
    folder = tmp_path / "cat"
    folder.mkdir()
    monkeypatch.setenv("OSCAR_ZOO_CATALOG", str(folder))
    fields = [p for p, is_key in _string_leaves(entry) if not is_key and p[0] not in ("catalog_version", "manifest")]
    fields += [("manifest", "rotation", "hadamard"), ("manifest", "calibration", "dataset")]
    for path in fields:
        bad = json.loads(json.dumps(entry))
        _set(bad, path, False, value)
        if path[0] == "manifest":
            bad["manifest_sha256"] = manifest_sha256(Manifest.from_dict(bad["manifest"]))
        (folder / "entry.json").write_text(json.dumps(bad), encoding="utf-8")
        for args in (["list"], ["list", "--json"], ["pull", entry["name"], "--dest", str(tmp_path / "d")]):
            code, out, err = run_cli(*args)
            assert code in (0, 2, 4, 5), (path, args, err[-400:])  # pull is offline here: exit 5 naming the repo
            assert_terminal_safe(out + err, (path, args))
            if code:
                assert err.startswith("error:") and len(err.strip().splitlines()) <= 2, (path, args, err[:400])
        assert not (tmp_path / "d").exists()


def test_a_catalog_repo_id_with_escapes_reaches_pull_escaped(tmp_path, monkeypatch):
    entry = _catalog_entry()
    entry["locations"][0]["repo_id"] = "zoo/\x1b]0;pwned\x07rot" + MARK
    entry["locations"][0]["published"] = True
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "e.json").write_text(json.dumps(entry))
    monkeypatch.setenv("OSCAR_ZOO_CATALOG", str(tmp_path / "cat"))
    code, out, err = run_cli("pull", entry["name"], "--dest", str(tmp_path / "d"))
    assert code in (2, 4, 5) and "\\x1b]0;pwned\\x07rot" in err, err
    assert_terminal_safe(out + err, "pull")


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_every_zoo_index_string_is_escaped_in_the_zoo_readme(name):
    value = HOSTILE[name]
    base = dict(subfolder="a", model_id="org/m", model_revision="abc", granularity="per-head",
                manifest_sha256="0" * 64, bits_per_element_128k=2.5, verification="unverified",
                updated="2026-01-01T00:00:00+00:00")
    for field in ("model_id", "model_revision", "granularity", "verification", "updated", "manifest_sha256"):
        index = ZooIndex(models=[ZooModel(**{**base, field: value})])
        assert_card_safe(render_zoo_card(index, "zoo/r", "hf"), field)
    assert_card_safe(render_zoo_card(ZooIndex(models=[ZooModel(**base)]), "zoo/r" + value, "hf"), "repo_id")
