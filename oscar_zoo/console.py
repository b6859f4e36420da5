"""Rich consoles and the progress factory; only `cli.py` and `commands/` use rich."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.status import Status
from rich.text import Text

# What a terminal may act on instead of showing: C0 controls but newline and tab (ESC starts escape sequences, CR and
# BS overwrite what was shown), DEL, C1 controls (U+009B is a one-character CSI), line and paragraph separators, and
# the bidi overrides and isolates (they reorder what a reader sees).
_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_UNSAFE_IN_JSON = re.compile(r"\\u(00[0189][0-9a-f]|007f|202[89a-e]|206[6-9])", re.IGNORECASE)  # their JSON escapes


MAX_SHOWN = 4096  # characters of one string from a file or a hub that `shown` prints (a path is at most this long)
MAX_RENDERED = 16384  # characters of any one string a console renders: rich folds a long unbroken word in time
# quadratic in its length (40,000 characters take 10 s, a megabyte hangs)


def _visible(text: str, limit: int = MAX_RENDERED) -> str:
    if len(text) > limit:
        text = f"{text[:limit]}… ({len(text):,} characters in all)"
    return _UNSAFE.sub(lambda m: repr(m.group())[1:-1], text)


class _SafeStatus(Status):
    def update(self, status=None, **kwargs) -> None:
        super().update(_visible(status) if isinstance(status, str) else status, **kwargs)


class SafeConsole(Console):
    """A rich Console that never writes a control sequence it did not make: every string it renders (messages, table
    cells and titles, status lines) has `_UNSAFE` characters shown as escapes (`\\x1b`), and JSON that would carry one
    raw is written ASCII-escaped. The backstop under `shown`, which also escapes rich markup and is what each place
    that shows text from a file or a hub uses."""

    def render_str(self, text: str, **kwargs) -> Text:
        return super().render_str(_visible(text), **kwargs)

    def print_json(self, json: str | None = None, *, data=None, ensure_ascii: bool = False, **kwargs) -> None:
        from json import dumps

        raw = json if json is not None else dumps(data, ensure_ascii=False, default=kwargs.get("default"))
        if _UNSAFE.search(raw) or _UNSAFE_IN_JSON.search(raw):  # rich re-dumps the JSON: an escaped C1 or bidi
            ensure_ascii = True  # character would come back raw
        super().print_json(json, data=data, ensure_ascii=ensure_ascii, **kwargs)

    def status(self, status, **kwargs) -> Status:
        return _SafeStatus(_visible(status) if isinstance(status, str) else status, console=self, **kwargs)


# When output goes to a file or a pipe, rich would wrap tables at 80 columns; 120 keeps the wide ones readable.
console = SafeConsole(width=None if sys.stdout.isatty() else 120)  # results: tables, JSON
err_console = SafeConsole(stderr=True, width=None if sys.stderr.isatty() else 120)  # progress, warnings, errors

ProgressFn = Callable[..., None]  # (phase description, done, total, rate="", run_left=None)


def shown(text: object, limit: int = MAX_SHOWN) -> str:
    """Text that came from a file or a hub, for the terminal: on one line, every character that is not printable
    (controls, newlines, separators, bidi overrides) shown as its escape (no terminal escape sequence gets through),
    rich markup printed as written, and at most `limit` characters of it (then `… (N characters in all)`)."""
    from rich.markup import escape

    text = str(text)
    more = f"… ({len(text):,} characters in all)" if len(text) > limit else ""
    return escape("".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit]) + more)


class TimeLeftColumn(TimeRemainingColumn):
    """Rich's time remaining for the bar, or, where the caller reports `run_left` (seconds, None while unknown), the
    time left for the whole run the bar is one part of: calibration's capture passes each show all passes' time."""

    def render(self, task: Task) -> Text:
        if "run_left" not in task.fields:
            return super().render(task)
        left = task.fields["run_left"]
        if left is None:
            return Text("-:--:-- left in all passes", style="progress.remaining")
        minutes, seconds = divmod(int(round(left)), 60)
        hours, minutes = divmod(minutes, 60)
        return Text(f"{hours}:{minutes:02d}:{seconds:02d} left in all passes", style="progress.remaining")


@contextmanager
def progress_reporter(enabled: bool = True) -> Iterator[ProgressFn]:
    """A progress callback for library code: `report(description, done, total, rate="", run_left=None)`; one bar per
    description. `run_left`, where given, replaces the bar's own time remaining with the whole run's."""
    if not enabled:
        yield lambda description, done, total, rate="", run_left=None: None
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeLeftColumn(),
    )
    with Progress(*columns, console=err_console, transient=False) as progress:
        tasks: dict[str, int] = {}
        _missing = object()

        def report(description: str, done: int, total: int, rate: str = "", run_left=_missing) -> None:
            fields = {"rate": rate} if run_left is _missing else {"rate": rate, "run_left": run_left}
            if description not in tasks:
                tasks[description] = progress.add_task(description, total=total, **fields)
            progress.update(tasks[description], completed=done, total=total, **fields)

        yield report
