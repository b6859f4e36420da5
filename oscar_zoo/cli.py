"""The `oscar-zoo` typer app: lists every command (each module imported when its command runs) and is the ONE error
boundary (OscarZooError → message + code)."""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.markup import escape
from typer.core import TyperGroup

from .commands import COMMANDS
from .console import err_console
from .errors import InputError, OscarZooError, SettingError

_SETTINGS = dict(pretty_exceptions_enable=False, add_completion=False)


def _flags_show_no_type() -> None:
    """The rich help shows `<bool>` beside every flag with typer ≥ 0.2x (`--write <bool>`, `--help <bool>`), which
    reads as if the flag took a value: a flag's type column is left empty instead. Guarded: a typer without
    `TyperOption.display_type_rich` keeps its own rendering."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_flags_untyped", False):
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) and self.metavar is None else shown(self, ctx)

    display_type_rich._flags_untyped = True
    TyperOption.display_type_rich = display_type_rich


_flags_show_no_type()


class LazyCommands(TyperGroup):
    """The commands of `commands.COMMANDS`, each module imported when its command is resolved (to run, or to show its
    own help): the group lists them (its help, a mistyped name's suggestion) by name and summary alone, so `oscar-zoo
    --help` and the commands that hold no tensor (`list`) start without torch or transformers."""

    listing = False  # set while the group's own help is formatted

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.commands = {name: click.Command(name, short_help=summary) for name, (_, summary) in COMMANDS.items()}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return _command(name) if name in COMMANDS and not self.listing else super().get_command(ctx, name)

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self.listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self.listing = False


@functools.cache
def _command(name: str) -> click.Command:
    """The command `name`, its module imported and registered on an app of its own (typer makes that app the command
    itself)."""
    module = COMMANDS[name][0]
    try:
        loaded = importlib.import_module(f"{__package__}.commands.{module}")
    except OSError as exc:  # a broken install (a shared library that will not load): a bug report, not a path error
        raise ImportError(f"the {name} command could not be loaded: {exc}") from exc
    one = typer.Typer(**_SETTINGS)
    loaded.register(one)
    command = typer.main.get_command(one)
    command.name = name
    return command


app = typer.Typer(
    name="oscar-zoo",
    help="Calibrate, verify, publish and serve OSCAR attention-aware rotations for 2-bit KV caches.",
    cls=LazyCommands,
    no_args_is_help=True,
    **_SETTINGS,
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
