"""Rich consoles and the progress factory; only `cli.py` and `commands/` use rich."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# When output goes to a file or a pipe, rich would wrap tables at 80 columns; 120 keeps the wide ones readable.
console = Console(width=None if sys.stdout.isatty() else 120)  # results: tables, JSON
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)  # progress, warnings, errors

ProgressFn = Callable[..., None]  # (phase description, done, total, rate="")


def shown(text: object) -> str:
    """Text that came from a file or a hub, for the terminal: control characters escaped (no terminal escape
    sequences get through) and rich markup printed as written."""
    from rich.markup import escape

    return escape("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text)))


@contextmanager
def progress_reporter(enabled: bool = True) -> Iterator[ProgressFn]:
    """A progress callback for library code: `report(description, done, total)`; one bar per description."""
    if not enabled:
        yield lambda description, done, total, rate="": None
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err_console, transient=False) as progress:
        tasks: dict[str, int] = {}

        def report(description: str, done: int, total: int, rate: str = "") -> None:
            if description not in tasks:
                tasks[description] = progress.add_task(description, total=total, rate=rate)
            progress.update(tasks[description], completed=done, total=total, rate=rate)

        yield report
