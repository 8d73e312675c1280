"""Cron schedules of campaigns: which expressions are accepted and when their slots fall.

Times are epoch seconds; a schedule is read in its sweep's IANA time zone, so "0 2 * * *" in
Europe/Paris stays at 02:00 local time across daylight-saving changes.
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

from service.teams import limit_source

ALIASES = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


def check_schedule(expression: str) -> str:
    """Accept five-field cron expressions and the usual @aliases that fire at least once; seconds
    fields are refused.

    A well-formed expression may still name no real day (`0 0 30 2 *`, the 30th of February):
    croniter accepts it and raises only when asked for the next slot, which made creating such a
    sweep a 500. Asking for the next slot here makes it a 422 that names the schedule.
    """
    text = " ".join(expression.split())
    fields = text.split(" ")
    if not (text in ALIASES or (len(fields) == 5 and croniter.is_valid(text))):
        raise ValueError(
            f"schedule {expression!r} is not a cron expression; use five fields "
            "(minute hour day-of-month month day-of-week, e.g. '0 2 * * *') or one of " + ", ".join(ALIASES)
        )
    try:
        next_slot(text, "UTC", time.time())
    except CroniterError:
        raise ValueError(f"schedule {expression!r} never fires (no date matches it); check the day and month") from None
    return text


def check_timezone(name: str) -> str:
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r}; use an IANA name such as UTC or Europe/Paris") from None
    return name


def _at(epoch: float, timezone: str) -> datetime:
    return datetime.fromtimestamp(epoch, ZoneInfo(timezone))


def next_slot(expression: str, timezone: str, after: float) -> float:
    """The first slot strictly later than `after`."""
    return croniter(expression, _at(after, timezone)).get_next(float)


def latest_slot(expression: str, timezone: str, at: float) -> float:
    """The last slot at or before `at`."""
    # get_prev is strictly earlier than its start, and slots fall on whole seconds: start just past `at`.
    return croniter(expression, _at(math.floor(at) + 1, timezone)).get_prev(float)


GAP_SLOTS = 400
"""Slots looked at for a schedule's shortest gap: a year and more of a daily schedule."""


def schedule_gap_problem(expression: str, timezone: str, at_least_seconds: int, now: float) -> str | None:
    """Why `expression` fires too often (two slots closer than `at_least_seconds` among its next
    GAP_SLOTS), else None. A deployment limit: `* * * * *` on a sweep of 512 cells is 512 jobs a minute."""
    if at_least_seconds <= 0:
        return None
    slots = croniter(expression, _at(now, timezone))
    previous = slots.get_next(float)
    for _ in range(GAP_SLOTS):
        following = slots.get_next(float)
        if following - previous < at_least_seconds:
            return (
                f"schedule {expression!r} fires {following - previous:g} s after a run at times; runs of a sweep "
                f"must be at least {at_least_seconds} s apart here (min_schedule_seconds: "
                f"{limit_source('min_schedule_seconds')}); use a sparser schedule"
            )
        previous = following
    return None
