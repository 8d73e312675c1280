"""The service commands of the `ftc` CLI: `serve`, `submit` and `jobs ls|get|cancel|retry|watch|files|download`.

The client commands read FTC_API_URL and FTC_API_KEY. Failures print one line on stderr and exit
with 2. `submit` takes every field of the API's job request as a flag (cli/fields.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cli.client import ApiClient
from cli.common import EXIT_JOB_UNSUCCESSFUL, UsageError, client_command, csv, fail, print_json
from cli.download import Remote, human_bytes, save_folder
from cli.fields import add_flags, check_request, flags_of, pending_upload, request_from
from service.schemas import JOB_STATUSES, JobRequest

JOB_FLAGS = flags_of(JobRequest)
"""`ftc submit`'s request flags: one per field of the API's job request."""

# --- serve -------------------------------------------------------------------------------------------


def addresses(host: str, port: int) -> list[str]:
    """The lines `ftc serve` prints: where the dashboard and the API's documentation are."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    base = f"http://{f'[{shown}]' if ':' in shown else shown}:{port}"
    every = " (listening on every interface)" if shown != host else ""
    return [f"ftc API on {base}{every}", f"  dashboard  {base}/", f"  API docs   {base}/docs"]


def _serve(args: argparse.Namespace) -> int:
    from api.app import create_app
    from api.server import serve
    from service.settings import Settings

    try:
        settings = Settings()
        create_app(settings)  # check the settings here, where a bad one can be reported in one line
    except ValueError as error:
        return fail(str(error))
    print("\n".join(addresses(args.host, args.port)), flush=True)
    serve(args.host, args.port, args.workers, log_format=settings.log_format)
    return 0


# --- submit ------------------------------------------------------------------------------------------


def build_request(args: argparse.Namespace, upload: Callable[[Path], str]) -> dict[str, Any]:
    """The JSON job request the flags describe; flags left out keep the server's defaults.

    A dataset flag that names an existing local file is uploaded first (`upload` returns its URI).
    """
    return request_from(args, JOB_FLAGS, upload)


def next_steps(record: dict[str, Any]) -> str:
    """What to run after a submission: follow the job, then fetch its model."""
    job_id = record["id"]
    linked = f" ({len(record['linked'])} linked jobs: ftc jobs ls)" if record.get("linked") else ""
    return f"next: ftc jobs watch {job_id}{linked}, then: ftc jobs download {job_id}"


@client_command
def _submit(client: ApiClient, args: argparse.Namespace) -> int:
    check_request(JobRequest, build_request(args, pending_upload), JOB_FLAGS)  # before any upload
    request = build_request(args, upload=lambda path: client.upload(path)["uri"])
    record = client.submit(request, idempotency_key=args.idempotency_key)
    print_json(record)
    print(next_steps(record), file=sys.stderr)
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


@client_command
def _jobs_retry(client: ApiClient, args: argparse.Namespace) -> int:
    record = client.retry(args.job_id)
    print_json(record)
    print(next_steps(record), file=sys.stderr)
    return 0


KIND_TITLES = {
    "model": "the compressed model (ftc jobs download JOB_ID fetches these, with the record)",
    "dense": "its dense export (--include dense)",
    "record": "the job's record",
    "checkpoint": "per-layer checkpoints, to resume (--include checkpoints)",
}


@client_command
def _jobs_files(client: ApiClient, args: argparse.Namespace) -> int:
    """The job's files grouped by kind, outputs first; checkpoints counted unless asked for."""
    listing = client.artifacts(args.job_id, include_checkpoints=args.include_checkpoints)
    if args.json:
        print_json(listing)
        return 0
    for kind, title in KIND_TITLES.items():
        files = [a for a in listing["artifacts"] if a["kind"] == kind]
        if files:
            print(f"# {title}")
            for artifact in files:
                print(f"{human_bytes(artifact['size']):>10}  {artifact['name']}")
    checkpoints = listing["checkpoints"]
    if checkpoints["files"] and not args.include_checkpoints:
        print(f"# {checkpoints['files']} checkpoint files, {human_bytes(checkpoints['bytes'])} (--include-checkpoints "
              "lists them)")
    if not listing["complete"]:
        print("# incomplete: the manifest is written last, once every file is in", file=sys.stderr)
    return 0


INCLUDES = ("dense", "checkpoints")
"""What `jobs download --include` adds to the model folder."""


def _includes(text: str) -> list[str]:
    names = csv(text)
    unknown = [name for name in names if name not in INCLUDES]
    if unknown:
        raise argparse.ArgumentTypeError(f"--include takes {', '.join(INCLUDES)}; got {', '.join(unknown)}")
    return names


@client_command
def _jobs_download(client: ApiClient, args: argparse.Namespace) -> int:
    """Save the job's model folder (and on request its dense export and checkpoints) into --to."""
    include = {name for names in args.include or [] for name in names}
    record = client.get(args.job_id)
    listing = client.artifacts(args.job_id, include_checkpoints="checkpoints" in include)
    if not listing["complete"]:
        hint = f"follow it with: ftc jobs watch {args.job_id}" if record["status"] in ("queued", "running") else (
            f"nothing to download; resubmit it with: ftc jobs retry {args.job_id}")
        raise UsageError(f"job {args.job_id} is {record['status']} and its model is not complete; {hint}")
    kinds = {"model", "record"} | ({"dense"} if "dense" in include else set()) | (
        {"checkpoint"} if "checkpoints" in include else set())
    files = [Remote(a["name"], a["size"], a["url"]) for a in listing["artifacts"] if a["kind"] in kinds]
    if "dense" in include and not any(a["kind"] == "dense" for a in listing["artifacts"]):
        raise UsageError(f"job {args.job_id} has no dense export; submit with --outputs compressed,dense to get one")
    to = Path(args.to or args.job_id)
    size = save_folder(client, files, to, overwrite=args.overwrite, quiet=args.quiet)
    print(f"{to} ({len(files)} files, {human_bytes(size)})")
    print(f"load it: AutoModelForCausalLM.from_pretrained({str(to)!r}, trust_remote_code=True), and "
          "AutoTokenizer likewise; or: ftc eval " + str(to), file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `serve`, `submit` and `jobs` to the `ftc` command line."""
    serve = subparsers.add_parser("serve", help="run the job API and the dashboard (needs Redis; docs/service.md)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    serve.set_defaults(func=_serve)

    submit = subparsers.add_parser(
        "submit", help="submit a compression job to the API (every field of the job request is a flag)"
    )
    add_flags(submit, JOB_FLAGS)
    submit.add_argument(
        "--idempotency-key",
        default=None,
        help="a retry with the same key returns the same job (without one, an identical request does, "
        "unless that job failed or was cancelled)",
    )
    submit.set_defaults(func=_submit)

    jobs = subparsers.add_parser("jobs", help="list, inspect, cancel, retry, follow or download jobs")
    actions = jobs.add_subparsers(
        dest="jobs_command", required=True, metavar="{ls,get,cancel,retry,watch,files,download}"
    )
    ls = actions.add_parser("ls", help="list your team's jobs, newest first")
    ls.add_argument("--status", choices=JOB_STATUSES, help="only jobs in this status (default: all)")
    ls.add_argument("--limit", type=int, default=50, help="jobs per page")
    ls.add_argument("--cursor", help="next_cursor of the previous page (default: the first page)")
    ls.add_argument("--all", action="store_true", help="follow next_cursor to the end")
    ls.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    ls.set_defaults(func=_jobs_ls)
    job_id_help = "the job's id, as `ftc submit` or `ftc jobs ls` print it"
    for name, func, text in (
        ("get", _jobs_get, "print a job record"),
        ("cancel", _jobs_cancel, "cancel a job"),
        ("retry", _jobs_retry, "submit a failed or cancelled job again (a new job with the same request)"),
        ("watch", _jobs_watch, "follow a job's events until it ends (exit 0 if it succeeded)"),
    ):
        action = actions.add_parser(name, help=text)
        action.add_argument("job_id", help=job_id_help)
        action.set_defaults(func=func)

    files = actions.add_parser("files", help="list a job's files by kind: the model, its record, checkpoints")
    files.add_argument("job_id", help=job_id_help)
    files.add_argument("--include-checkpoints", action="store_true", help="list the per-layer checkpoints too")
    files.add_argument("--json", action="store_true", help="print the API's JSON instead")
    files.set_defaults(func=_jobs_files)

    download = actions.add_parser(
        "download", help="save a succeeded job's model folder, ready to load (with a progress bar)"
    )
    download.add_argument("job_id", help=job_id_help)
    download.add_argument("--to", help="folder to write (default: the job's id, here)")
    download.add_argument("--include", type=_includes, action="append",
                          help="also fetch: dense (its dense export, under dense/), checkpoints (under checkpoints/); "
                               "comma-separated (default: the model folder, metrics.json and log.txt only)")
    download.add_argument("--overwrite", action="store_true", help="replace a non-empty --to")
    download.add_argument("--quiet", action="store_true", help="no progress bar")
    download.set_defaults(func=_jobs_download)
