"""Time-sortable identifiers for jobs and uploads.

Ids sort by creation time as plain strings, which lets Redis page a team's jobs newest-first with a
lexicographic sorted set (ZREVRANGEBYLEX) and lets an id double as the pagination cursor.
"""

from __future__ import annotations

import re
import secrets
import time

# Crockford's base32 in ASCII order, so string order equals numeric order.
_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"
_TIME_CHARS = 10  # 50 bits of milliseconds: good until the year 37000
_RANDOM_CHARS = 12  # 60 bits: no collision among ids minted in the same millisecond

ID_PATTERN = rf"^[a-z]+_[{_ALPHABET}]{{{_TIME_CHARS + _RANDOM_CHARS}}}$"
_ID_RE = re.compile(ID_PATTERN)


def _base32(value: int, width: int) -> str:
    chars = []
    for _ in range(width):
        value, digit = divmod(value, 32)
        chars.append(_ALPHABET[digit])
    return "".join(reversed(chars))


def new_id(kind: str, now: float | None = None) -> str:
    """A fresh id such as `job_01jd3k...`: kind, then milliseconds since the epoch, then randomness."""
    millis = int((time.time() if now is None else now) * 1000)
    randomness = secrets.randbits(5 * _RANDOM_CHARS)
    return f"{kind}_{_base32(millis, _TIME_CHARS)}{_base32(randomness, _RANDOM_CHARS)}"


def is_id(text: str) -> bool:
    """Whether `text` has the shape of an id minted by `new_id` (any kind)."""
    return bool(_ID_RE.match(text))
