"""Uploads and artifacts through the API, on the local-folder store and on S3 (moto over HTTP)."""

from __future__ import annotations

import hashlib

import httpx

from service.store import open_store
from service.store.layout import checkpoint_name, job_prefix
from service.uploads import upload_key_for
from tests.support.service import Api

CALIBRATION_TEXT = "The quick brown fox jumps over the lazy dog.\n" * 50


def put_fake_artifacts(api: Api, team: str, job_id: str, *, finished: bool) -> dict[str, bytes]:
    """Write what a worker would, straight into the store the API uses."""
    settings = api.settings
    store = open_store(settings.store_url, settings.s3_endpoint_url)
    files = {checkpoint_name(0): b"layer zero", checkpoint_name(1): b"layer one", "log.txt": b"layer 1 done\n"}
    if finished:
        files |= {"model.safetensors": b"\x00\x01" * 4096, "metrics.json": b'{"wikitext2_ppl": 21.4}'}
    prefix = job_prefix(team, job_id)
    for name, data in files.items():
        store.put_bytes(prefix + name, data)
    if finished:
        store.finalise(prefix, {"files": {name: {"size": len(data)} for name, data in files.items()}})
    return files


def test_upload_a_calibration_file_and_submit_a_job_that_uses_it(any_store_api: Api, job_request: dict) -> None:
    client = any_store_api.client("team-a")
    uploaded = client.post("/v1/uploads", params={"filename": "calib.txt"}, content=CALIBRATION_TEXT.encode())
    assert uploaded.status_code == 201, uploaded.text
    upload = uploaded.json()
    assert upload["size"] == len(CALIBRATION_TEXT)
    assert upload["sha256"] == hashlib.sha256(CALIBRATION_TEXT.encode()).hexdigest()
    settings = any_store_api.settings
    store = open_store(settings.store_url, settings.s3_endpoint_url)
    assert upload["uri"].startswith("upload://upl_") and upload["uri"].endswith("/calib.txt")  # no server path
    assert store.get_bytes(upload_key_for(store, "team-a", upload["uri"])).decode() == CALIBRATION_TEXT

    body = {**job_request, "calibration": {**job_request["calibration"], "dataset": upload["uri"]}}
    created = client.post("/v1/jobs", json=body)
    assert created.status_code == 201 and created.json()["request"]["calibration"]["dataset"] == upload["uri"]

    # Another team cannot point a job at it, and a made-up upload is refused the same way.
    for team, uri in (("team-b", upload["uri"]), ("team-a", upload["uri"].replace("calib.txt", "other.txt"))):
        refused = any_store_api.client(team).post("/v1/jobs", json={**body, "calibration": {"dataset": uri}})
        assert refused.status_code == 422
        assert refused.json()["message"].startswith("calibration.dataset: no upload")


def test_uploads_that_cannot_be_calibration_text_are_refused(api_factory) -> None:
    api = api_factory("local", max_upload_bytes=1000)
    client = api.client()
    cases = [
        ({"filename": "calib.exe"}, b"text", 422, "ending in"),
        ({"filename": "../calib.txt"}, b"text", 422, "filename"),
        ({"filename": "calib.txt"}, b"", 422, "empty"),
        ({"filename": "calib.txt"}, b"\xff\xfe binary", 422, "UTF-8"),
        ({"filename": "calib.txt"}, b"x" * 1001, 413, "larger than 1000 bytes (FTC_MAX_UPLOAD_BYTES)"),
    ]
    for params, content, status, words in cases:
        response = client.post("/v1/uploads", params=params, content=content)
        assert response.status_code == status, (params, response.text)
        assert words in response.text


def test_artifacts_are_listed_and_downloadable(any_store_api: Api, job_request: dict) -> None:
    client = any_store_api.client("team-a")
    job_id = client.post("/v1/jobs", json=job_request).json()["id"]
    empty = {"job_id": job_id, "complete": False, "artifacts": [], "checkpoints": {"files": 0, "bytes": 0}}
    assert client.get(f"/v1/jobs/{job_id}/artifacts").json() == empty

    put_fake_artifacts(any_store_api, "team-a", job_id, finished=False)
    partial = client.get(f"/v1/jobs/{job_id}/artifacts").json()
    assert not partial["complete"]
    # checkpoints are counted, and listed only on request, after the outputs
    assert [a["name"] for a in partial["artifacts"]] == ["log.txt"]
    assert partial["checkpoints"] == {"files": 2, "bytes": len(b"layer zero") + len(b"layer one")}
    with_checkpoints = client.get(f"/v1/jobs/{job_id}/artifacts", params={"include": "checkpoints"}).json()
    assert [(a["name"], a["kind"]) for a in with_checkpoints["artifacts"]] == [
        ("log.txt", "record"),
        ("checkpoints/layer-000.safetensors", "checkpoint"),
        ("checkpoints/layer-001.safetensors", "checkpoint"),
    ]
    assert client.get(f"/v1/jobs/{job_id}/artifacts", params={"include": "everything"}).status_code == 422

    files = put_fake_artifacts(any_store_api, "team-a", job_id, finished=True)
    listing = client.get(f"/v1/jobs/{job_id}/artifacts", params={"include": "checkpoints"}).json()
    assert listing["complete"]
    by_name = {a["name"]: a for a in listing["artifacts"]}
    assert set(by_name) == set(files) | {"manifest.json"}
    kinds = [a["kind"] for a in listing["artifacts"]]
    assert kinds == ["model", "model", "record", "record", "checkpoint", "checkpoint"]  # what loads comes first
    for name, data in files.items():
        assert by_name[name]["size"] == len(data)
        url = by_name[name]["url"]
        if any_store_api.settings.store_url.startswith("s3://"):
            assert "Signature" in url
            downloaded = httpx.get(url)  # presigned: no API key needed
        else:
            assert url.startswith(any_store_api.base_url + f"/v1/jobs/{job_id}/artifacts/")
            downloaded = client.get(url)
            assert httpx.get(url).status_code == 401  # streamed through the API: the key is needed
        assert downloaded.status_code == 200 and downloaded.content == data, name


def test_downloads_are_streamed_by_the_api_on_both_stores(any_store_api: Api, job_request: dict) -> None:
    client = any_store_api.client("team-a")
    job_id = client.post("/v1/jobs", json=job_request).json()["id"]
    files = put_fake_artifacts(any_store_api, "team-a", job_id, finished=True)
    response = client.get(f"/v1/jobs/{job_id}/artifacts/model.safetensors")
    assert response.status_code == 200 and response.content == files["model.safetensors"]
    assert response.headers["content-disposition"] == 'attachment; filename="model.safetensors"'
    assert client.get(f"/v1/jobs/{job_id}/artifacts/metrics.json").headers["content-type"] == "application/json"
    # Encoded so the client sends them as they are (it would resolve a plain '..' itself).
    for missing in ("nope.bin", "%2E%2E/%2E%2E/team-b/jobs/x/model.safetensors", "checkpoints/%2E%2E/log.txt"):
        assert client.get(f"/v1/jobs/{job_id}/artifacts/{missing}").status_code == 404, missing
