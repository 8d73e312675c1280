"""`ftc plans ls|rm`: the team's shared layer plans of `--allocation sensitivity` on the service.

A job measures a plan once (per model content, calibration, method and scope) and every later job of
the team reads it; removing one makes the next job that needs it measure it again. The commands read
FTC_API_URL and FTC_API_KEY, as `ftc jobs` does.
"""

from __future__ import annotations

import argparse
import re

from cli.client import ApiClient
from cli.common import UsageError, client_command, print_json
from cli.download import human_bytes
from service.plans import PLAN_KEY_PATTERN


@client_command
def _ls(client: ApiClient, args: argparse.Namespace) -> int:
    listing = client.list_plans()
    if args.json:
        print_json(listing)
        return 0
    for plan in listing["plans"]:
        what = "  ".join(str(plan.get(name) or "-") for name in ("model", "method", "scope", "job_id"))
        print(f"{plan['key']}  {plan['created'][:19]}  {human_bytes(plan['bytes']):>9}  {what}")
    return 0


@client_command
def _rm(client: ApiClient, args: argparse.Namespace) -> int:
    if not re.match(PLAN_KEY_PATTERN, args.key):
        raise UsageError(f"KEY must be a plan's 64-character key as `ftc plans ls` prints it; got {args.key!r}")
    print_json(client.delete_plan(args.key))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `plans` to the `ftc` command line."""
    plans = subparsers.add_parser("plans", help="list or remove your team's shared layer plans (allocation "
                                  "sensitivity) on the job service")
    actions = plans.add_subparsers(dest="plans_command", required=True, metavar="{ls,rm}")
    ls = actions.add_parser("ls", help="list the plans, newest first: key, when measured, size, model, method, "
                            "scope, job")
    ls.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    ls.set_defaults(func=_ls)
    rm = actions.add_parser("rm", help="remove a plan; the next job that needs it measures it again")
    rm.add_argument("key", help="the plan's key, as `ftc plans ls` prints it")
    rm.set_defaults(func=_rm)
