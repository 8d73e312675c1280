"""SmolLM2-135M end to end through the API, S3 and `ftc worker` (all 30 layers, small calibration).

Slow: minutes on two CPU cores. Run it with `make test-slow` (or `pytest --run-slow`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ftc.evaluation.data import load_text, tokenize
from ftc.evaluation.evaluate import perplexity
from ftc.runtime.artifact import load_artifact
from tests.support.workers import Stack
from tests.workers.test_e2e import compressed_layers, fetch, follow, statuses, submit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

LAYERS = 30


def test_smollm2_is_compressed_evaluated_and_published_by_a_worker(stack: Stack, worker, tmp_path: Path) -> None:
    request = {
        "model": "smollm2-135m",
        "method": "ftc",
        "ratio": 0.5,
        "calibration": {"dataset": "wikitext2", "samples": 4, "seq_len": 256, "seed": 0},
        "eval": {"datasets": ["wikitext2"], "seq_len": 128, "max_windows": 4, "dense_reference": True},
    }
    job_id = submit(stack, request)
    events = follow(stack, job_id)
    assert statuses(events) == ["queued", "running", "succeeded"]
    assert compressed_layers(events) == list(range(LAYERS + 1))

    folder = fetch(stack, job_id, tmp_path / "artifact")
    metrics = json.loads((folder / "metrics.json").read_text())
    compressed = metrics["perplexity"]["wikitext2"]["ppl"]
    dense = metrics["dense_perplexity"]["wikitext2"]["ppl"]
    assert math.isfinite(compressed) and dense < compressed < 10 * dense
    assert 0 < metrics["storage"]["model_reduction"] < 1

    model, tokenizer, manifest = load_artifact(folder)
    assert len(manifest["layers"]) == LAYERS
    again = perplexity(model, tokenize(tokenizer, load_text("wikitext2", "test")), 128, 4, progress=False)
    assert again["ppl"] == pytest.approx(compressed, rel=1e-4)
