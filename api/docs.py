"""`/docs` without the internet: the Swagger UI page with its script and styles served by the API.

FastAPI's default page loads Swagger UI from a CDN, so on an air-gapped network (or behind a strict
content policy) `/docs` stays blank. The same files ship in the `swagger-ui-bundle-v2` wheel
(Swagger UI 5, which reads the OpenAPI 3.1 that FastAPI writes); they are served from
`/docs/assets`. ReDoc has no such package and is switched off.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/assets"


def swagger_ui_folder() -> Path:
    """The folder of Swagger UI's dist files inside the installed wheel."""
    from swagger_ui_bundle import swagger_ui_path

    return Path(str(swagger_ui_path))


def add_offline_docs(app: FastAPI) -> None:
    """Serve `/docs` (build the app with `docs_url=None`) from the local Swagger UI files."""
    app.mount(ASSETS, StaticFiles(directory=swagger_ui_folder()), name="docs-assets")
    oauth2_redirect = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - API docs",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
            oauth2_redirect_url=oauth2_redirect,
        )

    @app.get(oauth2_redirect, include_in_schema=False)
    async def docs_oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
