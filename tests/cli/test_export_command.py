"""`ftc export`: a stock checkpoint out, one stderr line and exit 2 on bad input.

In process (`cli.main`, the command line's own parsing, exit codes and stderr): an interpreter and a
torch import per command cost seconds each; `python -m cli` itself runs in tests/ftc/test_streaming.py's
killed run."""

from __future__ import annotations

import json
import os

import pytest

from cli.main import main


def run(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """`ftc export ARGS` in process: the exit code, stdout and stderr."""
    capsys.readouterr()
    code = main(["export", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(done: tuple[int, str, str], *words: str) -> None:
    code, _, err = done
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftc: error:"), err
    for word in words:
        assert word in lines[0]


def test_export_writes_a_dense_checkpoint_and_refuses_to_overwrite(tiny_artifact, tmp_path, capsys):
    out = tmp_path / "dense"
    code, stdout, err = run(capsys, str(tiny_artifact("gqa")), "--format", "dense", "--out", str(out), "--dtype",
                            "bfloat16")
    assert code == 0, err
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["dtype"] == "bfloat16" and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    _one_error_line(run(capsys, str(tiny_artifact("gqa")), "--out", str(out)), "--overwrite")
    assert run(capsys, str(tiny_artifact("gqa")), "--out", str(out), "--overwrite")[0] == 0


def test_a_folder_that_is_not_an_artifact_is_refused(tiny_folder, tmp_path, capsys):
    _one_error_line(run(capsys, str(tiny_folder("gqa")), "--out", str(tmp_path / "o")),  # a dense folder: config.json
                    "is a model folder (config.json) but not a compressed artifact (no manifest.json)")
    _one_error_line(run(capsys, str(tmp_path), "--out", str(tmp_path / "o")), "not an ftc artifact")
    _one_error_line(run(capsys, str(tmp_path / "missing"), "--out", str(tmp_path / "o")), "not a folder")
    assert not (tmp_path / "o").exists()


def test_an_unwritable_out_is_refused(tiny_artifact, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        done = run(capsys, str(tiny_artifact("gqa")), "--out", str(locked / "dense"))
    finally:
        locked.chmod(0o700)
    if os.geteuid() == 0:  # root writes anywhere; nothing to refuse
        assert done[0] == 0
    else:
        _one_error_line(done, "not writable")
