"""`ftc eval --tasks` end to end, lm-eval's own command line with the `ftc` backend, and agreement
with lm-eval's `hf` backend on the dense export of the same artifact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from ftc.evaluation.tasks import TASK_DIR
from tests.support.cli import one_error_line

LM_EVAL = [sys.executable, "-m", "lm_eval"]
FTC_LM_EVAL = [sys.executable, "-m", "ftc.evaluation.harness"]
TASKS = ("arc_easy", "boolq")
LIMIT = 3
pytestmark = pytest.mark.timeout(900)


def run(command: list[str], *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env or {})}
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=800, env=environment,
                          stdin=subprocess.DEVNULL)


def lm_eval_run(launcher: list[str], model: str, model_args: str, out: Path) -> dict[str, dict]:
    """lm-eval's `run` on the shipped tasks; returns its results and per-document log-likelihoods."""
    done = run(launcher, "run", "--model", model, "--model_args", model_args, "--include_path", str(TASK_DIR),
               "--tasks", ",".join(f"ftc_{t}" for t in TASKS), "--limit", str(LIMIT), "--device", "cpu",
               "--output_path", str(out), "--log_samples")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    loglikelihoods = {}
    for task in TASKS:
        samples = [json.loads(line) for line in next(out.rglob(f"samples_ftc_{task}_*.jsonl")).read_text().splitlines()]
        # lm-eval writes each (log-likelihood, is-greedy) pair as strings
        loglikelihoods[task] = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in samples}
    return {"results": results, "loglikelihoods": loglikelihoods}


def test_task_dir_and_bad_task_input_are_one_line_errors(tiny_folder, tmp_path, capsys, monkeypatch):
    """In process (`cli.main`), as tests/cli/test_bad_input.py: the exit code and the one stderr line are
    the command line's; six interpreters started for them cost half a minute."""
    assert main(["eval", "--task-dir"]) == 0
    assert Path(capsys.readouterr().out.strip()) == TASK_DIR
    assert (TASK_DIR / "ftc_arc_easy.yaml").is_file()
    model = str(tiny_folder("gqa"))
    capsys.readouterr()  # the fixture's own progress bar
    for args, data_dir, message in (
        (["--tasks", "arc_easy,winogrande"], None, "unknown task winogrande; choose from arc_easy"),
        (["--tasks", "piqa"], tmp_path, f"task piqa needs {tmp_path}/tasks/piqa_validation.jsonl; set FTC_DATA_DIR"),
        (["--tasks", "piqa", "--limit", "0"], None, "--limit must be >= 1"),
        (["--tasks", ""], None, "--tasks names no task"),
        (["--limit", "5"], None, "--limit and --num-fewshot apply to tasks; add --tasks"),
    ):
        with monkeypatch.context() as patch:
            if data_dir is not None:
                patch.setenv("FTC_DATA_DIR", str(data_dir))
            assert main(["eval", "--model", model, *args]) == 2
        one_error_line(capsys, message)


def test_artifact_tasks_agree_across_ftc_eval_the_ftc_backend_and_hf_on_the_dense_export(tiny_folder, tmp_path,
                                                                                        capsys):
    """`ftc compress`, `ftc eval` and `ftc export` run in process (`cli.main`: the command line's own
    parsing and exit codes, without an interpreter and a torch import each); lm-eval runs as its users
    run it, its own command line in a process of its own, once with the `ftc` backend, once with `hf`."""
    artifact, dense = tmp_path / "art", tmp_path / "dense"
    assert main(["compress", "--model", str(tiny_folder("gqa")), "--ratio", "0.4", "--calib", "wikitext2",
                 "--calib-samples", "4", "--seq-len", "64", "--device", "cpu", "--quiet", "--out", str(artifact)]) == 0
    capsys.readouterr()
    assert main(["eval", str(artifact), "--tasks", ",".join(TASKS), "--limit", str(LIMIT), "--dataset", "wikitext2",
                 "--seq-len", "64", "--max-windows", "2", "--json", "--quiet", "--device", "cpu"]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ours["windows"] == 2 and ours["ppl"] > 1  # perplexity and tasks in one call
    assert set(ours["tasks"]) == set(TASKS) and all(row["n"] == LIMIT for row in ours["tasks"].values())
    assert ours["avg"] == pytest.approx(sum(row["acc"] for row in ours["tasks"].values()) / len(TASKS))

    # lm-eval's own command line with the `ftc` backend runs the artifact factorized...
    backend = lm_eval_run(FTC_LM_EVAL, "ftc", f"pretrained={artifact}", tmp_path / "ftc-backend")
    # ...and lm-eval's `hf` backend runs the stock dense export of the same artifact.
    assert main(["export", str(artifact), "--out", str(dense), "--dtype", "float32"]) == 0
    stock = lm_eval_run(LM_EVAL, "hf", f"pretrained={dense},dtype=float32", tmp_path / "hf-backend")
    for task in TASKS:
        for scored in (backend, stock):
            assert scored["results"][f"ftc_{task}"]["acc,none"] == ours["tasks"][task]["acc"]
        factorized, reconstructed = backend["loglikelihoods"][task], stock["loglikelihoods"][task]
        assert factorized.keys() == reconstructed.keys() and len(factorized) == LIMIT
        for doc in factorized:
            assert factorized[doc] == pytest.approx(reconstructed[doc], abs=1e-3)
