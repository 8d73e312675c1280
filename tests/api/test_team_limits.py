"""What one team may do to the others through the API: priority high only where configured, quotas
answered with 429 naming the limit (other teams unaffected), sweeps that queue their jobs as room
frees up, a stream cap that holds across API processes, and answers that show nothing internal."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest

from api.app import create_app
from api.sse import StreamSlots
from service.runtime import Services
from tests.support.servers import free_port, serve_in_thread, wait_until
from tests.support.service import TEAM_KEYS, Api
from tests.support.sweeps import SWEEP_REQUEST, scheduler_pass, work_queue


def seeded(job_request: dict, seed: int, **changes) -> dict:
    return {**job_request, "calibration": {**job_request["calibration"], "seed": seed}, **changes}


def refused(response: httpx.Response, limit: str, setting: str) -> None:
    """A 429 that names the limit and where it is set, and says when to come back."""
    assert response.status_code == 429, response.text
    assert response.json()["limit"] == limit and setting in response.json()["detail"]
    assert int(response.headers["retry-after"]) >= 1


# --- priority and job quotas -------------------------------------------------------------------------


def test_priority_high_is_open_only_to_teams_given_it(api: Api, job_request: dict) -> None:
    high = seeded(job_request, 1, priority="high")
    assert api.client("team-a").post("/v1/jobs", json=high).status_code == 201  # high_priority in FTC_TEAMS
    answer = api.client("team-b").post("/v1/jobs", json=high)
    assert answer.status_code == 403 and "high_priority in FTC_TEAMS" in answer.json()["detail"]
    sweep = api.client("team-b").post("/v1/sweeps", json={**SWEEP_REQUEST, "priority": "high"})
    assert sweep.status_code == 403
    assert api.client("team-b").post("/v1/jobs", json=seeded(job_request, 2, priority="low")).status_code == 201


def test_beyond_the_queued_jobs_quota_a_429_names_it_and_other_teams_are_unaffected(
    api_factory: Callable[..., Api], job_request: dict
) -> None:
    api = api_factory("local", quota_queued_jobs=3)
    a, b = api.client("team-a"), api.client("team-b")
    ids = [a.post("/v1/jobs", json=seeded(job_request, n)).json()["id"] for n in range(3)]
    refused(a.post("/v1/jobs", json=seeded(job_request, 3)), "queued_jobs", "FTC_QUOTA_QUEUED_JOBS")
    assert a.post("/v1/jobs", json=seeded(job_request, 0)).status_code == 200  # a replay is never refused
    assert b.post("/v1/jobs", json=seeded(job_request, 0)).status_code == 201
    many = {k: v for k, v in job_request.items() if k != "ratio"} | {"ratios": [0.2, 0.4, 0.6, 0.8]}
    never = a.post("/v1/jobs", json=many)  # more than may ever be queued: no wait helps, so not a 429
    assert never.status_code == 422 and never.json()["detail"][0]["loc"] == ["body", "ratios"]
    a.delete(f"/v1/jobs/{ids[0]}")
    assert a.post("/v1/jobs", json=seeded(job_request, 3)).status_code == 201  # room again
    assert api.run(lambda s: s.jobs.status_counts())["queued"] == 4  # 3 of team-a, 1 of team-b


def test_concurrent_submissions_cannot_pass_the_quota_together(api_factory, job_request: dict) -> None:
    api = api_factory("local", quota_queued_jobs=5)
    client = api.client("team-a")
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda n: client.post("/v1/jobs", json=seeded(job_request, n)).status_code, range(24)))
    assert sorted(codes) == [201] * 5 + [429] * 19


def test_the_submission_rate_is_limited_per_team(api_factory, job_request: dict) -> None:
    api = api_factory("local", quota_submissions_per_minute=2)
    a = api.client("team-a")
    assert [a.post("/v1/jobs", json=seeded(job_request, n)).status_code for n in range(2)] == [201, 201]
    answer = a.post("/v1/jobs", json=seeded(job_request, 2))
    refused(answer, "submissions_per_minute", "FTC_QUOTA_SUBMISSIONS_PER_MINUTE")
    assert int(answer.headers["retry-after"]) <= 30  # one token comes back every 30 s
    assert api.client("team-b").post("/v1/jobs", json=job_request).status_code == 201


# --- uploads -------------------------------------------------------------------------------------------


def test_uploads_count_against_the_teams_bytes_before_and_while_they_are_read(api_factory) -> None:
    api = api_factory("local", quota_upload_bytes=1000)
    a = api.client("team-a")
    assert a.post("/v1/uploads", params={"filename": "a.txt"}, content=b"x" * 600).status_code == 201
    refused(a.post("/v1/uploads", params={"filename": "b.txt"}, content=b"x" * 600), "upload_bytes",
            "FTC_QUOTA_UPLOAD_BYTES")  # fmt: skip
    where = urlsplit(api.base_url)
    with socket.create_connection((where.hostname, where.port), timeout=5) as raw:
        raw.sendall(  # 600 bytes announced, none sent: the answer comes without waiting for them
            f"POST /v1/uploads?filename=e.txt HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {TEAM_KEYS['team-a']}"
            "\r\nContent-Length: 600\r\n\r\n".encode()
        )
        assert raw.recv(100).startswith(b"HTTP/1.1 429")
    chunked = a.post("/v1/uploads", params={"filename": "c.txt"}, content=iter([b"x" * 300, b"x" * 300]))
    refused(chunked, "upload_bytes", "FTC_QUOTA_UPLOAD_BYTES")  # no length announced: refused all the same
    assert a.post("/v1/uploads", params={"filename": "d.txt"}, content=b"x" * 400).status_code == 201  # fits
    assert api.client("team-b").post("/v1/uploads", params={"filename": "a.txt"}, content=b"x" * 900).is_success


def test_a_calibration_file_is_checked_for_its_format_when_it_is_uploaded(api: Api) -> None:
    client = api.client()
    cases = [
        ("calib.jsonl", b'{"text": "one"}\n\n{"text": "two"}\n', 201, ""),
        ("calib.jsonl", b'{"text": "one"}\n{"text": "two"\n', 422, "line 2 is not JSON"),
        ("calib.jsonl", b'{"text": "one"}\n["two"]\n', 422, 'line 2 has no \\"text\\" field'),
        ("calib.jsonl", b'{"body": "one"}\n', 422, 'line 1 has no \\"text\\" field'),
        ("calib.jsonl", b"\n \n", 422, "no records"),
        ("calib.txt", b" \n\t\n", 422, "no text"),
    ]
    for filename, content, status, words in cases:
        answer = client.post("/v1/uploads", params={"filename": filename}, content=content)
        assert answer.status_code == status and words in answer.text, (content, answer.text)
    uploaded = client.post("/v1/uploads", params={"filename": "ok.txt"}, content=b"text")
    assert uploaded.json()["uri"].startswith("upload://upl_") and api.settings.store_url not in uploaded.text


# --- sweeps --------------------------------------------------------------------------------------------


def test_sweeps_are_limited_in_number_and_in_how_often_they_fire(api_factory) -> None:
    teams = json.dumps({"team-a": {"high_priority": True}, "team-b": {"min_schedule_seconds": 60}})
    api = api_factory("local", quota_sweeps=1, teams=teams)
    a = api.client("team-a")
    nightly = {**SWEEP_REQUEST, "schedule": "0 2 * * *"}
    first = a.post("/v1/sweeps", json=nightly)
    assert first.status_code == 201
    refused(a.post("/v1/sweeps", json=nightly), "sweeps", "FTC_QUOTA_SWEEPS")
    a.delete(f"/v1/sweeps/{first.json()['id']}")
    assert a.post("/v1/sweeps", json=nightly).status_code == 201  # a cancelled sweep is no longer live

    every_minute = {**SWEEP_REQUEST, "schedule": "* * * * *"}
    answer = api.client("team-b").post("/v1/sweeps", json={**SWEEP_REQUEST, "schedule": "0,30 * * * * "})
    assert answer.status_code == 201  # 30 minutes apart: team-b may fire every minute
    assert api.client("team-b").post("/v1/sweeps", json=every_minute).status_code == 429  # but holds 1 sweep
    too_often = api_factory("local").client("team-a").post("/v1/sweeps", json=every_minute)
    assert too_often.status_code == 422 and too_often.json()["detail"][0]["loc"] == ["body", "schedule"]
    assert "at least 3600 s apart" in too_often.json()["message"]


def test_a_sweep_queues_its_jobs_as_room_frees_up_instead_of_failing(api_factory) -> None:
    api = api_factory("local", quota_queued_jobs=2)
    client = api.client()
    sweep = client.post("/v1/sweeps", json=SWEEP_REQUEST).json()  # 2 job sets of 2 ratios
    cells = sweep["run"]["cells"]
    assert sweep["status"] == "queued" and sum(c["job_id"] is not None for c in cells) == 2
    assert api.run(work_queue) and scheduler_pass(api.settings).reported == []  # room again: the rest queues
    cells = client.get(f"/v1/sweeps/{sweep['id']}").json()["run"]["cells"]
    assert all(c["job_id"] for c in cells) and [c["status"] for c in cells].count("queued") == 2
    assert len(api.run(work_queue)) == 2
    assert scheduler_pass(api.settings).reported == [(sweep["id"], sweep["run"]["id"])]
    assert client.get(f"/v1/sweeps/{sweep['id']}").json()["status"] == "succeeded"


# --- event streams -------------------------------------------------------------------------------------


@contextlib.contextmanager
def second_process(api: Api) -> Iterator[str]:
    """Another API process on the same Redis and key prefix (an app of its own, on its own port)."""
    with serve_in_thread(create_app(api.settings), free_port()) as base_url:
        yield base_url


def test_the_stream_cap_holds_under_concurrent_opens_across_api_processes(api_factory, job_request) -> None:
    api = api_factory("local", max_streams_per_team=4)
    job_id = api.client().post("/v1/jobs", json=job_request).json()["id"]
    headers = {"Authorization": f"Bearer {TEAM_KEYS['team-a']}"}

    async def open_all(urls: list[str], count: int) -> list[int]:
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(httpx.AsyncClient(base_url=url, headers=headers, timeout=30))
                for url in urls
            ]

            async def open_one(n: int) -> int:
                client = clients[n % len(clients)]
                response = await client.send(client.build_request("GET", f"/v1/jobs/{job_id}/events"), stream=True)
                stack.push_async_callback(response.aclose)  # held open until every open is answered
                return response.status_code

            return await asyncio.gather(*(open_one(n) for n in range(count)))

    with second_process(api) as other:
        codes = asyncio.run(open_all([api.base_url, other], 40))
        assert sorted(codes) == [200] * 4 + [429] * 36
        # Every slot is given back once its server notices the client gone, which the close does not
        # wait for (under load that takes a moment): a slot never given back fails here after 10 s.
        wait_until(
            lambda: api.run(lambda s: StreamSlots(s.redis, s.jobs.keys).held("team-a")) == 0,
            "the closed streams' slots coming back",
            timeout=10,
        )
        assert asyncio.run(open_all([other], 4)) == [200] * 4


def test_streams_of_a_process_that_died_stop_counting_once_their_slots_lapse(api: Api) -> None:
    async def scenario(services: Services) -> None:
        dead = StreamSlots(services.redis, services.jobs.keys, lease_seconds=0.5)
        assert [await dead.take("team-a", 2) is not None for _ in range(3)] == [True, True, False]
        alive = StreamSlots(services.redis, services.jobs.keys, lease_seconds=0.5)
        await asyncio.sleep(0.6)  # `dead` never renews nor gives back: its process was killed
        assert await alive.held("team-a") == 0 and await alive.take("team-a", 2) is not None

    api.run(scenario)


# --- nothing internal shown ----------------------------------------------------------------------------


def test_readyz_without_a_key_says_which_dependency_but_no_address(api_factory) -> None:
    port = free_port()  # nothing listens there: Redis is down
    api = api_factory("s3", redis_url=f"redis://127.0.0.1:{port}/0", store_url="s3://no-such-bucket/x")
    keyless = api.client(team=None).get("/readyz")
    assert keyless.status_code == 503
    assert keyless.json() == {"status": "not ready", "redis": "unreachable", "store": "unreachable"}
    with_key = api.client("team-a").get("/readyz").json()
    assert str(port) in with_key["redis"] and "no-such-bucket" in with_key["store"]  # the operators' view
    outage = api.client("team-a").post("/v1/jobs", json={"model": "smollm2-135m", "ratio": 0.5})
    assert outage.status_code == 503 and str(port) not in outage.text and "cause" not in outage.json()


def test_metrics_show_queue_depth_and_running_jobs_per_team(api: Api, job_request: dict) -> None:
    for seed in range(2):
        api.client("team-a").post("/v1/jobs", json=seeded(job_request, seed))
    api.client("team-b").post("/v1/jobs", json=job_request)
    assert api.run(lambda s: s.queue.claim("w1", block_ms=0)) is not None  # team-a's oldest job starts
    text = api.client(team=None).get("/metrics").text
    for line in (
        'ftc_team_queue_depth{team="team-a"} 1.0',
        'ftc_team_running_jobs{team="team-a"} 1.0',
        'ftc_team_queue_depth{team="team-b"} 1.0',
        'ftc_team_running_jobs{team="team-b"} 0.0',
    ):
        assert line in text, line


@pytest.mark.parametrize("teams", ['{"team-z": {"weight": 2}}', '{"team-a": {"weight": 0}}', "{not json"])
def test_an_unusable_teams_setting_stops_the_api_at_startup(service_settings, teams: str) -> None:
    with pytest.raises(ValueError, match="FTC_TEAMS"):
        create_app(service_settings(teams=teams))
