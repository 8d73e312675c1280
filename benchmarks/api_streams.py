"""Open event streams against one API process: does the rest of the API keep answering?

Starts its own redis-server and one API process (`python -m api.server`, one uvicorn worker),
submits `--jobs` jobs and opens `--streams` server-sent-event streams spread over them (raw
HTTP/1.1 connections from a separate process, so the client costs the server nothing). With no
stream open, then with all of them open, it times `GET /readyz` and `POST /v1/jobs` one request at
a time (`--probes` each). Then it publishes one progress event per job, as a worker does, and
times how long until every stream has it; finally it finishes the jobs and checks that every
stream got the final status and ended.

    .venv/bin/python benchmarks/api_streams.py                      # 1,000 streams over 50 jobs
    .venv/bin/python benchmarks/api_streams.py --streams 2000 --jobs 100

Writes benchmarks/results/api_streams.{md,json}. Exits 1 when a stream failed to open or missed an
event, or a probe failed (with --strict, also when a latency target is missed).
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from service.runtime import Services  # noqa: E402
from service.schemas import Progress  # noqa: E402
from service.settings import Settings  # noqa: E402
from tests.support.servers import start_api, start_redis  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
API_KEY, TEAM = "bench-key-0123456789", "bench"
TARGET_P99_MS = 100.0
"""Probes must answer as they do with no stream open: within the submission target of api_load.py."""

REQUEST = {
    "model": "smollm2-135m",
    "ratio": 0.4,
    "calibration": {"dataset": "wikitext2", "samples": 8, "seq_len": 256, "seed": 0},
    "eval": {"datasets": ["wikitext2"], "seq_len": 256, "max_windows": 4},
}


async def _open_stream(port: int, job_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Accept: text/event-stream\r\n\r\n".encode()
    )
    status_line = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n", 1)[0]
    return reader, writer, int(status_line.split()[1])


async def _follow(reader: asyncio.StreamReader, marks: dict, index: int) -> None:
    """Read SSE lines; note when the progress event and the final status arrive."""
    while line := await reader.readline():
        if line.startswith(b"event: progress"):
            marks["progress"][index] = time.time()
        elif line.startswith(b"data:") and b'"succeeded"' in line:
            marks["final"][index] = time.time()
            return


def _stream_client(port: int, job_ids: list[str], streams: int, control, report) -> None:
    """The stream-holding process: open, report, then follow until the jobs end."""

    async def main() -> dict:
        opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        statuses: dict[str, int] = {}
        started = time.perf_counter()
        for first in range(0, streams, 100):  # a hundred at a time, as many dashboards would
            batch = [_open_stream(port, job_ids[n % len(job_ids)]) for n in range(first, min(first + 100, streams))]
            for result in await asyncio.gather(*batch, return_exceptions=True):
                status = "error" if isinstance(result, BaseException) else str(result[2])
                statuses[status] = statuses.get(status, 0) + 1
                if not isinstance(result, BaseException):
                    opened.append((result[0], result[1]))
        open_seconds = time.perf_counter() - started
        marks: dict = {"progress": {}, "final": {}}
        followers = [asyncio.create_task(_follow(reader, marks, n)) for n, (reader, _) in enumerate(opened)]
        report.send({"opened": len(opened), "statuses": statuses, "open_seconds": round(open_seconds, 2)})
        await asyncio.get_running_loop().run_in_executor(None, control.recv)  # the jobs have ended
        await asyncio.wait(followers, timeout=30)
        for _, writer in opened:
            writer.close()
        return {"progress": marks["progress"], "final": marks["final"]}

    report.send(asyncio.run(main()))


async def _probe(http: httpx.AsyncClient, probes: int, seed_base: int) -> dict:
    """`probes` readiness checks and submissions, one at a time; latencies in ms."""
    timings: dict[str, list[float]] = {"readyz": [], "submit": []}
    failed = 0
    for n in range(probes):
        started = time.perf_counter()
        failed += (await http.get("/readyz")).status_code != 200
        timings["readyz"].append((time.perf_counter() - started) * 1000)
        body = {**REQUEST, "calibration": {**REQUEST["calibration"], "seed": seed_base + n}}
        started = time.perf_counter()
        failed += (await http.post("/v1/jobs", json=body)).status_code != 201
        timings["submit"].append((time.perf_counter() - started) * 1000)
    summary = {
        name: {
            "p50": round(statistics.median(values), 2),
            "p99": round(sorted(values)[min(len(values) - 1, int(0.99 * len(values)))], 2),
            "max": round(max(values), 2),
        }
        for name, values in timings.items()
    }
    return {"latency_ms": summary, "failed": failed}


async def _drive(args: argparse.Namespace, port: int, settings: Settings) -> dict:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=30) as http:
        job_ids = []
        for n in range(args.jobs):
            body = {**REQUEST, "calibration": {**REQUEST["calibration"], "seed": 10_000_000 + n}}
            job_ids.append((await http.post("/v1/jobs", json=body)).json()["id"])
        baseline = await _probe(http, args.probes, seed_base=20_000_000)

        context = multiprocessing.get_context("spawn")
        control_out, control_in = context.Pipe(duplex=False)
        report_out, report_in = context.Pipe(duplex=False)
        client = context.Process(target=_stream_client, args=(port, job_ids, args.streams, control_out, report_in))
        client.start()
        opening = await asyncio.to_thread(report_out.recv)
        await asyncio.sleep(2.0)  # let every stream replay its history and settle into waiting
        loaded = await _probe(http, args.probes, seed_base=30_000_000)

        services = Services.open(settings)
        published: dict[str, float] = {}
        try:  # act as the worker: claim each job, publish one progress event, then finish them
            claimed = []
            for _ in job_ids:
                claim = await services.queue.claim("bench-worker", block_ms=0)
                if claim is not None:
                    claimed.append(claim.job_id)
            for job_id in claimed:
                published[job_id] = time.time()
                await services.jobs.update_progress(job_id, "bench-worker", Progress(layer=1, layers=2, stage="x"))
            await asyncio.sleep(3.0)
            for job_id in claimed:
                await services.jobs.finish(job_id, "bench-worker", "succeeded")
        finally:
            await services.close()
        control_in.send("ended")
        marks = await asyncio.to_thread(report_out.recv)
        await asyncio.to_thread(client.join, 30)
    # Stream n follows job n % jobs; its delay runs from the moment that job's event was published.
    delays = sorted((at - published[job_ids[n % len(job_ids)]]) * 1000 for n, at in marks["progress"].items())
    return {
        "opening": opening,
        "baseline": baseline,
        "with_streams": loaded,
        "jobs_claimed": len(claimed),
        "progress_received": len(delays),
        "progress_delay_ms": {
            "p50": round(statistics.median(delays), 1) if delays else None,
            "max": round(delays[-1], 1) if delays else None,
        },
        "final_received": len(marks["final"]),
        "progress_published": len(published),
    }


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="ftc-api-streams-"))
    redis_server = start_redis(workdir / "redis")
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    env = {
        "FTC_REDIS_URL": redis_server.url,
        "FTC_KEY_PREFIX": prefix,
        "FTC_STORE_URL": str(workdir / "store"),
        "FTC_API_KEYS": f"{API_KEY}:{TEAM}",
        "FTC_JANITOR_INTERVAL_SECONDS": "0",
    }
    settings = Settings(redis_url=redis_server.url, key_prefix=prefix, api_keys=env["FTC_API_KEYS"])
    api = start_api(workdir / "api", env, workers=1)
    try:
        measured = asyncio.run(_drive(args, api.port, settings))
    finally:
        api.stop()
        redis_server.stop()
    streams = args.streams
    opened = measured["opening"]["opened"]
    p99 = max(measured["with_streams"]["latency_ms"][name]["p99"] for name in ("readyz", "submit"))
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_before": round(load_before, 2),
        },
        "config": {"streams": streams, "jobs": args.jobs, "probes": args.probes, "api_workers": 1},
        **measured,
        "targets": {
            "streams_open": {"target": f"{streams}", "met": opened == streams},
            "every_stream_got_each_event": {
                "target": f"{streams}",
                "met": measured["progress_received"] == measured["final_received"] == streams,
            },
            "probes_answer": {
                "target": "all 200/201",
                "met": measured["with_streams"]["failed"] == 0 and measured["baseline"]["failed"] == 0,
            },
            "p99_ms_with_streams": {"target": f"< {TARGET_P99_MS:.0f}", "met": p99 < TARGET_P99_MS},
        },
    }


def to_markdown(result: dict) -> str:
    t, base, loaded = result["targets"], result["baseline"]["latency_ms"], result["with_streams"]["latency_ms"]
    c = result["config"]

    def mark(name: str) -> str:
        return "met" if t[name]["met"] else "MISSED"

    def row(name: str, label: str) -> str:
        b, w = base[name], loaded[name]
        return f"| {label} | {b['p50']} / {b['p99']} / {b['max']} | {w['p50']} / {w['p99']} / {w['max']} |"

    return "\n".join(
        [
            "# API event streams: many open streams on one process",
            "",
            f"`benchmarks/api_streams.py` on {result['date']}: {c['streams']} server-sent-event streams over "
            f"{c['jobs']} queued jobs, held open by a separate client process, against one API process "
            f"(uvicorn, 1 worker) and a redis-server on the same machine ({result['machine']['cpus']} CPUs, "
            f"Python {result['machine']['python']}; 1-minute load average before the run "
            f"{result['machine']['load_average_before']}). Probes are {c['probes']} `GET /readyz` and "
            f"{c['probes']} `POST /v1/jobs`, one request at a time, before the streams open and while they are open.",
            "",
            "| | value | target |",
            "| --- | --- | --- |",
            f"| streams open (HTTP 200) | {result['opening']['opened']} in {result['opening']['open_seconds']} s "
            f"{result['opening']['statuses']} | {t['streams_open']['target']} ({mark('streams_open')}) |",
            f"| streams that got the progress event / the final status | {result['progress_received']} / "
            f"{result['final_received']} | {t['every_stream_got_each_event']['target']} "
            f"({mark('every_stream_got_each_event')}) |",
            f"| one progress event per job, from its publication to each stream: p50 / max | "
            f"{result['progress_delay_ms']['p50']} ms / {result['progress_delay_ms']['max']} ms | |",
            f"| probes answered | failed {result['baseline']['failed']} before, {result['with_streams']['failed']} "
            f"with streams | {t['probes_answer']['target']} ({mark('probes_answer')}) |",
            f"| worst probe p99 with streams open | {max(loaded['readyz']['p99'], loaded['submit']['p99'])} ms | "
            f"{t['p99_ms_with_streams']['target']} ms ({mark('p99_ms_with_streams')}) |",
            "",
            "| probe latency (ms) | no stream: p50 / p99 / max | streams open: p50 / p99 / max |",
            "| --- | --- | --- |",
            row("readyz", "`GET /readyz`"),
            row("submit", "`POST /v1/jobs`"),
            "",
            "All open streams share one Redis reader in the API process (api/sse.py); before, each held a "
            "pooled Redis connection and about 110 streams made every route answer 503.",
            "",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=50, help="queued jobs the streams follow")
    parser.add_argument("--probes", type=int, default=200, help="readyz and submit requests per phase")
    parser.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a latency target is missed too")
    args = parser.parse_args()

    result = run(args)
    report = to_markdown(result)
    print(report)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "api_streams.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS / "api_streams.md").write_text(report)
    hard = ("streams_open", "every_stream_got_each_event", "probes_answer")
    if not all(result["targets"][name]["met"] for name in hard):
        return 1
    if args.strict and not result["targets"]["p99_ms_with_streams"]["met"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
