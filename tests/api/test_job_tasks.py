"""Downstream tasks over the API: known names are stored as asked, an unknown one is a 422 naming it."""

from __future__ import annotations

from tests.support.service import Api


def test_a_job_stores_its_tasks_and_an_unknown_task_or_a_lone_limit_is_a_422(api: Api, job_request: dict) -> None:
    client = api.client()
    evaluation = {**job_request["eval"], "tasks": ["avg6"], "limit": 20}
    created = client.post("/v1/jobs", json={**job_request, "eval": evaluation})
    assert created.status_code in (200, 201, 202), created.text
    stored = client.get(f"/v1/jobs/{created.json()['id']}").json()["request"]["eval"]
    assert stored["tasks"] == ["arc_easy", "arc_challenge", "hellaswag", "piqa", "boolq", "mathqa"]
    assert stored["limit"] == 20
    response = client.post("/v1/jobs", json={**job_request, "eval": {**evaluation, "tasks": ["piqa", "winogrande"]}})
    assert response.status_code == 422
    body = response.json()
    assert body["message"].startswith("eval.tasks:") and "unknown task winogrande" in body["message"], body
    alone = client.post("/v1/jobs", json={**job_request, "eval": {**job_request["eval"], "limit": 20}})
    assert alone.status_code == 422
    assert alone.json()["message"].startswith("eval:") and "add tasks" in alone.json()["message"], alone.json()
