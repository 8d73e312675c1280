"""End to end with real parts: redis-server, moto's S3 server over HTTP, the API and `ftc worker`
(local Ray, one CPU actor) as separate processes, and tiny models.

The first test starts a worker of its own and SIGKILLs it in the middle of a job; the module's
shared worker then resumes that job and serves the other tests, so Ray starts only twice.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ftc.evaluation.data import load_text, tokenize
from ftc.evaluation.evaluate import perplexity
from ftc.runtime.artifact import load_artifact
from service.store.layout import job_prefix
from tests.support.workers import Stack, WorkerProcess, download, worker_job_request

pytestmark = pytest.mark.timeout(600)

Event = tuple[str, dict[str, Any]]


def submit(stack: Stack, request: dict[str, Any]) -> str:
    """A new job each time (a fresh Idempotency-Key), even for a request submitted before."""
    with stack.client() as client:
        return client.submit(request, idempotency_key=uuid.uuid4().hex)["id"]


def follow(stack: Stack, job_id: str, stop: Callable[[Event], bool] = lambda event: False) -> list[Event]:
    """The job's events from the start, until its final status or until `stop(event)` says so."""
    seen = []
    with stack.client() as client:
        for event in client.events(job_id):
            seen.append(event)
            if stop(event):
                break
    return seen


def layer_reached(layer: int) -> Callable[[Event], bool]:
    def reached(event: Event) -> bool:
        kind, data = event
        return kind == "progress" and data["stage"] == "compressing" and data["layer"] >= layer

    return reached


def statuses(events: list[Event]) -> list[str]:
    return [data["status"] for kind, data in events if kind == "status"]


def compressed_layers(events: list[Event]) -> list[int]:
    return [data["layer"] for kind, data in events if kind == "progress" and data["stage"] == "compressing"]


def artifacts(stack: Stack, job_id: str) -> dict[str, Any]:
    return stack.get(f"/v1/jobs/{job_id}/artifacts")


def fetch(stack: Stack, job_id: str, folder: Path) -> Path:
    """Download the job's files (not its checkpoints) through the links the API hands out."""
    for item in artifacts(stack, job_id)["artifacts"]:
        if not item["name"].startswith("checkpoints/"):
            download(item["url"], folder / item["name"])
    return folder


def finished_checkpoints(stack: Stack, job_id: str) -> int:
    prefix = job_prefix("team-a", job_id) + "checkpoints/"
    return len([info for info in stack.store().list(prefix) if re.search(r"layer-\d+\.json$", info.key)])


def test_a_sigkilled_worker_loses_nothing_the_job_resumes_elsewhere_and_equals_an_uninterrupted_run(
    stack: Stack, models_dir, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    _root, model = models_dir(layers=16)
    doomed = stack.start_worker("doomed")
    job_id = submit(stack, worker_job_request(model))

    follow(stack, job_id, stop=layer_reached(3))
    doomed.kill()
    assert not doomed.leftovers(), "SIGKILL of the worker's processes leaves nothing running"
    with stack.client() as client:
        assert client.get(job_id)["status"] in ("running", "queued")
    restored = finished_checkpoints(stack, job_id)
    assert 3 <= restored < 16

    request.getfixturevalue("worker")  # a second worker, started after the first one died
    events = follow(stack, job_id)
    assert statuses(events) == ["queued", "running", "queued", "running", "succeeded"]
    second_run = events[[i for i, (kind, _) in enumerate(events) if kind == "status"][3] :]
    assert compressed_layers(second_run) == list(range(restored, 17)), "no finished layer is computed again"

    folder = fetch(stack, job_id, tmp_path / "resumed")
    log = (folder / "log.txt").read_text()
    assert "attempt 1 of 3" in log and "attempt 2 of 3" in log
    assert f"resuming at layer {restored} of 16 ({restored} layers from checkpoints)" in log
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["resumed_from_layer"] == restored and metrics["attempt"] == 2

    reference_id = submit(stack, worker_job_request(model))  # the same job again, run without interruption
    assert statuses(follow(stack, reference_id))[-1] == "succeeded"
    reference = fetch(stack, reference_id, tmp_path / "reference")
    resumed_tensors = load_file(folder / "model.safetensors")
    reference_tensors = load_file(reference / "model.safetensors")
    assert resumed_tensors.keys() == reference_tensors.keys()
    assert all(torch.equal(resumed_tensors[name], reference_tensors[name]) for name in resumed_tensors)
    reference_metrics = json.loads((reference / "metrics.json").read_text())
    assert reference_metrics["perplexity"] == metrics["perplexity"]


def test_a_job_goes_queued_running_succeeded_and_its_artifact_reloads_from_s3(
    stack: Stack, worker, models_dir, tmp_path: Path
) -> None:
    _root, model = models_dir(layers=4)
    calibration = tmp_path / "calib.txt"
    calibration.write_text(load_text("wikitext2", "validation")[:100_000])
    with stack.client() as client:
        uri = client.upload(calibration)["uri"]
    request = worker_job_request(
        model,
        calibration={"dataset": uri, "samples": 4, "seq_len": 64, "seed": 3},
        eval={"datasets": ["wikitext2", uri], "seq_len": 64, "max_windows": 2},
    )
    job_id = submit(stack, request)
    events = follow(stack, job_id)
    assert statuses(events) == ["queued", "running", "succeeded"]
    # the default allocation measures its layer plan first ("planning"); the layers' clock restarts after it
    assert compressed_layers(events) == [0, 0, 1, 2, 3, 4], "the events show every layer"
    assert "planning" in [data["stage"] for kind, data in events if kind == "progress"]
    stages = [data["stage"] for kind, data in events if kind == "progress"]
    assert stages[0] == "preparing" and stages[-2:] == ["evaluating", "uploading"]

    listing = artifacts(stack, job_id)
    names = {item["name"] for item in listing["artifacts"]}
    assert listing["complete"]
    assert {"manifest.json", "model.safetensors", "metrics.json", "log.txt"} <= names
    assert not [n for n in names if n.startswith("checkpoints/")] and listing["checkpoints"]["files"] >= 8
    folder = fetch(stack, job_id, tmp_path / "artifact")
    metrics = json.loads((folder / "metrics.json").read_text())
    assert set(metrics["perplexity"]) == {"wikitext2", uri}
    model_, tokenizer, manifest = load_artifact(folder)
    assert manifest["calibration"]["seed"] == 3 and len(manifest["layers"]) == 4
    again = perplexity(model_, tokenize(tokenizer, load_text("wikitext2", "test")), 64, 2, progress=False)
    assert again["ppl"] == pytest.approx(metrics["perplexity"]["wikitext2"]["ppl"], rel=1e-4)


def test_cancelling_a_running_job_stops_it_within_one_layer(stack: Stack, worker, models_dir) -> None:
    _root, model = models_dir(layers=16)
    job_id = submit(stack, worker_job_request(model, ratio=0.6))

    follow(stack, job_id, stop=layer_reached(2))
    with stack.client() as client:
        at_cancel = client.cancel(job_id)["progress"]["layer"]
    events = follow(stack, job_id)
    assert statuses(events)[-1] == "cancelled"
    assert any(kind == "cancel_requested" for kind, _ in events)
    assert max(compressed_layers(events)) <= at_cancel + 1 < 16
    assert finished_checkpoints(stack, job_id) == max(compressed_layers(events))
    assert not artifacts(stack, job_id)["complete"]


def test_an_object_store_outage_during_upload_is_retried_and_the_job_succeeds(
    stack: Stack, worker, models_dir, tmp_path: Path
) -> None:
    _root, model = models_dir(layers=16)
    job_id = submit(stack, worker_job_request(model, ratio=0.7))
    reopen = threading.Timer(2.5, stack.relay.open)
    cut = threading.Event()

    def cut_after_layer_1(event: Event) -> bool:
        if layer_reached(1)(event) and not cut.is_set():
            cut.set()
            stack.relay.close()  # the workers' only way to S3 is gone for 2.5 s
            reopen.start()
        return False

    try:
        events = follow(stack, job_id, stop=cut_after_layer_1)
    finally:
        if cut.is_set():
            reopen.join()
    assert cut.is_set()
    assert statuses(events)[-1] == "succeeded"
    log = (fetch(stack, job_id, tmp_path / "artifact") / "log.txt").read_text()
    assert re.search(r"upload \S+ failed \(.*\); retry 1/7", log), "an upload failed during the outage and was retried"


def test_a_worker_actor_that_dies_is_replaced_and_its_job_resumes(
    stack: Stack, worker: WorkerProcess, models_dir, tmp_path: Path
) -> None:
    _root, model = models_dir(layers=16)
    job_id = submit(stack, worker_job_request(model, ratio=0.45))
    follow(stack, job_id, stop=layer_reached(2))
    actors = worker.actor_pids()
    assert len(actors) == 1
    os.kill(actors[0], signal.SIGKILL)  # the actor alone: an out-of-memory kill, a crashed CUDA context
    events = follow(stack, job_id)
    assert statuses(events) == ["queued", "running", "queued", "running", "succeeded"]
    assert "starting a new one" in worker.log_text(), "the supervisor replaced the dead actor"
    metrics = json.loads((fetch(stack, job_id, tmp_path / "artifact") / "metrics.json").read_text())
    assert metrics["resumed_from_layer"] >= 2 and metrics["attempt"] == 2
