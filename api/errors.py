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
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import IdempotencyConflict, JobNotFound, QuotaExceeded
from service.redis_client import REDIS_DOWN_ERRORS
from service.store import StoreUnavailable
from service.uploads import UploadRejected, UploadTooLarge

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = "5"
MAX_MESSAGE_CHARS = 300
"""Longest message kept per invalid field: messages quote what was sent, and a 10 MB field must not
come back (twice: in `detail` and in `message`) as a 20 MB answer."""
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


class Problem(BaseModel):
    """The body of every error other than a validation error: what went wrong and what to do."""

    detail: str


_DESCRIPTIONS = {
    400: "The body is not JSON text",
    401: "Missing or unknown API key",
    404: "No such job for your team",
    409: "Conflicts with the job's state or an earlier request",
    403: "Your team may not do this (e.g. priority high without high_priority in FTC_TEAMS)",
    413: "Body larger than FTC_MAX_BODY_BYTES (uploads: FTC_MAX_UPLOAD_BYTES)",
    429: "Beyond one of your team's quotas (`limit` names it); retry after Retry-After seconds",
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


def shorten(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` cut to at most `limit` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    cut = f"... ({len(text) - limit + 40} characters left out)"
    return text[: limit - len(cut)] + cut


def validation_body(errors: list[dict]) -> dict:
    """FastAPI's `detail` list (loc, msg, type) plus one `message` line naming each field.

    The submitted values themselves are never echoed (no `input`), and each message is shortened:
    a message may quote the value, and the answer must stay small whatever was sent.
    """
    detail = [
        {"loc": list(e["loc"]), "msg": shorten(str(e["msg"]).removeprefix("Value error, ")), "type": e["type"]}
        for e in errors
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


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """The methods some route answers at this request's path, asked of the router itself.

    Included routers are nested route objects in FastAPI, so reading `methods` off the top-level
    routes finds none; matching the path once per method works whatever the nesting.
    """
    return [
        method
        for method in _METHODS
        if any(route.matches({**scope, "method": method})[0] == Match.FULL for route in app.router.routes)
    ]


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's answers, except that a 405 lists the methods of every route at that path."""
    if error.status_code != status.HTTP_405_METHOD_NOT_ALLOWED:
        return await http_exception_handler(request, error)
    allowed = allowed_methods(request.app, request.scope)
    return JSONResponse(
        {"detail": f"{request.method} is not allowed here; use {', '.join(allowed)}"},
        status.HTTP_405_METHOD_NOT_ALLOWED,
        headers={"Allow": ", ".join(allowed)},
    )


# Outages are answered without their cause: it names addresses, buckets and folders of the
# deployment, which are the operators' business (it is logged for them).
async def _redis_down(request: Request, error: Exception) -> JSONResponse:
    log.warning("Redis unreachable: %s", error)
    return JSONResponse(
        {"detail": "the job store (Redis) is unreachable; nothing was changed. Retry in a few seconds."},
        status.HTTP_503_SERVICE_UNAVAILABLE,
        headers={"Retry-After": RETRY_AFTER_SECONDS},
    )


async def _store_down(request: Request, error: StoreUnavailable) -> JSONResponse:
    log.warning("object store unavailable: %s", error)
    return JSONResponse(
        {"detail": "the object store is unreachable. Retry in a few seconds."},
        status.HTTP_503_SERVICE_UNAVAILABLE,
        headers={"Retry-After": RETRY_AFTER_SECONDS},
    )


async def _over_quota(request: Request, error: QuotaExceeded) -> JSONResponse:
    """429 naming the limit (`limit`, and the setting in `detail`), with when to try again."""
    return JSONResponse(
        {"detail": str(error), "limit": error.limit},
        status.HTTP_429_TOO_MANY_REQUESTS,
        headers={"Retry-After": str(error.retry_after)},
    )


class UnexpectedErrors:
    """ASGI middleware answering 500 for an error no handler knows, and keeping the connection.

    Starlette's own last-resort handler re-raises after answering, and uvicorn then closes the
    keep-alive connection: every client of a bug pays a reconnect. Here the error is logged and
    answered, and the server never sees it. An error after the answer has started cannot be
    answered any more; it is raised on, and the server ends that connection.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_and_note_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_start)
        except Exception:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            answer = {"detail": "internal error; it has been logged"}
            await JSONResponse(answer, status.HTTP_500_INTERNAL_SERVER_ERROR)(scope, receive, send)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(JobNotFound, _not_found)
    app.add_exception_handler(IdempotencyConflict, _conflict)
    app.add_exception_handler(UploadRejected, _upload_rejected)
    app.add_exception_handler(StoreUnavailable, _store_down)
    app.add_exception_handler(QuotaExceeded, _over_quota)
    for error_type in REDIS_DOWN_ERRORS:
        app.add_exception_handler(error_type, _redis_down)
