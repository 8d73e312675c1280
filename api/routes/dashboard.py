"""The dashboard: one static page (plus its script and style) that talks to the REST API.

The page holds no data of its own; it asks for an API key, keeps it in the tab's sessionStorage
and sends it with every request, so it shows exactly what that key's team may see. Served
without a key, outside the OpenAPI document.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException, status
from fastapi.responses import FileResponse

router = APIRouter(include_in_schema=False)

STATIC = Path(__file__).resolve().parents[1] / "static"
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css",
    ".svg": "image/svg+xml",
}
_ASSETS = {path.name: path for path in STATIC.iterdir() if path.suffix in _MEDIA_TYPES} if STATIC.is_dir() else {}

# The page loads only its own script and style, and talks only to this API; plots arrive as blobs.
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; connect-src 'self'; "
        "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _asset(name: str) -> FileResponse:
    path = _ASSETS.get(name)
    if path is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no dashboard file {name!r}")
    return FileResponse(path, media_type=_MEDIA_TYPES[path.suffix], headers=_SECURITY_HEADERS)


@router.get("/")
async def dashboard() -> FileResponse:
    return _asset("index.html")


@router.get("/static/{name}")
async def dashboard_asset(name: str) -> FileResponse:
    return _asset(name)
