"""The job routes over real HTTP with a real Redis: submit, get, list, cancel, retries, auth, teams."""

from __future__ import annotations

from typing import Any

import pytest

from service.schemas import Progress
from tests.support.service import Api


@pytest.fixture
def both(any_store_api: Api) -> Api:
    """The core job routes run once per store backend."""
    return any_store_api


def with_seed(request: dict[str, Any], seed: int) -> dict[str, Any]:
    return {**request, "calibration": {**request["calibration"], "seed": seed}}


def test_submit_answers_201_with_the_record_and_get_returns_it(both: Api, job_request: dict) -> None:
    client = both.client("team-a")
    created = client.post("/v1/jobs", json=job_request)
    assert created.status_code == 201, created.text
    record = created.json()
    assert created.headers["location"] == f"/v1/jobs/{record['id']}"
    assert {k: record[k] for k in ("team", "status", "attempts", "error")} == {
        "team": "team-a",
        "status": "queued",
        "attempts": 0,
        "error": None,
    }
    assert record["progress"] == {
        "layer": 0,
        "layers": 0,
        "stage": "queued",
        "eta_seconds": None,
        "elapsed_seconds": None,
    }
    assert record["request"]["eval"] == job_request["eval"]
    assert record["created_at"] == record["updated_at"]
    fetched = client.get(f"/v1/jobs/{record['id']}")
    assert fetched.status_code == 200 and fetched.json() == record


def test_ratios_submit_one_linked_job_per_ratio(api: Api, job_request: dict) -> None:
    client = api.client()
    body = {k: v for k, v in job_request.items() if k != "ratio"} | {"ratios": [0.25, 0.5]}
    first = client.post("/v1/jobs", json=body).json()
    [other_id] = first["linked"]
    other = client.get(f"/v1/jobs/{other_id}").json()
    assert (first["request"]["ratio"], other["request"]["ratio"]) == (0.25, 0.5)
    assert other["linked"] == [first["id"]]


def test_a_retry_with_the_idempotency_key_returns_the_same_job(both: Api, job_request: dict) -> None:
    client = both.client()
    headers = {"Idempotency-Key": "submit-7f3a"}
    first = client.post("/v1/jobs", json=job_request, headers=headers)
    retry = client.post("/v1/jobs", json=job_request, headers=headers)
    assert (first.status_code, retry.status_code) == (201, 200)
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json()["id"] == first.json()["id"]
    changed = client.post("/v1/jobs", json={**job_request, "ratio": 0.9}, headers=headers)
    assert changed.status_code == 409 and "different request" in changed.json()["detail"]
    assert len(client.get("/v1/jobs").json()["jobs"]) == 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"ratio": 1.5}, "ratio"),
        ({"ratio": 0}, "ratio"),
        ({"calibration": {"samples": 100000}}, "calibration.samples"),
        ({"calibration": {"seq_len": 1}}, "calibration.seq_len"),
        ({"eval": {"datasets": ["imagenet"]}}, "eval.datasets.0"),
        ({"method": "zip"}, "method"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_out_of_bounds_requests_get_a_422_naming_the_field(
    api: Api, job_request: dict, change: dict, field: str
) -> None:
    response = api.client().post("/v1/jobs", json={**job_request, **change})
    assert response.status_code == 422
    body = response.json()
    assert body["message"].startswith(field + ":"), body
    assert body["detail"][0]["loc"] == ["body", *[int(p) if p.isdigit() else p for p in field.split(".")]]
    assert api.client().get("/v1/jobs").json()["jobs"] == []  # nothing stored


def test_not_json_is_a_422_too(api: Api) -> None:
    response = api.client().post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422 and "json" in response.json()["message"].lower()


def test_list_filters_by_status_and_pages_with_a_cursor(both: Api, job_request: dict) -> None:
    client = both.client()
    ids = [client.post("/v1/jobs", json=with_seed(job_request, seed)).json()["id"] for seed in range(5)]
    client.delete(f"/v1/jobs/{ids[0]}")
    seen, cursor = [], None
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/jobs", params=params).json()
        assert len(page["jobs"]) <= 2
        seen += [job["id"] for job in page["jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids[::-1]
    queued = client.get("/v1/jobs", params={"status": "queued"}).json()["jobs"]
    assert [job["id"] for job in queued] == ids[:0:-1]
    cancelled = client.get("/v1/jobs", params={"status": "cancelled"}).json()["jobs"]
    assert [job["id"] for job in cancelled] == [ids[0]]
    assert client.get("/v1/jobs", params={"status": "paused"}).status_code == 422
    assert client.get("/v1/jobs", params={"cursor": "not-an-id"}).status_code == 422


def test_cancel_queued_running_and_finished_jobs(both: Api, job_request: dict) -> None:
    client = both.client()
    queued = client.post("/v1/jobs", json=with_seed(job_request, 1)).json()["id"]
    cancelled = client.delete(f"/v1/jobs/{queued}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert client.delete(f"/v1/jobs/{queued}").status_code == 200  # cancelling twice is harmless

    running = client.post("/v1/jobs", json=with_seed(job_request, 2)).json()["id"]

    async def worker_takes_it(services):
        lease = await services.queue.claim("w1", block_ms=0)
        assert lease is not None and lease.job_id == running  # the cancelled job was never handed out
        return lease

    both.run(worker_takes_it)
    flagged = client.delete(f"/v1/jobs/{running}").json()
    assert (flagged["status"], flagged["cancel_requested"]) == ("running", True)

    async def worker_sees_the_flag_and_stops(services):
        assert await services.jobs.update_progress(running, "w1", Progress(layer=4, layers=30))
        await services.jobs.finish(running, "w1", "cancelled")

    both.run(worker_sees_the_flag_and_stops)
    assert client.get(f"/v1/jobs/{running}").json()["status"] == "cancelled"

    done = client.post("/v1/jobs", json=with_seed(job_request, 3)).json()["id"]

    async def worker_finishes(services):
        await services.queue.claim("w1", block_ms=0)
        await services.jobs.finish(done, "w1", "succeeded")

    both.run(worker_finishes)
    refused = client.delete(f"/v1/jobs/{done}")
    assert refused.status_code == 409 and "already succeeded" in refused.json()["detail"]


def test_missing_or_unknown_keys_get_401(api: Api, job_request: dict) -> None:
    for client in (api.client(team=None), api.client(key="not-a-real-key")):
        for method, path in (("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/job_0000000000000000000000")):
            response = client.request(method, path, json=job_request)
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"


def test_another_teams_job_is_404_everywhere_and_never_listed(both: Api, job_request: dict) -> None:
    mine = both.client("team-a").post("/v1/jobs", json=job_request).json()["id"]
    theirs = both.client("team-b")
    for method, path in (
        ("GET", f"/v1/jobs/{mine}"),
        ("DELETE", f"/v1/jobs/{mine}"),
        ("GET", f"/v1/jobs/{mine}/events"),
        ("GET", f"/v1/jobs/{mine}/artifacts"),
        ("GET", f"/v1/jobs/{mine}/artifacts/manifest.json"),
    ):
        response = theirs.request(method, path)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json() == {"detail": f"job {mine} not found"}
    assert theirs.get("/v1/jobs").json()["jobs"] == []
    assert both.client("team-a").get(f"/v1/jobs/{mine}").json()["status"] == "queued"  # not cancelled
    # The same body from team-b is its own job, not team-a's.
    assert theirs.post("/v1/jobs", json=job_request).json()["id"] != mine
