"""A job that asks for `outputs: ["compressed", "dense"]` publishes a stock checkpoint under dense/."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from ftc.runtime.artifact import load_artifact
from service.artifacts import list_artifacts
from service.store import LocalStore
from tests.support.workers import worker_job_request
from tests.workers.test_job import TEAM, job_folder, run_job, store_names
from workers.publish import upload_outputs

pytestmark = pytest.mark.timeout(600)


def test_a_job_asking_for_dense_publishes_it_beside_the_artifact(worker_settings, models_dir) -> None:
    settings = worker_settings()
    _root, model = models_dir(layers=2)
    request = worker_job_request(model, eval={"datasets": []}, outputs=["compressed", "dense"])

    record = run_job(settings, request, timeout=480)
    assert record.status == "succeeded", record.error
    names = store_names(settings, record.id)
    assert {"config.json", "model.safetensors", "modeling_ftc.py", "dense/config.json",
            "dense/model.safetensors", "dense/tokenizer.json"} <= set(names)
    folder = job_folder(settings, record.id)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {n: m["size"] for n, m in manifest["files"].items() if n.startswith("dense/")} == {
        n: s for n, s in names.items() if n.startswith("dense/")}
    listing = list_artifacts(LocalStore(settings.store_url), TEAM, record.id, lambda name: name, 60)
    assert "dense/model.safetensors" in {a.name for a in listing.artifacts} and listing.complete

    dense = AutoModelForCausalLM.from_pretrained(folder / "dense")
    assert type(dense).__module__.startswith("transformers.models.")
    factorized, _, _ = load_artifact(folder)
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = dense(ids).logits.float(), factorized(ids).logits
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-2


def test_upload_outputs_puts_the_dense_export_under_dense_only_when_asked(tiny_artifact, tmp_path) -> None:
    store = LocalStore(str(tmp_path / "store"))
    artifact = tiny_artifact("gqa")
    plain = upload_outputs(store, "a/", artifact, ["compressed"])
    assert "model.safetensors" in plain and not any(n.startswith("dense/") for n in plain)
    both = upload_outputs(store, "b/", artifact, ["compressed", "dense"])
    dense = {n: m for n, m in both.items() if n.startswith("dense/")}
    assert {"dense/config.json", "dense/model.safetensors"} <= set(dense)
    stored = {info.key: info.size for info in store.list("b/dense/")}
    assert {"b/" + n: m["size"] for n, m in dense.items()} == stored
    assert not (artifact.parent / "dense").exists()  # the local export is removed once uploaded
