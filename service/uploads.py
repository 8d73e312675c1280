"""Calibration files uploaded by a team, and the checks that a job only reads its own team's uploads.

An upload is named `upload://{upload_id}/{filename}`: the same on every store, and read against
the team of the job that names it, so the name shows neither where the store is nor whose it is.
A file is checked for what a worker will read when it arrives (UTF-8 text; a `.jsonl` file one
JSON object with a `text` field a line), so a bad file is refused here, not by a job later. A
team's uploads count against its upload_bytes quota.
"""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import json
import re
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from redis.asyncio import Redis

from service.errors import QuotaExceeded
from service.ids import ID_PATTERN, new_id
from service.keys import Keys
from service.schemas import UPLOAD_SCHEME, JobRequest, Upload, is_upload_uri
from service.store import ObjectStore
from service.store.layout import FILENAME_PATTERN, UPLOAD_SUFFIXES, upload_key, uploads_prefix
from service.teams import limit_source

_FILENAME_RE = re.compile(FILENAME_PATTERN)
_ID_RE = re.compile(ID_PATTERN)
RETRY_AFTER_UPLOAD_BYTES_SECONDS = 3600
"""Upload bytes are not freed by waiting; an operator raises the quota (or removes old uploads)."""

_RESERVE = """
local used, size, most = tonumber(redis.call('GET', KEYS[1]) or '0'), tonumber(ARGV[1]), tonumber(ARGV[2])
if most > 0 and used + size > most then return {0, used} end
return {1, redis.call('INCRBY', KEYS[1], size)}
"""


def upload_uri(upload_id: str, filename: str) -> str:
    return f"{UPLOAD_SCHEME}{upload_id}/{filename}"


def upload_key_for(store: ObjectStore, team: str, uri: str) -> str | None:
    """The store key of `team`'s upload `uri`, or None when the URI cannot be one of its uploads.

    `upload://` names are read against `team`; the store URIs answers carried before (s3://...,
    file://...) are still understood, for the jobs that name them."""
    if uri.startswith(UPLOAD_SCHEME):
        upload_id, _, filename = uri[len(UPLOAD_SCHEME) :].partition("/")
        if not (upload_id.startswith("upl_") and _ID_RE.match(upload_id) and _FILENAME_RE.match(filename)):
            return None
        return upload_key(team, upload_id, filename)
    key = store.key_for_uri(uri)
    return key if key is not None and key.startswith(uploads_prefix(team)) else None


class UploadQuota:
    """A team's upload bytes (`{p}:team:{team}:upload_bytes`), reserved atomically before a file is stored."""

    def __init__(self, redis: Redis, keys: Keys, team: str, most: int) -> None:
        self.redis = redis
        self.key = keys.upload_bytes(team)
        self.most = most
        self._reserve = redis.register_script(_RESERVE)

    def refused(self, used: int, size: int) -> QuotaExceeded:
        return QuotaExceeded(
            "upload_bytes",
            f"your team's uploads hold {used} bytes; {size} more would pass its limit of {self.most} "
            f"(upload_bytes: {limit_source('upload_bytes')})",
            RETRY_AFTER_UPLOAD_BYTES_SECONDS,
        )

    async def room(self) -> int | None:
        """Bytes the team may still upload; None without a limit."""
        if not self.most:
            return None
        return max(0, self.most - int(await self.redis.get(self.key) or 0))

    async def check(self, size: int) -> None:
        """Refuse at once (before reading) a body that cannot fit."""
        room = await self.room()
        if room is not None and size > room:
            raise self.refused(self.most - room, size)

    async def reserve(self, size: int) -> None:
        taken, used = await self._reserve(keys=[self.key], args=[size, self.most])
        if not taken:
            raise self.refused(int(used), size)

    async def release(self, size: int) -> None:
        await self.redis.decrby(self.key, size)


class UploadRejected(ValueError):
    """The file cannot be a calibration set; the message says why, `loc` says which input."""

    def __init__(self, message: str, loc: tuple[str, ...] = ("body",)) -> None:
        super().__init__(message)
        self.loc = loc


class UploadTooLarge(UploadRejected):
    pass


def check_filename(filename: str) -> str:
    if not _FILENAME_RE.match(filename) or not filename.endswith(UPLOAD_SUFFIXES):
        raise UploadRejected(
            f"filename {filename!r}: use letters, digits and '._-', ending in {' or '.join(UPLOAD_SUFFIXES)}",
            loc=("query", "filename"),
        )
    return filename


def check_records(path: Path, filename: str) -> None:
    """Refuse a file a worker could not calibrate on: no text at all, or (`.jsonl`) a line that is
    not a JSON object with a `text` field, as the library reads it (ftc/evaluation/data.py)."""
    if not filename.endswith(".jsonl"):
        with open(path, encoding="utf-8") as text:
            if not any(line.strip() for line in text):
                raise UploadRejected("the file holds no text, only blank space")
        return
    records = 0
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                message = f"line {number} is not JSON ({error.msg}); a .jsonl file has one object a line"
                raise UploadRejected(message) from None
            if not isinstance(record, dict) or "text" not in record:
                raise UploadRejected(f'line {number} has no "text" field; write each line as {{"text": "..."}}')
            records += 1
    if not records:
        raise UploadRejected('the file holds no records; write one {"text": "..."} a line')


async def save_upload(
    store: ObjectStore,
    team: str,
    filename: str,
    chunks: AsyncIterator[bytes],
    max_bytes: int,
    quota: UploadQuota | None = None,
) -> Upload:
    """Spool the body to disk (checking size, room in the team's quota and UTF-8 as it arrives),
    check its records, then reserve its bytes and put it into the store."""
    check_filename(filename)
    room = await quota.room() if quota is not None else None
    digest, size = hashlib.sha256(), 0
    decoder = codecs.getincrementaldecoder("utf-8")()
    with tempfile.NamedTemporaryFile(prefix="ftc-upload-") as spool:
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise UploadTooLarge(f"upload is larger than the limit of {max_bytes} bytes")
                if quota is not None and room is not None and size > room:
                    raise quota.refused(quota.most - room, size)
                decoder.decode(chunk)
                digest.update(chunk)
                spool.write(chunk)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as error:
            raise UploadRejected(f"calibration files must be UTF-8 text; byte {error.start} is not") from None
        if size == 0:
            raise UploadRejected("the upload is empty; send the file as the request body")
        spool.flush()
        await asyncio.to_thread(check_records, Path(spool.name), filename)
        upload_id = new_id("upl")
        if quota is not None:
            await quota.reserve(size)
        try:
            await asyncio.to_thread(
                store.put_file, upload_key(team, upload_id, filename), Path(spool.name), "text/plain; charset=utf-8"
            )
        except BaseException:
            if quota is not None:
                await quota.release(size)
            raise
    return Upload(uri=upload_uri(upload_id, filename), filename=filename, size=size, sha256=digest.hexdigest())


def upload_problems(store: ObjectStore, team: str, request: JobRequest) -> list[dict]:
    """Validation errors (FastAPI's shape) for dataset URIs that are not this team's existing uploads.

    Another team's upload gets the same answer as a missing one, so URIs do not leak.
    """
    places = [(("body", "calibration", "dataset"), request.calibration.dataset)]
    places += [(("body", "eval", "datasets", i), name) for i, name in enumerate(request.evaluation.datasets)]
    problems = []
    for loc, name in places:
        if not is_upload_uri(name):
            continue
        key = upload_key_for(store, team, name)
        if key is None or not store.exists(key):
            problems.append(
                {
                    "loc": loc,
                    "msg": f"no upload {name} for this team; send the file with POST /v1/uploads first",
                    "type": "value_error",
                }
            )
    return problems
