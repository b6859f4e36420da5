"""Rich consoles and the progress factory; only `cli.py` and `commands/` use rich."""

from __future__ import annotations

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
from rich.text import Text

# When output goes to a file or a pipe, rich would wrap tables at 80 columns; 120 keeps the wide ones readable.
console = Console(width=None if sys.stdout.isatty() else 120)  # results: tables, JSON
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)  # progress, warnings, errors

ProgressFn = Callable[..., None]  # (phase description, done, total, rate="", run_left=None)


def shown(text: object) -> str:
    """Text that came from a file or a hub, for the terminal: control characters escaped (no terminal escape
    sequences get through) and rich markup printed as written."""
    from rich.markup import escape

    return escape("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text)))


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
