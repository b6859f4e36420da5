"""The `oscar-zoo` typer app: registers every command and is the ONE error boundary (OscarZooError → message + code)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from .console import err_console
from .errors import InputError, OscarZooError, SettingError

app = typer.Typer(
    name="oscar-zoo",
    help="Calibrate, verify, publish and serve OSCAR attention-aware rotations for 2-bit KV caches.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"oscar-zoo {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Options of `oscar-zoo` itself, before the command."""


def _register() -> None:
    """Each command module exposes `register(app)`; importing them here keeps startup in one place."""
    from .commands import COMMAND_MODULES

    for module in COMMAND_MODULES:
        module.register(app)


_register()


def main() -> None:
    """Typer reports its own usage errors (exit 2); our typed errors become one line (+ hint) and their exit code; an
    OSError of a full disk, read-only file system or missing permission, or of a path that cannot be looked up (a
    symlink loop, a name too long, a file-size limit, …), is exit 2 naming the file (`artifacts.write_failure`); any
    other OSError no command mapped is exit 2 too, one line with its reason, never a traceback."""
    try:
        try:
            app()
        except OSError as exc:  # met where no command mapped it: still exit 2 for what the user fixes
            from .artifacts import write_failure

            path = Path(exc.filename or "a file")
            raise (write_failure(exc, path) or InputError(
                f"cannot use {path}: {exc.strerror or exc} (errno {exc.errno}); nothing was changed there",
                "check the path and the file system, then run the command again")) from None
    except OscarZooError as exc:
        if isinstance(exc, SettingError):  # a library setting no command spelled: its flag (group_size → --group-size)
            exc = exc.spelled(lambda name: "--" + name.replace("_", "-"))
        # messages quote user input (file names, manifest keys): escaped, so `[/]` in them is text, not rich markup
        err_console.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False, soft_wrap=True)
        if exc.advice:
            err_console.print(f"[dim]hint:[/] {escape(exc.advice)}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
