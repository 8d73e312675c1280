"""benchmarks/structures.py: a table per model, named for the model it measured, and no file mixing
two models' cells."""

from __future__ import annotations

import json

import pytest

from tests.support.benchmarks import load_benchmark

structures = load_benchmark("structures")


def _cell(method: str, ppl: float) -> dict:
    return {"method": method, "ratio": 0.4, "allocation": "uniform", "ppl": ppl, "windows": 64,
            "compress_seconds": 60.0, "qkv_seconds": 30.0, "qkv_values_used": 90, "qkv_budget_values": 100,
            "layer_errors": [0.1, 0.2], "layer_shapes": [{"r1": 4, "r2": 4, "K": 8, "R": 3, "sweeps": 5}] * 2}


def test_the_table_names_the_model_it_measured():
    results = {"cells": {"ftc@0.4": _cell("ftc", 40.0), "cp@0.4": _cell("cp", 44.0)}}
    assert structures.render(results).startswith(
        "# Structures: Tucker (FTC) against CP at equal storage, SmolLM2-135M-Instruct (Q4_1 GGUF")
    gemma = structures.render({**results, "model": "gemma3-270m"})
    assert gemma.startswith("# Structures: Tucker (FTC) against CP at equal storage, Gemma-3-270M (base model")
    assert "| 0.4 | 40.00 | 44.00 | 90 / 90 / 100 |" in gemma


def test_a_file_of_one_model_takes_no_cells_of_another(tmp_path):
    out = tmp_path / "structures.json"
    out.write_text(json.dumps({"cells": {}}))  # an earlier SmolLM2 file names no model
    with pytest.raises(SystemExit, match="holds smollm2-135m's cells, not gemma3-270m's"):
        structures.run(None, None, [0.4], 64, out, model="gemma3-270m")
    assert json.loads(out.read_text()) == {"cells": {}}


def test_a_new_file_is_the_model_s_own(tmp_path):
    out = tmp_path / "structures_gemma3-270m.json"
    assert structures.run(None, None, [], 64, out, model="gemma3-270m")["model"] == "gemma3-270m"
    assert json.loads(out.read_text())["model"] == "gemma3-270m"
    assert structures.run(None, None, [], 64, out, model="gemma3-270m")["cells"] == {}  # and is read again
