"""Worker metrics and log lines, in process: a job counts as started and succeeded with one layer time
per layer, a job that cannot open its model fails as invalid_input, every worker line of a job
carries its id and team; and one endpoint per node sums the counts of all its worker processes."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client import REGISTRY

from service.logs import ContextFilter, JsonFormatter
from tests.support.workers import REPO, worker_job_request
from tests.workers.test_job import TEAM, run_job
from workers.metrics import NodeEndpoint, failure_reason

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def json_lines() -> Iterator[list[dict]]:
    """The JSON lines the workers' loggers write while the test runs."""
    lines: list[dict] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(json.loads(self.format(record)))

    handler = Collect(logging.INFO)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("workers")
    logger.addHandler(handler)
    saved = logger.level
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(saved)


def test_a_job_is_counted_timed_per_layer_and_logged_with_its_context(worker_settings, models_dir, json_lines) -> None:
    settings = worker_settings()
    _root, model = models_dir(layers=2, hidden=64)
    before = {
        "started": sample("ftc_worker_jobs_started_total"),
        "succeeded": sample("ftc_worker_jobs_succeeded_total"),
        "layers": sample("ftc_worker_layer_seconds_count"),
        "jobs": sample("ftc_worker_job_seconds_count", outcome="succeeded"),
        "first": sample("ftc_worker_job_attempt_bucket", le="1.0"),
    }

    record = run_job(settings, worker_job_request(model, eval={"datasets": []}))
    assert record.status == "succeeded", record.error
    assert sample("ftc_worker_jobs_started_total") - before["started"] == 1
    assert sample("ftc_worker_jobs_succeeded_total") - before["succeeded"] == 1
    assert sample("ftc_worker_layer_seconds_count") - before["layers"] == 2
    assert sample("ftc_worker_job_seconds_count", outcome="succeeded") - before["jobs"] == 1
    assert sample("ftc_worker_job_attempt_bucket", le="1.0") - before["first"] == 1

    during = [line for line in json_lines if line["job_id"] == record.id]
    assert {line["team"] for line in during} == {TEAM}
    job_lines = [line for line in json_lines if line["logger"] in ("workers.attempt", "workers.job")]
    assert job_lines and all(line["job_id"] == record.id for line in job_lines), "every line of the job is tagged"
    layer_done = [line for line in job_lines if " done in " in line["message"]]
    assert [line["layer"] for line in layer_done] == [1, 2], "each layer's line names that layer"
    published = [line for line in job_lines if line["message"].startswith("published")]
    assert published and published[0]["layer"] is None, "after the layers, no layer is named"


def test_a_model_the_worker_cannot_open_fails_as_invalid_input(worker_settings, models_dir, tmp_path: Path) -> None:
    root, _model = models_dir()
    pickles = root / "tiny" / "pickles"
    pickles.mkdir(parents=True, exist_ok=True)
    (pickles / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (pickles / "pytorch_model.bin").write_bytes(b"not read")
    settings = worker_settings()
    before = sample("ftc_worker_jobs_failed_total", reason="invalid_input")

    record = run_job(settings, worker_job_request("tiny/pickles"))
    assert record.status == "failed" and "only PyTorch .bin weights" in (record.error or "")
    assert sample("ftc_worker_jobs_failed_total", reason="invalid_input") - before == 1


def test_failure_reasons_are_a_bounded_set() -> None:
    from ftc.models.hub import ModelError

    assert failure_reason(ModelError("x")) == "invalid_input"
    assert failure_reason(MemoryError()) == "out_of_memory"
    assert failure_reason(torch.cuda.OutOfMemoryError("CUDA out of memory")) == "out_of_memory"
    assert failure_reason(RuntimeError("anything")) == "error"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


NODE_PROCESS = """
import sys, time
from workers import metrics
assert metrics.prepare(sys.argv[1]) is not None
endpoint = metrics.NodeEndpoint(int(sys.argv[2]))
serving = endpoint.try_serve()
metrics.record_attempt(int(sys.argv[3]))
metrics.record_outcome("failed", 1.5, ValueError("x"))
print("serving" if serving else "counted", flush=True)
if serving:
    time.sleep(60)
"""


def test_one_endpoint_per_node_sums_every_worker_process(tmp_path: Path) -> None:
    """Three worker processes of one node: the first to bind the port serves the counts of all of them,
    the ones that have exited included; the others find the port taken and only count."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)

    def start(attempt: int) -> subprocess.Popen:
        command = [sys.executable, "-c", NODE_PROCESS, str(tmp_path), str(port), str(attempt)]
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)

    server = start(1)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "serving"
        for attempt in (2, 3):
            other = start(attempt)
            out, _ = other.communicate(timeout=60)
            assert out.strip() == "counted", "the port is taken: the process only counts"
        deadline = time.monotonic() + 10
        while True:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            if "ftc_worker_jobs_started_total 3.0" in text or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "ftc_worker_jobs_started_total 3.0" in text, text
        assert 'ftc_worker_jobs_failed_total{reason="error"} 3.0' in text
        assert 'ftc_worker_job_attempt_bucket{le="2.0"} 2.0' in text
    finally:
        server.kill()
        server.wait(10)
    assert {p.name.split("_")[0] for p in (tmp_path / "prometheus").glob("*.db")} == {"counter", "histogram"}
    assert NodeEndpoint(0).try_serve() is False, "port 0: nothing is served"
