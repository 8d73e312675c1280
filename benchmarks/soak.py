"""Soak under faults: three teams' jobs through the whole stack while its parts are killed, again and again.

Starts the real stack on this machine: redis-server with the append-only file (fsync per write),
moto's S3 server (reached through a relay that can close its port), the API (`python -m api.server`)
and two `ftc worker` processes (one Ray actor each) on a tiny model. Three teams submit small jobs
(team-a in two bursts, at the start and when the faults stop, at most 60 queued at once by its
quota; team-b and team-c a few at a time over the whole run) while, for the first --minutes, a
fault is injected every few seconds, in turn:

    redis       kill -9 of redis-server, restarted from its append-only file 3 s later
    s3_refused  the S3 server unreachable for 30 s (its port closed: connections refused, open ones cut)
    s3_paused   the S3 server stopped for 30 s (SIGSTOP, then SIGCONT: requests hang, then answer)
    worker      kill -9 of every process of one `ftc worker` (Ray included), restarted at once
    actor       kill -9 of one worker's Ray actor (its supervisor starts another)
    api_kill    kill -9 of the API, restarted
    api_term    SIGTERM of the API (a rolling restart), restarted

moto keeps its objects in memory only, so "stopped" is a closed port or a paused process, never a
killed one. Clients retry what the API refuses (503, connection errors; 429 after Retry-After) with
the same Idempotency-Key, as a careful client does.

At the end every accepted job must have succeeded exactly once (one `succeeded` event, one write
of its manifest: successful PUTs counted in moto's access log), with metrics and an artifact that `load_artifact`
opens. Reported: jobs, faults, retries, and per team the wait from submission to the first start
(p50/p99), over all jobs and over those whose wait met no fault, against two job durations.

    .venv/bin/python benchmarks/soak.py                                  # >= 10 min, 210 jobs
    .venv/bin/python benchmarks/soak.py --minutes 1 --jobs 20 --s3-seconds 10 --out-dir /tmp/soak-smoke  # smoke

Writes benchmarks/results/soak.{json,md} (or into --out-dir). Exits 1 when a job was lost, ran to
completion twice or left no loadable artifact, or (at full size) when fewer than 200 jobs or 20
faults made the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.servers import (  # noqa: E402
    S3_ENV,
    MotoServer,
    RedisServer,
    ServerProcess,
    TcpRelay,
    free_port,
    start_api,
    start_moto,
    start_redis,
    wait_until,
)
from tests.support.workers import WorkerProcess, worker_job_request  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
TEAMS = ("team-a", "team-b", "team-c")
KEYS = {team: f"soak-key-{team}-0123456789" for team in TEAMS}
BURST_TEAM, BURST_SHARE = "team-a", 0.6
BURST_QUEUED_LIMIT = 60
"""team-a's queued-jobs quota: its burst meets 429s and comes back after Retry-After."""
BUCKET, PREFIX, MODEL = "ftc-soak", "soak", "tiny/soak-2x32"
LEASE_SECONDS = 10
MAX_ATTEMPTS = 8
"""Deliveries one job may take: a job can meet several faults; each attempt resumes from checkpoints."""
FAULTS = ("redis", "s3_refused", "worker", "api_kill", "redis", "s3_paused", "actor", "api_term")
REDIS_DOWN_SECONDS = 3.0
FULL_SIZE = {"minutes": 10, "jobs": 200, "faults": 20}
SPREAD = 1.4
"""team-b's and team-c's jobs arrive over this many times the faults' time: the last ones in a quiet tail."""
FAIR_WAIT_DURATIONS = 2.0
"""The fairness target: a team's job starts within this many job durations (p99), whatever team-a queued."""


# --- the stack -------------------------------------------------------------------------------------------


def make_model(models_dir: Path) -> None:
    """A 2-layer Llama-style model of hidden size 32 with SmolLM2's tokenizer and tied embeddings
    (the vocabulary dominates its size: about 6 MB, so moto holds a few hundred in memory)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftc.models.registry import resolve_model
    from tests.support.tiny import tiny_config

    source = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    config = tiny_config("gqa", vocab_size=len(tokenizer), layers=2, hidden=32)
    config.tie_word_embeddings = True
    import torch

    torch.manual_seed(0)
    folder = models_dir / MODEL
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@dataclass
class Fault:
    kind: str
    started: float
    ended: float | None = None
    detail: str = ""


@dataclass
class Stack:
    """Every process of the soak, and how to break and mend each."""

    workdir: Path
    redis: RedisServer | None = None
    moto: MotoServer | None = None
    relay: TcpRelay | None = None
    api: ServerProcess | None = None
    api_port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    workers: dict[int, WorkerProcess | None] = field(default_factory=dict)
    restarts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def start(self, worker_count: int) -> None:
        self.redis = start_redis(self.workdir / "redis", appendonly=True, fsync="always")
        os.environ.update(S3_ENV)
        self.moto = start_moto(self.workdir / "moto")
        self.moto.create_bucket(BUCKET)  # not versioned: manifest writes are counted in moto's access log
        self.relay = TcpRelay(self.moto.server.port).open()
        models = self.workdir / "models"
        make_model(models)
        self.env = {
            **S3_ENV,
            "FTC_API_KEYS": ",".join(f"{key}:{team}" for team, key in KEYS.items()),
            "FTC_TEAMS": json.dumps({BURST_TEAM: {"queued_jobs": BURST_QUEUED_LIMIT}}),
            "FTC_REDIS_URL": self.redis.url,
            "FTC_KEY_PREFIX": PREFIX,
            "FTC_STORE_URL": f"s3://{BUCKET}/{PREFIX}",
            "FTC_S3_ENDPOINT_URL": f"http://127.0.0.1:{self.relay.port}",
            "FTC_LEASE_SECONDS": str(LEASE_SECONDS),
            "FTC_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
            "FTC_JANITOR_INTERVAL_SECONDS": "2",
            "FTC_STORE_RETRIES": "10",
            "FTC_STORE_BACKOFF_SECONDS": "0.5",
            "FTC_STORE_BACKOFF_MAX_SECONDS": "8",
            "FTC_MODELS_DIR": str(models),
        }
        self.api_port = free_port()
        self.api = start_api(self.workdir / "api", self.env, port=self.api_port)
        starting = [threading.Thread(target=self.start_worker, args=(n,)) for n in range(worker_count)]
        for thread in starting:
            thread.start()
        for thread in starting:
            thread.join()
        if not all(self.workers.values()):
            raise RuntimeError("a worker did not start; see its log under " + str(self.workdir))

    def s3(self) -> Any:
        """A client straight to moto (not through the relay)."""
        import boto3

        assert self.moto is not None
        return boto3.client("s3", endpoint_url=self.moto.url, region_name="us-east-1")

    def manifest_writes(self) -> dict[str, int]:
        """Successful PUTs of each job's `manifest.json`, from moto's access log (moto is never
        restarted, so the log holds every request it answered)."""
        assert self.moto is not None
        pattern = re.compile(rf'"PUT /{BUCKET}/{PREFIX}/[^/]+/jobs/([^/]+)/manifest\.json HTTP/[0-9.]+" 200 ')
        writes: dict[str, int] = {}
        for match in pattern.finditer(self.moto.server.log_path.read_text(errors="replace")):
            writes[match.group(1)] = writes.get(match.group(1), 0) + 1
        return writes

    def moto_peak_bytes(self) -> int | None:
        """moto's high-water resident memory (`VmHWM`), read from /proc while it runs."""
        with contextlib.suppress(Exception):
            assert self.moto is not None and self.moto.server.process is not None
            status = Path(f"/proc/{self.moto.server.process.pid}/status").read_text()
            return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) * 1024
        return None

    def start_worker(self, slot: int) -> WorkerProcess | None:
        with self.lock:
            self.restarts += 1
            name = f"worker-{slot}-{self.restarts}"  # a fresh log: readiness is read from it
        env = {**os.environ, **self.env, "FTC_WORK_DIR": str(self.workdir / name), "PYTHONPATH": str(REPO)}
        env.pop("RAY_ADDRESS", None)
        command = [sys.executable, "-m", "cli", "worker", "--num-workers", "1", "--device", "cpu"]
        try:
            worker = WorkerProcess(name, command, env, self.workdir / "workers").start()
        except (TimeoutError, RuntimeError) as error:
            print(f"soak: {name} did not start: {error}", file=sys.stderr, flush=True)
            worker = None
        self.workers[slot] = worker
        return worker

    def restart_api(self, kill: bool) -> None:
        assert self.api is not None
        self.api.kill() if kill else self.api.stop()
        self.api.start(lambda: httpx.get(f"{self.api_url}/healthz", timeout=1).status_code == 200)

    def stop(self) -> None:
        for worker in self.workers.values():
            if worker is not None:
                with contextlib.suppress(Exception):
                    worker.stop(timeout=30)
        for server in (self.api, self.moto, self.redis):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
        if self.relay is not None:
            self.relay.close()


class Injector:
    """Injects FAULTS in turn, `gap` seconds apart, until stopped; each fault is mended before the next."""

    def __init__(self, stack: Stack, gap: float, s3_seconds: float) -> None:
        self.stack = stack
        self.gap = gap
        self.s3_seconds = s3_seconds
        self.faults: list[Fault] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="faults", daemon=True)
        self.turn = 0
        self.menders: list[threading.Thread] = []
        """Threads still bringing a killed worker (or actor) back; waited for before the stack stops."""

    def _mend(self, work: Any) -> None:
        thread = threading.Thread(target=work, daemon=True)
        self.menders.append(thread)
        thread.start()

    def join(self, timeout: float) -> None:
        self.stopping.set()
        self.thread.join(timeout)
        for thread in self.menders:
            thread.join(timeout)

    def _run(self) -> None:
        while not self.stopping.wait(self.gap):
            kind = FAULTS[self.turn % len(FAULTS)]
            self.turn += 1
            fault = Fault(kind, time.time())
            try:
                done = getattr(self, f"_{kind}")(fault)
            except Exception as error:  # a fault that could not be injected is reported, not fatal
                fault.detail = f"not injected: {error!r}"
                done = False
            if done:
                self.faults.append(fault)
                print(f"soak: fault {len(self.faults)}: {kind} {fault.detail}", flush=True)

    def _redis(self, fault: Fault) -> bool:
        server = self.stack.redis
        assert server is not None
        server.kill()
        time.sleep(REDIS_DOWN_SECONDS)
        server.restart()
        fault.ended = time.time()
        return True

    def _s3_refused(self, fault: Fault) -> bool:
        relay = self.stack.relay
        assert relay is not None
        relay.close()
        time.sleep(self.s3_seconds)
        relay.open()
        fault.ended = time.time()
        return True

    def _s3_paused(self, fault: Fault) -> bool:
        moto = self.stack.moto
        assert moto is not None and moto.server.process is not None
        os.killpg(moto.server.process.pid, signal.SIGSTOP)
        try:
            time.sleep(self.s3_seconds)
        finally:
            os.killpg(moto.server.process.pid, signal.SIGCONT)
        fault.ended = time.time()
        return True

    def _ready_slots(self) -> list[int]:
        return [slot for slot, worker in self.stack.workers.items() if worker is not None]

    def _worker(self, fault: Fault) -> bool:
        ready = self._ready_slots()
        if len(ready) < 2:  # the other is still restarting: keep one worker alive
            return self._actor(fault)
        slot = random.choice(ready)
        worker = self.stack.workers[slot]
        assert worker is not None
        self.stack.workers[slot] = None
        worker.kill()
        fault.detail = worker.name

        def restart() -> None:
            self.stack.start_worker(slot)
            fault.ended = time.time()

        self._mend(restart)
        return True

    def _actor(self, fault: Fault) -> bool:
        for slot in self._ready_slots():
            worker = self.stack.workers[slot]
            pids = worker.actor_pids() if worker is not None else []
            if worker is not None and pids:
                fault.kind = "actor"
                os.kill(pids[0], signal.SIGKILL)
                fault.detail = f"{worker.name} pid {pids[0]}"

                def replaced(worker: WorkerProcess = worker, killed: int = pids[0]) -> None:
                    with contextlib.suppress(TimeoutError, RuntimeError):
                        wait_until(lambda: bool(set(worker.actor_pids()) - {killed}), "a new actor", 180)
                    fault.ended = time.time()

                self._mend(replaced)
                return True
        return False

    def _api_kill(self, fault: Fault) -> bool:
        self.stack.restart_api(kill=True)
        fault.ended = time.time()
        return True

    def _api_term(self, fault: Fault) -> bool:
        self.stack.restart_api(kill=False)
        fault.ended = time.time()
        return True


# --- the teams -----------------------------------------------------------------------------------------


@dataclass
class Submission:
    team: str
    index: int
    due: float
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    job_id: str | None = None
    first_try: float | None = None
    accepted_at: float | None = None
    tries: int = 0
    refusals: dict[str, int] = field(default_factory=dict)


def plan(jobs: int, seconds: float, started: float) -> dict[str, list[Submission]]:
    """team-a's share in two bursts, at the start and when the faults stop (so it has a backlog in
    the quiet tail of the run too); the other teams' jobs evenly over SPREAD x the faults' time."""
    burst = round(jobs * BURST_SHARE)
    others = [t for t in TEAMS if t != BURST_TEAM]
    shares = {BURST_TEAM: burst} | {
        t: (jobs - burst) // len(others) + (i < (jobs - burst) % len(others)) for i, t in enumerate(others)
    }
    planned, index = {}, 0
    for team, count in shares.items():
        if team == BURST_TEAM:
            dues = [started + (0 if n < count // 2 else seconds) for n in range(count)]
        else:
            dues = [started + n * SPREAD * seconds / max(count, 1) for n in range(count)]
        planned[team] = [Submission(team, index + n, due) for n, due in enumerate(dues)]
        index += count
    return planned


class Submitter:
    """One team's client: submits its jobs when due, retrying until each is accepted."""

    def __init__(self, stack: Stack, submissions: list[Submission], refusal_ms: list[float]) -> None:
        self.stack = stack
        self.submissions = submissions
        self.refusal_ms = refusal_ms
        self.thread = threading.Thread(target=self._run, name=f"submit-{submissions[0].team}", daemon=True)

    def _run(self) -> None:
        team = self.submissions[0].team
        with httpx.Client(headers={"Authorization": f"Bearer {KEYS[team]}"}, timeout=30) as client:
            for submission in self.submissions:
                time.sleep(max(0.0, submission.due - time.time()))
                self._submit(client, submission)

    def _submit(self, client: httpx.Client, submission: Submission) -> None:
        body = worker_job_request(
            MODEL, calibration={"dataset": "wikitext2", "samples": 4, "seq_len": 64, "seed": submission.index}
        )
        submission.first_try = time.time()
        while True:
            submission.tries += 1
            started = time.perf_counter()
            try:
                answer = client.post(
                    f"{self.stack.api_url}/v1/jobs", json=body, headers={"Idempotency-Key": submission.key}
                )
            except httpx.HTTPError:
                submission.refusals["connection"] = submission.refusals.get("connection", 0) + 1
                time.sleep(1.0)
                continue
            if answer.status_code in (200, 201):
                submission.job_id, submission.accepted_at = answer.json()["id"], time.time()
                return
            reason = str(answer.status_code)
            submission.refusals[reason] = submission.refusals.get(reason, 0) + 1
            if answer.status_code == 429:
                self.refusal_ms.append((time.perf_counter() - started) * 1000)
                time.sleep(float(answer.headers.get("retry-after", "5")))
            elif answer.status_code >= 500:
                time.sleep(1.0)
            else:
                raise RuntimeError(f"{submission.team} job {submission.index}: {answer.status_code} {answer.text}")


# --- reading what happened -----------------------------------------------------------------------------


def redis_client(stack: Stack) -> redis.Redis:
    assert stack.redis is not None
    return redis.Redis.from_url(stack.redis.url, decode_responses=True, socket_timeout=5)


def job_states(stack: Stack, job_ids: list[str]) -> dict[str, str | None]:
    """Each job's status; Redis may be restarting, so this retries for a while."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with redis_client(stack) as client:
                pipe = client.pipeline(transaction=False)
                for job_id in job_ids:
                    pipe.hget(f"{PREFIX}:job:{job_id}", "status")
                return dict(zip(job_ids, pipe.execute(), strict=True))
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def history(client: redis.Redis, job_id: str) -> dict[str, Any]:
    """What a job's record and events say: when it was made, started, finished, how often delivered."""
    record = client.hgetall(f"{PREFIX}:job:{job_id}")
    events = [
        json.loads(fields["data"]) | {"type": fields["type"]}
        for _id, fields in client.xrange(f"{PREFIX}:job:{job_id}:events")
    ]
    statuses = [e for e in events if e["type"] == "status"]
    runs = [e["at"] for e in statuses if e["status"] == "running"]
    succeeded = [e["at"] for e in statuses if e["status"] == "succeeded"]
    return {
        "team": record.get("team"),
        "status": record.get("status"),
        "created": float(record["created_at"]) if record.get("created_at") else None,
        "first_start": runs[0] if runs else None,
        "last_start": runs[-1] if runs else None,
        "finished": succeeded[-1] if succeeded else None,
        "deliveries": len(runs),
        "requeued": sum(1 for e in statuses if e["status"] == "queued" and "re-delivered" in (e.get("reason") or "")),
        "succeeded_events": len(succeeded),
    }


def check_artifact(stack: Stack, team: str, job_id: str, folder: Path, written: int) -> str | None:
    """Why the job's artifact is not one loadable artifact with metrics (its manifest `written` times),
    else None."""
    from ftc.runtime.artifact import load_artifact

    if written != 1:
        return f"manifest written {written} times"
    key = {"Authorization": f"Bearer {KEYS[team]}"}
    listing = httpx.get(f"{stack.api_url}/v1/jobs/{job_id}/artifacts", headers=key, timeout=60).json()
    if not listing.get("complete"):
        return "artifacts not complete"
    folder.mkdir(parents=True, exist_ok=True)
    for artifact in listing["artifacts"]:
        if artifact["name"].startswith("checkpoints/"):
            continue
        target = folder / artifact["name"]
        target.parent.mkdir(parents=True, exist_ok=True)
        headers = key if artifact["url"].startswith(stack.api_url) else {}  # presigned links carry their own
        with httpx.stream("GET", artifact["url"], headers=headers, timeout=60) as response:
            response.raise_for_status()
            target.write_bytes(response.read())
    metrics = json.loads((folder / "metrics.json").read_text())
    ppl = metrics.get("perplexity", {}).get("wikitext2", {}).get("ppl")
    if not (isinstance(ppl, (int, float)) and math.isfinite(ppl) and ppl > 0):
        return f"metrics.json without a perplexity: {metrics.get('perplexity')}"
    try:
        load_artifact(folder)
    except Exception as error:
        return f"load_artifact failed: {error!r}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 2)


def overlaps(start: float, end: float, faults: list[Fault], margin: float) -> bool:
    return any(f.started - margin < end and start < (f.ended or f.started) + margin for f in faults)


# --- the run -------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="ftc-soak-"))
    stack = Stack(workdir)
    print(f"soak: starting the stack in {workdir}", flush=True)
    try:
        stack.start(args.workers)
        started = time.time()
        seconds = args.minutes * 60
        refusal_ms: list[float] = []
        planned = plan(args.jobs, seconds, started)
        submitters = [Submitter(stack, subs, refusal_ms) for subs in planned.values()]
        injector = Injector(stack, args.fault_gap, args.s3_seconds)
        for submitter in submitters:
            submitter.thread.start()
        injector.thread.start()
        print(f"soak: {args.jobs} jobs of {len(TEAMS)} teams, faults every {args.fault_gap:g} s", flush=True)

        everything = [s for subs in planned.values() for s in subs]
        deadline = started + seconds + args.grace_minutes * 60
        while True:
            time.sleep(5)
            elapsed = time.time() - started
            if elapsed >= seconds and not injector.stopping.is_set():
                injector.stopping.set()  # the fault in progress is mended before the thread ends
            accepted = [s.job_id for s in everything if s.job_id]
            states = job_states(stack, accepted) if accepted else {}
            ended = sum(1 for state in states.values() if state in ("succeeded", "failed", "cancelled"))
            print(
                f"soak: {elapsed:5.0f} s: {len(accepted)} accepted, {ended} ended, {len(injector.faults)} faults",
                flush=True,
            )
            done = len(accepted) == len(everything) and ended == len(accepted)
            if (done and injector.stopping.is_set()) or time.time() > deadline:
                break
        injector.join(240)  # the fault in progress is mended, and killed workers are back
        for submitter in submitters:
            submitter.thread.join(1)
        finished = time.time()
        return {**report(args, stack, everything, injector.faults, refusal_ms, started, finished, load_before),
                "store": {"moto_peak_bytes": stack.moto_peak_bytes()}}
    finally:
        stack.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def report(
    args: argparse.Namespace,
    stack: Stack,
    everything: list[Submission],
    faults: list[Fault],
    refusal_ms: list[float],
    started: float,
    finished: float,
    load_before: float,
) -> dict[str, Any]:
    accepted = [s for s in everything if s.job_id]
    with redis_client(stack) as client:
        histories = {s.job_id: history(client, s.job_id) for s in accepted if s.job_id}
    problems: dict[str, str] = {}
    writes = stack.manifest_writes()
    for submission in accepted:
        assert submission.job_id is not None
        seen = histories[submission.job_id]
        if seen["status"] in ("queued", "running"):
            problems[submission.job_id] = f"still {seen['status']} at the deadline"
        elif seen["status"] != "succeeded":
            problems[submission.job_id] = f"ended {seen['status']}"
        elif seen["succeeded_events"] != 1:
            problems[submission.job_id] = f"{seen['succeeded_events']} succeeded events"
        else:
            why = check_artifact(stack, submission.team, submission.job_id, stack.workdir / "check" / submission.job_id,
                                 writes.get(submission.job_id, 0))
            if why:
                problems[submission.job_id] = why
    durations = [h["finished"] - h["last_start"] for h in histories.values() if h["finished"] and h["last_start"]]
    job_seconds = statistics.median(durations) if durations else None
    margin = LEASE_SECONDS + 2.0  # a fault's effects last until the janitor has re-delivered what it broke
    teams = {}
    for team in TEAMS:
        mine = [h for h in histories.values() if h["team"] == team and h["first_start"] and h["created"]]
        waits = [h["first_start"] - h["created"] for h in mine]
        clear = [
            h["first_start"] - h["created"]
            for h in mine
            if not overlaps(h["created"], h["first_start"], faults, margin)
        ]
        ahead = [
            sum(
                1
                for other in histories.values()
                if other["team"] != team
                and other["first_start"]
                and h["created"] < other["first_start"] < h["first_start"]
            )
            for h in mine
        ]
        teams[team] = {
            "jobs": sum(1 for s in everything if s.team == team),
            "accepted": sum(1 for s in accepted if s.team == team),
            "wait_seconds": {
                "p50": percentile(waits, 0.5),
                "p99": percentile(waits, 0.99),
                "max": percentile(waits, 1),
            },
            "clear_of_faults": {"jobs": len(clear), "p50": percentile(clear, 0.5), "p99": percentile(clear, 0.99)},
            "others_started_first": {
                "p50": percentile(ahead, 0.5),
                "p99": percentile(ahead, 0.99),
                "max": percentile(ahead, 1),
            },
        }
    refusals: dict[str, int] = {}
    for submission in everything:
        for reason, count in submission.refusals.items():
            refusals[reason] = refusals.get(reason, 0) + count
    kinds: dict[str, int] = {}
    for fault in faults:
        kinds[fault.kind] = kinds.get(fault.kind, 0) + 1
    lost = len(everything) - len(accepted) + sum(1 for h in histories.values() if h["status"] != "succeeded")
    twice = sum(1 for why in problems.values() if "twice" in why or "events" in why or "manifest written" in why)
    unreadable = sum(1 for why in problems.values() if why.startswith(("load_artifact", "metrics", "artifacts")))
    minutes = (finished - started) / 60
    full = args.jobs >= FULL_SIZE["jobs"] and args.minutes >= FULL_SIZE["minutes"]
    fair_limit = FAIR_WAIT_DURATIONS * job_seconds if job_seconds else None
    others = [t for t in TEAMS if t != BURST_TEAM]
    clear_p99 = [teams[t]["clear_of_faults"]["p99"] for t in others]
    fair_p99 = None if None in clear_p99 else max(clear_p99)
    targets = {
        "lost": {"value": lost, "target": "0", "met": lost == 0},
        "completed_twice": {"value": twice, "target": "0", "met": twice == 0},
        "unreadable": {"value": unreadable, "target": "0", "met": unreadable == 0},
        "jobs": {
            "value": len(accepted),
            "target": f">= {FULL_SIZE['jobs']}",
            "met": len(accepted) >= FULL_SIZE["jobs"],
        },
        "faults": {
            "value": len(faults),
            "target": f">= {FULL_SIZE['faults']}",
            "met": len(faults) >= FULL_SIZE["faults"],
        },
        "minutes": {
            "value": round(minutes, 1),
            "target": f">= {FULL_SIZE['minutes']}",
            "met": minutes >= FULL_SIZE["minutes"],
        },
        "fair_wait_p99_seconds": {
            "value": fair_p99,
            "target": f"<= {FAIR_WAIT_DURATIONS:g} job durations ({fair_limit:.1f} s)" if fair_limit else "n/a",
            "met": fair_limit is not None and fair_p99 is not None and fair_p99 <= fair_limit,
        },
        "refused_429_p99_ms": {
            "value": percentile(refusal_ms, 0.99),
            "target": "< 50",
            "met": bool(refusal_ms) and (percentile(refusal_ms, 0.99) or 0) < 50,
        },
    }
    deliveries = sum(h["deliveries"] for h in histories.values())
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_before": round(load_before, 2),
        },
        "config": {
            "minutes": args.minutes,
            "jobs": args.jobs,
            "workers": args.workers,
            "fault_gap_seconds": args.fault_gap,
            "s3_outage_seconds": args.s3_seconds,
            "lease_seconds": LEASE_SECONDS,
            "max_attempts": MAX_ATTEMPTS,
            "burst_team_queued_limit": BURST_QUEUED_LIMIT,
            "model": MODEL,
            "full_size": full,
        },
        "minutes": round(minutes, 1),
        "jobs": {
            "planned": len(everything),
            "accepted": len(accepted),
            "succeeded": sum(1 for h in histories.values() if h["status"] == "succeeded"),
        },
        "job_seconds": {"p50": round(job_seconds, 2) if job_seconds else None, "p99": percentile(durations, 0.99)},
        "teams": teams,
        "retries": {
            "deliveries_beyond_first": deliveries - len(histories),
            "requeued_by_janitor": sum(h["requeued"] for h in histories.values()),
            "client_refusals": refusals,
            "refused_429_ms": {"p50": percentile(refusal_ms, 0.5), "p99": percentile(refusal_ms, 0.99)},
        },
        "faults": {"total": len(faults), "by_kind": kinds, "list": [asdict(f) for f in faults]},
        "problems": problems,
        "targets": targets,
        "passed": all(targets[name]["met"] for name in ("lost", "completed_twice", "unreadable"))
        and (not full or all(targets[name]["met"] for name in ("jobs", "faults", "minutes"))),
    }


def to_markdown(result: dict[str, Any]) -> str:
    c, t = result["config"], result["targets"]

    def mark(name: str) -> str:
        return f"{t[name]['value']} | {t[name]['target']} | {'met' if t[name]['met'] else 'MISSED'}"

    team_rows = [
        f"| {team} | {row['accepted']} | {row['wait_seconds']['p50']} | {row['wait_seconds']['p99']} | "
        f"{row['wait_seconds']['max']} | {row['clear_of_faults']['jobs']} | {row['clear_of_faults']['p50']} | "
        f"{row['clear_of_faults']['p99']} | {row['others_started_first']['p50']} | "
        f"{row['others_started_first']['p99']} | {row['others_started_first']['max']} |"
        for team, row in result["teams"].items()
    ]
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(result["faults"]["by_kind"].items()))
    r = result["retries"]
    lines = [
        "# Soak under faults",
        "",
        f"`benchmarks/soak.py` on {result['date']}{'' if c['full_size'] else ' (a smoke run, below full size)'}: "
        f"{result['jobs']['accepted']} jobs of three teams over {result['minutes']} minutes through redis-server "
        f"(append-only file, fsync always), moto's S3 server, the API and {c['workers']} "
        f"`ftc worker` processes (one Ray actor each) on a 2-layer model ({c['model']}), while "
        f"{result['faults']['total']} faults were injected ({kinds}), one every {c['fault_gap_seconds']:g} s "
        f"after the previous was mended; S3 outages last {c['s3_outage_seconds']:g} s. Lease "
        f"{c['lease_seconds']} s, at most {c['max_attempts']} deliveries a job; team-a submits half its share at once "
        f"and half when the faults stop, with at most {c['burst_team_queued_limit']} queued (429 beyond); "
        f"team-b and team-c a job every few seconds. One machine ({result['machine']['cpus']} CPUs, load average "
        f"{result['machine']['load_average_before']} before).",
        "",
        "| check | value | target | |",
        "| --- | --- | --- | --- |",
        f"| accepted jobs not succeeded (lost, failed or unfinished) | {mark('lost')} |",
        f"| jobs run to completion twice (succeeded events, manifest writes) | {mark('completed_twice')} |",
        f"| artifacts unreadable or without metrics | {mark('unreadable')} |",
        f"| jobs | {mark('jobs')} |",
        f"| faults | {mark('faults')} |",
        f"| minutes | {mark('minutes')} |",
        f"| team-b/team-c wait p99, clear of faults (s) | {mark('fair_wait_p99_seconds')} |",
        f"| 429 answer p99 (ms, client side) | {mark('refused_429_p99_ms')} |",
        "",
        f"A job takes {result['job_seconds']['p50']} s (p50 of its last attempt, p99 "
        f"{result['job_seconds']['p99']} s). Wait: from submission to the job's first start.",
        "",
        "| team | jobs | wait p50 s | wait p99 s | wait max s | jobs clear of faults | p50 s | p99 s "
        "| other teams' jobs started first: p50 | p99 | max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *team_rows,
        "",
        f"Retries: {r['deliveries_beyond_first']} deliveries beyond the first ({r['requeued_by_janitor']} "
        f"re-deliveries by the janitor after a lost lease); client refusals by reason {r['client_refusals']}; "
        f"429 answers p50 {r['refused_429_ms']['p50']} ms. A wait is clear of faults when no fault (nor the "
        f"lease after it) fell between the job's submission and its start: team-a queues a second burst when "
        f"the faults stop, and the other teams keep submitting, so the quiet tail measures fairness against "
        f"a backlog. 'Other teams' jobs started first' counts, for each job, the jobs of other teams that "
        f"started while it waited: with fair dispatch a few, with one queue for all up to team-a's backlog.",
    ]
    if store := result.get("store"):
        peak = store["moto_peak_bytes"]
        lines += ["", f"The store: moto's peak resident memory {'-' if peak is None else f'{peak / 2**30:.2f} GiB'} "
                  "(manifest writes are counted in its access log; a versioned bucket, listed per job, grew moto "
                  "past 22 GB in two earlier runs)."]
    if result["problems"]:
        lines += ["", "Problems:", *[f"- {job}: {why}" for job, why in sorted(result["problems"].items())]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10, help="how long faults are injected")
    parser.add_argument("--jobs", type=int, default=210, help="jobs of the three teams together")
    parser.add_argument("--workers", type=int, default=2, help="`ftc worker` processes, one actor each")
    parser.add_argument("--fault-gap", type=float, default=10, help="seconds between one fault mended and the next")
    parser.add_argument("--s3-seconds", type=float, default=30, help="how long each S3 outage lasts")
    parser.add_argument("--grace-minutes", type=float, default=30, help="how long to wait for the last jobs")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where soak.json and soak.md go")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs of every process)")
    args = parser.parse_args()
    result = run(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "soak.md").write_text(to_markdown(result))
    print(to_markdown(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
