"""The workers' Prometheus metrics: jobs started and how they ended, attempts, job and layer seconds.

The numbers are counted in the actor processes, where jobs run. A node may run several actors (one
per GPU), each its own process, so they count in prometheus_client's multiprocess mode into one
folder of the node (`{FTC_WORK_DIR}/prometheus`), and one endpoint per node serves their sum:
each actor tries to bind `FTC_WORKER_METRICS_PORT` when it starts and again now and then, and
whichever holds the port serves `/metrics` for all (if it dies, another takes the port over).
Counters and histograms only, which add up correctly across processes, dead ones included.

Without a port (the default) nothing is served and metrics stay in the process's default registry.
prometheus_client picks its storage when it is first imported, so this module imports it only in
`metrics()` and the endpoint, after `prepare` has pointed PROMETHEUS_MULTIPROC_DIR at the folder.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from service.retry import error_kind

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Histogram

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
JOB_SECONDS_BUCKETS = (10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400)
LAYER_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
ATTEMPT_BUCKETS = (1, 2, 3, 4, 5, 10)
STOPPED_OUTCOMES = ("cancelled", "lost", "interrupted", "retry")
RETRY_BIND_SECONDS = 30.0
"""How often an actor that does not hold the port tries to take it over."""


@dataclass(frozen=True)
class WorkerMetrics:
    jobs_started: Counter
    jobs_succeeded: Counter
    jobs_failed: Counter
    jobs_stopped: Counter
    leases_lost: Counter
    attempt: Histogram
    job_seconds: Histogram
    layer_seconds: Histogram


_metrics: WorkerMetrics | None = None


def metrics() -> WorkerMetrics:
    """The process's metrics, created on first use (after `prepare` chose where they are kept)."""
    global _metrics
    if _metrics is None:
        from prometheus_client import Counter, Histogram

        _metrics = WorkerMetrics(
            jobs_started=Counter("ftc_worker_jobs_started", "Job attempts started by this node's workers."),
            jobs_succeeded=Counter("ftc_worker_jobs_succeeded", "Job attempts that ended with the job succeeded."),
            jobs_failed=Counter(
                "ftc_worker_jobs_failed",
                "Job attempts that failed the job, by reason: an error kind of service/retry.py ERROR_KINDS.",
                ["reason"],
            ),
            jobs_stopped=Counter(
                "ftc_worker_jobs_stopped",
                "Job attempts that ended without an outcome: cancelled, lost (lease lost) or interrupted "
                "(worker shutdown; the job is re-delivered).",
                ["outcome"],
            ),
            leases_lost=Counter(
                "ftc_worker_leases_lost", "Leases this node's workers failed to renew (another worker got the job)."
            ),
            attempt=Histogram(
                "ftc_worker_job_attempt", "Delivery number of each job attempt (1 = first).", buckets=ATTEMPT_BUCKETS
            ),
            job_seconds=Histogram(
                "ftc_worker_job_seconds", "Wall time of one job attempt, by outcome.", ["outcome"],
                buckets=JOB_SECONDS_BUCKETS,
            ),
            layer_seconds=Histogram(
                "ftc_worker_layer_seconds", "Time to compress one decoder layer.", buckets=LAYER_SECONDS_BUCKETS
            ),
        )
    return _metrics


def failure_reason(error: BaseException) -> str:
    """A bounded label for why a job failed (the message itself goes to the job record)."""
    return error_kind(error)


def record_attempt(attempt: int) -> None:
    metrics().jobs_started.inc()
    metrics().attempt.observe(attempt)


def record_outcome(outcome: str, seconds: float, error: BaseException | None = None) -> None:
    """Count how an attempt ended: succeeded, failed (with its error), cancelled, lost, interrupted."""
    m = metrics()
    m.job_seconds.labels(outcome).observe(seconds)
    if outcome == "succeeded":
        m.jobs_succeeded.inc()
    elif outcome == "failed":
        m.jobs_failed.labels(failure_reason(error) if error is not None else "error").inc()
    elif outcome in STOPPED_OUTCOMES:
        m.jobs_stopped.labels(outcome).inc()
        if outcome == "lost":
            m.leases_lost.inc()


def record_layer(seconds: float) -> None:
    metrics().layer_seconds.observe(seconds)


def prepare(work_dir: str | Path) -> Path | None:
    """Keep this process's metrics in the node's shared folder; call before prometheus_client is imported.

    An operator's own PROMETHEUS_MULTIPROC_DIR is kept. Returns the folder, or None when it is too
    late (prometheus_client already loaded without it: the metrics stay in this process's registry).
    """
    if "prometheus_client" in sys.modules and MULTIPROC_ENV not in os.environ:
        log.warning("prometheus_client was loaded before the metrics folder was set; this node's endpoint "
                    "shows only the process that serves it")
        return None
    folder = Path(os.environ.setdefault(MULTIPROC_ENV, str(Path(work_dir) / "prometheus")))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class NodeEndpoint:
    """Serves the node's metrics on `port` once this process holds it; `try_serve()` is cheap to repeat."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.serving = False
        self._next_try = 0.0

    def try_serve(self) -> bool:
        """Bind the port if no one on this node has it (at most every RETRY_BIND_SECONDS)."""
        if self.serving or self.port == 0 or time.monotonic() < self._next_try:
            return self.serving
        self._next_try = time.monotonic() + RETRY_BIND_SECONDS
        from prometheus_client import start_http_server

        try:
            start_http_server(self.port, registry=node_registry())
        except OSError:  # another worker of this node serves them
            return False
        self.serving = True
        log.info("serving this node's worker metrics on port %d (/metrics)", self.port)
        return True


def node_registry() -> CollectorRegistry:
    """What a scrape sees: every process of the node in multiprocess mode, else this process."""
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    folder = os.environ.get(MULTIPROC_ENV)
    if not folder:
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folder)
    return registry
