"""The worker's parts one at a time: checkpoint mirroring, inputs, progress, errors, placement, CLI."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from botocore.awsrequest import AWSResponse

from ftc.options import InputError
from service.ids import new_id
from service.retry import RetryPolicy
from service.schemas import JobRequest
from service.store import LocalStore, ObjectStore, S3Store, StoreUnavailable
from service.store.layout import checkpoint_name, job_prefix, upload_key
from service.uploads import upload_uri
from tests.support.service import JOB_REQUEST, S3_BUCKET
from workers.checkpoints import CheckpointSync, finished_layers
from workers.inputs import compress_options, local_dataset, model_spec
from workers.job import MAX_REASON_CHARS, summarise
from workers.joblog import JobLog
from workers.progress import ProgressClock
from workers.settings import WorkerSettings
from workers.supervisor import Placement, PlacementError, place

REPO = Path(__file__).resolve().parents[2]
PREFIX = job_prefix("team-a", "job_0123")


class RecordingStore(LocalStore):
    """A local store that remembers the order of writes and deletes."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls: list[tuple[str, str]] = []

    def put_file(self, key, path, content_type=None):
        self.calls.append(("put", key.rsplit("/", 1)[-1]))
        super().put_file(key, path, content_type)

    def delete(self, key):
        self.calls.append(("delete", key.rsplit("/", 1)[-1]))
        super().delete(key)


def write_layer(folder: Path, index: int) -> None:
    """What the library leaves in its work folder after layer `index` (older streams removed)."""
    (folder / f"layer-{index:03d}.safetensors").write_bytes(b"tensors %d" % index)
    (folder / f"layer-{index:03d}.json").write_text("{}")
    (folder / f"stream-{index:03d}.safetensors").write_bytes(b"stream %d" % index)
    for old in folder.glob("stream-*.safetensors"):
        if old.name != f"stream-{index:03d}.safetensors":
            old.unlink()


# --- checkpoints -------------------------------------------------------------------------------------


def test_checkpoints_go_up_in_commit_order_and_superseded_streams_are_dropped(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path / "store")
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "fingerprint.json").write_text("{}")
    sync = CheckpointSync(store, PREFIX, folder)
    write_layer(folder, 0)
    sync.push()
    assert store.calls == [
        ("put", "fingerprint.json"),
        ("put", "stream-000.safetensors"),
        ("put", "layer-000.safetensors"),
        ("put", "layer-000.json"),  # last: its presence makes the layer count as finished
    ]
    store.calls.clear()
    write_layer(folder, 1)
    (folder / ".layer-002.safetensors.tmp").write_bytes(b"half")  # a write in progress stays local
    (folder / "extra-abc.safetensors").write_bytes(b"embeddings")  # re-read from the model instead
    assert sync.push() == ["stream-001.safetensors", "layer-001.safetensors", "layer-001.json"]
    assert store.calls[-1] == ("delete", "stream-000.safetensors"), "the old stream goes only after the new entry"
    assert sync.push() == [], "nothing changed, nothing sent"
    keys = [info.key[len(PREFIX) :] for info in store.list(PREFIX)]
    assert keys == [
        "checkpoints/fingerprint.json",
        "checkpoints/layer-000.json",
        checkpoint_name(0),
        "checkpoints/layer-001.json",
        checkpoint_name(1),
        "checkpoints/stream-001.safetensors",
    ]


def test_a_fresh_folder_is_restored_from_the_store_up_to_the_last_committed_layer(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    first = tmp_path / "first"
    first.mkdir()
    sync = CheckpointSync(store, PREFIX, first)
    for index in range(3):
        write_layer(first, index)
        sync.push()
    # A worker killed between uploads: layer 3's tensors are up, its entry is not.
    store.put_bytes(PREFIX + checkpoint_name(3), b"tensors 3")
    restored = CheckpointSync(store, PREFIX, tmp_path / "second")
    assert restored.restore() == 3
    names = sorted(path.name for path in (tmp_path / "second").iterdir())
    assert "stream-002.safetensors" in names and "layer-002.json" in names
    assert (tmp_path / "second" / "layer-001.safetensors").read_bytes() == b"tensors 1"
    assert restored.push() == [], "restored files are not sent back"
    restored.drop_streams()
    assert not [info for info in store.list(PREFIX) if "stream-" in info.key]


def test_a_layer_is_finished_only_with_both_its_files_and_all_before_it() -> None:
    assert finished_layers({"layer-000.json", "layer-000.safetensors", "layer-001.safetensors"}) == 1
    assert finished_layers({"layer-001.json", "layer-001.safetensors"}) == 0
    assert finished_layers(set()) == 0


# --- inputs ------------------------------------------------------------------------------------------


def test_models_are_aliases_or_folders_and_files_under_the_models_dir(tmp_path: Path) -> None:
    (tmp_path / "org" / "folder-model").mkdir(parents=True)
    (tmp_path / "org" / "file-model.gguf").write_bytes(b"GGUF")
    (tmp_path / "org" / "folder-model@v2").mkdir()
    assert model_spec("smollm2-135m", None, None) == "smollm2-135m"
    assert model_spec("org/folder-model", None, str(tmp_path)) == str(tmp_path / "org" / "folder-model")
    assert model_spec("org/file-model", None, str(tmp_path)) == str(tmp_path / "org" / "file-model.gguf")
    assert model_spec("org/folder-model", "v2", str(tmp_path)) == str(tmp_path / "org" / "folder-model@v2")
    # not under the models folder (or no folder): a hub id, resolved from the Hugging Face cache
    assert model_spec("org/other", None, str(tmp_path)) == "org/other"
    assert model_spec("org/folder-model", "main", None) == "org/folder-model@main"
    with pytest.raises(InputError, match="has no revisions"):
        model_spec("smollm2-135m", "main", None)
    for path in ("../etc", "/etc/passwd", "org/../../etc"):
        with pytest.raises(InputError, match="not a path"):
            model_spec(path, None, str(tmp_path))


def test_uploaded_datasets_are_downloaded_once_keeping_their_suffix(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    upload_id = new_id("upl")
    key = upload_key("team-a", upload_id, "calib.jsonl")
    store.put_bytes(key, b'{"text": "hello"}\n')
    name = upload_uri(upload_id, "calib.jsonl")
    cache = tmp_path / "cache"
    assert local_dataset(store, "wikitext2", cache, "team-a") == "wikitext2"
    local = local_dataset(store, name, cache, "team-a")
    assert local.endswith("calib.jsonl") and Path(local).read_bytes() == b'{"text": "hello"}\n'
    assert local_dataset(store, store.uri(key), cache, "team-a").endswith("calib.jsonl")  # as answers named it before
    store.delete(key)
    assert local_dataset(store, name, cache, "team-a") == local, "cached: the same path on every attempt"
    with pytest.raises(InputError, match="no longer in the object store"):
        local_dataset(store, upload_uri(new_id("upl"), "gone.txt"), cache, "team-a")
    with pytest.raises(InputError, match="no longer in the object store"):  # another team's: not found for this one
        local_dataset(store, name, tmp_path / "other-cache", "team-b")
    for elsewhere in ("s3://elsewhere/calib.txt", store.uri(key), "upload://job_x/calib.txt"):
        team = "team-b" if elsewhere == store.uri(key) else "team-a"
        with pytest.raises(InputError, match="not one of this team's uploads"):
            local_dataset(store, elsewhere, cache, team)


# --- progress, errors, log ---------------------------------------------------------------------------


def test_the_eta_counts_only_layers_computed_in_this_attempt() -> None:
    now = [100.0]
    clock = ProgressClock(now=lambda: now[0])
    now[0] += 5  # preparing
    start = clock.start_layers(10, first=4)
    assert (start.layer, start.layers, start.stage, start.eta_seconds) == (4, 10, "compressing", None)
    now[0] += 6
    progress = clock.layer_done(6)  # two layers in 6 s: 3 s each, four to go
    assert progress.eta_seconds == pytest.approx(12.0)
    assert progress.elapsed_seconds == pytest.approx(11.0)
    assert clock.stage("evaluating").layer == 6


def test_failure_reasons_are_one_readable_line() -> None:
    assert summarise(InputError("ratio must be in (0, 1]; got 1.5")) == "ratio must be in (0, 1]; got 1.5"
    reason = summarise(RuntimeError("CUDA out of memory\nmore details"))
    assert reason == "RuntimeError: CUDA out of memory (details in log.txt)"
    assert len(summarise(ValueError("x" * 5000))) == MAX_REASON_CHARS
    assert summarise(KeyError()) == "KeyError (details in log.txt)"


def test_the_job_log_continues_the_log_of_earlier_attempts(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put_bytes(PREFIX + "log.txt", b"attempt 1 was here\n")
    with JobLog(store, PREFIX, tmp_path / "log.txt") as job_log:
        logging.getLogger("workers.test").info("attempt 2 says hello")
        job_log.upload()
    text = store.get_bytes(PREFIX + "log.txt").decode()
    assert text.startswith("attempt 1 was here\n") and text.rstrip().endswith("attempt 2 says hello")


def test_a_log_upload_during_an_outage_does_not_fail_the_job(tmp_path: Path) -> None:
    class DownStore(LocalStore):
        def put_file(self, key, path, content_type=None):
            raise StoreUnavailable("object store unavailable: upload failed 5 times")

    store: ObjectStore = DownStore(tmp_path / "store")
    with JobLog(store, PREFIX, tmp_path / "log.txt") as job_log:
        job_log.upload()
    assert "could not upload the job log" in (tmp_path / "log.txt").read_text()


# --- placement and the command -----------------------------------------------------------------------


def test_one_actor_per_gpu_or_cpu_actors_without_gpus() -> None:
    auto = WorkerSettings(device="auto", cpus_per_worker=2)
    assert place(auto, None, 4.0) == Placement(4, "cuda", {"num_gpus": 1, "num_cpus": 2})
    assert place(auto, None, 0.0).device == "cpu" and place(auto, None, 0.0).count == 1
    assert place(auto, 3, 0.0).resources == {"num_gpus": 0, "num_cpus": 2}
    assert place(WorkerSettings(device="cpu"), None, 8.0).device == "cpu"
    assert place(WorkerSettings(device="cuda"), 2, 0.0).count == 2, "may wait for GPU nodes to be added"
    with pytest.raises(PlacementError, match="no GPU"):
        place(WorkerSettings(device="cuda"), None, 0.0)
    with pytest.raises(PlacementError, match="at least 1"):
        place(auto, 0, 1.0)


def test_the_worker_command_loads_neither_ray_nor_torch_until_it_runs() -> None:
    code = (
        "import sys, cli.main; cli.main.build_parser();"
        "print(sorted(m for m in ('ray', 'torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    usage = subprocess.run(
        [sys.executable, "-m", "cli", "worker", "--help"], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert "--num-workers" in usage.stdout


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--num-workers", "0"], {}, "--num-workers must be at least 1"),
        ([], {"FTC_STORE_URL": "ftp://nowhere"}, "use a folder path or s3://bucket/prefix"),
        ([], {"FTC_CPUS_PER_WORKER": "0"}, "cpus_per_worker"),
        ([], {"FTC_TEAMS": '{"team-a": {"weight": 0}}'}, "FTC_TEAMS: team 'team-a': weight"),
    ],
)
def test_unusable_worker_settings_end_with_one_line_and_code_2(args: list[str], env: dict, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cli", "worker", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr and result.stderr.startswith("ftc: error:")


# --- uploads -----------------------------------------------------------------------------------------


class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_kwargs):
        yield self.data


def test_a_checkpoint_upload_answered_503_is_retried(moto_server) -> None:
    """boto3's upload_file wraps a 5xx answer in S3UploadFailedError; it must still count as transient."""
    store = S3Store(S3_BUCKET, uuid.uuid4().hex, endpoint_url=moto_server.url,
                    retry=RetryPolicy(store_attempts=3, store_backoff_seconds=0.01))
    unavailable = [2]

    def answer_503(request, **_kwargs):
        if unavailable[0] and request.method == "PUT":
            unavailable[0] -= 1
            body = b"<Error><Code>ServiceUnavailable</Code><Message>restarting</Message></Error>"
            return AWSResponse(request.url, 503, {}, _Body(body))
        return None

    store.client.meta.events.register("before-send.s3.PutObject", answer_503)
    with tempfile.NamedTemporaryFile() as layer:
        layer.write(b"tensors")
        layer.flush()
        store.put_file(PREFIX + checkpoint_name(0), Path(layer.name))
    assert unavailable == [0], "both 503 answers were seen"
    assert store.get_bytes(PREFIX + checkpoint_name(0)) == b"tensors"


def test_the_job_request_reaches_the_library_options_allocation_scope_and_dtype_included() -> None:
    request = JobRequest.model_validate({**JOB_REQUEST, "allocation": "global", "ablate": ["no_anchor"]})
    options = compress_options(request, "smollm2-135m", "wikitext2", "cpu")
    assert (options.allocation, options.ablate, options.ratio) == ("global", ("no_anchor",), request.ratio)
    whole = JobRequest.model_validate({**JOB_REQUEST, "scope": "model", "dtype": "bfloat16"})
    options = compress_options(whole, "smollm2-135m", "wikitext2", "cpu")
    assert (options.scope, options.dtype, options.allocation) == ("model", "bfloat16", whole.allocation)
