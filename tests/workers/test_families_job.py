"""A service job on a Gemma 3 model (sliding-window and global layers) runs end to end: the worker
compresses it, evaluates it and publishes an artifact that reloads with the family's own layers."""

from __future__ import annotations

import pytest

from ftc.runtime.artifact import load_artifact
from tests.support.workers import worker_job_request
from tests.workers.test_job import job_folder, run_job

pytestmark = pytest.mark.timeout(600)


def test_a_gemma3_job_succeeds_and_publishes_a_reloadable_artifact(worker_settings, models_dir, tiny_folder):
    root, _ = models_dir(layers=2)
    name = "tiny/gemma3-2"
    link = root / name
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(tiny_folder("gemma3", layers=2), target_is_directory=True)
    settings = worker_settings()
    request = worker_job_request(name, eval={"datasets": ["wikitext2"], "seq_len": 64, "max_windows": 1})

    record = run_job(settings, request, timeout=480)
    assert record.status == "succeeded", record.error
    model, _, manifest = load_artifact(job_folder(settings, record.id))
    assert model.config.model_type == "ftc_gemma3_text"
    assert manifest["base_model"]["model_type"] == "gemma3_text"
