"""How long a succeeded job's checkpoints stay in the object store (`FTC_KEEP_CHECKPOINTS`).

A job checkpoints every finished layer so that another worker can resume it; once it succeeded,
nothing resumes it, and its checkpoints (most of its folder's files and, for a big model, about as
many bytes as the model itself) are only worth keeping for a while, to look into a surprising
result. The worker that publishes a job marks its checkpoints for deletion at `finished + keep`
in one Redis sorted set; deletion passes (the worker after each job, and `ftc scheduler` on every
pass) delete the marked folders that are due. A keep of 0 deletes them at publication; `forever`
keeps them.
"""

from __future__ import annotations

import asyncio
import logging
import re

from redis.asyncio import Redis

from service.store import ObjectStore
from service.store.layout import CHECKPOINTS

log = logging.getLogger(__name__)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
FOREVER = "forever"
PURGE_BATCH = 100
"""Job folders one pass deletes at most, so a pass stays short after a long outage."""


def parse_keep(text: str | float | int) -> float | None:
    """Seconds to keep checkpoints after success (`3600`, `90m`, `12h`, `7d`; 0: none), or None for
    `forever`. Raises ValueError naming the setting and the accepted forms."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        text = str(text)
    if isinstance(text, str) and text.strip().lower() == FOREVER:
        return None
    match = _DURATION.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"FTC_KEEP_CHECKPOINTS must be a duration such as 0, 3600, 90m, 12h or 7d, or 'forever'; got {text!r}"
        )
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def expiry_key(key_prefix: str) -> str:
    """The sorted set of job folders whose checkpoints are to be deleted, scored by when."""
    return f"{key_prefix}:checkpoints:expiry"


def delete_checkpoints(store: ObjectStore, job_prefix: str) -> int:
    """Delete every checkpoint under a job's folder; returns how many files went."""
    infos = store.list(job_prefix + CHECKPOINTS)
    for info in infos:
        store.delete(info.key)
    return len(infos)


async def after_success(
    redis: Redis, store: ObjectStore, key_prefix: str, job_prefix: str, keep_seconds: float | None, now: float
) -> None:
    """What a worker does with a job's checkpoints once the job succeeded: delete them at once
    (keep 0), mark them for deletion at `now + keep`, or leave them (`forever`)."""
    if keep_seconds is None:
        return
    if keep_seconds <= 0:
        await asyncio.to_thread(delete_checkpoints, store, job_prefix)
        return
    await redis.zadd(expiry_key(key_prefix), {job_prefix: now + keep_seconds})


async def purge_due(redis: Redis, store: ObjectStore, key_prefix: str, now: float) -> list[str]:
    """Delete the checkpoints of every marked job folder that is due; returns those folders.

    A folder is unmarked only after its files are gone, so a store outage leaves it for the next
    pass; two passes at once delete the same files twice, which is harmless."""
    key = expiry_key(key_prefix)
    due = await redis.zrangebyscore(key, "-inf", now, start=0, num=PURGE_BATCH)
    purged = []
    for member in due:
        job_prefix = member.decode() if isinstance(member, bytes) else member
        try:
            count = await asyncio.to_thread(delete_checkpoints, store, job_prefix)
        except Exception:  # one bad folder (a store outage) must not stop the others
            log.warning("could not delete the checkpoints under %s; retrying on the next pass", job_prefix,
                        exc_info=True)
            continue
        await redis.zrem(key, member)
        log.info("deleted %d checkpoint files under %s (FTC_KEEP_CHECKPOINTS)", count, job_prefix)
        purged.append(job_prefix)
    return purged
