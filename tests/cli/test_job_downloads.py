"""`ftc jobs download` and `ftc jobs retry` against a running API: the model folder by default,
checked against the manifest, written atomically; on S3 through presigned links, locally through
the API."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from service.store import open_store
from service.store.layout import checkpoint_name, job_prefix
from tests.cli.test_service_commands import ftc
from tests.support.service import JOB_REQUEST, TEAM_KEYS, Api

MODEL_FILES = {
    "model.safetensors": b"\x00\x01" * 3000,
    "config.json": b'{"model_type": "ftc_llama"}',
    "tokenizer.json": b"{}",
}
RECORD_FILES = {"metrics.json": b'{"perplexity": {"wikitext2": {"ppl": 31.2}}}', "log.txt": b"layer 1 done\n"}
DENSE_FILES = {"dense/model.safetensors": b"\x02" * 5000, "dense/config.json": b"{}"}
CHECKPOINTS = {checkpoint_name(0): b"layer zero", checkpoint_name(1): b"layer one"}


@pytest.fixture(params=["local", "s3"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def cli_api(store_kind: str, api_factory: Callable[..., Api], monkeypatch: pytest.MonkeyPatch) -> Api:
    """The API on a local-folder store and on S3 (moto over HTTP), the CLI pointed at it."""
    api = api_factory(store_kind)
    monkeypatch.setenv("FTC_API_URL", api.base_url)
    monkeypatch.setenv("FTC_API_KEY", TEAM_KEYS["team-a"])
    return api


def finished_job(api: Api, status: str = "succeeded", files: dict[str, bytes] | None = None) -> str:
    """A job the way a worker leaves it: files in the store, the manifest (with sizes and sha256) last."""
    job_id = api.client().post("/v1/jobs", json=JOB_REQUEST).json()["id"]

    async def work(services) -> None:
        await services.queue.claim("w1", block_ms=0)
        await services.jobs.finish(job_id, "w1", status, None if status == "succeeded" else "out of memory")

    api.run(work)
    store = open_store(api.settings.store_url, api.settings.s3_endpoint_url)
    prefix = job_prefix("team-a", job_id)
    files = MODEL_FILES | RECORD_FILES | DENSE_FILES | CHECKPOINTS if files is None else files
    for name, data in files.items():
        store.put_bytes(prefix + name, data)
    if status == "succeeded":
        table = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                 for name, data in files.items() if not name.startswith("checkpoints/") and name != "log.txt"}
        store.finalise(prefix, {"method": "ftc", "files": table})
    return job_id


def test_download_saves_the_model_folder_ready_to_load(cli_api: Api, capsys, tmp_path: Path) -> None:
    job_id = finished_job(cli_api)
    target = tmp_path / "downloads" / "model"
    assert ftc("jobs", "download", job_id, "--to", str(target)) == 0
    out, err = capsys.readouterr()
    expected = MODEL_FILES | RECORD_FILES
    assert sorted(p.name for p in target.iterdir()) == sorted([*expected, "manifest.json"])
    assert all((target / name).read_bytes() == data for name, data in expected.items())
    assert out.startswith(f"{target} (6 files, ") and "load it: AutoModelForCausalLM.from_pretrained" in err
    assert [p.name for p in target.parent.iterdir()] == ["model"]  # no partial folder left beside it

    everything = tmp_path / "everything"
    assert ftc("jobs", "download", job_id, "--to", str(everything), "--include", "dense,checkpoints") == 0
    capsys.readouterr()
    names = {str(p.relative_to(everything)) for p in everything.rglob("*") if p.is_file()}
    assert names == {*expected, "manifest.json", *DENSE_FILES, *CHECKPOINTS}


def test_a_download_that_disagrees_with_the_manifest_writes_nothing(cli_api: Api, capsys, tmp_path: Path) -> None:
    job_id = finished_job(cli_api)
    store = open_store(cli_api.settings.store_url, cli_api.settings.s3_endpoint_url)
    store.put_bytes(job_prefix("team-a", job_id) + "model.safetensors", b"\x00\x01" * 2999 + b"\x00\x02")
    target = tmp_path / "downloads" / "model"
    assert ftc("jobs", "download", job_id, "--to", str(target)) == 2
    err = capsys.readouterr().err
    assert "model.safetensors does not match the manifest's sha256" in err and err.count("\n") == 1
    assert list(target.parent.iterdir()) == []


@pytest.mark.parametrize("store_kind", ["local"])
def test_download_refuses_what_it_cannot_do_in_one_line(cli_api: Api, capsys, tmp_path: Path) -> None:
    failed = finished_job(cli_api, status="failed", files=RECORD_FILES)
    done = finished_job(cli_api, files=MODEL_FILES)
    running = cli_api.client().post("/v1/jobs", json={**JOB_REQUEST, "ratio": 0.5}).json()["id"]
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    cases = [
        (["jobs", "download", running], f"job {running} is queued and its model is not complete; follow it with: "
                                        f"ftc jobs watch {running}"),
        (["jobs", "download", failed], f"resubmit it with: ftc jobs retry {failed}"),
        (["jobs", "download", done, "--include", "dense"], "has no dense export; submit with --outputs"),
        (["jobs", "download", done, "--to", str(occupied)], "exists and is not empty; pass --overwrite"),
    ]
    for argv, words in cases:
        assert ftc(*argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and err.startswith("ftc: error: ") and err.count("\n") == 1, err
    assert (occupied / "keep.txt").read_text() == "mine"
    assert ftc("jobs", "download", done, "--to", str(occupied), "--overwrite", "--quiet") == 0
    assert not (occupied / "keep.txt").exists() and (occupied / "model.safetensors").is_file()


@pytest.mark.parametrize("store_kind", ["local"])
def test_retry_resubmits_a_failed_job_once_and_refuses_a_live_one(cli_api: Api, capsys) -> None:
    failed = finished_job(cli_api, status="failed", files=RECORD_FILES)
    assert ftc("jobs", "retry", failed) == 0
    out, err = capsys.readouterr()
    retried = json.loads(out)
    assert retried["id"] != failed and retried["status"] == "queued"
    assert retried["request"] == cli_api.client().get(f"/v1/jobs/{failed}").json()["request"]
    assert err.strip() == f"next: ftc jobs watch {retried['id']}, then: ftc jobs download {retried['id']}"
    assert ftc("jobs", "retry", failed) == 0  # retried twice: the live retry, not a third job
    assert json.loads(capsys.readouterr().out)["id"] == retried["id"]
    assert ftc("jobs", "retry", retried["id"]) == 2
    assert "409: job " + retried["id"] + " is queued: nothing to retry" in capsys.readouterr().err


@pytest.mark.parametrize("store_kind", ["local"])
def test_files_lists_the_model_first_and_counts_the_checkpoints(cli_api: Api, capsys) -> None:
    job_id = finished_job(cli_api)
    assert ftc("jobs", "files", job_id) == 0
    lines = capsys.readouterr().out.splitlines()
    headings = [line for line in lines if line.startswith("#")]
    assert headings[:3] == ["# the compressed model (ftc jobs download JOB_ID fetches these, with the record)",
                            "# its dense export (--include dense)", "# the job's record"]
    assert headings[3].startswith("# 2 checkpoint files, 19 B")
    assert "   5.9 KiB  model.safetensors" in lines and "      13 B  log.txt" in lines
    assert not [line for line in lines if "checkpoints/" in line]
    assert ftc("jobs", "files", job_id, "--include-checkpoints") == 0
    assert "      10 B  checkpoints/layer-000.safetensors" in capsys.readouterr().out.splitlines()
