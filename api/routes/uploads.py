"""Calibration files sent into the object store, to be named by jobs of the same team."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, status

from api.deps import AppSettings, ServicesDep, Store, Team
from api.errors import documented
from service.schemas import Upload
from service.store.layout import FILENAME_PATTERN
from service.teams import policies_for
from service.uploads import UploadQuota, save_upload

router = APIRouter(prefix="/v1/uploads", tags=["uploads"], responses=documented(401, 503))

_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=Upload,
    openapi_extra=_BODY,
    responses=documented(413, 429),
)
async def upload_calibration_file(
    request: Request,
    filename: Annotated[str, Query(pattern=FILENAME_PATTERN, description="e.g. calib.txt or calib.jsonl")],
    team: Team,
    store: Store,
    settings: AppSettings,
    services: ServicesDep,
) -> Upload:
    """Store the request body (UTF-8 text, .txt or .jsonl with one {"text": ...} object a line,
    checked now); use the returned `uri` as a dataset.

    `api.gate.RequestGate` has refused a body announced larger than FTC_MAX_UPLOAD_BYTES already;
    `save_upload` stops one sent without a length as soon as it passes the limit. A body that
    would pass the team's upload_bytes quota is refused (429), before it is read when its length
    is announced."""
    quota = UploadQuota(services.redis, services.jobs.keys, team, policies_for(settings).of(team).upload_bytes)
    declared = request.headers.get("content-length", "")
    if declared.isdigit():
        await quota.check(int(declared))
    return await save_upload(store, team, filename, request.stream(), settings.max_upload_bytes, quota)
