"""`ftc submit` and `ftc jobs ...` against a running API; `ftc serve` as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from cli.main import main
from cli.service import addresses
from service.schemas import Progress
from tests.support.servers import free_port, wait_until
from tests.support.service import API_KEYS, TEAM_KEYS, Api


def ftc(*argv: str) -> int:
    """Run a command in process, through the `ftc` entry point itself."""
    return main(list(argv))


@pytest.fixture
def cli_api(api: Api, monkeypatch: pytest.MonkeyPatch) -> Api:
    monkeypatch.setenv("FTC_API_URL", api.base_url)
    monkeypatch.setenv("FTC_API_KEY", TEAM_KEYS["team-a"])
    return api


SUBMIT = [
    "submit",
    "--model",
    "smollm2-135m",
    "--method",
    "ftc",
    "--calib",
    "wikitext2",
    "--calib-samples",
    "8",
    "--seq-len",
    "256",
    "--seed",
    "0",
    "--eval-datasets",
    "wikitext2",
    "--eval-seq-len",
    "256",
    "--max-windows",
    "4",
]


def test_submit_prints_the_record_and_jobs_get_ls_cancel_use_it(cli_api: Api, capsys) -> None:
    assert ftc(*SUBMIT, "--ratio", "0.4", "--priority", "high", "--ablate", "no_whiten") == 0
    out, err = capsys.readouterr()
    record = json.loads(out)
    assert err.strip() == f"next: ftc jobs watch {record['id']}, then: ftc jobs download {record['id']}"
    assert (record["status"], record["priority"], record["request"]["ablate"]) == ("queued", "high", ["no_whiten"])
    assert record["request"]["calibration"] == {"dataset": "wikitext2", "samples": 8, "seq_len": 256, "seed": 0}
    assert record["request"]["eval"] == {"datasets": ["wikitext2"], "seq_len": 256, "max_windows": 4}

    assert ftc("jobs", "get", record["id"]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == record["id"]

    assert ftc("jobs", "ls") == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(record["id"]) and "queued" in line and "ratio=0.4" in line

    assert ftc("jobs", "cancel", record["id"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "cancelled"
    assert ftc("jobs", "ls", "--status", "cancelled", "--json") == 0
    assert [job["id"] for job in json.loads(capsys.readouterr().out)["jobs"]] == [record["id"]]


def test_ratios_and_a_local_calibration_file_are_handled(cli_api: Api, capsys, tmp_path: Path) -> None:
    calib = tmp_path / "my-calib.txt"
    calib.write_text("some calibration text\n" * 20)
    assert ftc("submit", "--model", "smollm2-135m", "--ratios", "0.3,0.6", "--calib", str(calib)) == 0
    record = json.loads(capsys.readouterr().out)
    assert len(record["linked"]) == 1
    dataset = record["request"]["calibration"]["dataset"]
    assert dataset.startswith("upload://upl_") and dataset.endswith("/my-calib.txt")  # uploaded first
    assert ftc("jobs", "ls", "--limit", "1", "--all") == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 2


def test_watch_follows_events_and_exits_with_the_outcome(cli_api: Api, capsys) -> None:
    assert ftc(*SUBMIT, "--ratio", "0.5") == 0
    job_id = json.loads(capsys.readouterr().out)["id"]

    async def work(services):
        await services.queue.claim("w1", block_ms=0)
        await services.jobs.update_progress(
            job_id, "w1", Progress(layer=1, layers=2, stage="compressing", eta_seconds=12)
        )
        await services.jobs.finish(job_id, "w1", "failed", "CUDA out of memory on layer 2")

    worker = threading.Timer(0.3, lambda: cli_api.run(work))
    worker.start()
    code = ftc("jobs", "watch", job_id)
    worker.join()
    lines = capsys.readouterr().out.splitlines()
    assert code == 1
    assert lines == [
        "status    queued",
        "status    running",
        "progress  compressing 1/2 eta 12s",
        "status    failed  (CUDA out of memory on layer 2)",
    ]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["jobs", "get", "job_0000000000000000000000"], "404: job job_0000000000000000000000 not found"),
        (["jobs", "get", "nonsense"], "422"),
        ([*SUBMIT, "--ratio", "1.5"], "ratio: ratio must be in (0, 1]"),
    ],
)
def test_errors_are_one_line_on_stderr_with_exit_code_2(cli_api: Api, capsys, argv: list[str], words: str) -> None:
    assert ftc(*argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and words in captured.err
    assert captured.err.startswith("ftc: error: ") and captured.err.count("\n") == 1


def test_an_unreachable_api_or_a_bad_key_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch, capsys, api: Api
) -> None:
    monkeypatch.setenv("FTC_API_URL", f"http://127.0.0.1:{free_port()}")
    assert ftc("jobs", "ls") == 2
    assert "cannot reach the job API" in capsys.readouterr().err
    monkeypatch.setenv("FTC_API_URL", api.base_url)
    monkeypatch.setenv("FTC_API_KEY", "wrong-key-123")
    assert ftc("jobs", "ls") == 2
    assert "401: unknown API key" in capsys.readouterr().err


def test_serve_addresses_name_the_dashboard_and_the_docs() -> None:
    assert addresses("0.0.0.0", 8000) == [
        "ftc API on http://127.0.0.1:8000 (listening on every interface)",
        "  dashboard  http://127.0.0.1:8000/",
        "  API docs   http://127.0.0.1:8000/docs",
    ]
    assert addresses("::1", 9000)[1] == "  dashboard  http://[::1]:9000/"


def test_serve_runs_the_api(service_settings, tmp_path: Path) -> None:
    settings = service_settings()
    port = free_port()
    env = {
        "FTC_REDIS_URL": settings.redis_url,
        "FTC_STORE_URL": str(tmp_path / "store"),
        "FTC_API_KEYS": API_KEYS,
        "FTC_KEY_PREFIX": settings.key_prefix,
        "PATH": "/usr/bin:/bin",
    }
    program = (
        "import sys; from cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", program, "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200, "ftc serve")
        said = [server.stdout.readline().strip() for _ in range(3)]
        assert said == [f"ftc API on http://127.0.0.1:{port}", f"dashboard  http://127.0.0.1:{port}/",
                        f"API docs   http://127.0.0.1:{port}/docs"]
        assert httpx.get(f"http://127.0.0.1:{port}/docs").status_code == 200
        listing = httpx.get(
            f"http://127.0.0.1:{port}/v1/jobs", headers={"Authorization": f"Bearer {TEAM_KEYS['team-a']}"}
        )
        assert listing.json() == {"jobs": [], "next_cursor": None}
    finally:
        server.terminate()
        server.wait(10)

    env["FTC_API_KEYS"] = ""
    refused = subprocess.run([sys.executable, "-c", program, "serve"], env=env, capture_output=True, text=True)
    assert refused.returncode == 2
    assert (
        refused.stderr.strip()
        == "ftc: error: FTC_API_KEYS is empty: set it to key:team,... or to a file of key:team lines"
    )
