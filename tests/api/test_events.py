"""Server-sent events of a job: replay, live progress, resume with Last-Event-ID, end on a final status."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from cli.client import parse_sse
from service.schemas import Progress
from tests.support.service import Api


def read_events(client: httpx.Client, job_id: str, headers: dict | None = None) -> list[tuple[str, str, dict]]:
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers or {}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(parse_sse(response.iter_lines()))


def test_a_finished_job_replays_its_events_and_the_stream_ends(any_store_api: Api, job_request: dict) -> None:
    client = any_store_api.client()
    job_id = client.post("/v1/jobs", json=job_request).json()["id"]

    async def run_the_job(services):
        await services.queue.claim("w1", block_ms=0)
        for layer in (1, 2, 3):
            await services.jobs.update_progress(job_id, "w1", Progress(layer=layer, layers=3, stage="compressing"))
        await services.jobs.finish(job_id, "w1", "succeeded")

    any_store_api.run(run_the_job)
    events = read_events(client, job_id)
    assert [(kind, data.get("status", data.get("layer"))) for _, kind, data in events] == [
        ("status", "queued"),
        ("status", "running"),
        ("progress", 1),
        ("progress", 2),
        ("progress", 3),
        ("status", "succeeded"),
    ]
    # Reconnecting after the third event replays only what came after it.
    after_third = read_events(client, job_id, {"Last-Event-ID": events[2][0]})
    assert [e[0] for e in after_third] == [e[0] for e in events[3:]]


def test_live_progress_arrives_while_the_job_runs(api: Api, job_request: dict) -> None:
    client = api.client()
    job_id = client.post("/v1/jobs", json=job_request).json()["id"]
    received: list[tuple[float, str, dict]] = []

    def follow() -> None:
        with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            for _, kind, data in parse_sse(response.iter_lines()):
                received.append((time.monotonic(), kind, data))

    listener = threading.Thread(target=follow)
    listener.start()

    async def work_slowly(services):
        await services.queue.claim("w1", block_ms=0)
        sent = []
        for layer in (1, 2):
            await asyncio.sleep(0.3)
            sent.append(time.monotonic())
            await services.jobs.update_progress(
                job_id, "w1", Progress(layer=layer, layers=2, stage="compressing", eta_seconds=0.3 * (2 - layer))
            )
        await asyncio.sleep(0.3)
        sent.append(time.monotonic())
        await services.jobs.finish(job_id, "w1", "failed", "calibration data too short for seq_len 256")
        return sent

    sent = api.run(work_slowly)
    listener.join(10)
    assert not listener.is_alive(), "the stream should end after the final status"
    progress = [(at, data) for at, kind, data in received if kind == "progress"]
    assert [data["layer"] for _, data in progress] == [1, 2]
    finished = sent[-1]  # when the worker recorded the end; every progress event arrived before it
    assert all(published <= at < finished for (at, _), published in zip(progress, sent[:-1], strict=True))  # live
    assert received[-1][1] == "status" and received[-1][2]["status"] == "failed"
    assert "too short" in received[-1][2]["error"]


def test_cancelling_is_announced_on_the_stream(api: Api, job_request: dict) -> None:
    client = api.client()
    job_id = client.post("/v1/jobs", json=job_request).json()["id"]
    client.delete(f"/v1/jobs/{job_id}")
    events = read_events(client, job_id)
    assert events[-1][2]["status"] == "cancelled" and events[-1][2]["reason"] == "cancelled before it started"
