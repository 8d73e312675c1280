"""`ftc compress --dry-run`: a short summary for people (what is kept, memory, time, output size),
the whole plan with `--json`; the estimates rest on measured constants and on what the artifact stores."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from cli.compress import FIRST_TIME_DENSE_PASSES, REFERENCE, estimate_run
from cli.main import main
from ftc.compression.compress import CompressOptions
from ftc.options import default_allocation

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "quality.json"


def test_the_time_estimate_rests_on_the_measured_constants() -> None:
    timing = json.loads(RESULTS.read_text())["timing"]["cpu"]
    assert REFERENCE.dense_forward_seconds == timing["dense_forward_seconds"]
    assert REFERENCE.compress_over_dense == timing["ratio"] and REFERENCE.device == timing["device"]
    assert REFERENCE.decoder_params == timing["layers"] * 3_540_096  # SmolLM2-135M's decoder layer
    assert json.loads(RESULTS.read_text())["calibration"].startswith(f"{REFERENCE.tokens // 512} x 512 tokens")
    plans = timing["sensitivity"]
    assert FIRST_TIME_DENSE_PASSES["sensitivity"] == plans["fresh_plan"]["ratio"] - plans["kept_plan"]["ratio"]


def plan_like(layers: int, layer_params: int, tokens: int) -> dict:
    parts = {"qkv": {"params": 96, "budget_values": 10}, "o": {"params": 64, "budget_values": 5},
             "gateup": {"params": 300, "budget_values": None}, "down": {"params": 150, "budget_values": None}}
    return {"layers": layers, "calibration_tokens": tokens, "parts_per_layer": parts, "model_params_dense": 100_000,
            "estimated_peak_bytes": {"one_layer_float32": 4 * layer_params}}


def test_time_scales_with_decoder_parameters_and_tokens_and_a_measured_plan_adds_its_first_time() -> None:
    options = CompressOptions(model="m", dtype="float16", allocation="uniform")
    reference = plan_like(30, REFERENCE.decoder_params // 30, REFERENCE.tokens)
    same = estimate_run(options, reference)
    assert same.seconds == REFERENCE.dense_forward_seconds * REFERENCE.compress_over_dense
    assert estimate_run(options, {**reference, "calibration_tokens": 2 * REFERENCE.tokens}).seconds == (
        2 * same.seconds)
    assert same.first_time_seconds == 0
    for plan, planned_options in (("sensitivity", replace(options, allocation="sensitivity")),
                                  ("asvd", replace(options, method="asvd"))):
        first = estimate_run(planned_options, reference).first_time_seconds
        assert first == FIRST_TIME_DENSE_PASSES[plan] * REFERENCE.dense_forward_seconds
    removed = 30 * ((96 - 10) + (64 - 5))  # the MLP is not compressed at scope attention
    assert same.artifact_bytes == 2 * (100_000 - removed)
    wide = estimate_run(replace(options, dtype="float32"), reference)
    assert wide.artifact_bytes == 4 * (100_000 - removed)


def test_the_summary_is_short_and_its_size_estimate_matches_a_real_artifact(tiny_folder, tiny_artifact, capsys):
    folder = tiny_folder("gqa")
    argv = ["compress", "--model", str(folder), "--ratio", "0.4", "--calib-samples", "4", "--seq-len", "64",
            "--dtype", "float32", "--device", "cpu", "--dry-run"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["model", "method", "calibration", "kept", "memory", "time",
                                                   "output", "(--json"]
    assert lines[1].startswith(f"method       ftc, keep ratio 0.4, allocation {default_allocation('ftc')}, "
                               "stored as float32")
    assert "4 x 64 = 256 tokens of wikitext2" in lines[2] and "on two CPU threads" in lines[5]
    artifact = tiny_artifact("gqa", ratio=0.4, dtype="float32")  # the same options, compressed for real
    written = (artifact / "model.safetensors").stat().st_size
    shown = lines[6].split("about ")[1].split(" (")[0]
    number, unit = shown.split()
    estimate = float(number) * {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}[unit]
    assert abs(estimate - written) / written < 0.01, (shown, written)

    assert main([*argv, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["layers"] == 2 and planned["calibration_tokens"] == 256
