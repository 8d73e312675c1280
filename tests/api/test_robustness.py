"""Redis outages: fast, clear 503s while it is down, nothing half-written, and no accepted job lost
when it restarts from its append-only file, even after a SIGKILL in the middle of a burst."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from service.runtime import Services
from tests.support.servers import RedisServer, start_redis, wait_until
from tests.support.service import Api, require_redis_server


@pytest.fixture
def own_redis(tmp_path: Path) -> RedisServer:
    """A redis-server this test may stop and kill, persisting every write to its AOF."""
    require_redis_server()
    server = start_redis(tmp_path / "redis", appendonly=True)
    yield server
    server.stop()


@pytest.fixture
def api_on_own_redis(api_factory: Callable[..., Api], own_redis: RedisServer) -> Api:
    return api_factory("local", redis_url=own_redis.url)


def submit(client: httpx.Client, job_request: dict, seed: int) -> httpx.Response:
    return client.post("/v1/jobs", json={**job_request, "calibration": {**job_request["calibration"], "seed": seed}})


async def consistency_report(services: Services, team: str) -> dict[str, int]:
    """Counts that must agree if no job was half-written: records, indexes, queue entries, counters."""
    keys = services.jobs.keys
    ids = await services.redis.zrange(keys.team_jobs(team), 0, -1)
    complete = 0
    for job_id in ids:
        fields = await services.redis.hgetall(keys.job(job_id))
        stored_entry = await services.redis.xrange(fields.get("stream", "-"), fields.get("entry"), fields.get("entry"))
        if fields.get("status") == "queued" and stored_entry and fields.get("request"):
            complete += 1
    return {
        "indexed": len(ids),
        "complete": complete,
        "queued_index": await services.redis.zcard(keys.team_status(team, "queued")),
        "queue_entries": await services.redis.xlen(keys.queue("normal", team)),
        "queued_counter": (await services.jobs.status_counts())["queued"],
        "hashes": len(
            [
                k
                async for k in services.redis.scan_iter(match=f"{keys.prefix}:job:*", count=1000)
                if not k.endswith(":events")
            ]
        ),
    }


def test_while_redis_is_down_requests_fail_fast_with_503_and_nothing_is_half_written(
    api_on_own_redis: Api, own_redis: RedisServer, job_request: dict
) -> None:
    api, client = api_on_own_redis, api_on_own_redis.client()
    accepted = [submit(client, job_request, seed).json()["id"] for seed in range(3)]
    own_redis.stop()

    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["redis"].startswith("unreachable")
    assert client.get("/healthz").status_code == 200  # the process itself is fine
    refused = submit(client, job_request, seed=99)  # fails fast: its latency is benchmarks/api_outage.py's
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    assert "Redis" in refused.json()["detail"] and "nothing was changed" in refused.json()["detail"]
    assert client.get(f"/v1/jobs/{accepted[0]}").status_code == 503
    assert client.get("/v1/jobs").status_code == 503
    assert "ftc_redis_up 0.0" in client.get("/metrics").text

    own_redis.restart()
    wait_until(lambda: client.get("/readyz").status_code == 200, "readiness after the restart", timeout=10)
    assert [job["id"] for job in client.get("/v1/jobs").json()["jobs"]] == accepted[::-1]
    report = api.run(lambda services: consistency_report(services, "team-a"))
    assert report == dict.fromkeys(report, 3), report
    assert submit(client, job_request, seed=99).status_code == 201


def test_a_redis_crash_mid_burst_loses_no_accepted_job_and_leaves_no_partial_one(
    api_on_own_redis: Api, own_redis: RedisServer, job_request: dict
) -> None:
    api = api_on_own_redis
    accepted: list[str] = []
    statuses: list[int] = []
    stop = threading.Event()
    lock = threading.Lock()

    def client_loop(offset: int) -> None:
        client, seed = api.client(), offset
        while not stop.is_set():
            seed += 1000
            try:
                response = submit(client, job_request, seed)
            except httpx.HTTPError:
                continue
            with lock:
                statuses.append(response.status_code)
                if response.status_code == 201:
                    accepted.append(response.json()["id"])

    threads = [threading.Thread(target=client_loop, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(accepted) >= 50, "50 accepted submissions", timeout=20)
    own_redis.kill()  # SIGKILL: no shutdown, no final flush
    time.sleep(0.5)
    stop.set()
    for thread in threads:
        thread.join(10)
    assert set(statuses) <= {201, 503}, sorted(set(statuses))
    assert 503 in statuses

    own_redis.restart()  # replays the append-only file
    client = api.client()
    wait_until(lambda: client.get("/readyz").status_code == 200, "readiness after the restart", timeout=10)
    for job_id in accepted:
        assert client.get(f"/v1/jobs/{job_id}").status_code == 200, job_id
    report = api.run(lambda services: consistency_report(services, "team-a"))
    # Every job Redis has is whole; it may hold a few more than were acknowledged (a reply lost in the
    # crash), which a client retry with the same Idempotency-Key or body gets back.
    assert len(set(report.values())) == 1, report
    assert report["indexed"] >= len(accepted)
