"""`/docs` works without the internet: the page names only assets the API serves itself."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from api.app import create_app
from service.settings import Settings


def test_the_docs_page_loads_swagger_ui_from_the_api_itself(tmp_path: Path) -> None:
    app = create_app(Settings(api_keys="docs-check-key:team-a", store_url=str(tmp_path)))
    client = TestClient(app)  # no lifespan: the docs need neither Redis nor the store
    page = client.get("/docs")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']|url: ?["']([^"']+)["']""", page.text)
    referenced = {a or b for a, b in urls}
    assert referenced, page.text
    external = sorted(u for u in referenced if re.match(r"^(https?:)?//", u))
    assert not external, f"the docs page loads {external} from outside"
    assert {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css", "/openapi.json"} <= referenced
    for url in referenced:
        response = client.get(url)
        assert response.status_code == 200, url
    bundle = client.get("/docs/assets/swagger-ui-bundle.js").text
    assert len(bundle) > 100_000 and "SwaggerUIBundle" in bundle
    assert client.get("/openapi.json").json()["openapi"].startswith("3.1"), "Swagger UI 5 reads OpenAPI 3.1"
    assert client.get("/docs/oauth2-redirect").status_code == 200
    assert client.get("/redoc").status_code == 404, "ReDoc would need a CDN; it is off"
