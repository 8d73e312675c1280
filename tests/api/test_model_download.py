"""GET /v1/jobs/{id}/model.tar: the model folder as one tar, streamed from the store (local and
S3), 409 until the manifest is there, another team's job a 404."""

from __future__ import annotations

import io
import tarfile

from service.store import open_store
from service.store.layout import checkpoint_name, job_prefix
from tests.support.service import Api


def test_the_model_folder_downloads_as_one_tar(any_store_api: Api, job_request: dict) -> None:
    client = any_store_api.client("team-a")
    job_id = client.post("/v1/jobs", json=job_request).json()["id"]
    store = open_store(any_store_api.settings.store_url, any_store_api.settings.s3_endpoint_url)
    prefix = job_prefix("team-a", job_id)
    files = {"model.safetensors": bytes(range(256)) * 7, "config.json": b"{}", "metrics.json": b'{"a": 1}',
             "dense/model.safetensors": b"\x01" * 600, checkpoint_name(0): b"layer zero"}
    for name, data in files.items():
        store.put_bytes(prefix + name, data)
    assert client.get(f"/v1/jobs/{job_id}/model.tar").status_code == 409  # no manifest yet
    store.finalise(prefix, {"files": {}})

    response = client.get(f"/v1/jobs/{job_id}/model.tar")
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-tar"
    assert response.headers["content-disposition"] == f'attachment; filename="{job_id}.tar"'
    with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
        saved = {member.name: tar.extractfile(member).read() for member in tar.getmembers()}
    expected = {name: data for name, data in files.items() if not name.startswith(("dense/", "checkpoints/"))}
    assert {name.removeprefix(f"{job_id}/"): data for name, data in saved.items() if "manifest" not in name} == expected
    assert f"{job_id}/manifest.json" in saved

    with_dense = client.get(f"/v1/jobs/{job_id}/model.tar", params={"include": "dense"})
    with tarfile.open(fileobj=io.BytesIO(with_dense.content)) as tar:
        assert tar.extractfile(f"{job_id}/dense/model.safetensors").read() == files["dense/model.safetensors"]
    assert any_store_api.client("team-b").get(f"/v1/jobs/{job_id}/model.tar").status_code == 404
