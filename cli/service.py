"""The service commands of the `ftc` CLI: `serve`, `submit` and `jobs ls|get|cancel|watch`.

The client commands read FTC_API_URL and FTC_API_KEY. Failures print one line on stderr and exit
with 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
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
from ftc.options import ALLOCATIONS, METHODS

# --- serve -------------------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    from api.app import create_app
    from api.server import serve
    from service.settings import Settings

    try:
        settings = Settings()
        create_app(settings)  # check the settings here, where a bad one can be reported in one line
    except ValueError as error:
        return fail(str(error))
    serve(args.host, args.port, args.workers, log_format=settings.log_format)
    return 0


# --- submit ------------------------------------------------------------------------------------------


def build_request(args: argparse.Namespace, upload: Callable[[Path], str]) -> dict[str, Any]:
    """The JSON job request the flags describe; flags left out keep the server's defaults.

    A --calib that names an existing local file is uploaded first (`upload` returns its URI).
    """
    request: dict[str, Any] = {"model": args.model, "method": args.method}
    if args.revision:
        request["revision"] = args.revision
    if args.ratios is not None:
        request["ratios"] = args.ratios
    else:
        request["ratio"] = args.ratio
    if args.ablate:
        request["ablate"] = csv(args.ablate)
    if args.allocation:
        request["allocation"] = args.allocation
    request |= calibration_and_eval(args, upload)
    if args.priority:
        request["priority"] = args.priority
    return request


@client_command
def _submit(client: ApiClient, args: argparse.Namespace) -> int:
    request = build_request(args, upload=lambda path: client.upload(path)["uri"])
    print_json(client.submit(request, idempotency_key=args.idempotency_key))
    return 0


# --- jobs ls|get|cancel|watch -------------------------------------------------------------------------


def _progress_text(progress: dict[str, Any]) -> str:
    if not progress.get("layers"):
        return progress.get("stage", "")
    eta = progress.get("eta_seconds")
    eta_text = f" eta {eta:.0f}s" if eta is not None else ""
    return f"{progress.get('stage', '')} {progress['layer']}/{progress['layers']}{eta_text}"


@client_command
def _jobs_ls(client: ApiClient, args: argparse.Namespace) -> int:
    records, cursor = [], args.cursor
    while True:
        page = client.list(status=args.status, limit=args.limit, cursor=cursor)
        records += page["jobs"]
        cursor = page["next_cursor"]
        if not (args.all and cursor):
            break
    if args.json:
        print_json({"jobs": records, "next_cursor": cursor})
        return 0
    for r in records:
        request = r["request"]
        print(
            f"{r['id']}  {r['status']:<9}  {request['model']}  {request['method']}  "
            f"ratio={request['ratio']}  {_progress_text(r['progress'])}".rstrip()
        )
    if cursor:
        print(f"# more: --cursor {cursor}", file=sys.stderr)
    return 0


@client_command
def _jobs_get(client: ApiClient, args: argparse.Namespace) -> int:
    print_json(client.get(args.job_id))
    return 0


@client_command
def _jobs_cancel(client: ApiClient, args: argparse.Namespace) -> int:
    print_json(client.cancel(args.job_id))
    return 0


@client_command
def _jobs_watch(client: ApiClient, args: argparse.Namespace) -> int:
    """Print each event; exit 0 when the job succeeds, 1 when it fails or is cancelled."""
    status = None
    for kind, data in client.events(args.job_id):
        if kind == "progress":
            print(f"progress  {_progress_text(data)}", flush=True)
        elif kind == "status":
            status = data["status"]
            reason = data.get("error") or data.get("reason")
            print(f"status    {status}" + (f"  ({reason})" if reason else ""), flush=True)
        else:
            print(f"{kind}", flush=True)
    return 0 if status == "succeeded" else EXIT_JOB_UNSUCCESSFUL


def _add_submit_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model alias (smollm2-135m) or hub id")
    parser.add_argument("--revision", help="hub commit, branch or tag of --model (default: the newest)")
    parser.add_argument("--method", default="ftc", help=f"ftc or a baseline: {', '.join(METHODS)}")
    ratio = parser.add_mutually_exclusive_group(required=True)
    ratio.add_argument("--ratio", type=float, help="keep ratio in (0, 1]")
    ratio.add_argument("--ratios", type=ratios, help="several keep ratios, one linked job each: 0.3,0.5")
    parser.add_argument("--ablate", help="FTC components to remove, comma-separated")
    parser.add_argument("--allocation", choices=ALLOCATIONS,
                        help="how rho is spent across layers: global (ftc), sensitivity (ftc, cp); the server's "
                             "default: uniform")
    add_calibration_and_eval_flags(parser)
    add_priority_flag(parser)
    parser.add_argument(
        "--idempotency-key",
        default=None,
        help="a retry with the same key returns the same job (without one, an identical request does, "
        "unless that job failed or was cancelled)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `serve`, `submit` and `jobs` to the `ftc` command line."""
    serve = subparsers.add_parser("serve", help="run the job API (needs Redis; see docs/service.md)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    serve.set_defaults(func=_serve)

    submit = subparsers.add_parser("submit", help="submit a compression job to the API")
    _add_submit_flags(submit)
    submit.set_defaults(func=_submit)

    jobs = subparsers.add_parser("jobs", help="list, inspect, cancel or follow jobs")
    actions = jobs.add_subparsers(dest="jobs_command", required=True, metavar="{ls,get,cancel,watch}")
    ls = actions.add_parser("ls", help="list your team's jobs, newest first")
    ls.add_argument("--status", choices=("queued", "running", "succeeded", "failed", "cancelled"),
                    help="only jobs in this status (default: all)")
    ls.add_argument("--limit", type=int, default=50, help="jobs per page")
    ls.add_argument("--cursor", help="next_cursor of the previous page (default: the first page)")
    ls.add_argument("--all", action="store_true", help="follow next_cursor to the end")
    ls.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    ls.set_defaults(func=_jobs_ls)
    for name, func, text in (
        ("get", _jobs_get, "print a job record"),
        ("cancel", _jobs_cancel, "cancel a job"),
        ("watch", _jobs_watch, "follow a job's events until it ends (exit 0 if it succeeded)"),
    ):
        action = actions.add_parser(name, help=text)
        action.add_argument("job_id", help="the job's id, as `ftc submit` or `ftc jobs ls` print it")
        action.set_defaults(func=func)
