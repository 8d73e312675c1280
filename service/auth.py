"""API keys and the teams they belong to.

FTC_API_KEYS is either `key:team,key:team,...` or the path of a file with one `key:team` a line
(`#` starts a comment), so keys can come from a mounted secret instead of the environment. Keys
are kept only as SHA-256 digests, which also makes the lookup independent of how much of a guessed
key is right.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

TEAM_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
_TEAM_RE = re.compile(TEAM_PATTERN)
MIN_KEY_LENGTH = 8


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """Which team, if any, an API key belongs to."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self._teams = {_digest(key): team for key, team in pairs}

    @classmethod
    def parse(cls, spec: str) -> ApiKeys:
        """Read `key:team,...` or a file of `key:team` lines; raise ValueError saying which entry is wrong."""
        text = spec.strip()
        source = "FTC_API_KEYS"
        if text and ":" not in text.splitlines()[0] and Path(text).is_file():
            source, text = text, Path(text).read_text()
        entries = [e.strip() for line in text.splitlines() for e in line.split("#", 1)[0].split(",")]
        pairs = []
        seen: dict[str, tuple[int, str]] = {}
        for number, entry in enumerate((e for e in entries if e), start=1):
            key, _, team = entry.rpartition(":")
            if len(key) < MIN_KEY_LENGTH or any(c.isspace() for c in key):
                raise ValueError(
                    f"{source}: entry {number}: the key must be at least {MIN_KEY_LENGTH} characters "
                    "without spaces, written as key:team"
                )
            if not _TEAM_RE.match(team):
                raise ValueError(
                    f"{source}: entry {number}: team {team!r} must be lower-case letters, digits, '-' or '_'"
                )
            first, first_team = seen.setdefault(key, (number, team))
            if first_team != team:
                # Silently, the last entry would win and the key would open the other team's jobs.
                raise ValueError(
                    f"{source}: entries {first} and {number} give one key to two teams ({first_team!r} and "
                    f"{team!r}); each key must belong to one team"
                )
            pairs.append((key, team))
        if not pairs:
            raise ValueError("FTC_API_KEYS is empty: set it to key:team,... or to a file of key:team lines")
        return cls(pairs)

    def team_for(self, key: str) -> str | None:
        return self._teams.get(_digest(key))

    @property
    def teams(self) -> frozenset[str]:
        return frozenset(self._teams.values())
