"""The worker loop in process (no Ray): real Redis, a local-folder store, tiny models.

These drive `JobWorker.run` exactly as the Ray actor does, so they cover the job's life (claim,
progress, checkpoints, evaluation, publication, cancel, failure, shutdown and resume) in seconds;
test_workers_e2e.py repeats the important paths with separate processes and S3.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ftc.evaluation.data import load_text, tokenize
from ftc.evaluation.evaluate import perplexity
from ftc.models.registry import resolve_model
from ftc.runtime.loading import load_model
from service.ids import new_id
from service.runtime import Services
from service.schemas import TERMINAL_STATUSES, JobRecord, JobRequest
from service.store import LocalStore
from service.store.layout import job_prefix, upload_key
from service.uploads import upload_uri
from tests.support.service import run_async
from tests.support.workers import worker_job_request
from workers.actor import JobWorker
from workers.settings import WorkerSettings

TEAM = "team-a"
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """The worker sets torch's thread count for its process; give the test process its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


async def submit(services: Services, request: dict, key: str | None = None) -> str:
    submission = await services.jobs.submit(TEAM, JobRequest.model_validate(request), key)
    return submission.record.id


async def wait_for(
    services: Services, job_id: str, done: Callable[[JobRecord], bool], timeout: float = 120.0
) -> JobRecord:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        record = await services.jobs.require(TEAM, job_id)
        if done(record):
            return record
        if loop.time() > deadline:
            raise TimeoutError(f"job {job_id} is {record.status} at {record.progress}")
        await asyncio.sleep(0.02)


def ended(record: JobRecord) -> bool:
    return record.status in TERMINAL_STATUSES


class Worker:
    """A `JobWorker` running on the test's event loop, stopped on exit."""

    def __init__(self, settings: WorkerSettings, slot: str = "cpu0") -> None:
        self.actor = JobWorker(settings, slot, "cpu")
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> JobWorker:
        self.task = asyncio.create_task(self.actor.run())
        return self.actor

    async def __aexit__(self, *exc_info: object) -> None:
        await self.actor.stop()
        assert self.task is not None
        await self.task


def run(settings: WorkerSettings, work: Callable[[Services], Awaitable]):
    return run_async(settings, work)


def run_job(settings: WorkerSettings, request: dict, timeout: float = 120.0) -> JobRecord:
    """Submit `request`, run one in-process worker until the job ends, and return its last record."""

    async def scenario(services: Services) -> JobRecord:
        job_id = await submit(services, request)
        async with Worker(settings):
            return await wait_for(services, job_id, ended, timeout)

    return run(settings, scenario)


async def events_of(services: Services, job_id: str) -> list:
    return await services.jobs.events(job_id)


def store_names(settings: WorkerSettings, job_id: str) -> dict[str, int]:
    store = LocalStore(settings.store_url)
    prefix = job_prefix(TEAM, job_id)
    return {info.key[len(prefix) :]: info.size for info in store.list(prefix)}


def job_folder(settings: WorkerSettings, job_id: str) -> Path:
    return Path(settings.store_url) / job_prefix(TEAM, job_id)


def test_a_job_runs_to_success_and_publishes_artifact_metrics_checkpoints_and_log(worker_settings, models_dir) -> None:
    settings = worker_settings()
    root, model = models_dir(layers=4)
    store = LocalStore(settings.store_url)
    upload_id = new_id("upl")
    store.put_bytes(upload_key(TEAM, upload_id, "calib.txt"), load_text("wikitext2", "validation")[:200_000].encode())
    calibration_uri = upload_uri(upload_id, "calib.txt")  # as POST /v1/uploads names it
    request = worker_job_request(
        model,
        calibration={"dataset": calibration_uri, "samples": 4, "seq_len": 64, "seed": 1},
        eval={"datasets": ["wikitext2", calibration_uri], "seq_len": 64, "max_windows": 2, "dense_reference": True},
    )

    async def scenario(services: Services):
        job_id = await submit(services, request)
        async with Worker(settings):
            record = await wait_for(services, job_id, ended)
        return record, await events_of(services, job_id)

    record, events = run(settings, scenario)
    assert record.status == "succeeded", record.error
    assert record.attempts == 1
    assert (record.progress.layer, record.progress.layers) == (4, 4)
    statuses = [e.data["status"] for e in events if e.type == "status"]
    assert statuses == ["queued", "running", "succeeded"]
    progress = [e.data for e in events if e.type == "progress"]
    # the default allocation measures its layer plan first; the layers' clock restarts at 0 after it
    assert [p["layer"] for p in progress if p["stage"] == "compressing"] == [0, 0, 1, 2, 3, 4]
    assert [p["stage"] for p in progress if p["stage"] != "compressing"] == ["preparing", "planning", "evaluating",
                                                                             "uploading"]
    assert all(p["eta_seconds"] is not None for p in progress if p["stage"] == "compressing" and p["layer"] > 0)

    names = store_names(settings, record.id)
    for expected in (
        "manifest.json",
        "model.safetensors",
        "metrics.json",
        "log.txt",
        "config.json",
        "tokenizer.json",
        "checkpoints/fingerprint.json",
    ):
        assert expected in names
    assert [n for n in names if n.startswith("checkpoints/layer-")] == [
        f"checkpoints/layer-{i:03d}.{suffix}" for i in range(4) for suffix in ("json", "safetensors")
    ]
    assert not [n for n in names if "stream-" in n], "calibration streams are dropped once the job succeeded"

    folder = job_folder(settings, record.id)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {name: meta["size"] for name, meta in manifest["files"].items()} == {
        name: size
        for name, size in names.items()
        if name not in ("manifest.json", "log.txt") and not name.startswith("checkpoints/")
    }
    metrics = json.loads((folder / "metrics.json").read_text())
    assert set(metrics["perplexity"]) == {"wikitext2", calibration_uri}
    assert metrics["resumed_from_layer"] == 0 and metrics["layers"] == 4 and metrics["attempt"] == 1
    assert metrics["storage"]["qkv_values_used"] <= metrics["storage"]["qkv_budget_values"]
    assert {"prepare_seconds", "compress_seconds", "evaluate_seconds", "upload_seconds"} <= set(metrics["timings"])
    assert manifest["calibration"]["seed"] == 1 and manifest["calibration"]["source"].endswith("calib.txt")

    # The published folder is a working artifact on its own, and its metrics describe it.
    test_ids = None
    for source, key in ((folder, "perplexity"), (root / model, "dense_perplexity")):
        loaded, tokenizer = load_model(resolve_model(str(source)))
        test_ids = tokenize(tokenizer, load_text("wikitext2", "test")) if test_ids is None else test_ids
        again = perplexity(loaded, test_ids, 64, 2, progress=False)
        assert again["ppl"] == pytest.approx(metrics[key]["wikitext2"]["ppl"], rel=1e-5)
    assert set(metrics["dense_perplexity"]) == set(metrics["perplexity"])

    log = (folder / "log.txt").read_text()
    assert "starting at layer 0 of 4 (no checkpoints)" in log
    assert "layer 4 of 4 done" in log and "job " + record.id + ": succeeded" in log


def test_a_cancelled_job_stops_within_one_layer(worker_settings, models_dir) -> None:
    settings = worker_settings()
    _root, model = models_dir(layers=12)

    async def scenario(services: Services):
        job_id = await submit(services, worker_job_request(model))
        async with Worker(settings):
            await wait_for(services, job_id, lambda r: r.progress.layer >= 2)
            cancellation = await services.jobs.cancel(TEAM, job_id)
            record = await wait_for(services, job_id, ended)
        return cancellation, record

    cancellation, record = run(settings, scenario)
    assert cancellation.outcome == "flagged"
    at_cancel = cancellation.record.progress.layer
    assert record.status == "cancelled"
    assert record.progress.layer <= at_cancel + 1 < 12
    names = store_names(settings, record.id)
    finished = [n for n in names if n.startswith("checkpoints/layer-") and n.endswith(".json")]
    assert len(finished) == record.progress.layer, "every finished layer is checkpointed, and no more ran"
    assert "manifest.json" not in names and "metrics.json" not in names
    log = (job_folder(settings, record.id) / "log.txt").read_text()
    assert "cancel requested; stopping before the next layer" in log and ": cancelled" in log


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"model": "tiny/not-there"}, "model tiny/not-there is not in the Hugging Face cache"),
        ({"calibration": {"samples": 1, "seq_len": 16}}, "raise --calib-samples or --seq-len"),
    ],
    ids=["unknown-model", "too-little-calibration"],
)
def test_a_job_that_cannot_run_fails_with_a_readable_reason_and_keeps_its_log(
    worker_settings, models_dir, change: dict, reason: str
) -> None:
    settings = worker_settings()
    _root, model = models_dir(layers=4)

    record = run_job(settings, worker_job_request(model) | change)
    assert record.status == "failed" and record.attempts == 1
    assert reason in record.error and "Traceback" not in record.error
    log = (job_folder(settings, record.id) / "log.txt").read_text()
    assert "Traceback" in log and reason in log


def test_a_worker_without_the_task_files_fails_the_job_before_compressing(
    worker_settings, models_dir, monkeypatch, tmp_path
) -> None:
    monkeypatch.setenv("FTC_DATA_DIR", str(tmp_path))
    settings = worker_settings()
    _root, model = models_dir(layers=4)

    record = run_job(settings, worker_job_request(model, eval={"datasets": [], "tasks": ["piqa"]}))
    assert record.status == "failed" and record.attempts == 1
    assert f"{tmp_path}/tasks/piqa_validation.jsonl; set FTC_DATA_DIR" in record.error
    assert record.progress.layer == 0  # not after hours of compression


def test_a_job_whose_lease_is_taken_away_is_left_to_its_new_owner(worker_settings, models_dir) -> None:
    settings = worker_settings(lease_seconds=5)
    _root, model = models_dir(layers=12)

    async def scenario(services: Services):
        job_id = await submit(services, worker_job_request(model))
        async with Worker(settings) as worker:
            await wait_for(services, job_id, lambda r: r.progress.layer >= 1)
            # What the janitor does when it re-delivers a job another worker then claims.
            await services.redis.hset(services.jobs.keys.job(job_id), "worker", "someone-else")
            await asyncio.sleep(2.5)  # more than one heartbeat interval
            jobs_run = worker.jobs_run
        return jobs_run, await services.jobs.require(TEAM, job_id)

    jobs_run, record = run(settings, scenario)
    assert jobs_run == 1, "the worker gave the job up and went back to the queue"
    assert record.status == "running" and record.worker == "someone-else"
    assert record.progress.layer < 12


def test_a_job_interrupted_by_shutdown_resumes_elsewhere_and_equals_an_uninterrupted_run(
    worker_settings, models_dir
) -> None:
    settings = worker_settings(lease_seconds=5)
    _root, model = models_dir(layers=12)
    request = worker_job_request(model)

    async def scenario(services: Services):
        job_id = await submit(services, request)
        async with Worker(settings, "first"):
            await wait_for(services, job_id, lambda r: r.progress.layer >= 3)
        interrupted = await services.jobs.require(TEAM, job_id)
        finished = store_names(settings, job_id)
        # The lease runs out; the janitor re-delivers the job and another worker resumes it.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not (await services.queue.reap()) and loop.time() < deadline:
            await asyncio.sleep(0.25)
        reference_id = await submit(services, request, key="uninterrupted")
        async with Worker(settings, "second"):
            resumed = await wait_for(services, job_id, ended)
            reference = await wait_for(services, reference_id, ended)
        return interrupted, finished, resumed, reference

    interrupted, finished, resumed, reference = run(settings, scenario)
    assert interrupted.status == "running", "a shutdown leaves the job for re-delivery"
    restored = len([n for n in finished if n.startswith("checkpoints/layer-") and n.endswith(".json")])
    assert 3 <= restored < 12
    assert resumed.status == reference.status == "succeeded"
    assert resumed.attempts == 2 and reference.attempts == 1

    log = (job_folder(settings, resumed.id) / "log.txt").read_text()
    assert "interrupted by worker shutdown" in log
    assert f"resuming at layer {restored} of 12 ({restored} layers from checkpoints)" in log
    assert log.index("attempt 1 of") < log.index("attempt 2 of"), "the log keeps every attempt"
    metrics = json.loads((job_folder(settings, resumed.id) / "metrics.json").read_text())
    assert metrics["resumed_from_layer"] == restored

    resumed_tensors = load_file(job_folder(settings, resumed.id) / "model.safetensors")
    reference_tensors = load_file(job_folder(settings, reference.id) / "model.safetensors")
    assert resumed_tensors.keys() == reference_tensors.keys()
    assert all(torch.equal(resumed_tensors[k], reference_tensors[k]) for k in resumed_tensors)
