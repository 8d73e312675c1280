"""The sweep endpoints against a real Redis: expansion into linked jobs, cell statuses, reports and
their comparison, cancellation, validation, and that no team sees another's sweeps."""

from __future__ import annotations

import csv
import io
from typing import Any

import httpx
import pytest

from ftc.options import default_allocation
from tests.support.service import Api
from tests.support.sweeps import SWEEP_REQUEST, complete, scheduler_pass, synthetic_metrics, work_queue


def create(client: httpx.Client, **changes: Any) -> dict[str, Any]:
    response = client.post("/v1/sweeps", json={**SWEEP_REQUEST, **changes})
    assert response.status_code == 201, response.text
    assert response.headers["Location"] == f"/v1/sweeps/{response.json()['id']}"
    return response.json()


def test_a_sweep_expands_into_one_linked_job_set_per_model_and_method(api: Api) -> None:
    client = api.client()
    sweep = create(client, models=["smollm2-135m", "org/other-model"], ablations=[[], ["no_whiten"]])
    run = sweep["run"]
    assert (sweep["status"], run["status"], run["trigger"], sweep["runs_total"]) == ("queued", "queued", "create", 1)
    # 2 models x (ftc, ftc-no_whiten, svd_llm) x 2 ratios
    cells = run["cells"]
    assert len(cells) == 12 and all(cell["job_id"] for cell in cells)
    assert [(c["method"], c["ablate"], c["ratio"]) for c in cells[:6]] == [
        ("ftc", [], 0.8),
        ("ftc", [], 0.4),
        ("ftc", ["no_whiten"], 0.8),
        ("ftc", ["no_whiten"], 0.4),
        ("svd_llm", [], 0.8),
        ("svd_llm", [], 0.4),
    ]
    # One job set per line: linked jobs made by the ordinary submission path, ratios in order.
    first = client.get(f"/v1/jobs/{cells[0]['job_id']}").json()
    assert first["linked"] == [cells[1]["job_id"]]
    assert (first["request"]["ratio"], first["request"]["calibration"]) == (0.8, SWEEP_REQUEST["calibration"])
    # The dense reference is asked for once per model: on its first line only.
    assert [c["dense_reference"] for c in cells] == [True, True] + [False] * 4 + [True, True] + [False] * 4
    assert first["request"]["eval"]["dense_reference"] is True
    assert "dense_reference" not in client.get(f"/v1/jobs/{cells[2]['job_id']}").json()["request"]["eval"]
    assert len(client.get("/v1/jobs", params={"limit": 100}).json()["jobs"]) == 12


def test_status_follows_the_cells_and_a_finished_run_gets_its_table_and_plot(any_store_api: Api) -> None:
    api = any_store_api
    client = api.client()
    sweep = create(client)
    lease = api.run(lambda s: s.queue.claim("w-1", block_ms=0))  # one cell starts
    assert client.get(f"/v1/sweeps/{sweep['id']}").json()["status"] == "running"

    api.run(lambda s: complete(s, lease))
    api.run(work_queue)
    record = client.get(f"/v1/sweeps/{sweep['id']}").json()
    assert record["status"] == "succeeded" and record["run"]["counts"] == {"succeeded": 4}
    assert record["run"]["report"] is None  # until the scheduler has written it

    assert scheduler_pass(api.settings).reported == [(sweep["id"], sweep["run"]["id"])]
    record = client.get(f"/v1/sweeps/{sweep['id']}").json()
    run = record["run"]
    assert run["report"]["folder"] == f"runs/{run['id']}/" and run["finished_at"] is not None
    listing = client.get(f"/v1/sweeps/{sweep['id']}/files").json()["files"]
    report_files = {"results.csv", "results.md", "results.json", "plot.png", "plot.svg"}
    assert {f["name"] for f in listing} == report_files | {f"runs/{run['id']}/{name}" for name in report_files}
    for item in listing:  # links into the API (the key is needed), never to the store itself
        assert item["url"] == f"{api.base_url}/v1/sweeps/{sweep['id']}/files/{item['name']}"
        assert api.client(team=None).get(item["url"]).status_code == 401

    table = list(csv.DictReader(io.StringIO(client.get(f"/v1/sweeps/{sweep['id']}/files/results.csv").text)))
    assert [(r["method"], r["rho"]) for r in table] == [
        ("dense", "1.0"),
        ("ftc", "0.8"),
        ("ftc", "0.4"),
        ("svd_llm", "0.8"),
        ("svd_llm", "0.4"),
    ]
    ftc_04 = table[2]
    assert float(ftc_04["ppl_wikitext2"]) == pytest.approx(20 * 1.36)
    assert float(ftc_04["ratio_to_dense_wikitext2"]) == pytest.approx(1.36)
    assert (ftc_04["attention_bytes"], ftc_04["seconds"], ftc_04["status"]) == ("400000", "12.5", "succeeded")
    svg = client.get(f"/v1/sweeps/{sweep['id']}/files/plot.svg")
    assert svg.headers["content-type"] == "image/svg+xml" and b"<svg" in svg.content
    png = client.get(f"/v1/sweeps/{sweep['id']}/files/plot.png")
    assert png.headers["content-type"] == "image/png" and png.content.startswith(b"\x89PNG")
    markdown = client.get(f"/v1/sweeps/{sweep['id']}/files/results.md").text
    assert f"| smollm2-135m | ftc | {default_allocation('ftc')} | 0.4 | 27.200 | 1.36x |" in markdown
    assert "Scope attention: rho is the keep ratio of the Q, K, V and O projections" in markdown
    assert (ftc_04["allocation"], ftc_04["scope"], ftc_04["bytes_written"]) == (
        default_allocation("ftc"), "attention", "1600000")
    assert "first finished run of the campaign" in markdown

    assert scheduler_pass(api.settings).reported == []  # written once


def test_a_second_run_is_compared_with_the_first(api: Api) -> None:
    client = api.client()
    sweep = create(client)
    api.run(work_queue)
    scheduler_pass(api.settings)

    again = client.post(f"/v1/sweeps/{sweep['id']}/runs")
    assert again.status_code == 201
    second = again.json()["run"]
    assert (second["trigger"], second["status"], again.json()["runs_total"]) == ("manual", "queued", 2)
    assert {c["job_id"] for c in second["cells"]}.isdisjoint({c["job_id"] for c in sweep["run"]["cells"]})

    def regressed_svd(record):  # svd_llm got 10% worse, ftc at rho 0.4 failed
        if record.request.method == "ftc" and record.request.ratio == 0.4:
            return "CUDA out of memory on layer 7"
        return synthetic_metrics(record, factor=1.10 if record.request.method == "svd_llm" else 1.0)

    api.run(lambda s: work_queue(s, regressed_svd))
    scheduler_pass(api.settings)
    record = client.get(f"/v1/sweeps/{sweep['id']}").json()
    run = record["run"]
    assert (run["id"], run["status"], run["counts"]) == (second["id"], "failed", {"failed": 1, "succeeded": 3})
    assert (run["report"]["previous_run"], run["report"]["worse"], run["report"]["better"]) == (
        sweep["run"]["id"],
        2,
        0,
    )
    assert [r["id"] for r in record["runs"]] == [second["id"], sweep["run"]["id"]]

    comparison = client.get(f"/v1/sweeps/{sweep['id']}/files/results.json").json()["comparison"]
    assert [(c["method"], c["ratio"]) for c in comparison["worse"]] == [("svd_llm", 0.8), ("svd_llm", 0.4)]
    assert comparison["unchanged"] == 1 and comparison["lost"] == [["smollm2-135m", "ftc", 0.4]]
    markdown = client.get(f"/v1/sweeps/{sweep['id']}/files/results.md").text
    assert f"## Changes since run {sweep['run']['id']}" in markdown
    assert "| smollm2-135m | svd_llm | 0.8 | wikitext2 |" in markdown and "+10.0% |" in markdown
    assert "CUDA out of memory on layer 7" in markdown  # the failed cell, with its reason
    # The first run's files stay where they were; the top level now shows the second run.
    first_json = client.get(f"/v1/sweeps/{sweep['id']}/files/runs/{sweep['run']['id']}/results.json").json()
    assert first_json["run_id"] == sweep["run"]["id"]
    older = client.get(f"/v1/sweeps/{sweep['id']}", params={"run": sweep["run"]["id"]}).json()["run"]
    assert older["status"] == "succeeded" and len(older["cells"]) == 4


def test_cancel_stops_queued_cells_flags_running_ones_and_refuses_new_runs(api: Api) -> None:
    client = api.client()
    sweep = create(client)
    lease = api.run(lambda s: s.queue.claim("w-1", block_ms=0))
    cancelled = client.delete(f"/v1/sweeps/{sweep['id']}")
    assert cancelled.status_code == 200
    record = cancelled.json()
    assert (record["status"], record["run"]["status"]) == ("cancelled", "cancelled")
    statuses = {c["job_id"]: c["status"] for c in record["run"]["cells"]}
    assert statuses.pop(lease.job_id) == "running"
    assert set(statuses.values()) == {"cancelled"}
    assert client.get(f"/v1/jobs/{lease.job_id}").json()["cancel_requested"] is True
    assert client.delete(f"/v1/sweeps/{sweep['id']}").status_code == 200  # harmless twice
    refused = client.post(f"/v1/sweeps/{sweep['id']}/runs")
    assert refused.status_code == 409 and "cancelled" in refused.json()["detail"]

    assert scheduler_pass(api.settings).reported == []  # the running cell has not stopped yet
    api.run(lambda s: s.jobs.finish(lease.job_id, "w-1", "cancelled"))
    assert scheduler_pass(api.settings).reported == [(sweep["id"], sweep["run"]["id"])]
    run = client.get(f"/v1/sweeps/{sweep['id']}").json()["run"]
    assert (run["status"], run["counts"]) == ("cancelled", {"cancelled": 4})


def test_another_team_sees_nothing(api: Api) -> None:
    sweep = create(api.client("team-a"))
    api.run(work_queue)
    scheduler_pass(api.settings)
    other = api.client("team-b")
    for path in ("", "/files", "/files/plot.svg", f"/files/runs/{sweep['run']['id']}/results.csv"):
        assert other.get(f"/v1/sweeps/{sweep['id']}{path}").status_code == 404
    assert other.delete(f"/v1/sweeps/{sweep['id']}").status_code == 404
    assert other.post(f"/v1/sweeps/{sweep['id']}/runs").status_code == 404
    assert other.get("/v1/sweeps").json() == {"sweeps": [], "next_cursor": None}
    assert api.client(team=None).get("/v1/sweeps").status_code == 401
    assert api.client("team-a").get(f"/v1/sweeps/{sweep['id']}").json()["status"] == "succeeded"


def test_listing_pages_newest_first(api: Api) -> None:
    client = api.client()
    made = [create(client, name=f"campaign-{i}", schedule="0 2 * * *")["id"] for i in range(3)]
    first = client.get("/v1/sweeps", params={"limit": 2}).json()
    assert [s["id"] for s in first["sweeps"]] == made[::-1][:2]
    rest = client.get("/v1/sweeps", params={"limit": 2, "cursor": first["next_cursor"]}).json()
    assert [s["id"] for s in rest["sweeps"]] == made[:1] and rest["next_cursor"] is None
    scheduled = first["sweeps"][0]
    assert (scheduled["status"], scheduled["runs_total"], scheduled["latest_run"]) == ("scheduled", 0, None)
    assert scheduled["next_run_at"].endswith("02:00:00Z")


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"ratios": [1.5]}, "ratios.0", "ratio must be in (0, 1]"),
        ({"methods": ["svd"], "ablations": [["no_whiten"]]}, "body", "add 'ftc' to methods"),
        ({"ablations": [["no_such_thing"]]}, "ablations", "unknown ablation no_such_thing"),
        ({"models": ["../etc/passwd"]}, "models.0", "paths are not accepted"),
        ({"schedule": "0 0 30 2 *"}, "schedule", "never fires"),
        ({"schedule": "every night"}, "schedule", "five fields"),
        ({"schedule": "0 0 2 * * *"}, "schedule", "five fields"),
        ({"schedule": "0 2 * * *", "timezone": "Mars/Olympus"}, "timezone", "unknown time zone"),
        (
            {
                "ratios": [round(0.01 * i, 2) for i in range(1, 33)],
                "allocation": "uniform",  # the default plan takes no ratio below 0.1
                "methods": ["ftc", "svd", "svd_llm", "svd_llm_v2"],
                "models": [f"org/m{i}" for i in range(5)],
            },
            "body",
            "more than 512",
        ),
        ({"eval": {"datasets": ["wikitext2"], "dense_reference": True}}, "body", "set by the sweep itself"),
        ({"ratio": 0.4}, "ratio", "Extra inputs are not permitted"),
    ],
)
def test_bad_requests_are_refused_with_the_field_and_nothing_is_stored(
    api: Api, changes: dict, field: str, words: str
) -> None:
    client = api.client()
    response = client.post("/v1/sweeps", json={**SWEEP_REQUEST, **changes})
    assert response.status_code == 422, response.text
    assert response.json()["message"].startswith(f"{field}: ") and words in response.json()["message"]
    assert client.get("/v1/sweeps").json()["sweeps"] == []
    assert client.get("/v1/jobs").json()["jobs"] == []


def test_calibration_uploads_must_be_the_teams_own(api: Api) -> None:
    owner, other = api.client("team-a"), api.client("team-b")
    upload = owner.post("/v1/uploads", params={"filename": "calib.txt"}, content=b"some text\n" * 50).json()
    calibration = {**SWEEP_REQUEST["calibration"], "dataset": upload["uri"]}
    refused = other.post("/v1/sweeps", json={**SWEEP_REQUEST, "calibration": calibration})
    assert refused.status_code == 422 and refused.json()["message"].startswith("calibration.dataset: no upload")
    accepted = create(owner, calibration=calibration)
    job = owner.get(f"/v1/jobs/{accepted['run']['cells'][0]['job_id']}").json()
    assert job["request"]["calibration"]["dataset"] == upload["uri"]


def test_unknown_sweeps_runs_and_files_answer_404(api: Api) -> None:
    client = api.client()
    sweep = create(client)
    missing_id = "swp_" + "0" * 22
    assert client.get(f"/v1/sweeps/{missing_id}").status_code == 404
    assert client.get(f"/v1/sweeps/{sweep['id']}", params={"run": "run_" + "0" * 22}).status_code == 404
    assert client.get(f"/v1/sweeps/{sweep['id']}/files/plot.svg").status_code == 404  # not written yet
    assert client.get(f"/v1/sweeps/{sweep['id']}/files/..%2F..%2Fsecret").status_code == 404
    assert client.get("/v1/sweeps/not-an-id").status_code == 422
