"""The `ftc` command line end to end on a tiny local model, and its handling of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main


@pytest.fixture()
def model_dir(tiny_folder) -> Path:
    return tiny_folder("gqa")


def test_compress_then_eval_artifact_and_dense(model_dir, tmp_path, capsys):
    """In process (`cli.main`): the command line's parsing and output without an interpreter per command."""
    out = tmp_path / "art"
    assert main(["compress", "--model", str(model_dir), "--method", "ftc", "--ratio", "0.4", "--calib", "wikitext2",
                 "--calib-samples", "4", "--seq-len", "64", "--device", "cpu", "--quiet", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["method"] == "ftc" and manifest["ratio"] == 0.4
    assert manifest["calibration"]["tokens"] == 256 and len(manifest["calibration"]["sha256"]) == 64
    assert {"r1", "r2", "K", "eps", "r_o", "error_allocated", "error_refit", "seconds"} <= set(manifest["layers"][0])
    for layer in manifest["layers"]:  # the phases partition the layer's time (the clock laps are contiguous)
        assert set(layer["phase_seconds"]) == {"statistics", "qkv", "o", "propagate"}
        assert sum(layer["phase_seconds"].values()) <= layer["seconds"] + 0.01
    storage = manifest["storage"]
    assert storage["qkv_values_used"] <= storage["qkv_budget_values"]
    assert storage["bytes_written"] if "bytes_written" in storage else manifest["bytes_written"] > 0
    for name in ("config.json", "tokenizer_config.json", "model.safetensors"):
        assert (out / name).is_file()
    results = []
    for target in ([str(out)], ["--model", str(model_dir)]):
        capsys.readouterr()
        assert main(["eval", *target, "--dataset", "wikitext2", "--seq-len", "64", "--max-windows", "3", "--json",
                     "--device", "cpu"]) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    for r in results:
        assert {"dataset", "seq_len", "windows", "tokens", "ppl"} <= set(r)
        assert r["windows"] == 3 and r["tokens"] == 192 and r["ppl"] > 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "no-such-model"], "unknown model"),
        (["--calib", "no-such-set"], "unknown dataset"),
        (["--ratio", "1.5"], "ratio must be in (0, 1]"),
        (["--ratio", "0"], "ratio must be in (0, 1]"),
        (["--calib-samples", "1", "--seq-len", "16"], "raise --calib-samples or --seq-len"),
        (["--ablate", "no_magic"], "unknown ablation"),
        (["--out", "/proc/ftc-out"], "not writable"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_output(model_dir, tmp_path, args, message, capsys, monkeypatch):
    """In process (`cli.main`, as tests/cli/test_bad_input.py): the exit code and the stderr line are the
    command line's, without an interpreter started per case."""
    out = tmp_path / "never"
    base = {"--model": str(model_dir), "--calib-samples": "4", "--seq-len": "64", "--out": str(out)}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    flat = [x for kv in base.items() for x in kv]
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()  # the fixture's own progress bar
    assert main(["compress", "--device", "cpu", *flat]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    assert not out.exists()
    assert not list(tmp_path.glob(".never.tmp-*"))
