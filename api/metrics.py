"""Prometheus metrics: request latency measured here, queue depth and jobs by status read from Redis.

The Redis-backed numbers are read at scrape time, so every API process reports the same values.
Request latency is per process; with several uvicorn workers set PROMETHEUS_MULTIPROC_DIR (as the
prometheus_client docs describe) to aggregate it.
"""

from __future__ import annotations

import os
import time

from prometheus_client import REGISTRY, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.redis_client import REDIS_DOWN_ERRORS
from service.runtime import Services

REQUEST_SECONDS = Histogram(
    "ftc_api_request_seconds",
    "Time to answer an API request.",
    ["method", "route", "status"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)


class RequestTimer:
    """ASGI middleware timing each request under its route template (bounded label values)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            REQUEST_SECONDS.labels(scope["method"], route, str(status)).observe(time.perf_counter() - started)


class _Snapshot:
    """A one-off collector for values already read from Redis."""

    def __init__(self, families: list[GaugeMetricFamily]) -> None:
        self.families = families

    def collect(self) -> list[GaugeMetricFamily]:
        return self.families


async def _service_gauges(services: Services, teams: list[str]) -> list[GaugeMetricFamily]:
    up = GaugeMetricFamily("ftc_redis_up", "Whether the API could read Redis for this scrape.")
    try:
        depth = await services.queue.depth()
        counts = await services.jobs.status_counts()
        per_team = await services.jobs.team_counts(teams, ("queued", "running"))
    except REDIS_DOWN_ERRORS:
        up.add_metric([], 0)
        return [up]
    up.add_metric([], 1)
    queued = GaugeMetricFamily("ftc_queue_depth", "Jobs waiting for a worker.", labels=["priority"])
    for priority, waiting in depth.items():
        queued.add_metric([priority], waiting)
    jobs = GaugeMetricFamily("ftc_jobs", "Jobs by status, all teams.", labels=["status"])
    for status, count in counts.items():
        jobs.add_metric([status], count)
    team_queued = GaugeMetricFamily("ftc_team_queue_depth", "A team's jobs waiting for a worker.", labels=["team"])
    team_running = GaugeMetricFamily("ftc_team_running_jobs", "A team's jobs running now.", labels=["team"])
    for team, count in per_team.items():
        team_queued.add_metric([team], count["queued"])
        team_running.add_metric([team], count["running"])
    return [up, queued, jobs, team_queued, team_running]


async def render(services: Services, teams: list[str]) -> bytes:
    """The Prometheus text exposition of this process (or all, in multiprocess mode) plus Redis
    gauges, per team for `teams` (those with a key: label values stay bounded)."""
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    snapshot = CollectorRegistry()
    snapshot.register(_Snapshot(await _service_gauges(services, teams)))
    return generate_latest(registry) + generate_latest(snapshot)
