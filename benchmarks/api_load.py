"""Load test of job submission: N concurrent clients POST /v1/jobs for a fixed time.

Starts its own redis-server (append-only file on, fsync per write) and the API under uvicorn, then
drives it from separate load-generator processes over loopback. Reports accepted submissions per
second and latency percentiles (medians over repeated windows), and checks that Redis holds
exactly the accepted jobs.

    .venv/bin/python benchmarks/api_load.py                # 3 x 10 s, 32 clients, 2 API workers
    .venv/bin/python benchmarks/api_load.py --seconds 30 --clients 128

Writes benchmarks/results/api_load.{md,json}. Exits 1 when a job was lost (or, with --strict,
when a target is missed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
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
import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.servers import start_api, start_redis  # noqa: E402
from tests.support.service import JOB_REQUEST as REQUEST  # noqa: E402  (the tests' example job, not a copy)

RESULTS = REPO / "benchmarks" / "results"
API_KEY, TEAM = "bench-key-0123456789", "bench"
TARGET_RATE, TARGET_P99_MS = 500.0, 100.0

class RawHttpConnection:
    """A minimal keep-alive HTTP/1.1 client: one connection, one request at a time.

    The load generator must cost far less than the server it measures; httpx's async pool spends
    several milliseconds of CPU per request at this concurrency, so it is kept as an option only.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_json(self, path: str, body: dict) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        self.writer.write(head.encode() + payload)
        status_line, *headers = (await self.reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        length = next(int(h.split(":", 1)[1]) for h in headers if h.lower().startswith("content-length:"))
        await self.reader.readexactly(length)
        return int(status_line.split()[1])

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class HttpxConnection:
    """The same, through a shared httpx.AsyncClient."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def post_json(self, path: str, body: dict) -> int:
        return (await self.http.post(path, json=body)).status_code

    async def close(self) -> None:
        pass


async def _client(connection, client_id: int, start: float, stop: float, out: dict) -> None:
    """One client: submit back to back (each body unique, so none is deduplicated) until `stop`."""
    sequence = 0
    while (now := time.perf_counter()) < stop:
        sequence += 1
        body = {**REQUEST, "calibration": {**REQUEST["calibration"], "seed": client_id * 1_000_000 + sequence}}
        try:
            status = await connection.post_json("/v1/jobs", body)
        except (OSError, asyncio.IncompleteReadError, httpx.HTTPError):
            status = 0
            await connection.close()  # a raw connection reconnects on the next request
        elapsed = time.perf_counter() - now
        measured = now >= start
        if status == 201:
            out["accepted_total"] += 1
            if measured:
                out["accepted"] += 1
                out["latencies"].append(elapsed)
        else:
            out["failed"] += 1
            out["statuses"][str(status)] = out["statuses"].get(str(status), 0) + 1
    await connection.close()


def _generate_load(kind: str, port: int, first_client: int, clients: int, warmup: float, seconds: float, pipe) -> None:
    """A load-generator process: `clients` concurrent clients; sends its tallies back through `pipe`."""

    async def main() -> dict:
        out = {"accepted": 0, "accepted_total": 0, "failed": 0, "statuses": {}, "latencies": []}
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        base_url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=30) as http:
            if kind == "httpx":
                connections = [HttpxConnection(http) for _ in range(clients)]
            else:
                connections = [RawHttpConnection("127.0.0.1", port) for _ in range(clients)]
            start = time.perf_counter() + warmup
            stop = start + seconds
            await asyncio.gather(*(_client(c, first_client + n, start, stop, out) for n, c in enumerate(connections)))
        return out

    pipe.send(asyncio.run(main()))
    pipe.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _one_run(args: argparse.Namespace, port: int, first_client: int) -> dict:
    """One timed window from fresh load-generator processes; returns its numbers."""
    context = multiprocessing.get_context("spawn")
    per_process = [args.clients // args.load_processes] * args.load_processes
    per_process[0] += args.clients - sum(per_process)
    pipes, processes = [], []
    for clients in per_process:
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(
            target=_generate_load,
            args=(args.client, port, first_client, clients, args.warmup, args.seconds, sender),
        )
        process.start()
        pipes.append(receiver)
        processes.append(process)
        first_client += clients
    tallies = [pipe.recv() for pipe in pipes]
    for process in processes:
        process.join()
    latencies = [x for t in tallies for x in t["latencies"]]
    statuses: dict[str, int] = {}
    for t in tallies:
        for code, count in t["statuses"].items():
            statuses[code] = statuses.get(code, 0) + count
    return {
        "accepted_per_second": round(sum(t["accepted"] for t in tallies) / args.seconds, 1),
        "accepted_including_warmup": sum(t["accepted_total"] for t in tallies),
        "failed": sum(t["failed"] for t in tallies),
        "failed_by_status": statuses,
        "latency_ms": {
            name: round(_percentile(latencies, q) * 1000, 2)
            for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
        },
    }


def run(args: argparse.Namespace) -> dict:
    """Start Redis and the API, run `args.repeats` windows, then count what Redis holds."""
    load_before = os.getloadavg()[0]  # other work on the machine skews the numbers; say so
    workdir = Path(tempfile.mkdtemp(prefix="ftc-api-load-"))
    redis_server = start_redis(workdir / "redis", appendonly=True, fsync=args.fsync)
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    env = {
        "FTC_REDIS_URL": redis_server.url,
        "FTC_KEY_PREFIX": prefix,
        "FTC_STORE_URL": str(workdir / "store"),
        "FTC_API_KEYS": f"{API_KEY}:{TEAM}",
        "FTC_JANITOR_INTERVAL_SECONDS": "0",
        # One team submits everything here: its queued-jobs and rate quotas would refuse most of it.
        "FTC_QUOTA_QUEUED_JOBS": "0",
        "FTC_QUOTA_SUBMISSIONS_PER_MINUTE": "0",
    }
    api = start_api(workdir / "api", env, workers=args.workers)
    try:
        # Client ids differ between runs, so every body (and so every job) is new.
        runs = [_one_run(args, api.port, first_client=n * args.clients) for n in range(args.repeats)]
        with redis.Redis.from_url(redis_server.url, decode_responses=True) as client:
            in_redis = client.zcard(f"{prefix}:team:{TEAM}:jobs")
            queued_entries = client.xlen(f"{prefix}:queue:normal:team:{TEAM}")
    finally:
        api.stop()
        redis_server.stop()

    accepted = sum(r["accepted_including_warmup"] for r in runs)
    rate = statistics.median(r["accepted_per_second"] for r in runs)
    p50 = statistics.median(r["latency_ms"]["p50"] for r in runs)
    p99 = statistics.median(r["latency_ms"]["p99"] for r in runs)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_before": round(load_before, 2),
        },
        "config": {
            "seconds": args.seconds,
            "warmup_seconds": args.warmup,
            "repeats": args.repeats,
            "clients": args.clients,
            "load_processes": args.load_processes,
            "load_client": args.client,
            "api_workers": args.workers,
            "redis": f"redis-server, appendonly yes, appendfsync {args.fsync}",
        },
        "median": {"accepted_per_second": rate, "latency_ms": {"p50": p50, "p99": p99}},
        "runs": runs,
        "accepted_total": accepted,
        "jobs_in_redis": in_redis,
        "queue_entries_in_redis": queued_entries,
        "lost": accepted - in_redis,
        "targets": {
            "accepted_per_second": {"target": f">= {TARGET_RATE:.0f}", "met": rate >= TARGET_RATE},
            "p99_ms": {"target": f"< {TARGET_P99_MS:.0f}", "met": p99 < TARGET_P99_MS},
            "lost": {"target": "0", "met": accepted == in_redis == queued_entries},
        },
    }


def to_markdown(result: dict) -> str:
    c, median, t = result["config"], result["median"], result["targets"]

    def mark(name: str) -> str:
        return "met" if t[name]["met"] else "MISSED"

    rows = [
        f"| {n} | {r['accepted_per_second']} | {r['latency_ms']['p50']} | {r['latency_ms']['p90']} | "
        f"{r['latency_ms']['p99']} | {r['latency_ms']['max']} | {r['failed']} |"
        for n, r in enumerate(result["runs"], start=1)
    ]
    return "\n".join(
        [
            "# API load: job submissions",
            "",
            f"`benchmarks/api_load.py` on {result['date']}: {c['clients']} concurrent clients "
            f"({c['load_client']} HTTP/1.1 keep-alive, {c['load_processes']} load process) submit "
            f"`POST /v1/jobs` back to back for {c['seconds']:g} s after {c['warmup_seconds']:g} s of warm-up, "
            f"{c['repeats']} times, against the API under uvicorn with {c['api_workers']} workers and a "
            f"{c['redis']}. Everything runs on one machine ({result['machine']['cpus']} CPUs, Python "
            f"{result['machine']['python']}) over loopback, the load generator included; the 1-minute load "
            f"average before the run was {result['machine']['load_average_before']}.",
            "",
            "| median of the runs | value | target |",
            "| --- | --- | --- |",
            f"| accepted submissions / s | {median['accepted_per_second']} | "
            f"{t['accepted_per_second']['target']} ({mark('accepted_per_second')}) |",
            f"| latency p50 | {median['latency_ms']['p50']} ms | |",
            f"| latency p99 | {median['latency_ms']['p99']} ms | {t['p99_ms']['target']} ms ({mark('p99_ms')}) |",
            f"| accepted / jobs in Redis / queue entries | {result['accepted_total']} / {result['jobs_in_redis']} / "
            f"{result['queue_entries_in_redis']} | equal ({mark('lost')}) |",
            "",
            "| run | accepted / s | p50 ms | p90 ms | p99 ms | max ms | failed |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            "Latency is measured by the clients for each accepted submission inside the timed window.",
            "",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="timed window")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed windows; the report gives medians")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients")
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw", help="load-generator HTTP client")
    parser.add_argument("--load-processes", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    parser.add_argument("--fsync", choices=("always", "everysec"), default="always", help="Redis appendfsync policy")
    parser.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()

    result = run(args)
    report = to_markdown(result)
    print(report)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "api_load.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS / "api_load.md").write_text(report)
    if not result["targets"]["lost"]["met"]:
        return 1
    if args.strict and not all(target["met"] for target in result["targets"].values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
