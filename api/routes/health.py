"""Liveness, readiness and metrics: unauthenticated, for orchestrators and Prometheus."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response, status
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import TimeoutError as RedisTimeoutError

from api import metrics
from api.deps import ServicesDep
from api.gate import bearer_token, unauthorized_detail
from service.redis_client import REDIS_DOWN_ERRORS

router = APIRouter(tags=["health"])


def reason(error: BaseException, timeout: float) -> str:
    """What /readyz says of a failed check. A timeout carries no message of its own (a hung Redis
    once gave `"redis": "unreachable: "`), so it is named by the wait."""
    if isinstance(error, (asyncio.TimeoutError, RedisTimeoutError)):
        return f"unreachable: no answer within {timeout:g} s"
    return f"unreachable: {str(error) or type(error).__name__}"


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up (it checks nothing else, so a Redis outage does not restart the API)."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={503: {"description": "Redis or the object store is unreachable; with an API key, says why"}},
)
async def readyz(services: ServicesDep, request: Request) -> JSONResponse:
    """Ready when Redis answers a PING and the object store answers a check, each within the Redis
    timeout (FTC_REDIS_TIMEOUT_SECONDS). Without a valid API key the answer only says which
    dependency is unreachable: the reasons name addresses, buckets and folders of the deployment."""
    timeout = services.settings.redis_timeout_seconds
    checks = {"redis": "ok", "store": "ok"}
    try:
        await asyncio.wait_for(services.redis.ping(), timeout)
    except (*REDIS_DOWN_ERRORS, asyncio.TimeoutError) as error:
        checks["redis"] = reason(error, timeout)
    try:
        await asyncio.wait_for(asyncio.to_thread(services.store.check), timeout)
    except Exception as error:
        checks["store"] = reason(error, timeout)
    ready = all(value == "ok" for value in checks.values())
    api_keys = request.app.state.api_keys
    if unauthorized_detail(api_keys, bearer_token(request.headers.get("authorization"))) is not None:
        checks = {name: value.partition(":")[0] for name, value in checks.items()}
    code = status.HTTP_200_OK if ready else status.HTTP_503_SERVICE_UNAVAILABLE
    return JSONResponse({"status": "ready" if ready else "not ready", **checks}, code)


@router.get("/metrics", response_class=Response)
async def prometheus_metrics(services: ServicesDep, request: Request) -> Response:
    teams = sorted(request.app.state.api_keys.teams)
    return Response(await metrics.render(services, teams), media_type=CONTENT_TYPE_LATEST)
