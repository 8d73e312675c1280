"""`ftc export`: a stock checkpoint out, one stderr line and exit 2 on bad input.

In process (`cli.main`, the command line's own parsing, exit codes and stderr): an interpreter and a
torch import per command cost seconds each; `python -m cli` itself runs in tests/ftc/test_streaming.py's
killed run."""

from __future__ import annotations

import json
import os

import pytest

from cli.main import main
from tests.support.cli import one_error_line


def export(capsys: pytest.CaptureFixture, *args: str) -> int:
    """`ftc export ARGS` in process, its exit code; what the fixtures printed before it is dropped."""
    capsys.readouterr()
    return main(["export", *args])


def test_export_writes_a_dense_checkpoint_and_refuses_to_overwrite(tiny_artifact, tmp_path, capsys):
    out = tmp_path / "dense"
    assert export(capsys, str(tiny_artifact("gqa")), "--format", "dense", "--out", str(out), "--dtype", "bfloat16") == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["dtype"] == "bfloat16" and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert export(capsys, str(tiny_artifact("gqa")), "--out", str(out)) == 2
    one_error_line(capsys, "--overwrite")
    assert export(capsys, str(tiny_artifact("gqa")), "--out", str(out), "--overwrite") == 0


def test_a_folder_that_is_not_an_artifact_is_refused(tiny_folder, tmp_path, capsys):
    for folder, words in ((tiny_folder("gqa"),  # a dense folder: config.json
                           "is a model folder (config.json) but not a compressed artifact (no manifest.json)"),
                          (tmp_path, "not an ftc artifact"), (tmp_path / "missing", "not a folder")):
        assert export(capsys, str(folder), "--out", str(tmp_path / "o")) == 2
        one_error_line(capsys, words)
    assert not (tmp_path / "o").exists()


def test_an_unwritable_out_is_refused(tiny_artifact, tmp_path, capsys):
    artifact = tiny_artifact("gqa")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code = export(capsys, str(artifact), "--out", str(locked / "dense"))
    finally:
        locked.chmod(0o700)
    if os.geteuid() == 0:  # root writes anywhere; nothing to refuse
        assert code == 0
    else:
        assert code == 2
        one_error_line(capsys, "not writable")
