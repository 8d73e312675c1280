"""Requests no worker could run are refused when they are made: a keep ratio with no budget, too few
calibration tokens for the model, names that are neither an alias nor a hub id, loose JSON types.
The deployment's token limit (FTC_MAX_CALIB_TOKENS) is checked by the API; see tests/api."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from service.schemas import KNOWN_SHAPES, LARGEST_SHAPE, JobRequest, budget_problem, calibration_problem
from service.sweeps.cron import check_schedule
from service.sweeps.schemas import SweepRequest
from tests.support.service import JOB_REQUEST


def errors_of(model: type, body: dict) -> list[tuple[tuple, str]]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate_json(json.dumps(body))
    return [(e["loc"], e["msg"]) for e in caught.value.errors()]


def test_the_alias_shape_is_the_models_own_config() -> None:
    from transformers import AutoConfig

    from ftc.models.registry import resolve_model

    source = resolve_model("smollm2-135m")
    config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
    shape = KNOWN_SHAPES["smollm2-135m"]
    assert (shape.hidden, shape.heads, shape.kv_heads) == (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    assert shape.head_dim == config.hidden_size // config.num_attention_heads


def test_a_budget_rounds_to_zero_exactly_below_one_weight() -> None:
    shape = KNOWN_SHAPES["smollm2-135m"]
    assert shape.qkv_params == 576 * 64 * (9 + 2 * 3)
    smallest = 1 / shape.qkv_params
    assert budget_problem("smollm2-135m", smallest) is None
    assert "keeps less than one" in (budget_problem("smollm2-135m", smallest * 0.99) or "")
    # A model the API does not know is held to the largest layer: only ratios that leave nothing anywhere fail.
    assert budget_problem("org/unknown", smallest * 0.99) is None
    assert budget_problem("org/unknown", 0.99 / LARGEST_SHAPE.qkv_params) is not None
    assert budget_problem("org/unknown", 5e-324) is not None


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"ratio": 5e-324}, ("ratio",), "keeps less than one of smollm2-135m's"),
        ({"ratio": None, "ratios": [0.5, 1e-9]}, ("ratios",), "keeps less than one"),
        ({"model": "org/name", "ratio": 5e-324}, ("ratio",), "any model"),
        ({"calibration": {"samples": 2, "seq_len": 256}}, ("calibration",), "fewer than smollm2-135m's hidden"),
        ({"model": "/etc/passwd"}, ("model",), "neither a built-in alias"),
        ({"model": "org/../x"}, ("model",), "paths are not accepted"),
        ({"model": "org/name/weights"}, ("model",), "paths are not accepted"),
        ({"model": "org--x/name"}, ("model",), "paths are not accepted"),
        ({"model": "my model"}, ("model",), "paths are not accepted"),
        ({"model": "local@main"}, ("model",), "paths are not accepted"),
        ({"revision": "main"}, ("revision",), "alias and has no revisions"),
        ({"model": "gpt2"}, ("model",), "neither a built-in alias"),
        ({"model": "org/name", "revision": "a..b"}, ("revision",), "not a branch, tag or commit"),
        ({"model": "org/name@v1", "revision": "v2"}, ("revision",), "give it once"),
        ({"ratio": True}, ("ratio",), "valid number"),
        ({"calibration": {"samples": "8"}}, ("calibration", "samples"), "valid integer"),
    ],
)
def test_requests_no_worker_can_run_are_refused_naming_the_field(change: dict, field: tuple, words: str) -> None:
    body = {key: value for key, value in {**JOB_REQUEST, **change}.items() if value is not None}
    found = errors_of(JobRequest, body)
    assert any(loc == field and words in msg for loc, msg in found), found


def test_hub_ids_with_revisions_and_enough_tokens_are_accepted() -> None:
    for model in ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M@main", "org/name@refs/pr/1"):
        assert JobRequest.model_validate({"model": model, "ratio": 0.5}).model == model
    pinned = JobRequest.model_validate({"model": "org/name", "revision": "v1.0", "ratio": 0.5})
    assert pinned.revision == "v1.0"
    assert calibration_problem("smollm2-135m", 1, 576) is None and calibration_problem("org/x", 1, 16) is None
    assert JobRequest.model_validate_json('{"model": "org/x", "ratio": 1}').ratio == 1.0  # whole numbers are numbers


def test_sweeps_apply_the_same_rules_to_every_model() -> None:
    body = {"models": ["org/big", "smollm2-135m"], "ratios": [0.5, 1e-9]}
    assert any(loc == ("ratios",) and "smollm2-135m" in msg for loc, msg in errors_of(SweepRequest, body))
    short = {"models": ["smollm2-135m"], "ratios": [0.5], "calibration": {"samples": 1, "seq_len": 64}}
    assert any(loc == ("calibration",) and "hidden size" in msg for loc, msg in errors_of(SweepRequest, short))
    assert any(loc == ("models", 0) for loc, _ in errors_of(SweepRequest, {"models": ["../x"], "ratios": [0.5]}))


@pytest.mark.parametrize("schedule", ["0 0 30 2 *", "0 0 31 4 *", "0 0 31 6,9,11 *"])
def test_schedules_that_name_no_real_day_are_refused(schedule: str) -> None:
    with pytest.raises(ValueError, match="never fires"):
        check_schedule(schedule)


def test_rare_but_real_schedules_are_kept() -> None:
    assert check_schedule("0 0 29 2 *") == "0 0 29 2 *"  # every leap year
    assert check_schedule("0  0 31 * *") == "0 0 31 * *"
