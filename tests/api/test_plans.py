"""GET /v1/plans and DELETE /v1/plans/{key}: a team's shared layer plans, on S3 (moto over HTTP)."""

from __future__ import annotations

from service.keys import Keys
from service.plans import SharedPlans
from service.redis_client import connect_sync
from service.store import store_for
from service.store.layout import plan_object
from tests.support.service import Api

ENTRIES = [{"layer": 0, "unit": "attention", "ratios": [0.3], "errors": [0.2], "divergence": 0.01,
            "reference_error": 0.2}]


def measured(api: Api, team: str, key: str, model: str) -> None:
    """A plan as a worker of `team` keeps it."""
    about = {"model": model, "method": "ftc", "scope": "model", "job_id": f"job_of_{team}"}
    plans = SharedPlans(store_for(api.settings), connect_sync(api.settings), Keys(api.settings.key_prefix), team,
                        about, lease_seconds=5)
    plans.get(key, lambda: ENTRIES, lambda entries: entries)


def test_a_team_lists_and_deletes_its_own_plans_only(api_factory) -> None:
    api = api_factory("s3")
    mine, theirs = "a1" * 32, "b2" * 32
    measured(api, "team-a", mine, "smollm2-135m")
    measured(api, "team-b", theirs, "org/other")
    client = api.client("team-a")

    listed = client.get("/v1/plans")
    assert listed.status_code == 200, listed.text
    (plan,) = listed.json()["plans"]
    size = len(store_for(api.settings).get_bytes(plan_object("team-a", mine)))
    assert {name: plan[name] for name in ("key", "model", "method", "scope", "bytes", "job_id")} == {
        "key": mine, "model": "smollm2-135m", "method": "ftc", "scope": "model", "bytes": size,
        "job_id": "job_of_team-a"}
    assert plan["created"]

    assert client.delete(f"/v1/plans/{theirs}").status_code == 404, "another team's plan is not found"
    assert store_for(api.settings).exists(plan_object("team-b", theirs))

    deleted = client.delete(f"/v1/plans/{mine}")
    assert deleted.status_code == 200 and deleted.json()["key"] == mine
    assert client.get("/v1/plans").json() == {"plans": []}
    assert client.delete(f"/v1/plans/{mine}").status_code == 404
    assert [p["key"] for p in api.client("team-b").get("/v1/plans").json()["plans"]] == [theirs]


def test_plan_routes_need_a_key_and_a_plan_key(api) -> None:
    assert api.client(None).get("/v1/plans").status_code == 401
    bad = api.client("team-a").delete("/v1/plans/..%2Fjobs")
    assert bad.status_code in (404, 422)
    assert api.client("team-a").delete("/v1/plans/" + "z" * 64).status_code == 422
