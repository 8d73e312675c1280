"""The API as `ftc serve` runs it: several uvicorn workers in their own processes."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.servers import RedisServer, start_api
from tests.support.service import API_KEYS, JOB_REQUEST, TEAM_KEYS


def test_several_workers_share_the_port_and_answer(redis_server: RedisServer, tmp_path: Path) -> None:
    """Latency (no Nagle stalls: a median of a few ms, not ~40) is measured by benchmarks/api_load.py."""
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
            for seed in range(30):
                body = {**JOB_REQUEST, "calibration": {**JOB_REQUEST["calibration"], "seed": seed}}
                assert client.post("/v1/jobs", json=body).status_code == 201
            assert len(client.get("/v1/jobs", params={"limit": 100}).json()["jobs"]) == 30
    finally:
        api.stop()
