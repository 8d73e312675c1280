"""Job request validation: bounds, names from ftc.options, and messages that say what to change."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.ids import is_id, new_id
from service.schemas import JobRequest
from tests.support.service import JOB_REQUEST


def errors_of(body: dict) -> list[tuple[tuple, str]]:
    with pytest.raises(ValidationError) as caught:
        JobRequest.model_validate(body)
    return [(e["loc"], e["msg"]) for e in caught.value.errors()]


def test_the_issue_example_is_valid_and_round_trips_with_the_eval_alias() -> None:
    request = JobRequest.model_validate(JOB_REQUEST)
    assert request.keep_ratios() == [0.4]
    assert request.evaluation.max_windows == 4
    assert JobRequest.model_validate_json(request.model_dump_json(by_alias=True)) == request
    assert '"eval"' in request.model_dump_json(by_alias=True)


def test_defaults_fill_everything_but_model_and_ratio() -> None:
    request = JobRequest.model_validate({"model": "org/some-model", "ratio": 1})
    assert (request.method, request.priority, request.calibration.dataset) == ("ftc", "normal", "wikitext2")


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"ratio": 0}, ("ratio",), "(0, 1]"),
        ({"ratio": 1.5}, ("ratio",), "(0, 1]"),
        ({"calibration": {"samples": 0}}, ("calibration", "samples"), "greater than or equal"),
        ({"calibration": {"seq_len": 10**6}}, ("calibration", "seq_len"), "less than or equal"),
        ({"eval": {"max_windows": -1}}, ("eval", "max_windows"), "greater than or equal"),
        ({"eval": {"datasets": ["nope"]}}, ("eval", "datasets", 0), "wikitext2"),
        ({"method": "magic"}, ("method",), "ftc"),
        ({"ablate": ["no_whiten", "bogus"]}, ("ablate",), "unknown ablation bogus"),
        ({"ablate": [{}]}, ("ablate",), "list of names"),  # found by the schema-based run
        ({"model": "../../etc/passwd"}, ("model",), "paths are not accepted"),
        ({"ratoi": 0.5}, ("ratoi",), "Extra inputs"),
        ({"priority": "urgent"}, ("priority",), "high"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(change: dict, field: tuple, words: str) -> None:
    body = {**JOB_REQUEST, **change}
    found = errors_of(body)
    assert any(loc == field and words in msg for loc, msg in found), found


def test_exactly_one_of_ratio_and_ratios() -> None:
    both = {**JOB_REQUEST, "ratios": [0.3]}
    neither = {k: v for k, v in JOB_REQUEST.items() if k != "ratio"}
    for body in (both, neither):
        assert any("exactly one of ratio" in msg for _, msg in errors_of(body))


def test_ratios_expand_to_one_single_ratio_request_each() -> None:
    body = {k: v for k, v in JOB_REQUEST.items() if k != "ratio"} | {"ratios": [0.3, 0.5, 0.3]}
    request = JobRequest.model_validate(body)
    assert request.keep_ratios() == [0.3, 0.5]
    assert [r.ratio for r in map(request.for_ratio, request.keep_ratios())] == [0.3, 0.5]
    assert request.for_ratio(0.3).ratios is None


def test_ablations_need_the_ftc_method_and_accept_a_comma_list() -> None:
    assert JobRequest.model_validate({**JOB_REQUEST, "ablate": "no_whiten,no_anchor"}).ablate == [
        "no_whiten",
        "no_anchor",
    ]
    assert any(
        "needs method 'ftc'" in msg for _, msg in errors_of({**JOB_REQUEST, "method": "svd", "ablate": ["no_anchor"]})
    )


def test_a_model_wide_allocation_is_for_ftc_only() -> None:
    request = JobRequest.model_validate({**JOB_REQUEST, "allocation": "global"})
    assert request.model_dump(by_alias=True)["allocation"] == "global"
    assert any(loc == ("allocation",) and "uniform" in msg
               for loc, msg in errors_of({**JOB_REQUEST, "allocation": "greedy"}))
    assert any("applies to method 'ftc' only" in msg
               for _, msg in errors_of({**JOB_REQUEST, "method": "svd_llm", "allocation": "global"}))
    assert any("applies to method 'ftc' only" in msg
               for _, msg in errors_of({**JOB_REQUEST, "method": "cp", "allocation": "global"}))
    assert JobRequest.model_validate({**JOB_REQUEST, "method": "cp", "allocation": "sensitivity"}).method == "cp"
    assert any("applies to method 'ftc' or 'cp' only" in msg
               for _, msg in errors_of({**JOB_REQUEST, "method": "asvd", "allocation": "sensitivity"}))
    assert any("at least 0.1 with allocation 'sensitivity'" in msg
               for _, msg in errors_of({**JOB_REQUEST, "allocation": "sensitivity", "ratio": 0.05}))


def test_upload_uris_are_accepted_as_datasets() -> None:
    body = {**JOB_REQUEST, "calibration": {"dataset": "s3://bucket/team-a/uploads/upl_x/c.txt"}}
    assert JobRequest.model_validate(body).calibration.dataset.startswith("s3://")


def test_ids_sort_by_creation_time() -> None:
    earlier, later = new_id("job", now=1_700_000_000.0), new_id("job", now=1_700_000_000.002)
    assert earlier < later
    assert is_id(earlier) and not is_id("job_../../x")


def test_asvd_below_its_smallest_measured_ratio_is_refused_before_it_is_queued() -> None:
    from service.sweeps.schemas import SweepRequest

    assert any(loc == () and "at least 0.1 with asvd" in msg
               for loc, msg in errors_of({**JOB_REQUEST, "method": "asvd", "ratio": 0.05}))
    assert JobRequest.model_validate({**JOB_REQUEST, "method": "asvd", "ratio": 0.1}).ratio == 0.1
    with pytest.raises(ValidationError, match=r"at least 0\.1 with asvd"):
        SweepRequest.model_validate({"models": ["smollm2-135m"], "methods": ["ftc", "asvd"], "ratios": [0.4, 0.05],
                                     "allocation": "uniform"})
