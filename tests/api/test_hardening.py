"""What breaking the running API from outside found, each pinned by a test: streams that starve the
API, unbounded bodies read before the key is checked, schedules and event ids that crash a request,
loose types, keys listed twice, and answers that drop the connection or say too much or too little."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from api.app import create_app
from service.auth import ApiKeys
from tests.support.servers import RedisServer, serve_in_thread, start_redis
from tests.support.service import TEAM_KEYS, Api, require_redis_server

KEY = TEAM_KEYS["team-a"]


# --- raw HTTP: one connection, so keep-alive and early answers can be seen ---------------------------


def _connect(base_url: str) -> socket.socket:
    parts = urlsplit(base_url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body; (0, {}, b"") when the server closed instead."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, {}, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split(" ")[1]), headers, body


def _request(method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# --- 1. event streams share one reader -----------------------------------------------------------------


def test_150_open_event_streams_leave_readyz_and_submissions_answering(api: Api, job_request: dict) -> None:
    """More streams than the Redis pool has connections (100); each used to hold one while it waited."""
    client = api.client()
    job_id = client.post("/v1/jobs", json=job_request).json()["id"]
    streams = 150

    async def scenario() -> tuple[list[int], float, int, float, int, list[str]]:
        limits = httpx.Limits(max_connections=streams + 10)
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=api.base_url, headers=headers, limits=limits, timeout=30) as http:
            opened: list[int] = []
            finals: list[str] = []

            async def follow() -> None:
                try:
                    async with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
                        opened.append(response.status_code)
                        async for line in response.aiter_lines():
                            if line.startswith("data:") and '"succeeded"' in line:
                                finals.append(line)
                except httpx.HTTPError as error:
                    opened.append(-1)
                    raise AssertionError(f"stream {len(opened)} failed: {error!r}") from error

            followers = []
            for wave in range(0, streams, 25):  # as dashboards open them: a few at a time, all staying open
                followers += [asyncio.create_task(follow()) for _ in range(25)]
                deadline = time.monotonic() + 30
                while len(opened) < wave + 25 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(1.5)  # every stream is now waiting for news
            started = time.perf_counter()
            ready = await http.get("/readyz")
            ready_seconds = time.perf_counter() - started
            started = time.perf_counter()
            submitted = await http.post("/v1/jobs", json={**job_request, "calibration": {"seed": 7}})
            submit_seconds = time.perf_counter() - started

            async def run_the_job(services) -> None:
                await services.queue.claim("w1", block_ms=0)
                await services.jobs.finish(job_id, "w1", "succeeded")

            await asyncio.to_thread(api.run, run_the_job)
            await asyncio.wait_for(asyncio.gather(*followers), 30)
            return opened, ready_seconds, ready.status_code, submit_seconds, submitted.status_code, finals

    opened, ready_seconds, ready_status, submit_seconds, submit_status, finals = asyncio.run(scenario())
    assert opened == [200] * streams
    assert (ready_status, submit_status) == (200, 201)
    assert ready_seconds < 1 and submit_seconds < 1, (ready_seconds, submit_seconds)
    assert len(finals) == streams  # every stream got the final status and ended


def test_one_team_cannot_hold_more_than_its_share_of_streams(api_factory: Callable[..., Api], job_request) -> None:
    api = api_factory("local", max_streams_per_team=3)
    job_a = api.client("team-a").post("/v1/jobs", json=job_request).json()["id"]
    job_b = api.client("team-b").post("/v1/jobs", json=job_request).json()["id"]

    async def scenario() -> list[int]:
        async with contextlib.AsyncExitStack() as stack:
            clients = {
                team: await stack.enter_async_context(
                    httpx.AsyncClient(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
                )
                for team, key in TEAM_KEYS.items()
            }

            readers = []  # kept, so that no line iterator is collected (which would close its stream)

            async def open_stream(team: str, job_id: str) -> httpx.Response:
                request = clients[team].build_request("GET", f"/v1/jobs/{job_id}/events")
                response = await clients[team].send(request, stream=True)
                stack.push_async_callback(response.aclose)
                if response.status_code == 200:
                    readers.append(lines := response.aiter_lines())
                    while not (await anext(lines)).startswith("data:"):  # the replayed "queued" event:
                        pass  # the stream now follows the job
                    await asyncio.sleep(0.2)
                return response

            held = [await open_stream("team-a", job_a) for _ in range(3)]
            refused = await open_stream("team-a", job_a)
            other_team = await open_stream("team-b", job_b)
            await held[0].aclose()
            await asyncio.sleep(0.3)
            again = await open_stream("team-a", job_a)
            assert refused.headers.get("retry-after") == "5"
            assert "FTC_MAX_STREAMS_PER_TEAM" in (await refused.aread()).decode()
            return [r.status_code for r in held] + [refused.status_code, other_team.status_code, again.status_code]

    assert asyncio.run(scenario()) == [200, 200, 200, 429, 200, 200]


# --- 2. bodies: the key first, then a size limit ---------------------------------------------------------


@pytest.fixture
def small_body_api(api_factory: Callable[..., Api]) -> Api:
    return api_factory("local", max_body_bytes=64 * 1024, max_upload_bytes=1024 * 1024)


def test_a_body_without_a_key_is_refused_before_it_is_read(small_body_api: Api) -> None:
    with contextlib.closing(_connect(small_body_api.base_url)) as sock:
        # Announce 300 MB and send none of it: the answer must come without waiting for the body.
        head = _request("POST", "/v1/jobs", {"Content-Type": "application/json"})
        sock.sendall(head.replace(b"Content-Length: 0", b"Content-Length: 300000000"))
        status, _headers, body = _read_response(sock)
    assert status == 401 and b"missing API key" in body


def test_an_oversized_content_length_is_refused_at_once_with_413(small_body_api: Api) -> None:
    with contextlib.closing(_connect(small_body_api.base_url)) as sock:
        head = _request("POST", "/v1/jobs", {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        sock.sendall(head.replace(b"Content-Length: 0", b"Content-Length: 300000000"))
        status, _headers, body = _read_response(sock)
    assert status == 413 and b"FTC_MAX_BODY_BYTES" in body and b"65536" in body


def test_a_chunked_body_is_not_read_past_the_limit(small_body_api: Api) -> None:
    limit = 64 * 1024
    head = (
        f"POST /v1/jobs HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = b"%x\r\n%s\r\n" % (8192, b" " * 8192)
    sent = 0
    with contextlib.closing(_connect(small_body_api.base_url)) as sock:
        sock.sendall(head)
        answered = False
        while sent < 100 * limit:
            if select.select([sock], [], [], 0.005)[0]:
                answered = True
                break
            try:
                sock.sendall(chunk)
            except OSError:  # the server closed the connection after answering
                answered = True
                break
            sent += 8192
        assert answered, "the server read 100 times its body limit without answering"
        status, _headers, body = _read_response(sock)
    assert status == 413 and b"FTC_MAX_BODY_BYTES" in body
    assert sent < 10 * limit, sent


def test_uploads_keep_their_own_larger_limit(small_body_api: Api) -> None:
    text = ("calibration text " * 10_000).encode()  # 170 KB: above the body limit, below the upload limit
    response = small_body_api.client().post("/v1/uploads?filename=calib.txt", content=text)
    assert response.status_code == 201, response.text
    too_big = small_body_api.client().post("/v1/uploads?filename=calib.txt", content=text * 7)
    assert too_big.status_code == 413


# --- 3. a schedule that never fires ------------------------------------------------------------------------


def test_a_schedule_that_never_fires_is_a_422_naming_schedule(api: Api) -> None:
    client = api.client()
    body = {"models": ["smollm2-135m"], "ratios": [0.5], "schedule": "0 0 30 2 *"}
    response = client.post("/v1/sweeps", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "schedule"]
    assert "never" in response.json()["message"]
    assert client.get("/v1/sweeps").json()["sweeps"] == []


# --- 4. jobs no worker can run ----------------------------------------------------------------------------


def test_calibration_beyond_the_token_limit_is_a_422_for_jobs_and_sweeps(
    api_factory: Callable[..., Api], job_request: dict
) -> None:
    api = api_factory("local", max_calib_tokens=4096)
    client = api.client()
    too_many = {**job_request, "calibration": {"samples": 17, "seq_len": 256}}
    response = client.post("/v1/jobs", json=too_many)
    assert response.status_code == 422, response.text
    assert response.json()["message"].startswith("calibration.samples: samples x seq_len = 17 x 256 = 4352")
    assert "FTC_MAX_CALIB_TOKENS" in response.json()["message"]
    sweep = {"models": ["smollm2-135m"], "ratios": [0.5], "calibration": {"samples": 17, "seq_len": 256}}
    assert client.post("/v1/sweeps", json=sweep).status_code == 422
    assert client.get("/v1/jobs").json()["jobs"] == [] and client.get("/v1/sweeps").json()["sweeps"] == []
    at_limit = {**job_request, "calibration": {"samples": 16, "seq_len": 256}}
    assert client.post("/v1/jobs", json=at_limit).status_code == 201


@pytest.mark.parametrize(
    ("change", "field"),
    [({"ratio": 5e-324}, "ratio"), ({"model": "/models/x"}, "model"), ({"calibration": {"samples": 1}}, "calibration")],
)
def test_requests_no_worker_can_run_are_refused_at_submit(api: Api, job_request: dict, change, field) -> None:
    response = api.client().post("/v1/jobs", json={**job_request, **change})
    assert response.status_code == 422, response.text
    assert response.json()["message"].startswith(f"{field}:")


# --- 5. an out-of-range Last-Event-ID ----------------------------------------------------------------------


@pytest.mark.parametrize("event_id", ["18446744073709551616-0", "1-99999999999999999999"])
def test_an_event_id_beyond_64_bits_is_a_422(api: Api, job_request: dict, event_id: str) -> None:
    client = api.client()
    job_id = client.post("/v1/jobs", json=job_request).json()["id"]
    response = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": event_id})
    assert response.status_code == 422, response.text
    assert "Last-Event-ID" in response.json()["message"]
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": f"{2**64 - 1}-0"}) as largest:
        assert largest.status_code == 200


# --- 6. a key listed for two teams -------------------------------------------------------------------------


def test_a_key_listed_for_two_teams_is_refused_at_startup(service_settings) -> None:
    spec = "shared-key-0123456789:team-a,other-key-0123456789:team-b,shared-key-0123456789:team-b"
    with pytest.raises(ValueError, match="entries 1 and 3"):
        ApiKeys.parse(spec)
    with pytest.raises(ValueError, match="two teams"):
        create_app(service_settings(api_keys=spec))
    assert ApiKeys.parse("same-key-0123456789:team-a,same-key-0123456789:team-a").teams == {"team-a"}


def test_ftc_serve_refuses_a_key_listed_for_two_teams_with_exit_2(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "FTC_API_KEYS": "shared-key-0123456789:team-a,shared-key-0123456789:team-b",
        "FTC_STORE_URL": str(tmp_path),
    }
    result = subprocess.run(
        [sys.executable, "-m", "cli", "serve", "--port", "1"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "two teams" in result.stderr


# --- 7. strict types ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"ratio": True}, "ratio"),
        ({"ratio": "0.5"}, "ratio"),
        ({"ratio": None, "ratios": [0.5, True]}, "ratios.1"),
        ({"calibration": {"samples": "8"}}, "calibration.samples"),
        ({"calibration": {"seed": 1.0}}, "calibration.seed"),
        ({"eval": {"max_windows": "4"}}, "eval.max_windows"),
        ({"eval": {"dense_reference": "yes"}}, "eval.dense_reference"),
    ],
)
def test_numbers_and_flags_must_be_json_numbers_and_booleans(api: Api, job_request: dict, change, field) -> None:
    body = {key: value for key, value in {**job_request, **change}.items() if value is not None}
    response = api.client().post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["message"].startswith(f"{field}:"), response.json()["message"]


def test_sweep_requests_are_strict_too(api: Api) -> None:
    client = api.client()
    for change, field in [({"ratios": [True]}, "ratios.0"), ({"change_threshold": "0.1"}, "change_threshold")]:
        response = client.post("/v1/sweeps", json={"models": ["smollm2-135m"], "ratios": [0.5], **change})
        assert response.status_code == 422, response.text
        assert response.json()["message"].startswith(f"{field}:"), response.json()["message"]
    whole = client.post("/v1/sweeps", json={"models": ["smollm2-135m"], "ratios": [1], "eval": {"datasets": []}})
    assert whole.status_code == 201, whole.text  # a whole number is still a number


# --- 8. answers: Allow, short 422s, 500s that keep the connection, a hung Redis ---------------------------


def test_405_lists_the_allowed_methods(api: Api) -> None:
    client = api.client()
    one_job = "/v1/jobs/job_01jdq3x6v2k8m4n5p7r9s0t1w3"
    for path, methods in [("/v1/jobs", {"GET", "POST"}), (one_job, {"GET", "DELETE"})]:
        response = client.put(path)
        assert response.status_code == 405
        assert set(response.headers["allow"].split(", ")) == methods, response.headers
        assert all(method in response.json()["detail"] for method in methods)


def test_a_422_does_not_echo_a_long_input(api: Api, job_request: dict) -> None:
    long_name = "s3://" + "x" * 200_000
    body = {**job_request, "calibration": {**job_request["calibration"], "dataset": long_name}}
    response = api.client().post("/v1/jobs", json=body)
    assert response.status_code == 422
    assert "calibration.dataset" in response.json()["message"]
    assert len(response.content) < 4096, len(response.content)


@pytest.fixture
def failing_api(service_settings) -> Iterator[str]:
    """An API with one more route that fails unexpectedly."""
    app = create_app(service_settings())

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    with serve_in_thread(app) as base_url:
        yield base_url


def test_a_500_keeps_the_connection_open(failing_api: str) -> None:
    with contextlib.closing(_connect(failing_api)) as sock:
        sock.sendall(_request("GET", "/boom"))
        status, headers, body = _read_response(sock)
        assert status == 500 and b"internal error" in body and b"a bug" not in body
        assert headers.get("connection") != "close"
        sock.sendall(_request("GET", "/healthz"))
        assert _read_response(sock)[0] == 200


@pytest.fixture
def hung_redis(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis_server()
    server = start_redis(tmp_path / "redis")
    yield server
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.server.process.pid, signal.SIGCONT)
    server.stop()


def test_a_hung_redis_answers_503_within_about_the_timeout_and_readyz_says_why(
    api_factory: Callable[..., Api], hung_redis: RedisServer, job_request: dict
) -> None:
    api = api_factory("local", redis_url=hung_redis.url)
    client = api.client()
    assert client.post("/v1/jobs", json=job_request).status_code == 201
    os.killpg(hung_redis.server.process.pid, signal.SIGSTOP)
    timeout = api.settings.redis_timeout_seconds
    for attempt in range(2):
        started = time.monotonic()
        response = client.post("/v1/jobs", json={**job_request, "calibration": {"seed": attempt + 1}})
        elapsed = time.monotonic() - started
        assert response.status_code == 503 and elapsed < timeout + 0.5, (response.status_code, elapsed)
    started = time.monotonic()
    ready = client.get("/readyz")
    assert time.monotonic() - started < timeout + 0.5
    assert ready.status_code == 503
    assert ready.json()["redis"] == f"unreachable: no answer within {timeout:g} s", ready.json()
