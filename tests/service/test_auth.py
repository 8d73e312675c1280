"""API keys: parsed from a `key:team` list or a file, looked up by digest, rejected with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.auth import ApiKeys


def test_a_comma_list_maps_keys_to_teams() -> None:
    keys = ApiKeys.parse("alpha-key-123:team-a, beta-key-456:team-b")
    assert keys.team_for("alpha-key-123") == "team-a"
    assert keys.team_for("beta-key-456") == "team-b"
    assert keys.team_for("alpha-key-12") is None
    assert keys.teams == {"team-a", "team-b"}


def test_a_file_of_lines_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("# team keys\nalpha-key-123:team-a\n\nkey:with:colons:team-c  # ok\n")
    keys = ApiKeys.parse(str(path))
    assert keys.team_for("alpha-key-123") == "team-a"
    assert keys.team_for("key:with:colons") == "team-c"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("", "empty"),
        ("short:team-a", "at least 8"),
        ("long-enough-key:Team A", "lower-case"),
        ("long-enough-key:", "lower-case"),
    ],
)
def test_bad_specs_say_which_entry_is_wrong(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ApiKeys.parse(spec)
