"""The argument parser class every ``stoker`` command uses: help with defaults, and errors that help.

A typo in a flag gets the subcommand's own usage, the flag it most likely meant, and where its
``--help`` is; a subcommand reports the arguments it does not know itself rather than leaving them to
the top-level parser, whose usage says nothing about the subcommand's flags.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any, NoReturn, Optional, Sequence


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


class StokerArgumentParser(argparse.ArgumentParser):
    """Errors that name the command they belong to, suggest the flag a typo meant, and point at its --help.

    A subcommand (``stoker produce``) reports arguments it does not know itself, with its own usage, rather
    than leaving them to the top-level parser (whose usage says nothing about the subcommand's flags).
    """

    _given: Sequence[str] = ()

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
