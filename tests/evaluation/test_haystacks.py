"""The needle benchmark's fixed haystacks and needles: every (haystack, needle) pair builds prompts of the exact length
with the whole needle at its depth, each answer check takes the key and refuses near misses, the passkey on the plays
is verify's prompt exactly, and no haystack shares text with what calibrate reads by default."""

from __future__ import annotations

import ast
import inspect
import random
import re
from pathlib import Path

import pytest

from oscar_zoo.errors import InputError
from oscar_zoo.evaluation.haystacks import DOC_MODULES, HAYSTACKS, filler, haystack_named, stdlib_docs, write_texts
from oscar_zoo.evaluation.needle import (
    NAMES,
    NEEDLE,
    NEEDLES,
    PASSKEY,
    QUESTION,
    NeedleSettings,
    answer_is_right,
    build_prompt,
    needle_named,
    needle_of_report,
)
from oscar_zoo.texts import CALIBRATION_PLAYS, bundled_files, load_texts

ROOT = Path(__file__).resolve().parents[2]
KEY_SHAPES = {"passkey": r"\d{5}", "name": r"[A-Z][a-z]+ [A-Z][a-z]+", "code": r"[A-HJ-NP-Z]{2}-\d{4}-[A-HJ-NP-Z]{2}"}
PREFIX_CHARS = 40_000  # of each haystack, for the prompt tests: about 10,000 tokens, enough for 4,096-token prompts


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    return {name: h.text() for name, h in HAYSTACKS.items()}


@pytest.fixture(scope="module")
def fillers(tokenizer, texts) -> dict[str, list[int]]:
    return {name: filler(tokenizer, text[:PREFIX_CHARS]) for name, text in texts.items()}


def test_the_registries_hold_three_kinds_of_text_and_three_needles(texts):
    assert set(HAYSTACKS) >= {"plays", "poems", "docs"} and len({h.kind for h in HAYSTACKS.values()}) >= 3
    assert set(NEEDLES) >= {"passkey", "name", "code"}
    assert len({n.sentence for n in NEEDLES.values()}) == len({n.question for n in NEEDLES.values()}) == len(NEEDLES)
    for name, h in HAYSTACKS.items():
        assert 100_000 <= len(texts[name]) <= h.max_chars  # bounded, and long enough for 8K-token prompts
    assert stdlib_docs() == texts["docs"]  # deterministic within an interpreter
    with pytest.raises(InputError, match="unknown haystack 'novel'"):
        haystack_named("novel")
    with pytest.raises(InputError, match="unknown needle 'date'"):
        needle_named("date")


@pytest.mark.parametrize("needle", sorted(NEEDLES))
@pytest.mark.parametrize("haystack", sorted(HAYSTACKS))
def test_every_haystack_and_needle_builds_exact_prompts(tokenizer, fillers, haystack, needle):
    fact, fill = NEEDLES[needle], fillers[haystack]
    rng = random.Random(11)
    for length in (1024, 4096):
        for depth in (0.0, 0.37, 1.0):
            p = build_prompt(tokenizer, fill, length, depth, rng, fact)
            assert re.fullmatch(KEY_SHAPES[needle], p.key)
            assert len(p.context) + len(p.question) == length
            assert p.question == tokenizer(fact.question, add_special_tokens=False).input_ids
            whole = tokenizer(fact.sentence.format(key=p.key), add_special_tokens=False).input_ids
            assert p.context[p.needle_start : p.needle_start + p.needle_len] == whole  # whole, where it says
            n_filler = len(p.context) - p.needle_len
            assert p.needle_start == round(depth * n_filler)
            rest = p.context[: p.needle_start] + p.context[p.needle_start + p.needle_len :]
            # one contiguous window of the haystack around it
            assert any(fill[i : i + n_filler] == rest for i in range(len(fill)) if fill[i : i + 16] == rest[:16])
            assert fact.is_right(f" {p.key}.", p.key)


def test_every_key_fits_its_answer_tokens(tokenizer):
    """The decoded answer holds the longest key's tokens and one more that would extend it (the check's guard)."""
    rng = random.Random(0)
    for fact in NEEDLES.values():
        keys = set(NAMES) if fact.name == "name" else {fact.draw(rng) for _ in range(300)}
        longest = max(len(tokenizer(f" {k}", add_special_tokens=False).input_ids) for k in keys)
        assert longest + 1 <= fact.new_tokens, fact.name
        assert fact.key_example in keys or re.fullmatch(KEY_SHAPES[fact.name], fact.key_example)


@pytest.mark.parametrize("needle, key, right, near_misses", [
    ("passkey", "48213", [" 48213.", "48213\n", " 48213"],
     [" 48214.", " 4821.", " 482139", " 148213", "", " the passkey is 48213", " 48 213"]),
    ("name", "Maria Lindqvist", [" Maria Lindqvist.", "Maria Lindqvist\n", "  Maria Lindqvist, who"],
     [" Maria Lindqvists", " Maria Lindqvis.", " Maria", " Maria\n\nLindqvist", " maria lindqvist.", " Lindqvist.",
      " Maria Lindholm.", " Maria Lindqvist-Berg", " Mrs Maria Lindqvist", ""]),
    ("code", "QX-4417-ZB", [" QX-4417-ZB.", "QX-4417-ZB\n", " QX-4417-ZB, then"],
     [" QX-4417-ZC.", " QX-4417", " QX-4417-ZBA", " QX-44170-ZB", " qx-4417-zb", " QX 4417 ZB", " QX-4417-ZB-1",
      " XQ-4417-ZB", " the code is QX-4417-ZB", ""]),
])
def test_each_answer_check_takes_the_key_and_refuses_a_near_miss(needle, key, right, near_misses):
    fact = NEEDLES[needle]
    assert all(fact.is_right(text, key) for text in right)
    assert not any(fact.is_right(text, key) for text in near_misses), [t for t in near_misses if fact.is_right(t, key)]
    assert all(answer_is_right(text, key, fact) for text in right)


def test_the_defaults_are_verifys_passkey_prompt(tokenizer, fillers):
    """build_prompt without a needle, and NeedleSettings without one, are exactly what verify ran before needles had
    names: the passkey sentence and question, its key the generator's first draw, 7 answer tokens."""
    assert PASSKEY.sentence == NEEDLE and PASSKEY.question == QUESTION and needle_of_report(NEEDLE.strip()) is PASSKEY
    p = build_prompt(tokenizer, fillers["plays"], 2000, 0.5, random.Random(3))
    assert p == build_prompt(tokenizer, fillers["plays"], 2000, 0.5, random.Random(3), PASSKEY)
    rng = random.Random(3)
    assert p.key == str(rng.randint(10000, 99999))
    assert p.context[p.needle_start : p.needle_start + p.needle_len] == tokenizer(
        f" The secret passkey is {p.key}. Remember it: the passkey is {p.key}. ", add_special_tokens=False).input_ids
    assert NeedleSettings(lengths=(300,)).new_tokens == 7 and NeedleSettings(lengths=(300,)).needle == "passkey"
    assert NeedleSettings(lengths=(300,), needle="code").new_tokens == NEEDLES["code"].new_tokens
    assert NeedleSettings(lengths=(300,), needle="name", new_tokens=5).new_tokens == 5
    with pytest.raises(InputError, match="unknown needle"):
        NeedleSettings(lengths=(300,), needle="date")
    for fact in NEEDLES.values():
        assert needle_of_report(fact.sentence.strip()) is fact


def test_names_appear_in_no_haystack(texts):
    for name, text in texts.items():
        assert not [n for n in NAMES if n in text], name


WIDTH = 100  # characters, after lower-casing and collapsing runs of whitespace


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower())


def _shared(text: str, calibration: str, seen: set[int]) -> list[str]:
    """`text`'s WIDTH-character windows found in `calibration` (`seen`: the hashes of all of its windows)."""
    hits = (text[i : i + WIDTH] for i in range(len(text) - WIDTH + 1) if hash(text[i : i + WIDTH]) in seen)
    return [w for w in hits if w in calibration]


def test_no_haystack_shares_text_with_the_calibration_data(texts):
    """No 100-character window of any haystack (case and runs of whitespace aside) appears in the text calibrate reads
    by default: the calibration plays of the bundled corpus."""
    assert inspect.signature(load_texts).parameters["plays"].default == CALIBRATION_PLAYS
    calibration = _normal("\n\n".join(f.read_text(encoding="utf-8") for f in bundled_files(CALIBRATION_PLAYS)))
    seen = {hash(calibration[i : i + WIDTH]) for i in range(len(calibration) - WIDTH + 1)}
    for name, text in texts.items():
        shared = _shared(_normal(text), calibration, seen)
        assert not shared, f"haystack {name} shares {len(shared)} windows with the calibration plays: {shared[0]!r}"
    # the check sees one: a haystack holding a calibration passage of WIDTH characters
    poems = _normal(texts["poems"])
    passage = calibration[500_000 : 500_000 + WIDTH]
    assert _shared(poems[:50_000] + passage + poems[50_000:60_000], calibration, seen) == [passage]


def test_docs_modules_are_none_of_the_docstring_calibration_modules():
    """benchmarks/quality_sweep.py calibrates on docstrings of DOC_CALIBRATION_MODULES: the docs haystack takes none."""
    tree = ast.parse((ROOT / "benchmarks" / "quality_sweep.py").read_text(encoding="utf-8"))
    calibration = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                       and any(getattr(t, "id", None) == "DOC_CALIBRATION_MODULES" for t in node.targets))
    assert calibration and not set(calibration) & set(DOC_MODULES)
    assert len(set(DOC_MODULES)) == len(DOC_MODULES)


def test_a_texts_folder_gives_the_same_haystacks(tmp_path, texts):
    written = write_texts(tmp_path / "texts")
    for name, h in HAYSTACKS.items():
        assert h.text(tmp_path / "texts") == texts[name] and written[name]["chars"] == len(texts[name])
    (tmp_path / "texts" / "sonnets_gut.txt").unlink()
    with pytest.raises(InputError, match="poems: .* lacks sonnets_gut.txt"):
        HAYSTACKS["poems"].text(tmp_path / "texts")
