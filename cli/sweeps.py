"""The sweep commands of the `ftc` CLI: `sweep create|ls|get|run|cancel|files|download|watch`, and
`scheduler`, the process that fires campaigns' cron slots and writes finished runs' reports.

The client commands share the conventions of cli/common.py (FTC_API_URL, FTC_API_KEY, one stderr
line and exit code 2 on failure).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from cli.client import ApiClient
from cli.common import (
    EXIT_JOB_UNSUCCESSFUL,
    add_calibration_and_eval_flags,
    add_priority_flag,
    calibration_and_eval,
    client_command,
    csv,
    fail,
    print_json,
    ratios,
)

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


def _ablation_sets(text: str) -> list[list[str]]:
    """`none;no_whiten;no_whiten,fixed_ranks` -> [[], ["no_whiten"], ["no_whiten", "fixed_ranks"]]."""
    return [[] if part.strip() in ("", "none") else csv(part) for part in text.split(";")]


def build_sweep_request(args: argparse.Namespace, upload) -> dict[str, Any]:
    """The JSON sweep request the flags describe; flags left out keep the server's defaults."""
    request: dict[str, Any] = {"models": csv(args.models), "ratios": args.ratios}
    if args.methods:
        request["methods"] = csv(args.methods)
    if args.ablations is not None:
        request["ablations"] = _ablation_sets(args.ablations)
    for field in ("name", "schedule", "timezone", "priority", "change_threshold"):
        if getattr(args, field) is not None:
            request[field] = getattr(args, field)
    return request | calibration_and_eval(args, upload)


def _run_line(run: dict[str, Any]) -> str:
    tally = ", ".join(f"{n} {status}" for status, n in run["counts"].items())
    report = "  report: " + run["report"]["folder"] if run.get("report") else ""
    return f"run {run['id']}  {run['status']:<9}  {tally}{report}"


@client_command
def _create(client: ApiClient, args: argparse.Namespace) -> int:
    print_json(client.create_sweep(build_sweep_request(args, upload=lambda path: client.upload(path)["uri"])))
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


@client_command
def _download(client: ApiClient, args: argparse.Namespace) -> int:
    out = Path(args.out or args.name.rsplit("/", 1)[-1])
    size = client.download_sweep_file(args.sweep_id, args.name, out)
    print(f"{out} ({size} bytes)")
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

    try:
        settings = Settings()
        store_for(settings)  # a bad store URL is reported here, in one line
    except ValueError as error:
        return fail(str(error))
    configure_logging(settings.log_format)
    run_scheduler(settings, interval_seconds=args.interval, lock_seconds=args.lock_seconds, name=args.name)
    return 0


SWEEP_ID_HELP = "the sweep's id, as `ftc sweep create` or `ftc sweep ls` print it"


def _add_create_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", required=True, help="comma-separated model aliases or hub ids")
    parser.add_argument("--ratios", required=True, type=ratios, help="keep ratios, e.g. 0.8,0.6,0.4,0.2")
    parser.add_argument("--methods", help="comma-separated, e.g. ftc,svd_llm (default ftc)")
    parser.add_argument(
        "--ablations",
        help="FTC variants separated by ';', components by ',' ('none' = plain FTC): none;no_whiten,fixed_ranks",
    )
    add_calibration_and_eval_flags(parser)
    parser.add_argument("--schedule", help="cron expression, e.g. '0 2 * * *' (default: run once, now)")
    parser.add_argument("--timezone", help="IANA time zone of the schedule (default UTC)")
    parser.add_argument("--name", help="a label for people, e.g. nightly")
    add_priority_flag(parser)
    parser.add_argument("--change-threshold", type=float, help="relative change reported as better/worse (0.02)")


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

    download = actions.add_parser("download", help="save one of the sweep's files")
    download.add_argument("sweep_id", help=SWEEP_ID_HELP)
    download.add_argument("name", help="a name from `ftc sweep files`, e.g. results.csv or runs/RUN/plot.png")
    download.add_argument("-o", "--out", help="where to write it (default: its file name, here)")
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
