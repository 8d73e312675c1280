"""Calibration files uploaded by a team, and the checks that a job only reads its own team's uploads."""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import re
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from service.ids import new_id
from service.schemas import JobRequest, Upload, is_upload_uri
from service.store import ObjectStore
from service.store.layout import FILENAME_PATTERN, UPLOAD_SUFFIXES, upload_key, uploads_prefix

_FILENAME_RE = re.compile(FILENAME_PATTERN)


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


async def save_upload(
    store: ObjectStore, team: str, filename: str, chunks: AsyncIterator[bytes], max_bytes: int
) -> Upload:
    """Spool the body to disk (checking size and UTF-8 as it arrives), then put it into the store."""
    check_filename(filename)
    digest, size = hashlib.sha256(), 0
    decoder = codecs.getincrementaldecoder("utf-8")()
    with tempfile.NamedTemporaryFile(prefix="ftc-upload-") as spool:
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise UploadTooLarge(f"upload is larger than the limit of {max_bytes} bytes")
                decoder.decode(chunk)
                digest.update(chunk)
                spool.write(chunk)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as error:
            raise UploadRejected(f"calibration files must be UTF-8 text; byte {error.start} is not") from None
        if size == 0:
            raise UploadRejected("the upload is empty; send the file as the request body")
        spool.flush()
        key = upload_key(team, new_id("upl"), filename)
        await asyncio.to_thread(store.put_file, key, Path(spool.name), "text/plain; charset=utf-8")
    return Upload(uri=store.uri(key), filename=filename, size=size, sha256=digest.hexdigest())


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
        key = store.key_for_uri(name)
        if key is None or not key.startswith(uploads_prefix(team)) or not store.exists(key):
            problems.append(
                {
                    "loc": loc,
                    "msg": f"no upload {name} for this team; send the file with POST /v1/uploads first",
                    "type": "value_error",
                }
            )
    return problems
