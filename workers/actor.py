"""The worker actor: claims jobs from the queue one at a time and runs them on its device.

Ray runs one per GPU (or per CPU slot) as an async actor; the class itself is plain Python, so the
same loop runs in a test process without Ray. Its event loop claims jobs and keeps leases; the
compression itself runs in a thread.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import threading
from typing import Any

from service.logs import configure_logging, log_context
from service.redis_client import REDIS_DOWN_ERRORS
from service.runtime import Services
from workers import metrics
from workers.settings import WorkerSettings

log = logging.getLogger(__name__)

CLAIM_BLOCK_MS = 1000
"""How long one claim waits for a job: also how fast an idle worker notices it should stop."""


class JobWorker:
    """One worker: `run()` claims and runs jobs until `stop()`."""

    def __init__(self, settings: WorkerSettings | dict[str, Any], slot: str, device: str) -> None:
        self.settings = settings if isinstance(settings, WorkerSettings) else WorkerSettings(**settings)
        self.device = device
        self.name = f"{socket.gethostname()}-{os.getpid()}-{slot}"
        self.jobs_run = 0
        self._shutdown = threading.Event()
        if not logging.getLogger().handlers:  # inside a Ray actor: lines go to the driver's output
            configure_logging(self.settings.log_format)
        self.metrics_endpoint = metrics.NodeEndpoint(self.settings.worker_metrics_port)
        if self.settings.worker_metrics_port:
            metrics.prepare(self.settings.work_dir)  # before anything loads prometheus_client
        import torch  # loaded now, so the first job does not pay for it

        torch.set_num_threads(self.settings.cpus_per_worker)

    async def ready(self) -> str:
        return self.name

    async def stop(self) -> None:
        """Stop claiming; a running job stops after its current layer and is left for re-delivery."""
        self._shutdown.set()

    async def run(self) -> int:
        """Claim and run jobs until stopped; returns how many it ran."""
        from workers.job import run_job  # the compression stack, imported where it runs

        services = Services.open(self.settings)
        log.info("worker %s started (device %s)", self.name, self.device)
        failures = 0  # consecutive failures to reach the queue
        try:
            while not self._shutdown.is_set():
                self.metrics_endpoint.try_serve()
                try:
                    lease = await services.queue.claim(self.name, block_ms=CLAIM_BLOCK_MS)
                except REDIS_DOWN_ERRORS as error:
                    failures += 1
                    delay = services.queue.policy.redis_delay(failures)
                    log.warning("queue unreachable (%s); retrying in %.1f s", error, delay)
                    await asyncio.sleep(delay)
                    continue
                failures = 0
                if lease is None:
                    continue
                log.info("claimed job %s (attempt %d)", lease.job_id, lease.attempt)
                try:
                    with log_context(job_id=lease.job_id):
                        await run_job(services, self.settings, lease, self.device, self._shutdown)
                except Exception:  # e.g. Redis gone mid-way: the lease runs out and the job is re-delivered
                    log.exception("job %s: could not run it here; it will be re-delivered", lease.job_id)
                self.jobs_run += 1
                self._release_memory()
        finally:
            await services.close()
        log.info("worker %s stopped after %d jobs", self.name, self.jobs_run)
        return self.jobs_run

    def _release_memory(self) -> None:
        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
