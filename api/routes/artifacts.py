"""A job's artifacts: the listing with download links, and the download itself for local stores."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Path, Query, Request, status
from fastapi.responses import StreamingResponse

from api.deps import AppSettings, Jobs, Store, Team
from api.errors import documented
from api.routes.jobs import JobId
from service.artifacts import list_artifacts, media_type, model_files, tar_stream
from service.schemas import ArtifactList
from service.store import ObjectMissing
from service.store.layout import MANIFEST, check_key, job_prefix

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"], responses=documented(401, 404, 503))


@router.get(
    "/{job_id}/artifacts",
    response_model=ArtifactList,
)
async def get_artifacts(
    job_id: JobId,
    team: Team,
    jobs: Jobs,
    store: Store,
    settings: AppSettings,
    request: Request,
    include: Annotated[
        Literal["checkpoints"] | None, Query(description="checkpoints: list the per-layer checkpoints too")
    ] = None,
) -> ArtifactList:
    """What the job has written so far, outputs first; `complete` once its manifest is there.
    Checkpoints are counted in `checkpoints` and listed only with `?include=checkpoints`."""
    await jobs.require(team, job_id)

    def stream_url(name: str) -> str:
        return str(request.url_for("download_artifact", job_id=job_id, name=name))

    return await asyncio.to_thread(
        list_artifacts, store, team, job_id, stream_url, settings.presign_seconds, include == "checkpoints"
    )


@router.get(
    "/{job_id}/artifacts/{name:path}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def download_artifact(
    job_id: JobId,
    name: Annotated[str, Path(description="An artifact name from the listing")],
    team: Team,
    jobs: Jobs,
    store: Store,
) -> StreamingResponse:
    """Stream one artifact from the store (the listing links here when the store cannot presign)."""
    await jobs.require(team, job_id)
    missing = HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no artifact {name!r}")
    try:
        key = check_key(job_prefix(team, job_id) + name)
        chunks = await asyncio.to_thread(store.iter_chunks, key)
    except (ValueError, ObjectMissing):
        raise missing from None
    filename = name.rsplit("/", 1)[-1]
    return StreamingResponse(
        chunks,
        media_type=media_type(name),
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )


@router.get(
    "/{job_id}/model.tar",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": {}}}, **documented(409)},
)
async def download_model(
    job_id: JobId,
    team: Team,
    jobs: Jobs,
    store: Store,
    include: Annotated[Literal["dense"] | None, Query(description="dense: add the dense export, under dense/")] = None,
) -> StreamingResponse:
    """The job's model folder as one tar (`{job_id}/`, ready to load once unpacked), with its
    metrics and log; the dashboard's download. 409 until the job's manifest is there."""
    await jobs.require(team, job_id)
    prefix = job_prefix(team, job_id)
    files = await asyncio.to_thread(model_files, store, team, job_id, include == "dense")
    if not any(info.key == prefix + MANIFEST for info in files):
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} has no complete model yet (no {MANIFEST})")
    return StreamingResponse(
        tar_stream(store, prefix, files, job_id),
        media_type="application/x-tar",
        headers={"Content-Disposition": f'attachment; filename="{job_id}.tar"'},
    )
