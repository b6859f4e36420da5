"""Manifests that are not strict JSON documents of sane size and depth (not UTF-8, nested 100,000 deep, NaN, numbers
out of range, lone surrogates, rich markup in keys): one parser refuses them all with exit 4 and a one-line message,
and the runtime's reader (`OscarCache.from_folder`) with ValueError."""

from __future__ import annotations

import json

import pytest

from oscar_zoo.errors import IntegrityError
from oscar_zoo.format.schema import Manifest
from oscar_zoo.hub.zoo import ZooIndex
from oscar_zoo.runtime.cache import OscarCache

from .hub.helpers import make_artifacts, run_cli


def _with_key(text: str, key: str) -> str:
    doc = json.loads(text)
    doc[key] = 1
    return json.dumps(doc)


def _with_model_id(text: str, model_id: str) -> bytes:
    doc = json.loads(text)
    doc["model"]["id"] = model_id
    return json.dumps(doc).encode()


BAD = {  # name -> (manifest bytes from the good text, words of the message)
    "latin-1": (lambda t: t.replace('"test"', '"t\u00e9st"').encode("latin-1"), "not UTF-8"),
    "utf-16": (lambda t: t.encode("utf-16"), "not UTF-8"),
    "nested 100,000 deep": (lambda t: ("[" * 100_000 + "]" * 100_000).encode(), "deeper than"),
    "nested object 100,000 deep": (lambda t: ('{"a":' * 100_000 + "1" + "}" * 100_000).encode(), "deeper than"),
    "nested 200 deep in verification": (lambda t: t.replace('"passed": true', '"passed": ' + "[" * 200 + "]" * 200)
                                        .encode(), "deeper than"),
    "NaN": (lambda t: t.replace('"wall_seconds": 1.0', '"wall_seconds": NaN').encode(), "NaN is not a JSON number"),
    "Infinity": (lambda t: t.replace('"k_default": 0.96', '"k_default": -Infinity').encode(), "Infinity"),
    "huge float": (lambda t: t.replace('"k_default": 0.96', '"k_default": 1e999').encode(), "out of range"),
    "huge int": (lambda t: t.replace('"group_size": 16', '"group_size": ' + "9" * 5000).encode(), "out of range"),
    "lone surrogate": (lambda t: t.replace('"test"', '"\\ud800"').encode(), "not valid Unicode"),
    "markup in a key": (lambda t: _with_key(t, "[/]").encode(), "invalid at '[/]'"),
    "BOM": (lambda t: b"\xef\xbb\xbf" + t.encode(), "not valid JSON"),
    "group not dividing head_dim": (lambda t: t.replace('"group_size": 16', '"group_size": 5').encode(),
                                    "does not fit"),
    "layer beyond the model": (lambda t: t.replace('"layer_ids": [\n      0,', '"layer_ids": [\n      7,').encode(),
                               "layer_ids"),
    "too big": (lambda t: t.replace('"test"', '"' + "x" * (2 << 20) + '"').encode(), "too many"),
    # a model id is written into shell files (export --format sglang): a newline there would start a command
    "newline in the model id": (lambda t: _with_model_id(t, "org/tiny\ntouch /tmp/x"), "bidi-override character"),
    "bidi override in the model id": (lambda t: _with_model_id(t, "org/\u202etiny"), "bidi-override character"),
    "flush of 10^15 tokens": (lambda t: t.replace('"flush": 8', '"flush": 1000000000000000').encode(),
                              "less than or equal to 1048576"),
}


@pytest.fixture(scope="module")
def good_text(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good") / "art"
    make_artifacts(folder)
    return (folder / "manifest.json").read_text()


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_manifest_is_exit_4_everywhere(case, good_text, tmp_path):
    make, words = BAD[case]
    folder = tmp_path / "art"
    make_artifacts(folder)
    data = make(good_text)
    assert data != good_text.encode()
    (folder / "manifest.json").write_bytes(data)
    for args in (["inspect", folder], ["export", folder, "--format", "sglang", "--out", tmp_path / "sg"]):
        code, out, err = run_cli(*map(str, args))
        assert code == 4, (args, err)
        lines = err.strip().splitlines()
        assert len(lines) <= 2 and lines[0].startswith("error:") and words in lines[0] and "Traceback" not in err
    with pytest.raises(IntegrityError, match="zoo.json"):
        ZooIndex.from_json(data)
    with pytest.raises(IntegrityError):
        Manifest.from_json(data)
    try:  # the runtime reads quant settings only; whatever it cannot read is a ValueError, never another exception
        OscarCache.from_folder(folder)
    except ValueError:
        pass


def test_runtime_reader_refuses_unreadable_manifests(good_text, tmp_path):
    folder = tmp_path / "art"
    make_artifacts(folder)
    for data, words in [(b"[" * 100_000 + b"]" * 100_000, "too deep"), (b"\xff{}", "not UTF-8"),
                        (b"[1, 2]", "JSON object"), (b'{"quant": 3}', "JSON object"),
                        (json.dumps({"quant": {"group_size": "16"}}).encode(), "expected an integer"),
                        (json.dumps({"quant": {"sink": 1.5}}).encode(), "expected an integer"),
                        (json.dumps({"quant": {"flush": True}}).encode(), "expected an integer"),
                        (json.dumps({"quant": {"recent": -3}}).encode(), "0 ≤ sink, recent, pin ≤"),
                        (json.dumps({"quant": {"flush": 10**15}}).encode(), "1 ≤ flush ≤ 1048576")]:
        (folder / "manifest.json").write_bytes(data)
        with pytest.raises(ValueError, match=words):
            OscarCache.from_folder(folder)
    (folder / "manifest.json").write_text(json.dumps({"quant": {"group_size": 8, "sink": 16, "recent": 32}}))
    assert OscarCache.from_folder(folder).quant_settings["group_size"] == 8
