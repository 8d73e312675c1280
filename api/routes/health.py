"""Liveness, readiness and metrics: unauthenticated, for orchestrators and Prometheus."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response, status
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from api import metrics
from api.deps import ServicesDep
from service.redis_client import REDIS_DOWN_ERRORS

router = APIRouter(tags=["health"])

READY_TIMEOUT_SECONDS = 3.0


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up (it checks nothing else, so a Redis outage does not restart the API)."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Redis or the object store is unreachable"}})
async def readyz(services: ServicesDep) -> JSONResponse:
    """Ready when Redis answers a PING and the object store answers a check."""
    checks = {"redis": "ok", "store": "ok"}
    try:
        await asyncio.wait_for(services.redis.ping(), READY_TIMEOUT_SECONDS)
    except (*REDIS_DOWN_ERRORS, asyncio.TimeoutError) as error:
        checks["redis"] = f"unreachable: {error or 'timeout'}"
    try:
        await asyncio.wait_for(asyncio.to_thread(services.store.check), READY_TIMEOUT_SECONDS)
    except Exception as error:
        checks["store"] = f"unreachable: {error or 'timeout'}"
    ready = all(value == "ok" for value in checks.values())
    code = status.HTTP_200_OK if ready else status.HTTP_503_SERVICE_UNAVAILABLE
    return JSONResponse({"status": "ready" if ready else "not ready", **checks}, code)


@router.get("/metrics", response_class=Response)
async def prometheus_metrics(services: ServicesDep) -> Response:
    return Response(await metrics.render(services), media_type=CONTENT_TYPE_LATEST)
