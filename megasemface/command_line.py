"""The strict argument parser every command line of megasemface uses.

Below every other part of the package, so that the lowest ones (the process launcher in
``distributed/``) use it as the commands do; ``cli/parsing.py`` adds what the tools share.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["CommandParser", "unknown_arguments_message"]

_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class _ShowsDefaults(argparse.HelpFormatter):
    """Adds ``(default: X)`` to an option's help that does not speak of its default already,
    where the default is a value (not None, a flag's False or an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        shown = not (
            default is None
            or default is argparse.SUPPRESS
            or isinstance(default, (bool, list, tuple))
            or action.required
            or not action.option_strings
        )
        if shown and "default" not in text.lower():
            text += " (default: %(default)s)"
        return text


_FORMATTERS: dict[type, type] = {}


def _showing_defaults(formatter: type) -> type:
    """``formatter`` (an argparse formatter class) that shows the options' defaults."""
    if issubclass(formatter, _ShowsDefaults):
        return formatter
    if formatter not in _FORMATTERS:
        _FORMATTERS[formatter] = type(formatter.__name__, (_ShowsDefaults, formatter), {})
    return _FORMATTERS[formatter]


class CommandParser(argparse.ArgumentParser):
    """The parser of every command: an argument it does not know stops the command before
    anything starts, with one line that names it and the closest valid option
    (``train: error: unknown option --stpes (did you mean --steps?)``) and exit status 2.

    A mistyped option would otherwise run with the option's default, after a cluster is
    allocated. Abbreviations are errors too (``allow_abbrev=False``): ``--max-token`` is a
    misspelling of ``--max-tokens`` as often as a shorthand for it. ``parse_known_args`` is
    as strict as ``parse_args``, because argparse runs a sub-command's parser through it.
    Every usage error is one line, without the usage (``--help`` prints it).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        # --help shows every option's default: a value a user must know before a long run.
        kwargs["formatter_class"] = _showing_defaults(
            kwargs.get("formatter_class", argparse.HelpFormatter)
        )
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        args = list(sys.argv[1:] if args is None else args)
        helps = [a for a in self._actions if isinstance(a, argparse._HelpAction)]
        if not any(flag in args for action in helps for flag in action.option_strings):
            self._check_unknown(args, namespace)  # (--help prints the required as required)
        return super().parse_known_args(args, namespace)

    def _check_unknown(self, args: list[str], namespace: argparse.Namespace | None) -> None:
        """Stops at an argument ``args`` holds that this parser does not know. argparse
        reports missing required options first, and a misspelt required option is both: a
        pass without them finds the misspelling."""
        required = [a for a in self._actions if a.required]
        required += [g for g in self._mutually_exclusive_groups if g.required]
        for item in required:
            item.required = False
        try:
            _, extras = super().parse_known_args(args, copy.copy(namespace))
        finally:
            for item in required:
                item.required = True
        if extras:
            self.error(unknown_arguments_message(self, extras))

    def error(self, message: str) -> NoReturn:
        # The command's name as its other errors print it: train.py -> train.
        name = " ".join(word.removesuffix(".py") for word in self.prog.split())
        self.exit(2, f"{name}: error: {message}\n")


def unknown_arguments_message(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """What is wrong with ``extras``, the arguments ``parser`` left over: each unknown option
    with the closest of ``parser``'s own, or else the first unexpected positional argument
    (an unknown option's value is left over with it and not named)."""
    known = [
        flag
        for flag, action in parser._option_string_actions.items()  # argparse has no public list
        if action.help != argparse.SUPPRESS
    ]
    prefixes = tuple(parser.prefix_chars)
    parts: list[str] = []
    for arg in extras:
        if not arg.startswith(prefixes) or arg in ("-", "--") or _NUMBER.match(arg):
            continue  # a positional argument, or an unknown option's value
        flag = arg.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1)
        hint = f"did you mean {close[0]}?" if close else "--help lists the options"
        parts.append(f"unknown option {flag} ({hint})")
    if not parts:
        return f"unexpected argument {extras[0]!r} (--help lists the arguments)"
    return "; ".join(parts)
