"""Calibration files sent into the object store, to be named by jobs of the same team."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, status

from api.deps import AppSettings, Store, Team
from api.errors import documented
from service.schemas import Upload
from service.store.layout import FILENAME_PATTERN
from service.uploads import save_upload

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
    responses=documented(413),
)
async def upload_calibration_file(
    request: Request,
    filename: Annotated[str, Query(pattern=FILENAME_PATTERN, description="e.g. calib.txt or calib.jsonl")],
    team: Team,
    store: Store,
    settings: AppSettings,
) -> Upload:
    """Store the request body (UTF-8 text, .txt or .jsonl); use the returned `uri` as a dataset.

    `api.gate.RequestGate` has refused a body announced larger than FTC_MAX_UPLOAD_BYTES already;
    `save_upload` stops one sent without a length as soon as it passes the limit."""
    return await save_upload(store, team, filename, request.stream(), settings.max_upload_bytes)
