"""``stoker keys generate``: CurveZMQ key pairs, and the rule every command with key flags keeps (``curve_pair``).

Producers take ``--curve-secret-key`` with ``--curve-authorized-keys``, trainers ``--curve-secret-key`` with
``--curve-server-key``: one without the other is refused (exit 2), never half-encrypted.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from stoker.cli.argument_parser import HelpFormatter
from stoker.cli.exit_codes import EXIT_OK

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def add_keys_parser(sub: "Subcommands", common: argparse.ArgumentParser) -> None:
    """``stoker keys generate``."""
    k = sub.add_parser("keys", parents=[common], formatter_class=HelpFormatter, help="make CurveZMQ key pairs",
                       description="CurveZMQ keys encrypt batches and let producers accept only known trainers. "
                       "Producers: --curve-secret-key server.key_secret --curve-authorized-keys DIR_OF_CLIENT_KEYS. "
                       "Trainers: --curve-secret-key client.key_secret --curve-server-key server.key.")
    ksub = k.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    kg = ksub.add_parser("generate", parents=[common], formatter_class=HelpFormatter, help="write NAME.key and NAME.key_secret",
                         description="Write a key pair: DIR/NAME.key (public, share it) and DIR/NAME.key_secret "
                         "(secret, mode 600).")
    kg.add_argument("dir", help="folder to write the key files into")
    kg.add_argument("--name", default="stoker", help="file name stem")
    kg.set_defaults(func=cmd_keys_generate)


def cmd_keys_generate(args: argparse.Namespace) -> int:
    from stoker.protocol.curve import generate_keypair

    public, secret = generate_keypair(args.dir, args.name)
    print(f"public key: {public}  (share it)\nsecret key: {secret}  (keep it on this host, mode 600)")
    return EXIT_OK


def curve_pair(args: argparse.Namespace, first: str, second: str) -> bool:
    """Whether the key flags ``first`` and ``second`` (dests) are given; ValueError (exit 2) if only one is."""
    a, b = getattr(args, first), getattr(args, second)
    if (a is None) != (b is None):
        flag = lambda name: "--" + name.replace("_", "-")
        raise ValueError(f"{flag(first)} and {flag(second)} go together: give both to enable CurveZMQ, or neither")
    return a is not None
