"""What every request passes before a route reads a byte of its body: the API key, then the size.

FastAPI reads and parses a JSON body before it solves a route's dependencies, so a key checked by
a dependency is checked only after the whole body has arrived: a 300 MB body without a key once
cost 6 s and about 1 GB of memory before its 401. This ASGI middleware looks at the headers
first: `/v1` requests without a valid key answer 401, a `Content-Length` over the limit answers
413 at once, and a body sent without one (chunked) is counted as the route reads it and refused as
soon as it passes the limit; the rest is never read.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.auth import ApiKeys

GUARDED_PREFIX = "/v1/"
"""Every route under it needs a key; the health routes, the dashboard and the docs do not."""
UPLOADS_PATH = "/v1/uploads"


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header, else None."""
    scheme, _, token = (authorization or "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def unauthorized_detail(api_keys: ApiKeys, token: str | None) -> str | None:
    """Why this key opens nothing (the 401's detail), or None when it belongs to a team."""
    if token is None:
        return "missing API key: send Authorization: Bearer KEY"
    return None if api_keys.team_for(token) is not None else "unknown API key"


class BodyTooLarge(HTTPException):
    """Raised from `receive` once the body passes its limit; the error handlers answer 413."""

    def __init__(self, limit: int, setting: str) -> None:
        super().__init__(
            413,
            f"request body larger than {limit} bytes ({setting}); send less",
            headers={"Connection": "close"},  # the rest of the body is not read
        )


class RequestGate:
    """The key, then the body size, before the application sees the request (see the module doc)."""

    def __init__(self, app: ASGIApp, api_keys: ApiKeys, max_body_bytes: int, max_upload_bytes: int) -> None:
        self.app = app
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes

    def _limit(self, path: str) -> tuple[int, str]:
        if path.rstrip("/") == UPLOADS_PATH:
            return self.max_upload_bytes, "FTC_MAX_UPLOAD_BYTES"
        return self.max_body_bytes, "FTC_MAX_BODY_BYTES"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path: str = scope["path"]
        if path.startswith(GUARDED_PREFIX):
            problem = unauthorized_detail(self.api_keys, bearer_token(headers.get("authorization")))
            if problem is not None:
                refuse = {"WWW-Authenticate": "Bearer"}
                if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
                    refuse["Connection"] = "close"  # its body is not read
                answer = JSONResponse({"detail": problem}, 401, refuse)
                await answer(scope, receive, send)
                return
        limit, setting = self._limit(path)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            too_large = BodyTooLarge(limit, setting)
            await JSONResponse({"detail": too_large.detail}, 413, too_large.headers)(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit, setting)
            return message

        await self.app(scope, receive_within_limit, send)
