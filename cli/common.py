"""What every sub-command shares: how a user error is reported (one line on stderr, exit code 2),
the API client wrapper of the client commands, and the small flag parsers."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cli.client import ApiClient, ApiError
from service.schemas import PRIORITIES

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


def ratios(text: str) -> list[float]:
    try:
        return [float(item) for item in csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"ratios must be numbers separated by commas; got {text!r}") from None


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


def add_priority_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--priority", choices=PRIORITIES, help="queue priority (default: the API's, normal)")


def add_calibration_and_eval_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calib", help="calibration dataset name, upload URI, or a local file to upload")
    parser.add_argument("--calib-samples", type=int, help="calibration sequences (server default: 64)")
    parser.add_argument("--seq-len", type=int, help="calibration sequence length (server default: 512)")
    parser.add_argument("--seed", type=int, help="calibration sampling seed (server default: 0)")
    parser.add_argument("--eval-datasets", help="comma-separated; empty for no evaluation (server default: wikitext2)")
    parser.add_argument("--eval-seq-len", type=int, help="evaluation window length (server default: 512)")
    parser.add_argument("--max-windows", type=int, help="evaluation windows at most (server default: all)")


def calibration_and_eval(args: argparse.Namespace, upload: Callable[[Path], str]) -> dict[str, Any]:
    """The `calibration` and `eval` sections the flags give (jobs and sweeps share them)."""
    request: dict[str, Any] = {}
    calibration = {
        "dataset": args.calib,
        "samples": args.calib_samples,
        "seq_len": args.seq_len,
        "seed": args.seed,
    }
    if args.calib and Path(args.calib).is_file():
        calibration["dataset"] = upload(Path(args.calib))
    evaluation = {
        "datasets": csv(args.eval_datasets) if args.eval_datasets is not None else None,
        "seq_len": args.eval_seq_len,
        "max_windows": args.max_windows,
    }
    for name, section in (("calibration", calibration), ("eval", evaluation)):
        given = {k: v for k, v in section.items() if v is not None}
        if given:
            request[name] = given
    return request
