"""`ftc sweep ...` against a running API, and `ftc scheduler` as a real process."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cli.client import ApiClient, ApiError
from cli.download import Remote, save_file
from cli.sweeps import _add_create_flags, build_sweep_request
from service.runtime import Services
from service.scheduler import Scheduler
from tests.cli.test_service_commands import ftc
from tests.support.servers import wait_until
from tests.support.service import TEAM_KEYS, Api
from tests.support.sweeps import work_queue

CREATE = [
    "sweep", "create", "--name", "nightly", "--models", "smollm2-135m", "--ratios", "0.8,0.4",
    "--methods", "ftc,svd_llm", "--calib-samples", "8", "--seq-len", "256", "--eval-datasets", "wikitext2",
    "--eval-seq-len", "256", "--max-windows", "4",
]  # fmt: skip


@pytest.fixture
def cli_api(api: Api, monkeypatch: pytest.MonkeyPatch) -> Api:
    monkeypatch.setenv("FTC_API_URL", api.base_url)
    monkeypatch.setenv("FTC_API_KEY", TEAM_KEYS["team-a"])
    return api


def test_flags_become_a_sweep_request() -> None:
    parser = argparse.ArgumentParser()
    _add_create_flags(parser)
    args = parser.parse_args(
        ["--models", "a,b", "--ratios", "0.5", "--ablations", "none;no_whiten,fixed_ranks", "--schedule", "0 2 * * *",
         "--change-threshold", "0.05", "--eval-datasets", ""]
    )  # fmt: skip
    assert build_sweep_request(args, upload=lambda path: "unused") == {
        "models": ["a", "b"],
        "ratios": [0.5],
        "ablations": [[], ["no_whiten", "fixed_ranks"]],
        "schedule": "0 2 * * *",
        "change_threshold": 0.05,
        "eval": {"datasets": []},
    }


def test_create_follow_download_rerun_and_cancel(
    cli_api: Api, capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ftc(*CREATE) == 0
    sweep = json.loads(capsys.readouterr().out)
    assert (sweep["name"], sweep["status"], len(sweep["run"]["cells"])) == ("nightly", "queued", 4)
    assert ftc("sweep", "ls") == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(sweep["id"]) and "nightly" in line and "[once]" in line and "4 queued" in line

    async def work_then_report(services: Services) -> None:
        await work_queue(services)
        await Scheduler(services).tick()

    # The worker starts when the watch has printed its first line, however long that takes: a quick
    # worker would otherwise finish before the first poll, and the line would not say "queued".
    first_line = threading.Event()
    write = sys.stdout.write  # capsys's buffer

    def write_and_note(text: str) -> int:
        written = write(text)
        if "\n" in text:
            first_line.set()
        return written

    def work_once_watched() -> None:
        first_line.wait()
        cli_api.run(work_then_report)

    worker = threading.Thread(target=work_once_watched)
    worker.start()
    with monkeypatch.context() as patch:
        patch.setattr(sys.stdout, "write", write_and_note)
        try:
            assert ftc("sweep", "watch", sweep["id"], "--interval", "0.2") == 0
        finally:
            first_line.set()  # a watch that failed before printing must not leave the worker waiting
            worker.join()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"run {sweep['run']['id']}  queued") and "report: runs/" in out[-1]

    assert ftc("sweep", "files", sweep["id"]) == 0
    listed = [line.split()[-1] for line in capsys.readouterr().out.splitlines()]
    assert "results.csv" in listed and f"runs/{sweep['run']['id']}/plot.svg" in listed
    target = tmp_path / "table.csv"
    assert ftc("sweep", "download", sweep["id"], "results.csv", "-o", str(target)) == 0
    assert capsys.readouterr().out.strip() == f"{target} ({target.stat().st_size} bytes)"
    assert target.read_text().startswith("model,method,allocation,rho,status,ppl_wikitext2")
    report = tmp_path / "report"
    assert ftc("sweep", "download", sweep["id"], "--to", str(report), "--include", "models") == 0
    assert capsys.readouterr().out.startswith(f"{report} (")
    saved = {str(path.relative_to(report)) for path in report.rglob("*") if path.is_file()}
    assert {"results.csv", "results.md", "results.json", "plot.png", "plot.svg"} <= saved
    assert {f"models/{cell['job_id']}/metrics.json" for cell in sweep["run"]["cells"]} <= saved
    assert not [name for name in saved if name.startswith("runs/")]  # the latest report, not every run's
    assert (report / "results.csv").read_text() == target.read_text()

    assert ftc("sweep", "run", sweep["id"]) == 0
    rerun = json.loads(capsys.readouterr().out)
    assert (rerun["runs_total"], rerun["run"]["trigger"]) == (2, "manual")
    assert ftc("sweep", "cancel", sweep["id"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "cancelled"
    assert ftc("sweep", "get", sweep["id"], "--run", sweep["run"]["id"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["status"] == "succeeded"


def test_errors_are_one_line_and_exit_code_2(cli_api: Api, capsys) -> None:
    assert ftc("sweep", "create", "--models", "org/m", "--ratios", "1.5") == 2
    assert (
        capsys.readouterr().err.strip()
        == "ftc: error: --ratios: ratio must be in (0, 1]; got 1.5"  # checked before anything is sent
    )
    assert ftc("sweep", "get", "swp_" + "0" * 22) == 2
    assert "answered 404" in capsys.readouterr().err
    assert ftc("sweep", "download", "swp_" + "0" * 22, "plot.svg", "-o", os.devnull) == 2
    capsys.readouterr()
    pending = cli_api.client().post("/v1/sweeps", json={"models": ["smollm2-135m"], "ratios": [0.5]}).json()["id"]
    assert ftc("sweep", "download", pending) == 2
    assert f"sweep {pending} has no report for any run yet" in capsys.readouterr().err


def test_the_scheduler_command_writes_reports_and_stops_cleanly(cli_api: Api, tmp_path: Path) -> None:
    settings = cli_api.settings
    env = {
        **os.environ,
        "FTC_REDIS_URL": settings.redis_url,
        "FTC_KEY_PREFIX": settings.key_prefix,
        "FTC_STORE_URL": settings.store_url,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    client = cli_api.client()
    sweep = client.post("/v1/sweeps", json={"models": ["smollm2-135m"], "ratios": [0.5]}).json()
    command = [sys.executable, "-m", "cli", "scheduler", "--interval", "0.2", "--name", "cli-test"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        cli_api.run(work_queue)
        wait_until(lambda: client.get(f"/v1/sweeps/{sweep['id']}").json()["run"]["report"], "the report")
        assert client.get(f"/v1/sweeps/{sweep['id']}/files/plot.png").status_code == 200
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "scheduler cli-test is active" in output and "report written" in output
    assert cli_api.run(lambda s: s.redis.exists(f"{settings.key_prefix}:scheduler:lock")) == 0  # released


@pytest.mark.parametrize(("setting", "value", "ending"), [
    ("FTC_STORE_URL", "gs://bucket/x", "use a folder path or s3://bucket/prefix"),
    ("FTC_TEAMS", "{not json", "FTC_TEAMS is not JSON: Expecting property name enclosed in double quotes at line 1 "
                               "column 2"),
])
def test_the_scheduler_command_refuses_unusable_settings(setting: str, value: str, ending: str) -> None:
    env = {**os.environ, setting: value, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run(
        [sys.executable, "-m", "cli", "scheduler"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and result.stderr.strip().endswith(ending)
    assert len(result.stderr.strip().splitlines()) == 1


def test_client_download_reports_http_errors_without_leaving_a_file(cli_api: Api, tmp_path: Path) -> None:
    target = tmp_path / "out" / "plot.svg"
    remote = Remote("plot.svg", 10, f"{cli_api.base_url}/v1/sweeps/swp_x/files/plot.svg")
    with pytest.raises(ApiError, match="answered 401"):
        save_file(ApiClient(cli_api.base_url, api_key="wrong-key-000"), remote, target, quiet=True)
    unreachable = Remote("plot.svg", 10, "http://127.0.0.1:9/v1/sweeps/swp_x/files/plot.svg")
    with pytest.raises(ApiError, match="cannot reach the job API"):
        save_file(ApiClient("http://127.0.0.1:9", api_key="k" * 10), unreachable, target, quiet=True)
    assert list(target.parent.iterdir()) == []  # neither the file nor a partial one
