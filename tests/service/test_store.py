"""Both object-store backends against real storage: a temp folder and moto's S3 server over HTTP."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from service.retry import RetryPolicy
from service.store import (
    IncompleteArtifacts,
    LocalStore,
    ObjectMissing,
    ObjectStore,
    StoreUnavailable,
    open_store,
)
from service.store.retry import is_transient, with_retries
from tests.support.servers import MotoServer, TcpRelay, free_port
from tests.support.service import S3_BUCKET


def store_policy(attempts: int, backoff_seconds: float) -> RetryPolicy:
    return RetryPolicy(store_attempts=attempts, store_backoff_seconds=backoff_seconds)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    moto: MotoServer = request.getfixturevalue("moto_server")
    return open_store(f"s3://{S3_BUCKET}/{uuid.uuid4().hex}", moto.url, retry=store_policy(2, 0.05))


def test_put_get_list_exists_delete(store: ObjectStore, tmp_path: Path) -> None:
    store.put_bytes("team-a/jobs/j1/metrics.json", b'{"ppl": 12.5}', "application/json")
    source = tmp_path / "model.bin"
    source.write_bytes(b"\x00" * 3000)
    store.put_file("team-a/jobs/j1/model.safetensors", source)
    store.put_bytes("team-a/jobs/j1/checkpoints/layer-000.safetensors", b"layer")
    store.put_bytes("team-a/jobs/j10/log.txt", b"other job")

    listed = store.list("team-a/jobs/j1/")
    assert [(i.key, i.size) for i in listed] == [
        ("team-a/jobs/j1/checkpoints/layer-000.safetensors", 5),
        ("team-a/jobs/j1/metrics.json", 13),
        ("team-a/jobs/j1/model.safetensors", 3000),
    ]
    assert store.get_bytes("team-a/jobs/j1/metrics.json") == b'{"ppl": 12.5}'
    assert b"".join(store.iter_chunks("team-a/jobs/j1/model.safetensors", chunk_size=1024)) == b"\x00" * 3000
    assert store.exists("team-a/jobs/j1/metrics.json") and not store.exists("team-a/jobs/j1/nope")
    store.delete("team-a/jobs/j1/metrics.json")
    store.delete("team-a/jobs/j1/metrics.json")  # deleting twice is fine
    assert not store.exists("team-a/jobs/j1/metrics.json")
    with pytest.raises(ObjectMissing):
        store.get_bytes("team-a/jobs/j1/metrics.json")
    with pytest.raises(ObjectMissing):
        store.iter_chunks("team-a/jobs/j1/metrics.json")


def test_uris_round_trip_and_foreign_uris_are_not_ours(store: ObjectStore) -> None:
    key = "team-a/uploads/upl_1/calib.txt"
    assert store.key_for_uri(store.uri(key)) == key
    assert store.key_for_uri("s3://elsewhere/team-a/uploads/upl_1/calib.txt") is None
    assert store.key_for_uri("file:///etc/passwd") is None


@pytest.mark.parametrize("key", ["../escape", "team-a/../../x", "/absolute", "team-a//x", "team-a/.hidden", ""])
def test_keys_that_could_escape_are_refused(store: ObjectStore, key: str) -> None:
    with pytest.raises(ValueError, match="invalid object key"):
        store.put_bytes(key, b"x")


def test_finalise_writes_the_manifest_last_and_only_over_complete_files(store: ObjectStore) -> None:
    prefix = "team-a/jobs/j2/"
    store.put_bytes(prefix + "model.safetensors", b"weights")
    manifest = {"files": {"model.safetensors": {"size": 7}, "metrics.json": {"size": 2}}}
    with pytest.raises(IncompleteArtifacts, match=r"metrics\.json"):
        store.finalise(prefix, manifest)
    assert not store.exists(prefix + "manifest.json")
    store.put_bytes(prefix + "metrics.json", b"{}")
    store.finalise(prefix, manifest)
    assert json.loads(store.get_bytes(prefix + "manifest.json")) == manifest


def test_s3_download_links_are_presigned_and_work_without_credentials(moto_server: MotoServer, tmp_path: Path) -> None:
    store = open_store(f"s3://{S3_BUCKET}/{uuid.uuid4().hex}", moto_server.url)
    store.put_bytes("team-a/jobs/j3/log.txt", b"layer 1 done\n")
    url = store.presigned_url("team-a/jobs/j3/log.txt", 600)
    assert url is not None and "X-Amz-Algorithm=AWS4-HMAC-SHA256" in url and "X-Amz-Signature=" in url  # SigV4
    assert httpx.get(url).content == b"layer 1 done\n"
    assert LocalStore(tmp_path).presigned_url("team-a/jobs/j3/log.txt", 60) is None  # the API streams instead


def test_s3_outage_is_retried_with_backoff_then_reported(tmp_path: Path) -> None:
    port = free_port()  # nothing listens here yet
    store = open_store(f"s3://{S3_BUCKET}/x", f"http://127.0.0.1:{port}", retry=store_policy(3, 0.1))
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="failed 3 times"):
        store.put_bytes("team-a/jobs/j/log.txt", b"x")
    assert time.monotonic() - started >= 0.1 * 0.8 + 0.2 * 0.8  # two backoff sleeps
    with pytest.raises(StoreUnavailable):
        store.check()


def test_s3_calls_survive_an_outage_shorter_than_the_retries(moto_server: MotoServer) -> None:
    relay = TcpRelay(moto_server.server.port)  # S3 is unreachable until the relay opens
    store = open_store(f"s3://{S3_BUCKET}/late", f"http://127.0.0.1:{relay.port}", retry=store_policy(6, 0.2))
    reopen = threading.Timer(0.5, relay.open)
    reopen.start()
    try:
        started = time.monotonic()
        store.put_bytes("team-a/jobs/j/log.txt", b"made it")
        assert time.monotonic() - started >= 0.4
        assert store.get_bytes("team-a/jobs/j/log.txt") == b"made it"
    finally:
        reopen.cancel()
        relay.close()


def test_only_transient_errors_are_retried() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ClientError({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "Put")
        return "ok"

    delays: list[float] = []
    assert with_retries(flaky, what="put", policy=store_policy(5, 1.0), sleep=delays.append) == "ok"
    assert len(delays) == 2 and 0.8 <= delays[0] <= 1.2 and 1.6 <= delays[1] <= 2.4
    denied = ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "Put")
    assert not is_transient(denied)
    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    with pytest.raises(ClientError):
        with_retries(lambda: (_ for _ in ()).throw(denied), what="put", policy=store_policy(5, 0), sleep=delays.append)
    assert len(delays) == 2
