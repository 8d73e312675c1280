"""What every sub-command shares: how a user error is reported (one line on stderr, exit code 2),
the API client wrapper of the client commands, and the small flag parsers. The request flags of
`ftc submit` and `ftc sweep create` are generated from the API's schemas in cli/fields.py."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cli.client import ApiClient, ApiError

EXIT_ERROR = 2
EXIT_JOB_UNSUCCESSFUL = 1


class UsageError(Exception):
    """A problem with the user's input: reported in one line, exit code 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, except a default of None: there the help text says
    what happens without the flag (the API's default, the first page, ...)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Give `parser` and every parser below it (`ftc jobs ls`, ...) the `HelpFormatter`."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)


def fail(message: str) -> int:
    """Report `message` the one way every command does and return the exit code for it."""
    print(f"ftc: error: {message.strip()}", file=sys.stderr)
    return EXIT_ERROR


def client_command(
    run: Callable[[ApiClient, argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """Give a command a client, and turn API and input errors into one stderr line and exit code 2."""

    @functools.wraps(run)
    def command(args: argparse.Namespace) -> int:
        client = ApiClient()
        try:
            return run(client, args)
        except (ApiError, ValueError, OSError) as error:
            return fail(str(error))
        finally:
            client.close()

    return command


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def writable_out(out: str) -> Path:
    """Fail before any work if `--out` cannot be created: probe the nearest existing ancestor."""
    import tempfile

    path = Path(out).resolve()
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder path")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    try:
        with tempfile.NamedTemporaryFile(dir=parent):
            pass
    except OSError:
        raise UsageError(f"--out {out}: {parent} is not writable; choose another folder") from None
    return path
