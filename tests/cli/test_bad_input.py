"""Bad input to the library commands ends in one `ftc: error:` line naming the problem and exit
code 2, before any model is loaded: a `.gguf` file that is not GGUF, an artifact folder and
`--model` given together."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import main
from tests.support.cli import one_error_line


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>not found</html>")
    return path


@pytest.mark.parametrize(
    "argv",
    [["compress", "--dry-run", "--model"], ["compress", "--out", "unused", "--model"], ["eval", "--model"]],
    ids=["compress --dry-run", "compress", "eval --model"],
)
def test_a_gguf_name_on_something_else_is_one_line(argv: list[str], fake_gguf: Path, capsys) -> None:
    assert main([*argv, str(fake_gguf)]) == 2
    one_error_line(capsys, f"{fake_gguf} is not a GGUF file")


def test_an_empty_gguf_is_one_line_too(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert main(["eval", "--model", str(empty)]) == 2
    one_error_line(capsys, "is not a GGUF file")


def test_eval_refuses_an_artifact_and_a_model_together(tmp_path: Path, capsys) -> None:
    assert main(["eval", str(tmp_path), "--model", "smollm2-135m"]) == 2
    one_error_line(capsys, "give an artifact folder or --model, not both")
