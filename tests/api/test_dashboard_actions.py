"""The dashboard acts, in headless Chromium: submit a job and a sweep from forms built from the API's
own schema (and show the API's errors on the fields they name), cancel and retry, a job's metrics,
manifest and files, its model as one download, and a comparison of jobs with a per-layer plot."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

from cli.download import human_bytes
from ftc.options import default_allocation
from service.schemas import Progress
from service.store import open_store
from service.store.layout import checkpoint_name, job_prefix
from tests.api.test_dashboard_browser import WAIT_MS, beside_the_browser, browser, sign_in  # noqa: F401
from tests.support.service import JOB_REQUEST, Api


def leaf_paths(schema: dict, defs: dict, prefix: str = "") -> list[str]:
    paths = []
    for name, spec in schema["properties"].items():
        ref = spec.get("$ref")
        if ref:
            paths += leaf_paths(defs[ref.rsplit("/", 1)[-1]], defs, f"{prefix}{name}.")
        else:
            paths.append(prefix + name)
    return paths


def watch_for_problems(page, expected: str = "\0") -> list[str]:
    """Script errors and console errors, but the browser's own note of an `expected` answer."""
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" and expected not in m.text else None)
    return problems


def test_jobs_and_sweeps_are_submitted_from_forms_built_from_the_schema(api: Api, browser) -> None:  # noqa: F811
    client = api.client("team-a")
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    problems = watch_for_problems(page, expected="status of 422 (Unprocessable Entity)")  # the forms' errors
    sign_in(page, api.base_url, "team-a")
    page.click("#new-details summary")
    page.wait_for_selector('#request-fields .field[data-path="model"]', timeout=WAIT_MS)

    shown = page.eval_on_selector_all("#request-fields .field", "nodes => nodes.map(n => n.dataset.path)")
    assert sorted(shown) == sorted(leaf_paths(schemas["JobRequest"], schemas))  # every field of the request, once
    assert page.get_attribute('.field[data-path="calibration.samples"] input', "placeholder") == "32"
    assert page.locator('.field[data-path="method"] option').all_inner_texts()[:2] == ["ftc", "svd"]

    page.click("#request-submit")  # nothing filled in: the API names what is missing
    page.locator("#form-error").filter(has_text="model: Field required").wait_for(timeout=WAIT_MS)
    assert page.locator('.field[data-path="model"].invalid').count() == 1

    page.fill('.field[data-path="model"] input', "smollm2-135m")
    page.fill('.field[data-path="ratio"] input', "1.5")
    page.click("#request-submit")
    page.locator("#form-error").filter(has_text="ratio must be in (0, 1]; got 1.5").wait_for(timeout=WAIT_MS)
    assert page.locator('.field[data-path="ratio"].invalid .field-error').inner_text().startswith("ratio must be")
    assert page.locator(".field.invalid").count() == 1  # the model field is fine now

    page.fill('.field[data-path="ratio"] input', "0.4")
    allocation = page.locator('.field[data-path="allocation"] select')
    assert allocation.input_value() == "" and allocation.locator("option").all_inner_texts()[0] == "(default)"
    page.select_option('.field[data-path="method"] select', "svd_llm")
    page.select_option('.field[data-path="scope"] select', "model")
    page.check('.field[data-path="outputs"] input[value="dense"]')
    page.fill('.field[data-path="calibration.samples"] input', "8")
    page.fill('.field[data-path="eval.datasets"] input', "none")
    page.click("#request-submit")
    page.locator("#form-result").filter(has_text="Submitted job job_").wait_for(timeout=WAIT_MS)
    job_id = page.locator("#form-result").inner_text().split()[-1]
    page.wait_for_selector(f'#jobs tr[data-job-id="{job_id}"]', timeout=WAIT_MS)
    request = client.get(f"/v1/jobs/{job_id}").json()["request"]
    assert (request["method"], request["outputs"], request["calibration"]["samples"]) == (
        "svd_llm", ["compressed", "dense"], 8)
    assert (request["scope"], request["allocation"]) == ("model", default_allocation("svd_llm"))  # resolved, unsent
    assert request["eval"]["datasets"] == [] and request["calibration"]["seq_len"] == 512  # the default, unsent
    assert page.locator(".field.invalid").count() == 0 and page.inner_text("#form-error") == ""

    page.click("#new-sweep-tab")
    page.wait_for_selector('#request-fields .field[data-path="models"]', timeout=WAIT_MS)
    sweep_fields = page.eval_on_selector_all("#request-fields .field", "nodes => nodes.map(n => n.dataset.path)")
    assert sorted(sweep_fields) == sorted(p for p in leaf_paths(schemas["SweepRequest"], schemas)
                                          if p != "eval.dense_reference")
    page.fill('.field[data-path="models"] input', "smollm2-135m")
    page.fill('.field[data-path="ratios"] input', "0.8, 2")
    page.click("#request-submit")
    page.locator("#form-error").filter(has_text="ratios.1: ratio must be in (0, 1]; got 2").wait_for(timeout=WAIT_MS)
    assert page.locator(".field.invalid").evaluate_all("nodes => nodes.map(n => n.dataset.path)") == ["ratios"]
    page.fill('.field[data-path="ratios"] input', "0.8,0.4")
    page.check('.field[data-path="methods"] input[value="svd_llm"]')
    page.fill('.field[data-path="name"] input', "from the form")
    page.click("#request-submit")
    page.locator("#form-result").filter(has_text="Submitted sweep swp_").wait_for(timeout=WAIT_MS)
    sweep_id = page.locator("#form-result").inner_text().split()[-1]
    page.wait_for_selector(f'#sweeps tr[data-sweep-id="{sweep_id}"]', timeout=WAIT_MS)
    sweep = client.get(f"/v1/sweeps/{sweep_id}").json()
    assert (sweep["request"]["methods"], sweep["request"]["ratios"], len(sweep["run"]["cells"])) == (
        ["ftc", "svd_llm"], [0.8, 0.4], 4)
    assert sweep["request"]["allocation"] == default_allocation("ftc")  # the field left at (default)
    assert problems == []


MODEL_FILES = {"model.safetensors": b"\x00" * 5000, "config.json": b"{}", "tokenizer.json": b"{}"}


def finished_job(api: Api, ratio: float, errors: list[float], ppl: float) -> str:
    """A succeeded job as a worker leaves it: progress at its last stage, files, metrics, manifest last."""
    job_id = api.client("team-a").post("/v1/jobs", json={**JOB_REQUEST, "ratio": ratio}).json()["id"]

    async def work(services) -> None:
        await services.queue.claim("w1", block_ms=0)
        await services.jobs.update_progress(job_id, "w1", Progress(layer=2, layers=2, stage="uploading"))
        await services.jobs.finish(job_id, "w1", "succeeded")

    beside_the_browser(lambda: api.run(work))
    store = open_store(api.settings.store_url, api.settings.s3_endpoint_url)
    prefix = job_prefix("team-a", job_id)
    metrics = {"perplexity": {"wikitext2": {"ppl": ppl}}, "storage": {"model_reduction": 0.1 * ratio,
               "attention_bytes_written": 700, "scope": "attention", "linear_reduction": 0.15 * ratio,
               "source_bytes": 3 * 2**20}, "bytes_written": 2**20, "timings": {"total_seconds": 95.0}}
    files = MODEL_FILES | {"metrics.json": json.dumps(metrics).encode(), checkpoint_name(0): b"layer"}
    for name, data in files.items():
        store.put_bytes(prefix + name, data)
    manifest = {"method": "ftc", "ratio": ratio, "options": {"model": "smollm2-135m", "allocation": "uniform",
                "dtype": "float16", "ablate": []}, "calibration": {"samples": 8, "seq_len": 256, "source": "wikitext2"},
                "compress_seconds": 80.0, "layers": [{"index": i, "error_activation": e} for i, e in enumerate(errors)],
                "files": {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in MODEL_FILES.items()}}
    store.finalise(prefix, manifest)
    return job_id


def test_jobs_are_cancelled_retried_read_downloaded_and_compared(api: Api, browser, tmp_path: Path) -> None:  # noqa: F811
    client = api.client("team-a")
    first = finished_job(api, 0.4, [0.10, 0.20], 31.2)
    second = finished_job(api, 0.8, [0.05, 0.08], 29.95)
    queued = client.post("/v1/jobs", json={**JOB_REQUEST, "ratio": 0.6}).json()["id"]

    page = browser.new_page(viewport={"width": 1400, "height": 1400})
    problems = watch_for_problems(page)
    sign_in(page, api.base_url, "team-a")
    row = page.locator(f'#jobs tr[data-job-id="{first}"]')
    row.wait_for(timeout=WAIT_MS)
    assert row.locator(".progress-text").inner_text().startswith("done")  # not "uploading 2/2"
    assert row.locator("progress").count() == 0

    page.click(f'#jobs tr[data-job-id="{queued}"] button.cancel')
    page.locator(f'#jobs tr[data-job-id="{queued}"] .badge').filter(has_text="cancelled").wait_for(timeout=WAIT_MS)
    page.click(f'#jobs tr[data-job-id="{queued}"] button.retry')
    page.locator("#job-note").filter(has_text=f"Retried {queued} as job_").wait_for(timeout=WAIT_MS)
    retried = page.inner_text("#job-note").split()[-1]
    page.locator(f'#jobs tr[data-job-id="{retried}"] .badge').filter(has_text="queued").wait_for(timeout=WAIT_MS)
    assert client.get(f"/v1/jobs/{retried}").json()["request"]["ratio"] == 0.6

    row.locator("button.details").click()
    page.wait_for_selector("#job-detail:not([hidden])", timeout=WAIT_MS)
    metrics = page.inner_text("#job-metrics")
    assert "perplexity wikitext2\t31.20" in metrics and "model reduction\t4.0%" in metrics and "time\t95 s" in metrics
    assert "linear reduction\t6.0%" in metrics and "weights written\t1.0 MiB (source 3.0 MiB)" in metrics
    manifest = page.inner_text("#job-manifest")
    assert "keep ratio\t0.4" in manifest and "layers\t2" in manifest and "8 x 256 tokens of wikitext2" in manifest
    assert "scope\tattention" in manifest
    files = page.inner_text("#job-artifacts")
    assert "config.json (2 B)" in files and "model.safetensors (4.9 KiB)" in files and "0.00 MiB" not in files
    assert "per-layer checkpoints (resume) 1 files, 5 B" in files
    assert page.inner_text("#job-cli") == f"ftc jobs download {first}"

    with page.expect_download(timeout=WAIT_MS) as download:
        page.click("#download-model")
    saved = tmp_path / "model.tar"
    download.value.save_as(saved)
    assert download.value.suggested_filename == f"{first}.tar"
    with tarfile.open(saved) as tar:
        names = set(tar.getnames())
        assert tar.extractfile(f"{first}/model.safetensors").read() == MODEL_FILES["model.safetensors"]
    assert {f"{first}/manifest.json", f"{first}/metrics.json", f"{first}/config.json"} <= names
    assert not [name for name in names if "checkpoints" in name]

    assert page.is_disabled("#compare-button")
    for job_id in (first, second):
        page.check(f'#jobs tr[data-job-id="{job_id}"] input.compare')
    page.click("#compare-button")
    page.wait_for_selector("#compare-section:not([hidden])", timeout=WAIT_MS)
    header = page.locator("#compare-table thead th").all_inner_texts()
    assert header == ["", first, second]
    table = {line.split("\t")[0]: line.split("\t")[1:] for line in page.inner_text("#compare-table tbody").splitlines()}
    assert table["perplexity wikitext2"] == ["31.20", "29.95"] and table["rho"] == ["0.4", "0.8"]
    assert table["scope"] == ["attention"] * 2 and table["linear reduction"] == ["6.0%", "12.0%"]
    assert table["weights written"] == ["1.0 MiB"] * 2
    sizes = [sum(a["size"] for a in client.get(f"/v1/jobs/{j}/artifacts").json()["artifacts"] if a["kind"] == "model")
             for j in (first, second)]
    assert table["model files"] == [human_bytes(size) for size in sizes] and table["time"] == ["95 s", "95 s"]
    lines = page.locator("#layer-plot polyline")
    assert lines.count() == 2 and lines.nth(0).get_attribute("data-job-id") == first
    # the larger errors of the first job sit higher (smaller y) at every layer
    ys = [[float(p.split(",")[1]) for p in lines.nth(i).get_attribute("points").split()] for i in range(2)]
    assert all(a < b for a, b in zip(ys[0], ys[1], strict=True))

    screenshot = tmp_path / "dashboard-actions.png"
    page.screenshot(path=str(screenshot), full_page=True)
    print(f"dashboard screenshot: {screenshot}")
    assert problems == []
