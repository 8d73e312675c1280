"""benchmarks/quality.py: a results file per model and scope, the committed table rendered as it
was, and the whole-model table with PTB, sizes and the MLP ablation."""

from __future__ import annotations

import json

import pytest

from tests.support.benchmarks import load_benchmark

quality = load_benchmark("quality")


@pytest.mark.parametrize(("kind", "model", "scope", "name"), [
    ("quality", "smollm2-135m", "attention", "quality.json"),
    ("quality", "gemma3-270m", "attention", "quality_gemma3-270m.json"),
    ("quality", "smollm2-135m", "model", "quality_model_scope.json"),
    ("quality", "gemma3-270m", "model", "quality_model_scope_gemma3-270m.json"),
    ("tasks", "smollm2-135m", "attention", "tasks.json"),
    ("tasks", "gemma3-270m", "attention", "tasks_gemma3-270m.json"),
])
def test_each_model_and_scope_has_its_own_results_file(kind, model, scope, name):
    assert quality.results_file(kind, model, scope) == quality.RESULTS / name


def test_whole_model_runs_leave_out_the_attention_only_allocation():
    assert quality.methods_of_scope(list(quality.METHODS), "attention") == list(quality.METHODS)
    assert quality.methods_of_scope(list(quality.METHODS), "model") == [m for m in quality.METHODS
                                                                          if m != "ftc_global"]
    assert "mlp_per_matrix" in quality.MLP_ABLATIONS and not {"no_whiten", "no_sink"} & set(quality.MLP_ABLATIONS)


def test_the_committed_table_renders_from_its_json_as_committed():
    # the SmolLM2 attention-only file keeps its numbers and layout: no PTB, size or scope parts appear
    results = json.loads((quality.RESULTS / "quality.json").read_text())
    assert quality.render(results, "quality.png") == (quality.RESULTS / "quality.md").read_text()


def _cell(method: str, ratio: float, ppl: float, ptb: dict | None = None, ablation: str = "") -> dict:
    return {"method": method, "ratio": ratio, "ablation": ablation, "calib_samples": 32, "scope": "model",
            "ppl": ppl, "windows": 64, "tokens": 32768, **({"ptb": ptb} if ptb else {}),
            "model_reduction": 0.3, "linear_reduction": 0.4, "model_params_dense": 1000, "value_bytes": 2,
            "artifact_bytes": 1500, "source_bytes": 1000}


def test_the_whole_model_table_has_ptb_sizes_and_the_mlp_ablation():
    ptb = {"ppl": 50.0, "windows": 64, "tokens": 32768}
    results = {"model": "smollm2-135m", "scope": "model", "calibration": "32 x 512",
               "dense": {"ppl": 30.0, "windows": 64, "tokens": 32768, "ptb": {**ptb, "ppl": 40.0}},
               "cells": {"ftc@0.6": _cell("ftc", 0.6, 36.0, ptb),
                         "svd_llm@0.6": _cell("svd_llm", 0.6, 45.0, {**ptb, "ppl": 70.0, "recompressed": True}),
                         "ftc@0.6+mlp_per_matrix": _cell("ftc", 0.6, 39.6, ablation="mlp_per_matrix")}}
    text = quality.render(results)
    assert text.startswith("# Whole-model compression: SmolLM2-135M-Instruct (Q4_1 GGUF")
    assert "![perplexity against the keep ratio](quality_model_scope.png)" in text
    assert "ftc_global" not in text.split("## PTB")[0]
    wikitext, rest = text.split("## PTB test perplexity")
    # columns: ftc, svd_llm, svd_llm_v2, asvd, svd, per_matrix (no variant of ftc ran), then FTC against the others
    assert "| 0.6 (40%) | 36.00 | 45.00 | - | - | - | - | 20.0% lower | - | 1.20x | 1.20x (ftc) |" in wikitext
    ptb_table, sizes = rest.split("## Parameters and file size")
    assert "Dense perplexity: **40.000**" in ptb_table and "| 70.00 ° |" in ptb_table
    assert "| 1.25x | 1.25x (ftc) |" in ptb_table and "° measured after the WikiText-2 number" in ptb_table
    assert "| 0.6 (40%) | ftc | 40.0% | 30.0% | 0.0 | 1.50x | 0.75x |" in sizes
    assert "| mlp_per_matrix | 39.60 (+10.0%) |" in sizes
    assert "no_whiten" not in sizes  # only ablations that were run have rows
