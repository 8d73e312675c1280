"""The command line run in process (`cli.main`), as users see its failures: one stderr line."""

from __future__ import annotations

import pytest


def one_error_line(capsys: pytest.CaptureFixture, *words: str) -> None:
    """What the command wrote to stderr since the last read is one `ftc: error:` line holding `words`."""
    err = capsys.readouterr().err
    assert err.startswith("ftc: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err
