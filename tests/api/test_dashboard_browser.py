"""The dashboard in a real browser (headless Chromium driven by Playwright): sign in with a key,
watch a running job's progress move, open a finished sweep's table and plot, and see nothing of
another team. A screenshot of the page is saved in the test's output folder."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from service.schemas import Progress
from tests.support.service import JOB_REQUEST, TEAM_KEYS, Api
from tests.support.sweeps import SWEEP_REQUEST, scheduler_pass, work_queue
from tests.support.tools import require_tool

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 15_000


def chromium_binary() -> str | None:
    """The system Chromium (make setup installs it); FTC_CHROMIUM points at another one."""
    return os.environ.get("FTC_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser() -> Iterator:
    """Skipped without Chromium or Playwright, except under CI=true, where that is a failure."""
    binary = chromium_binary()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        binary = None
    binary = require_tool("Chromium (with Playwright)", "make setup installs it as root; FTC_CHROMIUM names another",
                          binary or False)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=binary, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


def beside_the_browser(action: Callable[[], Any]) -> Any:
    """Run service-side work in another thread: Playwright's sync API keeps an event loop in this one."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(action).result()


def sign_in(page, base_url: str, team: str) -> None:
    page.goto(base_url)
    page.fill("#api-key", TEAM_KEYS[team])
    page.click("#key-form button")
    page.wait_for_selector("#content:not([hidden])", timeout=WAIT_MS)


def test_the_dashboard_shows_live_progress_and_a_finished_sweep_and_only_the_teams_own(
    api: Api, browser, tmp_path: Path
) -> None:
    client = api.client()
    sweep = client.post("/v1/sweeps", json=SWEEP_REQUEST).json()
    beside_the_browser(lambda: api.run(work_queue))
    beside_the_browser(lambda: scheduler_pass(api.settings))  # the sweep's report: table and plot
    job_id = client.post("/v1/jobs", json={**JOB_REQUEST, "ratio": 0.3}).json()["id"]

    async def start_job(services):
        await services.queue.claim("gpu-0", block_ms=0)
        await services.jobs.update_progress(job_id, "gpu-0", Progress(layer=1, layers=4, stage="compressing"))

    beside_the_browser(lambda: api.run(start_job))

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    streams = []
    page.on("request", lambda request: streams.append(request) if request.url.endswith("/events") else None)
    sign_in(page, api.base_url, "team-a")

    progress = page.locator(f'#jobs tr[data-job-id="{job_id}"] .progress-text')
    progress.filter(has_text="compressing 1/4").wait_for(timeout=WAIT_MS)
    moved = Progress(layer=3, layers=4, stage="compressing", eta_seconds=30)
    beside_the_browser(lambda: api.run(lambda s: s.jobs.update_progress(job_id, "gpu-0", moved)))
    progress.filter(has_text="compressing 3/4 · ETA 30 s").wait_for(timeout=WAIT_MS)
    assert page.locator(f'#jobs tr[data-job-id="{job_id}"] progress').get_attribute("value") == "3"
    assert any(f"/v1/jobs/{job_id}/events" in r.url and r.headers.get("authorization") for r in streams)

    page.click(f'#sweeps tr[data-sweep-id="{sweep["id"]}"] button')
    page.wait_for_selector("#report:not([hidden])", timeout=WAIT_MS)
    page.wait_for_function(
        "document.querySelector('#plot').complete && document.querySelector('#plot').naturalWidth > 0"
    )
    assert page.locator("#plot").get_attribute("src").startswith("blob:")  # fetched with the key, not a public link
    rows = page.locator("#results tbody tr")
    assert rows.count() == 5  # the dense reference and the 2 x 2 cells
    assert rows.nth(0).inner_text().split("\t")[:4] == ["smollm2-135m", "dense", "1", "20.000"]
    assert page.locator("#cells tbody tr").count() == 4
    assert "results.csv" in page.locator("#report-files").inner_text()
    assert page.locator("#sweep-meta .badge").inner_text() == "succeeded"

    screenshot = tmp_path / "dashboard.png"
    page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.read_bytes().startswith(b"\x89PNG")
    print(f"dashboard screenshot: {screenshot}")

    page.click("#sign-out")
    page.wait_for_selector("#sign-in:not([hidden])")
    assert page.evaluate("sessionStorage.length") == 0
    sign_in(page, api.base_url, "team-b")
    page.wait_for_selector("#jobs-empty:not([hidden])", timeout=WAIT_MS)
    page.wait_for_selector("#sweeps-empty:not([hidden])", timeout=WAIT_MS)
    assert page.locator("#jobs tbody tr").count() == 0 and page.locator("#sweeps tbody tr").count() == 0
    assert problems == []


def test_a_wrong_key_is_refused_and_nothing_is_kept(api: Api, browser) -> None:
    page = browser.new_page()
    page.goto(api.base_url)
    page.fill("#api-key", "not-a-real-key-0000")
    page.click("#key-form button")
    page.locator("#sign-in-error").filter(has_text="not known").wait_for(timeout=WAIT_MS)
    assert page.locator("#content").is_hidden() and page.evaluate("sessionStorage.length") == 0
