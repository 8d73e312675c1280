"""Sweep campaigns: create (once or on a cron schedule), read with every cell, cancel, run again,
and fetch the result tables and plots. Every route is scoped to the caller's team."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from api.deps import AppSettings, Store, Team
from api.errors import Problem, documented
from api.quotas import refuse_beyond
from service.ids import ID_PATTERN
from service.schemas import calibration_limit_problems, is_upload_uri
from service.store import ObjectMissing
from service.store.layout import check_key
from service.sweeps import SweepCancelled, SweepRecord, SweepRequest, SweepStore
from service.sweeps.cron import schedule_gap_problem
from service.sweeps.expand import job_sets
from service.sweeps.files import list_files, media_type, sweep_prefix
from service.sweeps.schemas import SweepFileList, SweepPage
from service.teams import policies_for
from service.uploads import upload_problems

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"], responses=documented(401, 503))

SweepId = Annotated[str, Path(pattern=ID_PATTERN, description="A sweep id, e.g. swp_01jd...")]
_NOT_FOUND = {404: {"model": Problem, "description": "No such sweep (or run, or file) for your team"}}
_CANCELLED = {409: {"model": Problem, "description": "The sweep was cancelled; it takes no more runs"}}
# Files are only ever fetched by scripts or the dashboard's code; never let a browser run them as a page.
_FILE_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
}


async def get_sweeps(request: Request) -> SweepStore:
    """One SweepStore per set of service clients, so its scripts are registered once."""
    state = request.app.state
    sweeps = getattr(state, "sweeps", None)
    if sweeps is None or sweeps.redis is not state.services.redis:
        services = state.services
        sweeps = state.sweeps = SweepStore(services.redis, services.jobs, teams=services.teams)
    return sweeps


Sweeps = Annotated[SweepStore, Depends(get_sweeps)]


class SweepFilter(BaseModel):
    """Query of GET /v1/sweeps; unknown parameters are refused."""

    model_config = ConfigDict(extra="forbid")

    limit: int = Field(20, ge=1, le=200)
    cursor: str | None = Field(None, pattern=ID_PATTERN, description="next_cursor of the previous page")


def _json(record: SweepRecord, code: int, headers: dict[str, str] | None = None) -> Response:
    return Response(record.model_dump_json(by_alias=True), code, headers, media_type="application/json")


async def _require(sweeps: SweepStore, team: str, sweep_id: str, run_id: str | None = None) -> SweepRecord:
    record = await sweeps.get(team, sweep_id, run_id)
    if record is None:
        what = f"sweep {sweep_id}" + (f" has no run {run_id}" if run_id else " not found")
        raise HTTPException(status.HTTP_404_NOT_FOUND, what)
    return record


@router.post(
    "", status_code=status.HTTP_201_CREATED, response_model=SweepRecord, responses=documented(400, 403, 429)
)
async def create_sweep(
    body: SweepRequest, team: Team, sweeps: Sweeps, store: Store, settings: AppSettings
) -> Response:
    """Create a campaign. Without `schedule` its first run starts now (the answer lists its cells'
    jobs); with one, runs start at the schedule's times (`next_run_at`), fired by `ftc scheduler`.
    Its jobs count against the team's queued-jobs quota and are queued as room frees up; the team's
    live sweeps are limited (429), and so is how often a schedule may fire (422)."""
    policy = policies_for(settings).of(team)
    refuse_beyond(policy, body.priority, len(body.ratios), ("body", "ratios"))
    if body.schedule and (
        problem := schedule_gap_problem(body.schedule, body.timezone, policy.min_schedule_seconds, time.time())
    ):
        raise RequestValidationError([{"loc": ("body", "schedule"), "msg": problem, "type": "value_error"}])
    if problems := calibration_limit_problems(body.calibration, settings.max_calib_tokens, ("body", "calibration")):
        raise RequestValidationError(problems)
    if any(is_upload_uri(name) for name in [body.calibration.dataset, *body.evaluation.datasets]):
        problems = await asyncio.to_thread(upload_problems, store, team, job_sets(body)[0])
        if problems:
            raise RequestValidationError(problems)
    sweep_id = await sweeps.create(team, body, time.time())
    record = await _require(sweeps, team, sweep_id)
    return _json(record, status.HTTP_201_CREATED, {"Location": f"/v1/sweeps/{sweep_id}"})


@router.get("", response_model=SweepPage)
async def list_sweeps(team: Team, sweeps: Sweeps, query: Annotated[SweepFilter, Query()]) -> SweepPage:
    """The team's sweeps, newest first, each with its latest run's status."""
    summaries, next_cursor = await sweeps.list(team, limit=query.limit, cursor=query.cursor)
    return SweepPage(sweeps=summaries, next_cursor=next_cursor)


@router.get("/{sweep_id}", response_model=SweepRecord, responses=_NOT_FOUND)
async def get_sweep(
    sweep_id: SweepId,
    team: Team,
    sweeps: Sweeps,
    run: Annotated[str | None, Query(pattern=ID_PATTERN, description="A run id; default: the latest run")] = None,
) -> Response:
    """The sweep's status (`succeeded` once every cell of its latest run has), its recent runs, and
    every cell of one run with its job's status and progress."""
    return _json(await _require(sweeps, team, sweep_id, run), status.HTTP_200_OK)


@router.delete("/{sweep_id}", response_model=SweepRecord, responses=_NOT_FOUND)
async def cancel_sweep(sweep_id: SweepId, team: Team, sweeps: Sweeps) -> Response:
    """Cancel the campaign: no more scheduled runs; queued cells never run, running ones stop
    between layers. Finished cells keep their results. Cancelling twice is harmless."""
    if not await sweeps.cancel(team, sweep_id, time.time()):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"sweep {sweep_id} not found")
    return _json(await _require(sweeps, team, sweep_id), status.HTTP_200_OK)


@router.post(
    "/{sweep_id}/runs",
    status_code=status.HTTP_201_CREATED,
    response_model=SweepRecord,
    responses=_NOT_FOUND | _CANCELLED | documented(429),
)
async def run_sweep_now(sweep_id: SweepId, team: Team, sweeps: Sweeps) -> Response:
    """Start one more run of the campaign now, outside its schedule; the answer shows the new run."""
    try:
        run_id = await sweeps.start_run(team, sweep_id, time.time(), trigger="manual")
    except KeyError:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"sweep {sweep_id} not found") from None
    except SweepCancelled as error:
        raise HTTPException(status.HTTP_409_CONFLICT, str(error)) from None
    return _json(await _require(sweeps, team, sweep_id, run_id), status.HTTP_201_CREATED)


@router.get("/{sweep_id}/files", response_model=SweepFileList, responses=_NOT_FOUND)
async def get_sweep_files(
    sweep_id: SweepId, team: Team, sweeps: Sweeps, store: Store, request: Request
) -> SweepFileList:
    """The result tables and plots written so far: the latest run's at the top, each run's under runs/."""
    await _require(sweeps, team, sweep_id)

    def url_for(name: str) -> str:
        return str(request.url_for("download_sweep_file", sweep_id=sweep_id, name=name))

    files = await asyncio.to_thread(list_files, store, team, sweep_id, url_for)
    return SweepFileList(sweep_id=sweep_id, files=files)


@router.get(
    "/{sweep_id}/files/{name:path}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}} | _NOT_FOUND,
)
async def download_sweep_file(
    sweep_id: SweepId,
    name: Annotated[str, Path(description="A file name from the listing, e.g. plot.svg")],
    team: Team,
    sweeps: Sweeps,
    store: Store,
) -> StreamingResponse:
    """Stream one file of the sweep (the dashboard shows plots this way, with the API key)."""
    await _require(sweeps, team, sweep_id)
    try:
        chunks = await asyncio.to_thread(store.iter_chunks, check_key(sweep_prefix(team, sweep_id) + name))
    except (ValueError, ObjectMissing):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"sweep {sweep_id} has no file {name!r}") from None
    filename = name.rsplit("/", 1)[-1]
    headers = _FILE_HEADERS | {"Content-Disposition": f'inline; filename="{filename}"'}
    return StreamingResponse(chunks, media_type=media_type(name), headers=headers)
