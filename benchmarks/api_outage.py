"""How fast the API answers while Redis is down: a submission must fail fast with 503, not hang.

Starts its own redis-server and the API (one uvicorn worker), submits a few jobs, stops Redis,
then times submissions, job reads and /readyz until Redis is back. The tests check what is
answered (503, Retry-After, nothing half-written); this script measures how long it takes, which
depends on the machine and is no test's business.

    .venv/bin/python benchmarks/api_outage.py               # 20 requests of each kind
    .venv/bin/python benchmarks/api_outage.py --requests 100 --strict

Writes benchmarks/results/api_outage.{md,json}. With --strict, exits 1 when the median refused
submission takes longer than the target (the Redis socket timeout, FTC_REDIS_TIMEOUT_SECONDS).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from service.settings import Settings  # noqa: E402
from tests.support.servers import start_api, start_redis  # noqa: E402
from tests.support.service import JOB_REQUEST  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
API_KEY, TEAM = "bench-key-0123456789", "bench"
TARGET_SECONDS = Settings().redis_timeout_seconds


def timed(call) -> tuple[float, int]:
    started = time.perf_counter()
    status = call().status_code
    return time.perf_counter() - started, status


def summary(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {"median_ms": round(statistics.median(ordered) * 1000, 1),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 1),
            "max_ms": round(ordered[-1] * 1000, 1)}


def run(requests: int) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="ftc-api-outage-"))
    redis_server = start_redis(workdir / "redis")
    env = {"FTC_REDIS_URL": redis_server.url, "FTC_KEY_PREFIX": f"bench-{uuid.uuid4().hex[:8]}",
           "FTC_STORE_URL": str(workdir / "store"), "FTC_API_KEYS": f"{API_KEY}:{TEAM}",
           "FTC_JANITOR_INTERVAL_SECONDS": "0"}
    api = start_api(workdir / "api", env)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{api.port}", headers=headers, timeout=30) as client:
            body = {**JOB_REQUEST, "calibration": {**JOB_REQUEST["calibration"], "seed": 0}}
            job_id = client.post("/v1/jobs", json=body).json()["id"]
            redis_server.stop()
            kinds = {
                "submit": lambda n: client.post(
                    "/v1/jobs", json={**JOB_REQUEST, "calibration": {**JOB_REQUEST["calibration"], "seed": n + 1}}),
                "get": lambda n: client.get(f"/v1/jobs/{job_id}"),
                "readyz": lambda n: client.get("/readyz"),
            }
            measured = {}
            for kind, call in kinds.items():
                results = [timed(lambda n=n, call=call: call(n)) for n in range(requests)]
                statuses = sorted({status for _, status in results})
                measured[kind] = {**summary([s for s, _ in results]), "statuses": statuses}
    finally:
        api.stop()
    return measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--requests", type=int, default=20, help="requests of each kind while Redis is down")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    parser.add_argument("--no-write", action="store_true", help="print only; keep benchmarks/results as it is")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    measured = run(args.requests)
    met = measured["submit"]["median_ms"] <= TARGET_SECONDS * 1000
    result = {"measured": measured, "target_median_submit_ms": TARGET_SECONDS * 1000, "target_met": met,
              "requests": args.requests, "load_average_before": round(load_before, 2),
              "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    lines = ["# API while Redis is down", "",
             f"`benchmarks/api_outage.py --requests {args.requests}`, {result['date']}, "
             f"{os.cpu_count()} CPUs, load average {load_before:.2f} before the run.", "",
             "| request | status | median ms | p90 ms | max ms |", "|---|---|---|---|---|"]
    for kind, m in measured.items():
        lines.append(f"| {kind} | {', '.join(map(str, m['statuses']))} | {m['median_ms']} | {m['p90_ms']} | "
                     f"{m['max_ms']} |")
    lines += ["", f"Target: a refused submission answers within the Redis socket timeout "
              f"({TARGET_SECONDS:g} s) at the median: {'met' if met else 'MISSED'}."]
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "api_outage.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS / "api_outage.md").write_text(report)
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
