"""Real servers for tests and benchmarks: redis-server, moto's S3 server and the API, each on a free port.

Every process started here is recorded and stopped at interpreter exit as well, so a failing test
or an interrupted run does not leave servers behind. Nothing here depends on pytest.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

START_TIMEOUT_SECONDS = 20.0
_started: list[ServerProcess] = []


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(ready: Callable[[], bool], what: str, timeout: float = START_TIMEOUT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not become ready within {timeout:.0f} s")


@dataclass
class ServerProcess:
    """A server subprocess in its own process group (so its children stop with it)."""

    name: str
    command: list[str]
    port: int
    workdir: Path
    env: dict[str, str] | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self, ready: Callable[[], bool]) -> ServerProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                cwd=self.workdir,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if self not in _started:
            _started.append(self)
        try:
            wait_until(lambda: self._alive() and ready(), f"{self.name} on port {self.port}")
        except TimeoutError:
            self.stop()
            raise TimeoutError(f"{self.name} failed to start; log:\n{self.log_tail()}") from None
        return self

    def _alive(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited; log:\n{self.log_tail()}")
        return True

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def _signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (a clean shutdown: Redis flushes its AOF), then SIGKILL if it lingers."""
        if self.process is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to flush anything."""
        if self.process is not None:
            self._signal(signal.SIGKILL)
            self.process.wait(10)


def _stop_all() -> None:
    for server in reversed(_started):
        with contextlib.suppress(Exception):
            server.stop(timeout=5)


atexit.register(_stop_all)


# --- Redis -----------------------------------------------------------------------------------------


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


@dataclass
class RedisServer:
    server: ServerProcess

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.server.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True, socket_timeout=5)

    def _ping(self) -> bool:
        with self.client() as client:
            return bool(client.ping())

    def start(self) -> RedisServer:
        self.server.start(self._ping)
        return self

    def stop(self) -> None:
        self.server.stop()

    def kill(self) -> None:
        self.server.kill()

    def restart(self) -> RedisServer:
        """Start again on the same port and folder, reloading the AOF when persistence is on."""
        return self.start()


def start_redis(
    workdir: Path, *, appendonly: bool = False, fsync: str = "always", port: int | None = None
) -> RedisServer:
    """redis-server on a free port, data in `workdir`. With `appendonly` every write goes to the AOF,
    fsynced per `fsync`: "always" (the default) loses no acknowledged write even to a SIGKILL,
    "everysec" up to a second of them."""
    binary = redis_server_binary()
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (make setup installs it)")
    port = port or free_port()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir)]
    command += ["--save", "", "--protected-mode", "no", "--daemonize", "no", "--databases", "4"]
    command += ["--appendonly", "yes", "--appendfsync", fsync] if appendonly else ["--appendonly", "no"]
    return RedisServer(ServerProcess("redis", command, port, workdir)).start()


# --- S3 (moto in server mode) ------------------------------------------------------------------------

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class MotoServer:
    server: ServerProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        self.server.stop()

    def create_bucket(self, bucket: str) -> None:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        client.create_bucket(Bucket=bucket)


def start_moto(workdir: Path, port: int | None = None) -> MotoServer:
    """moto's S3-compatible HTTP server as a subprocess; clients reach it with boto3 over HTTP."""
    port = port or free_port()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    env = {**os.environ, **S3_ENV}
    server = MotoServer(ServerProcess("moto", command, port, workdir, env=env))
    server.server.start(lambda: httpx.get(f"{server.url}/moto-api/", timeout=1).status_code < 500)
    return server


# --- The API ---------------------------------------------------------------------------------------


def start_api(workdir: Path, env: dict[str, str], *, workers: int = 1, port: int | None = None) -> ServerProcess:
    """The API (`python -m api.server`, as `ftc serve` runs it) as a subprocess configured by FTC_* in `env`."""
    port = port or free_port()
    command = [sys.executable, "-m", "api.server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--workers", str(workers), "--log-level", "warning"]
    repo = str(Path(__file__).resolve().parents[2])
    full_env = {**os.environ, **env, "PYTHONPATH": repo}
    server = ServerProcess("api", command, port, workdir, env=full_env)
    return server.start(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200)


@contextlib.contextmanager
def serve_in_thread(app, port: int | None = None) -> Iterator[str]:
    """Run an ASGI app under uvicorn in a background thread; yields its base URL.

    Real HTTP (streaming included) at the cost of milliseconds, so each test can have its own app.
    A connection still open at the end (a dashboard page's event stream) is closed after
    `timeout_graceful_shutdown` seconds: without it the stop waited out the whole `join` (15 s a test).
    """
    import uvicorn

    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, f"in-thread API on port {port}")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


# --- A network link that can be cut -----------------------------------------------------------------


class TcpRelay:
    """Relays 127.0.0.1:`port` to `target_port`; until `open()` and after `close()` nothing listens,
    which is how tests make a server unreachable without stopping it."""

    def __init__(self, target_port: int, port: int | None = None) -> None:
        self.target_port = target_port
        self.port = port or free_port()
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []

    def open(self) -> TcpRelay:
        listener = socket.create_server(("127.0.0.1", self.port))
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def close(self) -> None:
        for sock in [self._listener, *self._sockets]:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self._listener, self._sockets = None, []

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
