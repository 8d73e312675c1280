"""The sweep commands of the `ftc` CLI: `sweep create|ls|get|run|cancel|files|download|watch`, and
`scheduler`, the process that fires campaigns' cron slots and writes finished runs' reports.

The client commands share the conventions of cli/common.py (FTC_API_URL, FTC_API_KEY, one stderr
line and exit code 2 on failure).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cli.client import ApiClient
from cli.common import EXIT_JOB_UNSUCCESSFUL, UsageError, client_command, fail, print_json
from cli.download import Remote, human_bytes, save_file, save_folder
from cli.fields import add_flags, check_request, flags_of, pending_upload, request_from
from service.sweeps import SweepRequest

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})

SWEEP_FLAGS = flags_of(SweepRequest, skip=frozenset({("eval", "dense_reference")}))
"""`ftc sweep create`'s request flags: one per field of the API's sweep request, but
`eval.dense_reference`, which a sweep sets itself (once per model)."""


def build_sweep_request(args: argparse.Namespace, upload: Callable[[Path], str]) -> dict[str, Any]:
    """The JSON sweep request the flags describe; flags left out keep the server's defaults."""
    return request_from(args, SWEEP_FLAGS, upload)


def _run_line(run: dict[str, Any]) -> str:
    tally = ", ".join(f"{n} {status}" for status, n in run["counts"].items())
    report = "  report: " + run["report"]["folder"] if run.get("report") else ""
    return f"run {run['id']}  {run['status']:<9}  {tally}{report}"


@client_command
def _create(client: ApiClient, args: argparse.Namespace) -> int:
    check_request(SweepRequest, build_sweep_request(args, pending_upload), SWEEP_FLAGS)  # before any upload
    record = client.create_sweep(build_sweep_request(args, upload=lambda path: client.upload(path)["uri"]))
    print_json(record)
    print(f"next: ftc sweep watch {record['id']}, then: ftc sweep download {record['id']}", file=sys.stderr)
    return 0


@client_command
def _ls(client: ApiClient, args: argparse.Namespace) -> int:
    page = client.list_sweeps(limit=args.limit, cursor=args.cursor)
    if args.json:
        print_json(page)
        return 0
    for sweep in page["sweeps"]:
        schedule = sweep["schedule"] or "once"
        latest = _run_line(sweep["latest_run"]) if sweep["latest_run"] else "no run yet"
        print(f"{sweep['id']}  {sweep['status']:<9}  {sweep['name'] or '-'}  [{schedule}]  {latest}")
    return 0


@client_command
def _get(client: ApiClient, args: argparse.Namespace) -> int:
    print_json(client.get_sweep(args.sweep_id, run=args.run))
    return 0


@client_command
def _run_now(client: ApiClient, args: argparse.Namespace) -> int:
    print_json(client.run_sweep(args.sweep_id))
    return 0


@client_command
def _cancel(client: ApiClient, args: argparse.Namespace) -> int:
    print_json(client.cancel_sweep(args.sweep_id))
    return 0


@client_command
def _files(client: ApiClient, args: argparse.Namespace) -> int:
    for item in client.sweep_files(args.sweep_id)["files"]:
        print(f"{item['size']:>10}  {item['name']}")
    return 0


def _report_files(client: ApiClient, sweep_id: str, run_id: str | None) -> list[Remote]:
    """The report of the latest finished run (the sweep folder's top files) or of `run_id`
    (runs/RUN/), named as within that folder."""
    folder = "" if run_id is None else f"runs/{run_id}/"
    listed = client.sweep_files(sweep_id)["files"]
    chosen = [f for f in listed if ("/" not in f["name"] if run_id is None else f["name"].startswith(folder))]
    return [Remote(f["name"].removeprefix(folder), f["size"], f["url"]) for f in chosen]


def _cell_models(client: ApiClient, sweep_id: str, run_id: str | None) -> list[Remote]:
    """Every succeeded cell's model folder, under models/{job_id}/."""
    run = client.get_sweep(sweep_id, run=run_id)["run"] or {"cells": []}
    files = []
    for cell in run["cells"]:
        if cell["status"] != "succeeded":
            continue
        listing = client.artifacts(cell["job_id"])
        files += [Remote(f"models/{cell['job_id']}/{a['name']}", a["size"], a["url"])
                  for a in listing["artifacts"] if a["kind"] in ("model", "record")]
    return files


@client_command
def _download(client: ApiClient, args: argparse.Namespace) -> int:
    """One file (NAME) to -o, or the run's whole report (and on request its models) into --to."""
    if args.name is not None:
        if args.to or args.include or args.run:
            raise UsageError("NAME downloads one file (to -o); --to, --run and --include are for the whole report")
        listed = {f["name"]: f for f in client.sweep_files(args.sweep_id)["files"]}
        if args.name not in listed:
            raise UsageError(f"sweep {args.sweep_id} has no file {args.name!r}; see: ftc sweep files {args.sweep_id}")
        item = listed[args.name]
        out = Path(args.out or args.name.rsplit("/", 1)[-1])
        size = save_file(client, Remote(args.name, item["size"], item["url"]), out, quiet=args.quiet)
        print(f"{out} ({size} bytes)")
        return 0
    if args.out:
        raise UsageError("-o names the file NAME is saved as; for the whole report give --to DIR")
    files = _report_files(client, args.sweep_id, args.run)
    if not files:
        which = f"run {args.run}" if args.run else "any run"
        raise UsageError(f"sweep {args.sweep_id} has no report for {which} yet; the scheduler writes it once every "
                         f"cell has ended (ftc sweep watch {args.sweep_id})")
    if args.include:
        files += _cell_models(client, args.sweep_id, args.run)
    to = Path(args.to or args.sweep_id)
    size = save_folder(client, files, to, overwrite=args.overwrite, quiet=args.quiet)
    print(f"{to} ({len(files)} files, {human_bytes(size)})")
    return 0


@client_command
def _watch(client: ApiClient, args: argparse.Namespace) -> int:
    """Print the run's state when it changes; exit 0 once it succeeded and its report is written."""
    said = None
    while True:
        run = client.get_sweep(args.sweep_id, run=args.run)["run"]
        if run is not None:
            line = _run_line(run)
            if line != said:
                print(line, flush=True)
                said = line
            if run["status"] in TERMINAL and run.get("report"):
                return 0 if run["status"] == "succeeded" else EXIT_JOB_UNSUCCESSFUL
        time.sleep(args.interval)


def _scheduler(args: argparse.Namespace) -> int:
    from service.logs import configure_logging
    from service.scheduler import run_scheduler
    from service.settings import Settings
    from service.store import store_for
    from service.teams import policies_for

    try:
        settings = Settings()
        store_for(settings)  # a bad store URL or FTC_TEAMS is reported here, in one line
        policies_for(settings)
    except ValueError as error:
        return fail(str(error))
    configure_logging(settings.log_format)
    run_scheduler(settings, interval_seconds=args.interval, lock_seconds=args.lock_seconds, name=args.name)
    return 0


SWEEP_ID_HELP = "the sweep's id, as `ftc sweep create` or `ftc sweep ls` print it"


def _add_create_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SWEEP_FLAGS)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `sweep` and `scheduler` to the `ftc` command line."""
    sweep = subparsers.add_parser("sweep", help="create, follow and cancel sweep campaigns")
    actions = sweep.add_subparsers(
        dest="sweep_command", required=True, metavar="{create,ls,get,run,cancel,files,download,watch}"
    )
    create = actions.add_parser("create", help="create a campaign (once, or on a cron schedule)")
    _add_create_flags(create)
    create.set_defaults(func=_create)

    ls = actions.add_parser("ls", help="list your team's sweeps, newest first")
    ls.add_argument("--limit", type=int, default=20, help="sweeps per page")
    ls.add_argument("--cursor", help="next_cursor of the previous page (default: the first page)")
    ls.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    ls.set_defaults(func=_ls)

    get = actions.add_parser("get", help="print a sweep with every cell of its latest run (or --run)")
    get.add_argument("sweep_id", help=SWEEP_ID_HELP)
    get.add_argument("--run", help="a run id")
    get.set_defaults(func=_get)

    for name, func, text in (
        ("run", _run_now, "start one more run of the campaign now"),
        ("cancel", _cancel, "cancel the campaign and its unfinished jobs"),
        ("files", _files, "list the sweep's result tables and plots"),
    ):
        action = actions.add_parser(name, help=text)
        action.add_argument("sweep_id", help=SWEEP_ID_HELP)
        action.set_defaults(func=func)

    download = actions.add_parser(
        "download", help="save the latest run's report (tables, plots) into a folder, or one file NAME"
    )
    download.add_argument("sweep_id", help=SWEEP_ID_HELP)
    download.add_argument("name", nargs="?",
                          help="one file from `ftc sweep files`, e.g. results.csv or runs/RUN/plot.png "
                               "(default: the whole report)")
    download.add_argument("-o", "--out", help="where to write NAME (default: its file name, here)")
    download.add_argument("--to", help="folder for the whole report (default: the sweep's id, here)")
    download.add_argument("--run", help="a run id (default: the latest run with a report)")
    download.add_argument("--include", choices=("models",),
                          help="models: also every succeeded cell's model folder, under models/JOB_ID/ "
                               "(default: the report only)")
    download.add_argument("--overwrite", action="store_true", help="replace a non-empty --to")
    download.add_argument("--quiet", action="store_true", help="no progress bar")
    download.set_defaults(func=_download)

    watch = actions.add_parser("watch", help="follow a run until it ends and its report is written")
    watch.add_argument("sweep_id", help=SWEEP_ID_HELP)
    watch.add_argument("--run", help="a run id (default: the latest)")
    watch.add_argument("--interval", type=float, default=5.0, help="seconds between checks")
    watch.set_defaults(func=_watch)

    scheduler = subparsers.add_parser(
        "scheduler", help="fire sweep schedules and write sweep reports (needs Redis; see docs/sweeps.md)"
    )
    scheduler.add_argument("--interval", type=float, default=5.0, help="seconds between passes")
    scheduler.add_argument("--lock-seconds", type=float, default=30.0, help="leader lock lifetime (failover time)")
    scheduler.add_argument("--name", help="this scheduler's name in logs and in the lock (default host-pid)")
    scheduler.set_defaults(func=_scheduler)
