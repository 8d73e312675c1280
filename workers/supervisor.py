"""`ftc worker`: start or join a Ray cluster, place the worker actors, keep them running.

The supervisor is the Ray driver. It decides how many actors to run and where (one per GPU with
`num_gpus=1`, or CPU actors), restarts an actor that dies (its job is re-delivered when the lease
runs out, and resumes from its checkpoints), runs a janitor that re-delivers expired leases, and on
SIGTERM or SIGINT asks the actors to stop between layers before it leaves the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from service.logs import configure_logging
from service.queue import run_janitor
from service.runtime import Services
from workers.actor import JobWorker
from workers.settings import WorkerSettings

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 60.0
"""How long stopping actors get to reach the end of their current layer."""
RESTART_DELAY_SECONDS = 2.0
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2
"""The actors pass no tensors through Ray, so a local cluster needs only a small object store."""


class PlacementError(ValueError):
    """The cluster cannot host the workers asked for; the message says what to change."""


@dataclass(frozen=True)
class Placement:
    """How many worker actors run, on which device, and what each reserves in the cluster."""

    count: int
    device: str
    resources: dict[str, Any] = field(default_factory=dict)


def place(settings: WorkerSettings, num_workers: int | None, cluster_gpus: float) -> Placement:
    """One actor per GPU when there are GPUs (or `device` says cuda), else `num_workers` CPU actors (1).

    With device cuda and an explicit count, actors may wait for GPU nodes an autoscaler adds.
    """
    if num_workers is not None and num_workers < 1:
        raise PlacementError(f"--num-workers must be at least 1; got {num_workers}")
    device = settings.device
    if device == "auto":
        device = "cuda" if cluster_gpus >= 1 else "cpu"
    custom = {"resources": dict(settings.actor_resources)} if settings.actor_resources else {}
    if device == "cuda":
        if num_workers is None and cluster_gpus < 1:
            raise PlacementError("the Ray cluster has no GPU; use --device cpu, or give --num-workers to wait for GPUs")
        count = num_workers or int(cluster_gpus)
        return Placement(count, "cuda", {"num_gpus": 1, "num_cpus": settings.cpus_per_worker, **custom})
    return Placement(num_workers or 1, "cpu", {"num_gpus": 0, "num_cpus": settings.cpus_per_worker, **custom})


def connect(settings: WorkerSettings, num_workers: int | None, wait_seconds: float = 120.0) -> None:
    """Join the cluster at RAY_ADDRESS (waiting for it to come up), or start a local one."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    if not address:
        wanted = (num_workers or 1) * settings.cpus_per_worker
        ray.init(
            address="local",
            num_cpus=max(os.cpu_count() or 1, wanted),
            include_dashboard=False,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            logging_level=logging.WARNING,
        )
        return
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            ray.init(address=address, logging_level=logging.WARNING)
            return
        except ConnectionError as error:  # the head may still be starting (a sidecar starts with it)
            if time.monotonic() > deadline:
                raise
            log.warning("Ray cluster at %s not reachable yet (%s); retrying", address, error)
            time.sleep(5.0)


class Supervisor:
    """Keeps `placement.count` actors running until stopped."""

    def __init__(self, settings: WorkerSettings, placement: Placement) -> None:
        import ray

        self.settings = settings
        self.placement = placement
        self.actor_class = ray.remote(JobWorker).options(**placement.resources)
        self.stopping = asyncio.Event()

    def _start(self, index: int) -> Any:
        slot = f"{'gpu' if self.placement.device == 'cuda' else 'cpu'}{index}"
        return self.actor_class.remote(self.settings.model_dump(), slot, self.placement.device)

    async def run(self) -> None:
        actors = {index: self._start(index) for index in range(self.placement.count)}
        announce = asyncio.create_task(self._announce(list(actors.values())))
        runs = {index: _future(actor.run.remote()) for index, actor in actors.items()}
        janitor = asyncio.create_task(self._janitor())
        stop = asyncio.create_task(self.stopping.wait())
        try:
            while not self.stopping.is_set():
                done, _ = await asyncio.wait([*runs.values(), stop], return_when=asyncio.FIRST_COMPLETED)
                for index in [i for i, run in runs.items() if run in done]:
                    log.error("worker actor %d ended (%s); starting a new one", index, _ending(runs[index]))
                    await asyncio.sleep(RESTART_DELAY_SECONDS)
                    actors[index] = self._start(index)
                    runs[index] = _future(actors[index].run.remote())
        finally:
            for task in (stop, announce, janitor):
                task.cancel()
            await self._stop_actors(actors, runs)
            with contextlib.suppress(asyncio.CancelledError):
                await janitor

    async def _announce(self, actors: list[Any]) -> None:
        """Say when every actor is up (they may wait for resources, e.g. GPU nodes being added)."""
        try:
            names = await asyncio.gather(*(_future(actor.ready.remote()) for actor in actors))
        except Exception as error:  # the run loop reports and replaces the actor
            log.error("a worker actor failed to start: %s", error)
            return
        print(f"ftc worker: ready, {len(names)} worker(s) on {self.placement.device}: {', '.join(names)}", flush=True)

    async def _janitor(self) -> None:
        if self.settings.janitor_interval_seconds <= 0:
            return
        services = Services.open(self.settings)
        try:
            await run_janitor(services.queue, self.settings.janitor_interval_seconds, asyncio.Event())
        finally:
            await services.close()

    async def _stop_actors(self, actors: dict[int, Any], runs: dict[int, asyncio.Future]) -> None:
        import ray

        for actor in actors.values():
            with contextlib.suppress(Exception):
                actor.stop.remote()
        pending = [run for run in runs.values() if not run.done()]
        if pending:
            await asyncio.wait(pending, timeout=STOP_GRACE_SECONDS)
        for actor in actors.values():
            with contextlib.suppress(Exception):
                ray.kill(actor)


def _future(ref: Any) -> asyncio.Future:
    return asyncio.wrap_future(ref.future())


def _ending(run: asyncio.Future) -> str:
    error = run.exception()
    return f"it failed: {error}" if error is not None else f"it returned after {run.result()} jobs"


def main(settings: WorkerSettings, num_workers: int | None) -> int:
    """Run the workers until SIGTERM or SIGINT; the exit code of `ftc worker`."""
    import ray

    configure_logging(settings.log_format)
    connect(settings, num_workers)
    try:
        placement = place(settings, num_workers, ray.cluster_resources().get("GPU", 0))
        print(f"ftc worker: starting {placement.count} worker(s) on {placement.device}", flush=True)

        async def serve() -> None:
            supervisor = Supervisor(settings, placement)
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, supervisor.stopping.set)
            await supervisor.run()

        asyncio.run(serve())
    finally:
        ray.shutdown()
    print("ftc worker: stopped", flush=True)
    return 0
