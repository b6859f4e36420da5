"""Typed errors, each carrying its exit code (README, "Commands") and the advice a user needs; `cli.main` maps them.
The base and IntegrityError are the format's (`format/integrity.py`), named here with the rest."""

from __future__ import annotations

from collections.abc import Callable

from .format.integrity import IntegrityError, OscarZooError

__all__ = ["HubError", "InputError", "IntegrityError", "OscarZooError", "SettingError", "VerificationFailed", "literal"]


class InputError(OscarZooError):
    """Bad user input: a missing model path or dataset file, an unsupported architecture, a bad option value."""

    exit_code = 2


class SettingError(InputError):
    """A setting out of its bounds, or given where it would do nothing. `template` and `advice` write every setting
    they name as `{name}`: the message spells it as the library does (`group_size 5: expected …`), and `spelled(flag)`
    gives the same error as a command spells its options (`--group-size 5: expected …`). `setting`: the one at fault."""

    def __init__(self, setting: str, template: str, advice: str | None = None):
        self.setting, self.template, self.advice_template = setting, template, advice
        super().__init__(*self._render(lambda name: name))

    @classmethod
    def bound(cls, setting: str, value: object, expected: str, advice: str | None = None) -> SettingError:
        """`{setting} VALUE: expected EXPECTED` (EXPECTED and `advice` may name settings as `{name}`)."""
        return cls(setting, f"{{{setting}}} {literal(value)}: expected {expected}", advice)

    def _render(self, spell: Callable[[str], str]) -> tuple[str, str | None]:
        names = _Spelling(spell)
        advice = None if self.advice_template is None else self.advice_template.format_map(names)
        return self.template.format_map(names), advice

    def spelled(self, spell: Callable[[str], str]) -> InputError:
        """The same error with every setting's name passed through `spell` (e.g. group_size → --group-size)."""
        return InputError(*self._render(spell))


class _Spelling(dict):
    def __init__(self, spell: Callable[[str], str]):
        super().__init__()
        self.spell = spell

    def __missing__(self, name: str) -> str:
        return self.spell(name)


def literal(value: object) -> str:
    """`value` as text that a SettingError template keeps as it is (braces doubled)."""
    return str(value).replace("{", "{{").replace("}", "}}")


class VerificationFailed(OscarZooError):
    """An artifact was verified and missed a quality threshold."""

    exit_code = 3



class HubError(OscarZooError):
    """A hub or network failure: not found, gated, offline, wrong revision, missing or rejected credentials."""

    exit_code = 5
