"""`ftc export`: the real entry point, a stock checkpoint out, one stderr line and exit 2 on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

FTC = [sys.executable, "-m", "cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TQDM_DISABLE": "1"}
    return subprocess.run([*FTC, "export", *args], capture_output=True, text=True, timeout=600, env=env)


def _one_error_line(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftc: error:"), done.stderr
    for word in words:
        assert word in lines[0]


def test_export_writes_a_dense_checkpoint_and_refuses_to_overwrite(tiny_artifact, tmp_path):
    out = tmp_path / "dense"
    done = run(str(tiny_artifact("gqa")), "--format", "dense", "--out", str(out), "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["dtype"] == "bfloat16" and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    _one_error_line(run(str(tiny_artifact("gqa")), "--out", str(out)), "--overwrite")
    assert run(str(tiny_artifact("gqa")), "--out", str(out), "--overwrite").returncode == 0


def test_a_folder_that_is_not_an_artifact_is_refused(tiny_folder, tmp_path):
    _one_error_line(run(str(tiny_folder("gqa")), "--out", str(tmp_path / "o")),  # a dense folder: config.json
                    "is a model folder (config.json) but not a compressed artifact (no manifest.json)")
    _one_error_line(run(str(tmp_path), "--out", str(tmp_path / "o")), "not an ftc artifact")
    _one_error_line(run(str(tmp_path / "missing"), "--out", str(tmp_path / "o")), "not a folder")
    assert not (tmp_path / "o").exists()


def test_an_unwritable_out_is_refused(tiny_artifact, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        done = run(str(tiny_artifact("gqa")), "--out", str(locked / "dense"))
    finally:
        locked.chmod(0o700)
    if os.geteuid() == 0:  # root writes anywhere; nothing to refuse
        assert done.returncode == 0
    else:
        _one_error_line(done, "not writable")
