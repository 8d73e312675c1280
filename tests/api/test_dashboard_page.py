"""The dashboard's files as the API serves them: no key needed, no data inside, locked-down headers."""

from __future__ import annotations

import re

from tests.support.service import Api


def test_the_page_is_served_without_a_key_and_holds_no_data(api: Api) -> None:
    anonymous, member = api.client(team=None), api.client("team-a")
    page = anonymous.get("/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert member.get("/").content == page.content  # the same page for everyone; data comes from /v1 with a key
    assert 'id="api-key"' in page.text and 'type="password"' in page.text
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "img-src 'self' blob:" in policy
    assert "default-src 'none'" in policy and page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"


def test_the_page_loads_only_its_own_script_style_and_icon(api: Api) -> None:
    client = api.client(team=None)
    html = client.get("/").text
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    assert sorted(assets) == ["/static/dashboard.js", "/static/favicon.svg", "/static/style.css"]
    assert "<script>" not in html and "style=" not in html  # nothing inline: the policy forbids it
    script = client.get("/static/dashboard.js")
    assert script.status_code == 200 and script.headers["content-type"] == "text/javascript; charset=utf-8"
    assert "sessionStorage" in script.text and "Authorization" in script.text
    assert "localStorage" not in script.text and "innerHTML" not in script.text
    assert client.get("/static/style.css").headers["content-type"].startswith("text/css")


def test_nothing_else_is_served_from_the_static_folder(api: Api) -> None:
    client = api.client(team=None)
    for path in ("/static/missing.js", "/static/..%2Fapp.py", "/static/%2E%2E/routes/sweeps.py", "/static/"):
        assert client.get(path).status_code == 404, path


def test_the_dashboard_is_not_part_of_the_api_document(api: Api) -> None:
    paths = api.client(team=None).get("/openapi.json").json()["paths"]
    assert "/" not in paths and not any(path.startswith("/static") for path in paths)
    assert {"/v1/sweeps", "/v1/sweeps/{sweep_id}", "/v1/sweeps/{sweep_id}/files/{name}"} <= set(paths)
