"""The docs stay honest: every `oscar-zoo …` command line in README.md and docs/*.md parses against the CLI as it is
(click's own parser, no work run, so an unknown option or a bad choice fails), every relative link in README.md,
CHANGELOG.md, docs/*.md and benchmarks/*.md resolves (the file, and the #anchor as GitHub slugs headings), and every
number in README's Results table appears in the page its row links to."""

from __future__ import annotations

import enum
import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.main import get_command

from oscar_zoo.cli import app

try:  # typer ≥ 0.2x parses with its own copy of click, whose errors derive from TyperException
    from typer import TyperException as UsageError
except ImportError:  # older typer: click's own
    from click import ClickException as UsageError

ROOT = Path(__file__).resolve().parent.parent
COMMAND_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK_DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "benchmarks").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"(?<!!)\[([^\]\n]*)\]\(([^)\s]+)\)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---- command lines --------------------------------------------------------------------------------------------------

def command_lines(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, command, complete) for each `oscar-zoo …` invocation. In code blocks: the lines after a `$ `
    prompt where the block has prompts (the rest is output), else every line; `\\` continuations and a trailing
    `# comment` handled; such a line is complete unless it elides with `...`. In inline code spans of the prose: a
    mention, which may leave out what the command requires (`oscar-zoo verify`, `export --format sglang`)."""
    found: list[tuple[int, str, bool]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    in_code, prompted, pending, start = False, False, "", 0
    for number, line in enumerate(lines, 1):
        if FENCE.match(line.strip()):
            in_code, pending = not in_code, ""
            if in_code:  # does this block mark its commands with a prompt?
                block = lines[number:]
                end = next((i for i, text in enumerate(block) if FENCE.match(text.strip())), len(block))
                prompted = any(text.startswith("$ ") for text in block[:end])
            continue
        if in_code:
            if pending:
                text = pending + line.strip()
            elif prompted and not line.startswith("$ "):
                continue
            else:
                text = line.strip().removeprefix("$ ")
            if pending or _invocation(text) is not None:
                start = start if pending else number
                if text.endswith("\\"):
                    pending = text[:-1] + " "
                    continue
                pending = ""
                found.append((start, text, not re.search(r"(^|\s)(\.\.\.|…)(\s|$)", text)))
            continue
        for span in INLINE_CODE.findall(line):
            if _invocation(span) is not None:
                found.append((number, span, False))
    return found


def _invocation(text: str) -> list[str] | None:
    """The arguments after `oscar-zoo` (or `python -m oscar_zoo`), or None when `text` is not such a command."""
    text = re.split(r"\s+#\s", text, maxsplit=1)[0].strip()  # a shell comment after the command
    try:
        words = shlex.split(text)
    except ValueError:
        return None
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if words[:1] == ["oscar-zoo"]:
        return words[1:]
    if "oscar_zoo" in words and words.index("oscar_zoo") > 0 and words[words.index("oscar_zoo") - 1] == "-m":
        return words[words.index("oscar_zoo") + 1:]
    return None


def _normalised(args: list[str]) -> list[str]:
    """Doc conventions read as a user fills them in: `…`/`...` (more options) dropped, `[MODEL]` (an optional
    placeholder) dropped, `a|b` (alternatives) the first one."""
    out = []
    for arg in args:
        if arg in ("...", "…") or re.fullmatch(r"\[[A-Z_ .]+\]", arg):
            continue
        if "|" in arg and not arg.startswith("|"):
            arg = arg.split("|")[0]
        out.append(arg)
    return out


def parse(args: list[str], complete: bool = True) -> None:
    """Parse `oscar-zoo ARGS` as the CLI would, without running the command: the parser raises a usage error on an
    unknown command or option, a bad choice or a missing argument. Unless `complete`, what the command requires and
    the line leaves out is filled in (an argument `X`, a required option's first choice) and the rest still checked."""
    group = get_command(app)
    if not args or args[0].startswith("-"):
        with pytest.raises(typer.Exit):  # --help / --version: printed, then exit
            group.make_context("oscar-zoo", list(args))
        return
    parent = typer.Context(group, info_name="oscar-zoo")
    command = group.get_command(parent, args[0])
    assert command is not None, f"no such command {args[0]!r}"
    rest = list(args[1:])
    for _ in range(len(command.params) + 1):
        try:
            command.make_context(args[0], list(rest), parent=parent)
            return
        except typer.Exit:  # `--help`
            return
        except UsageError as exc:
            param = getattr(exc, "param", None)
            if complete or param is None or type(exc).__name__ != "MissingParameter":
                raise
            if param.param_type_name == "argument":
                rest.append("X")
            else:
                rest += [param.opts[0], _a_value(param)]


def _a_value(option) -> str:
    """A valid value for a required option a prose mention leaves out: its first choice, else `X`."""
    choices = getattr(getattr(option, "type", None), "choices", None)  # click's Choice
    annotation = getattr(getattr(option, "type_descriptor", None), "annotation", None)  # typer's own parameters
    if not choices and isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        choices = [member.value for member in annotation]
    return str(next(iter(choices))) if choices else "X"


COMMANDS = [pytest.param(args, complete, id=f"{_rel(path)}:{number}") for path in COMMAND_DOCS
            for number, text, complete in command_lines(path) if (args := _invocation(text))]  # not the bare name


def test_the_docs_have_command_lines_to_check():
    assert len(COMMANDS) >= 20
    names = {param.values[0][0] for param in COMMANDS if param.values[0]}
    assert {"calibrate", "verify", "push", "pull", "list", "inspect", "export", "import-oscar"} <= names


@pytest.mark.parametrize(("args", "complete"), COMMANDS)
def test_command_line_parses(args, complete):
    try:
        parse(_normalised(args), complete)
    except UsageError as exc:
        pytest.fail(f"oscar-zoo {shlex.join(args)}: {exc.format_message()}")


def test_an_unknown_option_fails_to_parse():
    with pytest.raises(UsageError, match="--no-such-option"):
        parse(["verify", "artifacts/demo", "--no-such-option"])
    with pytest.raises(UsageError):
        parse(["export", "artifacts/demo", "--format", "onnx", "--out", "x"])
    parse(["export", "artifacts/demo", "--format", "sglang", "--out", "x"])
    with pytest.raises(UsageError, match="Missing"):
        parse(["export", "--format", "sglang"])
    parse(["export", "--format", "sglang"], complete=False)  # a mention in the prose
    with pytest.raises(UsageError):
        parse(["export", "--format", "onnx"], complete=False)


# ---- links ----------------------------------------------------------------------------------------------------------

def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code (links there are not links)."""
    kept, in_code = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            in_code = not in_code
            continue
        if not in_code:
            kept.append(INLINE_CODE.sub("", line))
    return "\n".join(kept)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markdown links and code marks reduced to their text, lower case, every character
    but letters, digits, `_`, `-` and spaces dropped, spaces to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            in_code = not in_code
            continue
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_code or not match:
            continue
        slug = github_slug(match.group(1))
        result.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return result


def relative_links(path: Path) -> list[tuple[str, str]]:
    return [(text, target) for text, target in LINK.findall(prose(path.read_text(encoding="utf-8")))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: …


LINKS = [pytest.param(path, target, id=f"{_rel(path)}->{target}") for path in LINK_DOCS if path.is_file()
         for _, target in relative_links(path)]


def test_the_docs_have_links_to_check():
    assert len(LINKS) >= 10


@pytest.mark.parametrize(("page", "target"), LINKS)
def test_relative_link_resolves(page, target):
    file, _, anchor = target.partition("#")
    resolved = (page.parent / file).resolve() if file else page
    assert resolved.exists(), f"{_rel(page)} links to {target}: no {file}"
    if anchor and resolved.suffix == ".md":
        assert anchor in anchors(resolved), f"{_rel(page)} links to {target}: no heading #{anchor} in {file or 'it'}"


def test_github_slugs():
    assert github_slug("Targets: met / missed") == "targets-met--missed"
    assert github_slug("The runtime: `OscarCache` with `generate()`") == "the-runtime-oscarcache-with-generate"
    assert github_slug("Memory and KV budget") == "memory-and-kv-budget"


# ---- the README's Results table -------------------------------------------------------------------------------------

NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")


def results_rows() -> list[tuple[str, str, str]]:
    """(row text without its links, link target, the row) for each row of README's Results table."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not re.match(r"\|[-| ]+\|$", line)]
    out = []
    for row in rows[1:]:  # the header first
        links = LINK.findall(row)
        assert len(links) == 1, f"each Results row links to one page: {row}"
        out.append((LINK.sub("", row), links[0][1], row))
    return out


def test_results_table_is_short():
    rows = results_rows()
    assert 1 <= len(rows) <= 12
    for _, _, row in rows:
        for cell in row.strip("|").split("|"):
            assert len(cell.strip()) <= 200, cell


@pytest.mark.parametrize(("text", "target", "row"), [pytest.param(*r, id=r[1]) for r in results_rows()])
def test_results_numbers_appear_in_the_linked_page(text, target, row):
    page = (ROOT / target.partition("#")[0])
    assert page.is_file(), f"{target}: no such page"
    body = page.read_text(encoding="utf-8")
    missing = []
    for number in NUMBER.findall(text.replace("\u202f", "").replace("\u2009", "")):
        plain = number.rstrip(",").replace(",", "")
        digits = plain.split(".")[0]
        grouped = f"{int(digits):,}" + plain[len(digits):] if len(digits) > 3 else plain
        if not any(re.search(rf"(?<![\d.,]){re.escape(form)}(?![\d])", body) for form in {plain, grouped}):
            missing.append(number)
    assert not missing, f"{target} does not state {', '.join(missing)} (README Results row: {row})"
