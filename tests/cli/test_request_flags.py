"""`ftc submit` and `ftc sweep create` take every field of the API's requests as a flag, with the
same name and default, because both read one definition: the request schemas."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from cli.fields import add_flags, check_request, flags_of, pending_upload, request_from
from cli.main import build_parser
from cli.service import JOB_FLAGS
from cli.sweeps import SWEEP_FLAGS
from service.schemas import Calibration, JobRequest
from service.sweeps import SweepRequest


def leaf_fields(schema: dict, defs: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], dict]:
    """Every leaf field of a JSON schema (as the API publishes it), by path, with its schema."""
    leaves = {}
    for name, spec in schema["properties"].items():
        if "$ref" in spec:
            leaves |= leaf_fields(defs[spec["$ref"].rsplit("/", 1)[-1]], defs, (*prefix, name))
        else:
            leaves[(*prefix, name)] = spec
    return leaves


def options_of(command: str) -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[command]
    if command == "sweep":
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["create"]
    return {name: action for action in parser._actions for name in action.option_strings}


@pytest.mark.parametrize(
    ("model", "command", "left_out"),
    [(JobRequest, "submit", set()), (SweepRequest, "sweep", {("eval", "dense_reference")})],
)
def test_every_field_of_the_published_schema_is_a_flag_with_its_default(model, command, left_out) -> None:
    schema = model.model_json_schema(by_alias=True)
    options = options_of(command)
    for path, spec in leaf_fields(schema, schema.get("$defs", {})).items():
        if path in left_out:
            continue
        flag = "--" + "-".join(path).replace("_", "-")
        assert flag in options, f"{'.'.join(path)} has no flag {flag}"
        help_text = options[flag].help
        if "default" in spec and spec["default"] is not None and not isinstance(spec["default"], list):
            shown = str(spec["default"]).lower() if isinstance(spec["default"], bool) else str(spec["default"])
            assert f"(default: {shown})" in help_text, f"{flag}: {help_text!r}"
        if "enum" in spec:
            assert options[flag].metavar == "|".join(spec["enum"])
        if path in [("model",), ("models",), ("ratios",)] and path[0] in schema.get("required", []):
            assert options[flag].required


def test_the_method_flag_offers_the_list_and_refuses_free_text(capsys) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["submit", "--model", "smollm2-135m", "--ratio", "0.4", "--method", "tucker"])
    assert exited.value.code == 2
    assert "invalid choice 'tucker' (choose from ftc, svd, asvd" in capsys.readouterr().err


def test_one_calibration_default_everywhere() -> None:
    from ftc.compression.compress import CompressOptions

    compress = {name: action for action in options_of("compress").values() for name in action.option_strings}
    library = CompressOptions(model="m").calib_samples
    assert Calibration().samples == library == compress["--calib-samples"].default == 32
    assert "(default: 32)" in options_of("submit")["--calibration-samples"].help


def test_a_field_added_to_the_schema_is_a_flag_without_another_edit() -> None:
    class WithEffort(JobRequest):
        effort: Literal["quick", "thorough"] = Field("quick", description="How hard to try.")

    parser = argparse.ArgumentParser()
    flags = flags_of(WithEffort)
    add_flags(parser, flags)
    args = parser.parse_args(["--model", "smollm2-135m", "--ratio", "0.5", "--effort", "thorough"])
    request = request_from(args, flags, upload=pending_upload)
    assert request == {"model": "smollm2-135m", "ratio": 0.5, "effort": "thorough"}
    assert WithEffort.model_validate(request).effort == "thorough"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--effort", "everything"])


def test_flags_become_the_json_request_with_short_names_and_lists(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, JOB_FLAGS)
    calib = tmp_path / "calib.txt"
    calib.write_text("text\n")
    args = parser.parse_args([
        "--model", "smollm2-135m", "--ratios", "0.3,0.6", "--calib", str(calib), "--calib-samples", "8",
        "--eval-tasks", "arc_easy,piqa", "--limit", "20", "--outputs", "compressed,dense", "--eval-dense-reference",
        "--allocation", "global", "--ablate", "no_whiten,no_sink", "--eval-datasets", "",
    ])  # fmt: skip
    uploaded = []
    request = request_from(args, JOB_FLAGS, upload=lambda path: uploaded.append(path) or "file:///u/calib.txt")
    assert uploaded == [calib]
    assert request == {
        "model": "smollm2-135m", "ratios": [0.3, 0.6], "allocation": "global", "ablate": ["no_whiten", "no_sink"],
        "calibration": {"dataset": "file:///u/calib.txt", "samples": 8},
        "eval": {"tasks": ["arc_easy", "piqa"], "limit": 20, "dense_reference": True, "datasets": []},
        "outputs": ["compressed", "dense"],
    }  # fmt: skip
    JobRequest.model_validate(request)


def test_the_schema_checks_the_flags_before_anything_is_sent() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, JOB_FLAGS)
    cases = [
        (["--model", "smollm2-135m"], "give exactly one of ratio (a number) or ratios (a list)"),
        (["--model", "smollm2-135m", "--ratio", "0.4", "--limit", "5"], "eval: limit counts task documents"),
        (["--model", "smollm2-135m", "--ratio", "0.4", "--calib-samples", "0"], "--calibration-samples: Input should"),
        (["--model", "/etc/passwd", "--ratio", "0.4"], "--model: model '/etc/passwd' is neither"),
    ]
    for argv, words in cases:
        request = request_from(parser.parse_args(argv), JOB_FLAGS, upload=pending_upload)
        with pytest.raises(ValueError) as refused:
            check_request(JobRequest, request, JOB_FLAGS)
        assert words in str(refused.value) and "\n" not in str(refused.value), argv


def test_sweep_flags_leave_out_what_the_sweep_sets_itself() -> None:
    assert ("eval", "dense_reference") not in {flag.path for flag in SWEEP_FLAGS}
    assert "--eval-dense-reference" not in options_of("sweep")
