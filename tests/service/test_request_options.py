"""The options jobs and sweeps share with `ftc compress`: scope, dtype, and the allocation an absent
field resolves to through `ftc.options.default_allocation` (whatever its default is)."""

from __future__ import annotations

import hashlib
import json

import pytest
from pydantic import ValidationError

import ftc.options
from ftc.options import default_allocation
from service.jobs import request_digest
from service.schemas import JobRequest
from service.sweeps import SweepRequest
from service.sweeps.expand import job_sets
from tests.support.service import JOB_REQUEST

SWEEP = {"models": ["smollm2-135m"], "ratios": [0.3, 0.5], "methods": ["ftc", "svd_llm", "cp"]}


def errors_of(model: type, body: dict) -> list[tuple[tuple, str]]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return [(e["loc"], e["msg"]) for e in caught.value.errors()]


@pytest.fixture(params=["uniform", "sensitivity"])
def library_default(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The library's default allocation: today's, and the one the lead may switch to."""
    monkeypatch.setattr(ftc.options, "DEFAULT_ALLOCATION", request.param)
    return request.param


def test_an_absent_allocation_is_the_methods_default_stored_resolved(library_default: str) -> None:
    for method in ("ftc", "cp", "svd_llm", "asvd"):
        body = {**JOB_REQUEST, "method": method, "ratio": 0.4}
        request = JobRequest.model_validate(body)
        assert request.allocation == default_allocation(method)
        assert request.allocation == (library_default if method in ("ftc", "cp") else "uniform")
        stored = request.model_dump_json(by_alias=True)
        assert f'"allocation":"{request.allocation}"' in stored
        assert JobRequest.from_stored(stored) == request
        named = JobRequest.model_validate({**body, "allocation": request.allocation})
        for with_priority in (True, False):
            assert request_digest(named, with_priority=with_priority) == request_digest(request,
                                                                                       with_priority=with_priority)


def test_a_request_stored_before_allocations_were_written_reads_as_uniform(library_default: str) -> None:
    legacy = JobRequest.model_validate({**JOB_REQUEST, "allocation": "uniform"}).model_dump(by_alias=True)
    del legacy["allocation"]
    assert JobRequest.from_stored(json.dumps(legacy)).allocation == "uniform"
    sweep = SweepRequest.model_validate(SWEEP).model_dump(by_alias=True)
    del sweep["allocation"]
    assert SweepRequest.from_stored(json.dumps(sweep)).allocation == "uniform"


def test_uniform_is_hashed_as_before_it_was_stored() -> None:
    """Requests were hashed without an allocation when it was uniform: a key given before this field was
    stored resolved still finds its job."""
    request = JobRequest.model_validate(JOB_REQUEST | {"allocation": "uniform"})
    before = request.model_dump(mode="json", by_alias=True, exclude={"priority", "allocation"})
    digest = hashlib.sha256(json.dumps(before, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert request_digest(request, with_priority=False) == digest
    other = JobRequest.model_validate(JOB_REQUEST | {"allocation": "global"})
    assert request_digest(request, with_priority=False) != request_digest(other, with_priority=False)


def test_a_ratio_below_the_plans_floor_under_a_default_says_to_pass_uniform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ftc.options, "DEFAULT_ALLOCATION", "sensitivity")
    body = {**JOB_REQUEST, "ratio": 0.05}
    (problem,) = [msg for _, msg in errors_of(JobRequest, body)]
    assert "at least 0.1" in problem and "pass allocation 'uniform'" in problem
    assert JobRequest.model_validate({**body, "allocation": "uniform"}).allocation == "uniform"
    named = [msg for _, msg in errors_of(JobRequest, {**body, "allocation": "sensitivity"})]
    assert not any("pass allocation 'uniform'" in msg for msg in named), "a named allocation is not a default"
    (problem,) = [msg for _, msg in errors_of(SweepRequest, {**SWEEP, "ratios": [0.05, 0.5]})]
    assert "at least 0.1" in problem and "pass allocation 'uniform'" in problem
    assert SweepRequest.model_validate({**SWEEP, "ratios": [0.05], "allocation": "uniform"}).allocation == "uniform"


def test_scope_defaults_to_attention_and_must_fit_allocation_and_ablations() -> None:
    request = JobRequest.model_validate(JOB_REQUEST)
    assert request.scope == "attention" and "scope" not in request.model_dump(by_alias=True)
    whole = JobRequest.model_validate({**JOB_REQUEST, "scope": "model", "ablate": ["mlp_per_matrix"]})
    assert whole.model_dump(by_alias=True)["scope"] == "model"
    for body in ({**JOB_REQUEST, "scope": "model", "allocation": "global"},
                 {**JOB_REQUEST, "ablate": ["mlp_per_matrix"]},
                 {**JOB_REQUEST, "scope": "everything"}):
        assert [loc for loc, _ in errors_of(JobRequest, body)] == [("scope",)], body
    assert "use 'uniform' or 'sensitivity'" in errors_of(JobRequest, {**JOB_REQUEST, "scope": "model",
                                                                       "allocation": "global"})[0][1]


def test_dtype_is_a_storage_dtype_left_out_at_its_default() -> None:
    assert "dtype" not in JobRequest.model_validate(JOB_REQUEST).model_dump(by_alias=True)
    assert JobRequest.model_validate({**JOB_REQUEST, "dtype": "bfloat16"}).dtype == "bfloat16"
    assert [loc for loc, _ in errors_of(JobRequest, {**JOB_REQUEST, "dtype": "int8"})] == [("dtype",)]


def test_a_sweep_gives_its_allocation_to_the_methods_that_take_it_and_its_scope_to_every_job(
    library_default: str,
) -> None:
    default = SweepRequest.model_validate(SWEEP)
    assert {job.method: job.allocation for job in job_sets(default)} == {
        method: default_allocation(method) for method in SWEEP["methods"]}
    named = SweepRequest.model_validate({**SWEEP, "allocation": "sensitivity", "scope": "model"})
    assert [(job.method, job.allocation, job.scope) for job in job_sets(named)] == [
        ("ftc", "sensitivity", "model"), ("svd_llm", "uniform", "model"), ("cp", "sensitivity", "model")]
    assert [loc for loc, _ in errors_of(SweepRequest, {**SWEEP, "methods": ["svd_llm"], "allocation": "global"})] \
        == [("allocation",)]
    assert [loc for loc, _ in errors_of(SweepRequest, {**SWEEP, "allocation": "global", "scope": "model"})] \
        == [("scope",)]
    ablated = {**SWEEP, "ablations": [[], ["mlp_mode2"]]}
    assert [loc for loc, _ in errors_of(SweepRequest, ablated)] == [("scope",)]
    assert SweepRequest.model_validate({**ablated, "scope": "model", "allocation": "uniform"}).cell_count() == 8
