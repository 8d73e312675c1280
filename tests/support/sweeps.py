"""Helpers shared by the sweep and dashboard tests: an example campaign, a test process acting as
the worker (claiming jobs through the real queue and leaving metrics.json where workers do), and
one pass of the real scheduler."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from service.jobs import record_from_hash
from service.queue import Lease
from service.runtime import Services
from service.scheduler import Pass, Scheduler
from service.schemas import JobRecord
from service.settings import Settings
from service.store.layout import METRICS, job_prefix
from tests.support.service import run_async

SWEEP_REQUEST: dict[str, Any] = {
    "name": "nightly",
    "models": ["smollm2-135m"],
    "ratios": [0.8, 0.4],
    "methods": ["ftc", "svd_llm"],
    "calibration": {"dataset": "wikitext2", "samples": 8, "seq_len": 256, "seed": 0},
    "eval": {"datasets": ["wikitext2"], "seq_len": 256, "max_windows": 4},
}
"""2 ratios x 2 methods of one model: four cells."""

DENSE_PPL = 20.0
METHOD_PENALTY = {"ftc": 1.0, "svd_llm": 3.0, "svd": 10.0, "asvd": 8.0, "per_matrix": 2.0}


def synthetic_metrics(record: JobRecord, factor: float = 1.0) -> dict[str, Any]:
    """A plausible metrics.json: perplexity rises as rho falls, more for weaker methods."""
    request = record.request
    penalty = METHOD_PENALTY[request.method] * (1 + len(request.ablate))
    ppl = DENSE_PPL * (1 + penalty * (1 - request.ratio) ** 2) * factor
    metrics: dict[str, Any] = {
        "perplexity": {d: {"ppl": ppl, "seq_len": 256, "windows": 4} for d in request.evaluation.datasets},
        "allocation": request.allocation,
        "scope": request.scope,
        "storage": {
            "scope": request.scope,
            "attention_bytes_written": int(1_000_000 * request.ratio),
            "linear_reduction": 0.9 * (1 - request.ratio),
            "model_reduction": 0.3 * (1 - request.ratio),
            "source_bytes": 5_000_000,
        },
        "bytes_written": int(4_000_000 * request.ratio),
        "timings": {"total_seconds": 12.5},
    }
    if request.evaluation.dense_reference:
        metrics["dense_perplexity"] = {d: {"ppl": DENSE_PPL} for d in request.evaluation.datasets}
    return metrics


Outcome = Callable[[JobRecord], dict[str, Any] | str]
"""What the test worker does with a job: a metrics document to publish, or a failure reason."""


async def complete(services: Services, lease: Lease, outcome: Outcome = synthetic_metrics) -> None:
    """Finish a claimed job as a worker would: metrics.json first, then the record (or a failure)."""
    record = record_from_hash(await services.redis.hgetall(services.jobs.keys.job(lease.job_id)))
    result = outcome(record)
    if isinstance(result, str):
        await services.jobs.finish(lease.job_id, lease.worker, "failed", result)
    else:
        key = job_prefix(record.team, record.id) + METRICS
        services.store.put_bytes(key, json.dumps(result).encode(), "application/json")
        await services.jobs.finish(lease.job_id, lease.worker, "succeeded")
    await services.queue.ack(lease)


async def work_queue(services: Services, outcome: Outcome = synthetic_metrics, worker: str = "w-test") -> list[str]:
    """Claim and complete every queued job; returns their ids."""
    done = []
    while (lease := await services.queue.claim(worker, block_ms=0)) is not None:
        await complete(services, lease, outcome)
        done.append(lease.job_id)
    return done


def scheduler_pass(settings: Settings, now: float | None = None) -> Pass:
    """One pass of the real scheduler, at the wall-clock time or at `now`."""

    async def tick(services: Services) -> Pass:
        scheduler = Scheduler(services) if now is None else Scheduler(services, clock=lambda: now)
        return await scheduler.tick()

    return run_async(settings, tick)
