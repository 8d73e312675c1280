"""What each team may do: its share of the workers, its quotas, and whether it may jump the queue.

Every team gets the deployment's defaults (`FTC_QUOTA_*`, weight 1, no `priority: high`);
`FTC_TEAMS` changes them per team, as a JSON object or the path of a JSON file:

    {"team-alpha": {"weight": 2, "high_priority": true, "queued_jobs": 5000},
     "nightly-bot": {"running_jobs": 1}}

The API, the workers and the scheduler read the same environment, so they agree on the table:
the API enforces the submission limits, the workers' claims the weights and running limits
(service/queue.py), the scheduler the queued limit while it expands sweeps.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.settings import Settings

LIMIT_SETTINGS: dict[str, str] = {
    "queued_jobs": "FTC_QUOTA_QUEUED_JOBS",
    "running_jobs": "FTC_QUOTA_RUNNING_JOBS",
    "submissions_per_minute": "FTC_QUOTA_SUBMISSIONS_PER_MINUTE",
    "upload_bytes": "FTC_QUOTA_UPLOAD_BYTES",
    "sweeps": "FTC_QUOTA_SWEEPS",
    "min_schedule_seconds": "FTC_QUOTA_MIN_SCHEDULE_SECONDS",
}
"""Each quota, by the name answers and FTC_TEAMS use, and the setting of its default."""


class TeamPolicy(BaseModel):
    """One team's share and limits; a limit of 0 means none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(1.0, gt=0, le=1000, description="Share of the workers against other waiting teams.")
    high_priority: bool = Field(False, description="Whether the team may submit with priority high.")
    queued_jobs: int = Field(..., ge=0)
    running_jobs: int = Field(..., ge=0)
    submissions_per_minute: int = Field(..., ge=0)
    upload_bytes: int = Field(..., ge=0)
    sweeps: int = Field(..., ge=0)
    min_schedule_seconds: int = Field(..., ge=0)


def priority_problem(policy: TeamPolicy, priority: str) -> str | None:
    """Why the team may not submit at `priority`, else None: `high` jumps every other team's jobs,
    so only teams given `high_priority` may use it."""
    if priority == "high" and not policy.high_priority:
        return "priority high is not open to your team (high_priority in FTC_TEAMS); use normal or low"
    return None


def limit_source(limit: str) -> str:
    """Where an operator changes `limit`: its default setting, or the team's entry in FTC_TEAMS."""
    return f"{LIMIT_SETTINGS[limit]}, or {limit} in FTC_TEAMS"


@dataclass(frozen=True)
class TeamPolicies:
    """The defaults and the teams that differ from them."""

    default: TeamPolicy
    overrides: Mapping[str, TeamPolicy] = field(default_factory=dict)

    def of(self, team: str) -> TeamPolicy:
        return self.overrides.get(team, self.default)

    def dispatch_table(self) -> str:
        """What a claim needs of the teams that differ from the default, as JSON for the claim script:
        {team: [weight, running_jobs]}."""
        return json.dumps(
            {team: [p.weight, p.running_jobs] for team, p in sorted(self.overrides.items())}, separators=(",", ":")
        )

    def check_known(self, teams: frozenset[str]) -> None:
        """Refuse a team in FTC_TEAMS that no key belongs to: a misspelt name would silently do nothing."""
        unknown = sorted(set(self.overrides) - teams)
        if unknown:
            raise ValueError(
                f"FTC_TEAMS names {', '.join(repr(t) for t in unknown)}, which no key in FTC_API_KEYS belongs to; "
                "fix the team name"
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> TeamPolicies:
        """The defaults from `FTC_QUOTA_*`, the overrides from FTC_TEAMS; ValueError naming the bad entry."""
        return cls.parse(settings.teams, tuple(getattr(settings, f"quota_{limit}") for limit in LIMIT_SETTINGS))

    @classmethod
    def parse(cls, spec: str, defaults: tuple[int, ...]) -> TeamPolicies:
        """FTC_TEAMS's text `spec` over the default limits, in the order of LIMIT_SETTINGS."""
        default = TeamPolicy(**dict(zip(LIMIT_SETTINGS, defaults, strict=True)))
        entries = _read_entries(spec)
        overrides = {}
        for team, entry in entries.items():
            if not isinstance(entry, dict):
                raise ValueError(f"FTC_TEAMS: team {team!r}: give an object of settings, e.g. {{\"weight\": 2}}")
            try:
                overrides[team] = TeamPolicy.model_validate(default.model_dump() | entry)
            except ValidationError as error:
                first = error.errors()[0]
                where = ".".join(str(part) for part in first["loc"]) or "entry"
                raise ValueError(f"FTC_TEAMS: team {team!r}: {where}: {first['msg']}") from None
        return cls(default, overrides)


def policies_for(settings: Settings) -> TeamPolicies:
    """The policies of `settings`, parsed once (routes ask on every request; FTC_TEAMS may be a file)."""
    return _parsed(settings.teams, tuple(getattr(settings, f"quota_{limit}") for limit in LIMIT_SETTINGS))


_parsed = functools.lru_cache(maxsize=8)(TeamPolicies.parse)


def _read_entries(spec: str) -> dict:
    text = spec.strip()
    if not text:
        return {}
    source = "FTC_TEAMS"
    if not text.startswith(("{", "[")):
        path = Path(text)
        if not path.is_file():
            raise ValueError("FTC_TEAMS must be a JSON object or the path of a JSON file; no such file: " + text)
        source, text = f"FTC_TEAMS file {text}", path.read_text()
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{source} is not JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
    if not isinstance(entries, dict):
        raise ValueError(f"{source} must be a JSON object of team names")
    return entries
