"""The argument parser class every ``stoker`` command uses: help with defaults, and errors that help.

A typo in a flag gets the subcommand's own usage, the flag it most likely meant, and where its
``--help`` is; a subcommand reports the arguments it does not know itself rather than leaving them to
the top-level parser, whose usage says nothing about the subcommand's flags. The argument types every
family of commands shares are here too (``positive_int``, ``key_value``, ``output_file``, ``size_argument``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import Any, NoReturn, Optional, Sequence

_NAMES_A_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


def default_text(action: argparse.Action) -> Optional[str]:
    """An option's default as a user would type it, or None where there is none worth saying: a required option or
    switch, no default (``None``: unset; the help says what that means), an empty string. A list or tuple is its
    items joined by commas, never a Python repr."""
    default = action.default
    if action.required or action.nargs == 0 or default is None or default is argparse.SUPPRESS or default == "":
        return None
    if isinstance(default, (list, tuple)):
        return ", ".join(str(item) for item in default)
    return str(default)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and each option's default said once: ``(default: 64)`` is added unless the help
    already names the default in its own words (``(default: random, logged)``) or there is none (``default_text``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        text = default_text(action)
        takes_default = action.option_strings or action.nargs in ("?", "*")  # not a required positional
        if text is None or not takes_default or _NAMES_A_DEFAULT.search(help_text):
            return help_text
        return f"{help_text} (default: {text.replace('%', '%%')})"


class StokerArgumentParser(argparse.ArgumentParser):
    """Errors that name the command they belong to, suggest the flag a typo meant, and point at its --help.

    A subcommand (``stoker produce``) reports arguments it does not know itself, with its own usage, rather
    than leaving them to the top-level parser (whose usage says nothing about the subcommand's flags).
    """

    _given: Sequence[str] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)  # subcommands' parsers too: they are of this class
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None) -> Any:
        self._given = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and " " in self.prog:  # a subcommand: say it here, with this command's usage and flags
            self.error("unrecognized arguments: " + " ".join(extras))
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        known = [s for action in self._actions for s in action.option_strings]
        hints = []
        for token in self._given:
            flag = token.split("=", 1)[0]
            if flag.startswith("--") and flag not in known:
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
                if close:
                    hints.append(f"{flag}: did you mean {close[0]}?")
        self.print_usage(sys.stderr)
        advice = "".join(f"\n  {hint}" for hint in hints)
        self.exit(2, f"{self.prog}: error: {message}{advice}\nsee `{self.prog} --help` for every option\n")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def key_value(text: str) -> tuple[str, str]:
    """An argparse type: ``KEY=VALUE`` as ``(key, value)``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def output_file(text: str) -> str:
    """An argparse type: a file we will write at the end of a long run; refuse now a folder that is missing or
    read-only."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"folder {folder} is not writable")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    return text


def size_argument(text: str) -> int:
    """An argparse type: a size in bytes written as 64GB, 256MB, 1GiB."""
    from stoker.producer.dataset.build.sharded_writer import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
