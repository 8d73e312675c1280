"""`ftc worker`: the command that runs the Ray workers (see docs/workers.md).

Nothing heavy is imported until the command runs, so the
other commands (and `ftc worker --help`) start without ray or torch.
"""

from __future__ import annotations

import argparse

from cli.common import fail


def _worker(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from service.store import store_for
    from service.teams import policies_for
    from workers.settings import WorkerSettings

    flags = {"device": args.device, "cpus_per_worker": args.cpus_per_worker, "models_dir": args.models_dir}
    try:
        settings = WorkerSettings(**{name: value for name, value in flags.items() if value is not None})
        store_for(settings)  # an unusable store URL or FTC_TEAMS is reported here, not by every actor
        policies_for(settings)
    except (ValidationError, ValueError) as error:
        return fail(str(error))
    if args.num_workers is not None and args.num_workers < 1:
        return fail(f"--num-workers must be at least 1; got {args.num_workers}")

    from workers.supervisor import PlacementError, main

    try:
        return main(settings, args.num_workers)
    except PlacementError as error:
        return fail(str(error))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `worker` to the `ftc` command line."""
    worker = subparsers.add_parser(
        "worker",
        help="run Ray worker actors that execute queued jobs (configured by FTC_*; RAY_ADDRESS joins a cluster)",
    )
    worker.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="worker actors to run (default: one per GPU in the Ray cluster, or 1 CPU worker without GPUs)",
    )
    worker.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default: FTC_DEVICE, else auto")
    worker.add_argument("--cpus-per-worker", type=int, help="CPU cores per actor (default: FTC_CPUS_PER_WORKER, 1)")
    worker.add_argument("--models-dir", help="folder of local models offered to jobs (default: FTC_MODELS_DIR)")
    worker.set_defaults(func=_worker)
