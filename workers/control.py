"""How a running job is told to stop: cancellation, a lost lease, or the worker shutting down.

The compression runs in a thread while the worker's event loop keeps the lease alive. Both sides
learn why a job must stop (a heartbeat or a progress update reports a cancel request; a heartbeat
finds the lease gone; the worker is asked to shut down), and the thread acts on it at its next
check, which comes after every layer: the library then keeps every finished layer.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from service.errors import LeaseLost
from service.jobs import JobStore
from service.queue import Lease, Queue
from service.schemas import Progress

log = logging.getLogger(__name__)

REPLY_TIMEOUT_SECONDS = 30.0


class JobCancelled(Exception):
    """The submitter cancelled the job."""


class WorkerStopping(Exception):
    """The worker is shutting down; the job is left to be re-delivered and resumed elsewhere."""


class JobControl:
    """The stop flags of one job, shared by the event loop and the compression thread."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        jobs: JobStore,
        lease: Lease,
        shutdown: threading.Event,
    ) -> None:
        self.loop = loop
        self.jobs = jobs
        self.lease = lease
        self.shutdown = shutdown
        self._cancelled = threading.Event()
        self._lost: LeaseLost | None = None

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def check(self) -> None:
        """Raise if the job must stop now: LeaseLost, JobCancelled or WorkerStopping."""
        if self._lost is not None:
            raise self._lost
        if self._cancelled.is_set():
            raise JobCancelled(f"job {self.lease.job_id} was cancelled")
        if self.shutdown.is_set():
            raise WorkerStopping(f"worker {self.lease.worker} is shutting down")

    def _note(self, flagged: bool) -> None:
        if flagged and not self._cancelled.is_set():
            log.info("cancel requested; stopping before the next layer")
            self._cancelled.set()

    def _note_lost(self, error: LeaseLost) -> None:
        if self._lost is None:
            log.warning("lost the lease: %s", error)
            self._lost = error

    async def publish(self, progress: Progress) -> None:
        """Put progress on the job record and its events; a Redis hiccup costs an update, not the job."""
        try:
            self._note(await self.jobs.update_progress(self.lease.job_id, self.lease.worker, progress))
        except LeaseLost as error:
            self._note_lost(error)
        except Exception as error:
            log.warning("could not publish progress (%s); continuing", error)

    def publish_from_thread(self, progress: Progress) -> None:
        """`publish`, called from the compression thread, then `check`."""
        future = asyncio.run_coroutine_threadsafe(self.publish(progress), self.loop)
        future.result(REPLY_TIMEOUT_SECONDS)
        self.check()

    async def keep_lease(self, queue: Queue, interval_seconds: float) -> None:
        """Renew the lease every `interval_seconds` until cancelled (as a task) or the lease is lost."""
        while True:
            await asyncio.sleep(interval_seconds)
            try:
                self._note(await queue.heartbeat(self.lease))
            except LeaseLost as error:
                self._note_lost(error)
                return
            except Exception as error:  # Redis restarting: keep trying while the lease lasts
                log.warning("heartbeat failed (%s); retrying", error)
