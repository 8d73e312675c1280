"""The API as `ftc serve` runs it: several uvicorn workers in their own processes."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import httpx

from tests.support.servers import RedisServer, start_api
from tests.support.service import API_KEYS, JOB_REQUEST, TEAM_KEYS


def test_several_workers_share_the_port_and_answer_without_nagle_stalls(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    env = {
        "FTC_REDIS_URL": redis_server.url,
        "FTC_KEY_PREFIX": f"serve-{tmp_path.name}",
        "FTC_STORE_URL": str(tmp_path / "store"),
        "FTC_API_KEYS": API_KEYS,
    }
    api = start_api(tmp_path / "api", env, workers=2)
    try:
        headers = {"Authorization": f"Bearer {TEAM_KEYS['team-a']}"}
        with httpx.Client(base_url=f"http://127.0.0.1:{api.port}", headers=headers) as client:
            took = []
            for seed in range(30):
                body = {**JOB_REQUEST, "calibration": {**JOB_REQUEST["calibration"], "seed": seed}}
                started = time.perf_counter()
                assert client.post("/v1/jobs", json=body).status_code == 201
                took.append(time.perf_counter() - started)
            assert len(client.get("/v1/jobs", params={"limit": 100}).json()["jobs"]) == 30
        # With Nagle's algorithm left on, each answer waits ~40 ms for a delayed ACK.
        assert statistics.median(took) < 0.025, f"median {statistics.median(took) * 1000:.1f} ms"
    finally:
        api.stop()
