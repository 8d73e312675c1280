"""How failures become answers: what to change (4xx) or when to come back (503), never a traceback."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from service.errors import IdempotencyConflict, JobNotFound
from service.redis_client import REDIS_DOWN_ERRORS
from service.store import StoreUnavailable
from service.uploads import UploadRejected, UploadTooLarge

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = "5"


class Problem(BaseModel):
    """The body of every error other than a validation error: what went wrong and what to do."""

    detail: str


_DESCRIPTIONS = {
    400: "The body is not JSON text",
    401: "Missing or unknown API key",
    404: "No such job for your team",
    409: "Conflicts with the job's state or an earlier request",
    413: "Body larger than FTC_MAX_UPLOAD_BYTES",
    503: "Redis or the object store is unreachable; nothing was changed, retry later",
}


def documented(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error codes."""
    return {code: {"model": Problem, "description": _DESCRIPTIONS[code]} for code in codes}


def _field(loc: tuple | list) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:] or parts
    return ".".join(parts) or "body"


def validation_body(errors: list[dict]) -> dict:
    """FastAPI's `detail` list (loc, msg, type) plus one `message` line naming each field."""
    detail = [
        {"loc": list(e["loc"]), "msg": str(e["msg"]).removeprefix("Value error, "), "type": e["type"]} for e in errors
    ]
    message = "; ".join(f"{_field(d['loc'])}: {d['msg']}" for d in detail)
    return {"detail": detail, "message": message}


async def _invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    return JSONResponse(validation_body(list(error.errors())), status.HTTP_422_UNPROCESSABLE_CONTENT)


async def _not_found(request: Request, error: JobNotFound) -> JSONResponse:
    return JSONResponse({"detail": str(error)}, status.HTTP_404_NOT_FOUND)


async def _conflict(request: Request, error: IdempotencyConflict) -> JSONResponse:
    return JSONResponse({"detail": str(error), "job_id": error.job_id}, status.HTTP_409_CONFLICT)


async def _upload_rejected(request: Request, error: UploadRejected) -> JSONResponse:
    if isinstance(error, UploadTooLarge):
        return JSONResponse({"detail": str(error)}, status.HTTP_413_CONTENT_TOO_LARGE)
    problem = {"loc": error.loc, "msg": str(error), "type": "value_error"}
    return JSONResponse(validation_body([problem]), status.HTTP_422_UNPROCESSABLE_CONTENT)


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's answers, except that a 405 lists the methods of every route at that path."""
    if error.status_code != status.HTTP_405_METHOD_NOT_ALLOWED:
        return await http_exception_handler(request, error)
    allowed = sorted(
        {
            method
            for route in request.app.router.routes
            if route.matches(request.scope)[0] != Match.NONE
            for method in getattr(route, "methods", None) or ()
        }
    )
    return JSONResponse(
        {"detail": f"{request.method} is not allowed here; use {', '.join(allowed)}"},
        status.HTTP_405_METHOD_NOT_ALLOWED,
        headers={"Allow": ", ".join(allowed)},
    )


async def _redis_down(request: Request, error: Exception) -> JSONResponse:
    log.warning("Redis unreachable: %s", error)
    return JSONResponse(
        {
            "detail": "the job store (Redis) is unreachable; nothing was changed. Retry in a few seconds.",
            "cause": str(error),
        },
        status.HTTP_503_SERVICE_UNAVAILABLE,
        headers={"Retry-After": RETRY_AFTER_SECONDS},
    )


async def _store_down(request: Request, error: StoreUnavailable) -> JSONResponse:
    return JSONResponse(
        {"detail": f"{error}. Retry in a few seconds."},
        status.HTTP_503_SERVICE_UNAVAILABLE,
        headers={"Retry-After": RETRY_AFTER_SECONDS},
    )


async def _unexpected(request: Request, error: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse({"detail": "internal error; it has been logged"}, status.HTTP_500_INTERNAL_SERVER_ERROR)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(JobNotFound, _not_found)
    app.add_exception_handler(IdempotencyConflict, _conflict)
    app.add_exception_handler(UploadRejected, _upload_rejected)
    app.add_exception_handler(StoreUnavailable, _store_down)
    for error_type in REDIS_DOWN_ERRORS:
        app.add_exception_handler(error_type, _redis_down)
    app.add_exception_handler(Exception, _unexpected)
