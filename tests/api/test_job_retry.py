"""POST /v1/jobs/{id}/retry: a failed or cancelled job's request again, as a new job; a job that has
not ended, or succeeded, is a 409; another team's job is a 404 like a missing one."""

from __future__ import annotations

from tests.support.service import JOB_REQUEST, Api


def test_retry_makes_one_new_job_from_an_ended_one(api: Api) -> None:
    client = api.client("team-a")
    job = client.post("/v1/jobs", json=JOB_REQUEST).json()
    live = client.post(f"/v1/jobs/{job['id']}/retry")
    assert live.status_code == 409 and live.json()["detail"].startswith(f"job {job['id']} is queued: nothing to retry")
    assert api.client("team-b").post(f"/v1/jobs/{job['id']}/retry").status_code == 404

    assert client.delete(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled"
    retried = client.post(f"/v1/jobs/{job['id']}/retry")
    assert retried.status_code == 201 and retried.headers["location"] == f"/v1/jobs/{retried.json()['id']}"
    assert retried.json()["id"] != job["id"] and retried.json()["request"] == job["request"]
    again = client.post(f"/v1/jobs/{job['id']}/retry")
    assert again.status_code == 200 and again.json()["id"] == retried.json()["id"]  # not a third job
    assert again.headers["idempotent-replayed"] == "true"
