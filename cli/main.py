"""The `ftc` entry point: one parser, each sub-command registered explicitly from its module.

Every user error ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from cli import compress, evaluate, export, plans, service, sweeps, worker
from cli.common import UsageError, fail, show_defaults
from ftc import __version__
from ftc.options import InputError

COMMANDS = (compress, evaluate, export, service, sweeps, plans, worker)
"""Modules whose `register(subparsers)` adds their sub-commands, in the order `--help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftc", description="Compress LLM attention with FTC.")
    parser.add_argument("--version", action="version", version=f"ftc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    show_defaults(parser)  # one place, so a new command's flags show their defaults too
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, InputError, FileExistsError) as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print("ftc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
