"""Downstream tasks: names, the shipped lm-eval configs against lm-eval's own, the local data files
read through them, and the average of task scores."""

from __future__ import annotations

import importlib.metadata
import math
import os
from pathlib import Path

import lm_eval.tasks
import pytest
import torch
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml

from ftc.evaluation.downstream import average, document_scores, evaluate_tasks, paired_difference
from ftc.evaluation.harness import (
    LOGITS_BYTES,
    LOGITS_TOKENS,
    OFFLINE,
    offline,
    scored_inputs,
    scored_tail,
    task_batch_size,
)
from ftc.evaluation.tasks import AVG6, PREFIX, TASK_DIR, TASKS, TaskDataError, parse_tasks, task_file
from ftc.models.registry import resolve_model
from ftc.options import InputError
from ftc.runtime.loading import load_model

UPSTREAM = Path(lm_eval.tasks.__file__).parent
UPSTREAM_CONFIG = {
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_easy.yaml",  # lm-eval's arc_challenge.yaml includes arc_easy.yaml
    "hellaswag": "hellaswag/hellaswag.yaml",
    "piqa": "piqa/piqa.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "mathqa": "mathqa/mathqa.yaml",
    "gsm8k": "gsm8k/gsm8k.yaml",
}
SCORING_KEYS = ("output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "metric_list", "generation_kwargs",
                "filter_list", "num_fewshot", "repeats")


@pytest.fixture(scope="module")
def loaded_tasks() -> dict:
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=False)
    loaded = manager.load([PREFIX + t for t in TASKS])["tasks"]
    return {name[len(PREFIX):]: task for name, task in loaded.items()}


def test_the_documents_per_forward_are_capped_by_what_the_vocabularys_logits_take():
    """8 bytes per padded token and vocabulary entry (logits and their log-softmax, float32)."""
    for vocab in (49_152, 262_144, 10**7):
        fitting = task_batch_size(64, vocab)
        assert fitting * 8 * LOGITS_TOKENS * vocab <= LOGITS_BYTES or fitting == 1
        assert (fitting + 1) * 8 * LOGITS_TOKENS * vocab > LOGITS_BYTES
    assert task_batch_size(16, 49_152) == 16  # SmolLM2's tables keep their batch
    assert task_batch_size(16, 262_144) == 4  # Gemma-3-270M's 16 were killed for memory
    assert task_batch_size(2, 262_144) == 2 and task_batch_size(0, 100) == 1


def test_task_names_expand_avg6_and_reject_unknown_ones():
    assert parse_tasks("avg6") == AVG6
    assert parse_tasks("piqa, avg6,gsm8k") == ("piqa", *[t for t in AVG6 if t != "piqa"], "gsm8k")
    assert parse_tasks(["boolq", "boolq"]) == ("boolq",) and parse_tasks("") == ()
    with pytest.raises(InputError, match="unknown task winogrande; choose from arc_easy"):
        parse_tasks("arc_easy,winogrande")


def test_a_missing_data_file_names_the_file_and_ftc_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FTC_DATA_DIR", str(tmp_path))
    with pytest.raises(TaskDataError, match=f"{tmp_path}/tasks/piqa_validation.jsonl; set FTC_DATA_DIR"):
        task_file("piqa")


@pytest.mark.parametrize("task", TASKS)
def test_configs_keep_lm_evals_prompts_choices_and_metrics(task):
    ours = load_yaml(TASK_DIR / f"{PREFIX}{task}.yaml", resolve_func=False)
    if "include" in ours:
        ours = load_yaml(TASK_DIR / ours["include"], resolve_func=False) | ours
    upstream = load_yaml(UPSTREAM / UPSTREAM_CONFIG[task], resolve_func=False)
    for key in SCORING_KEYS:
        mine, theirs = ours.get(key), upstream.get(key)
        if isinstance(theirs, str) and theirs.endswith(".doc_to_choice"):  # `!function utils.x`, by path
            mine, theirs = Path(mine).name, Path(theirs).name
        assert mine == theirs, f"{task}: {key} differs from lm-eval's config"


def test_every_document_of_every_multiple_choice_task_has_a_valid_answer(loaded_tasks):
    sizes = {}
    for name, task in loaded_tasks.items():
        docs = task.eval_docs
        sizes[name] = len(docs)
        if task.OUTPUT_TYPE != "multiple_choice":
            continue
        for doc in docs:
            target, choices = task.doc_to_target(doc), task.doc_to_choice(doc)
            assert isinstance(target, int) and 0 <= target < len(choices) and all(choices), (name, doc)
    # full splits, as listed in the data folder's SOURCES.md
    assert sizes == {"arc_easy": 2376, "arc_challenge": 1172, "hellaswag": 10042, "piqa": 1838, "boolq": 3270,
                     "mathqa": 2985, "gsm8k": 1319}


def test_documents_render_as_lm_eval_prompts(loaded_tasks):
    arc = loaded_tasks["arc_easy"]
    doc = arc.eval_docs[0]
    assert arc.doc_to_text(doc) == (
        "Question: Which statement best explains why photosynthesis is the foundation of most food webs?\nAnswer:"
    )
    assert arc.doc_to_choice(doc)[0] == "Sunlight is the source of energy for nearly all ecosystems."
    boolq = loaded_tasks["boolq"]
    labels = [boolq.doc_to_target(d) for d in boolq.eval_docs]
    assert labels.count(1) == 2033 and labels.count(0) == 1237  # the string "true"/"false" of this copy
    assert boolq.doc_to_choice(boolq.eval_docs[0]) == ["no", "yes"]
    mathqa = loaded_tasks["mathqa"]
    assert mathqa.doc_to_choice(mathqa.eval_docs[0]) == ["38", "27.675", "30", "data inadequate", "none of these"]


def test_average_is_the_mean_score_with_the_stderr_of_a_mean_of_independent_tasks():
    rows = {
        "arc_easy": {"acc": 0.5, "acc_stderr": 0.03},
        "piqa": {"acc": 0.7, "acc_stderr": 0.04},
        "gsm8k": {"exact_match": 0.3, "exact_match_stderr": 0.12},
    }
    result = average(rows)
    assert result["avg"] == pytest.approx(0.5)
    assert result["avg_stderr"] == pytest.approx(math.sqrt(0.03**2 + 0.04**2 + 0.12**2) / 3)
    rows["piqa"]["acc_stderr"] = None
    assert average(rows)["avg_stderr"] is None


def test_paired_difference_is_the_mean_per_document_difference_with_its_standard_error():
    rows = {"arc_easy": {"documents": "1101"}, "boolq": {"documents": "10"}}
    reference = {"arc_easy": {"documents": "1000"}, "boolq": {"documents": "01"}, "piqa": {"documents": "1"}}
    result = paired_difference(rows, reference)
    # arc_easy: d = (0, 1, 0, 1), mean 0.5, sample stdev sqrt(1/3); boolq: d = (1, -1), mean 0, stdev sqrt(2)
    arc_se, boolq_se = math.sqrt(1 / 3) / 2, math.sqrt(2) / math.sqrt(2)
    assert result["avg_diff"] == pytest.approx((0.5 + 0.0) / 2)
    assert result["stderr"] == pytest.approx(math.sqrt(arc_se**2 + boolq_se**2) / 2)
    assert paired_difference(rows, rows) == {"avg_diff": 0.0, "stderr": 0.0}
    with pytest.raises(ValueError, match="boolq: both rows need per-document scores on the same documents"):
        paired_difference(rows, {**reference, "boolq": {"documents": "011"}})


def test_document_scores_follow_document_order_and_the_headline_filter():
    samples = [{"doc_id": 2, "filter": "none", "acc": 1.0}, {"doc_id": 0, "filter": "none", "acc": 0.0},
               {"doc_id": 1, "filter": "none", "acc": 1.0}]
    assert document_scores("piqa", samples) == "011"
    gsm8k = [{"doc_id": 1, "filter": "flexible-extract", "exact_match": 1.0},
             {"doc_id": 1, "filter": "strict-match", "exact_match": 0.0},
             {"doc_id": 0, "filter": "strict-match", "exact_match": 1.0}]
    assert document_scores("gsm8k", gsm8k) == "10"


def test_per_document_scores_are_lm_evals_and_pair_two_models_on_the_same_documents(tiny_folder, tiny_artifact,
                                                                                     monkeypatch):
    """A dense tiny model and its compression through lm-eval: each row's documents average to its
    acc, and the paired difference of the averages is the difference of the two avg."""
    for name in OFFLINE:  # evaluate_tasks turns them on while it runs, and must leave them as found
        monkeypatch.delenv(name, raising=False)
    tasks = ("arc_easy", "boolq")
    scored = []
    for folder in (tiny_folder("gqa"), tiny_artifact("gqa", 0.4)):
        model, tokenizer = load_model(resolve_model(str(folder)))
        scored.append(evaluate_tasks(model, tokenizer, tasks, limit=6, batch_size=4, per_document=True))
    for result in scored:
        for task in tasks:
            row = result["tasks"][task]
            assert len(row["documents"]) == row["n"] == 6
            assert row["documents"].count("1") / 6 == pytest.approx(row["acc"])
    assert not {name for name in OFFLINE if name in os.environ}, "the offline switches leaked out of evaluate_tasks"
    dense, compressed = (result["tasks"] for result in scored)
    assert paired_difference(compressed, dense)["avg_diff"] == pytest.approx(scored[1]["avg"] - scored[0]["avg"])
    assert paired_difference(dense, dense)["stderr"] == 0.0


def test_the_backend_lowers_a_fixed_batch_to_what_the_logits_take(tiny_folder, monkeypatch):
    """Every route to lm-eval builds `FTCLM`, so the cap lives there: a fixed batch (int or lm-eval's
    string) is lowered, never raised."""
    from ftc.evaluation import harness

    model, tokenizer = load_model(resolve_model(str(tiny_folder("gqa"))))
    assert harness.FTCLM(pretrained=model, tokenizer=tokenizer, batch_size=8).batch_size == 8
    monkeypatch.setattr(harness, "LOGITS_BYTES", 3 * 8 * LOGITS_TOKENS * model.config.vocab_size)
    assert harness.FTCLM(pretrained=model, tokenizer=tokenizer, batch_size="8").batch_size == 3
    assert harness.FTCLM(pretrained=model, tokenizer=tokenizer, batch_size=2).batch_size == 2


def test_offline_turns_the_hub_switches_on_inside_and_restores_them_after(monkeypatch):
    """A switch the user set is kept as set; those unset are on inside and unset again after, so a
    worker's next job (and the subprocesses it starts) may reach the hub."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    with offline():
        assert [os.environ.get(name) for name in OFFLINE] == ["0", "1", "1"]
    assert [os.environ.get(name) for name in OFFLINE] == ["0", None, None]
    with pytest.raises(RuntimeError), offline():
        raise RuntimeError("a failed evaluation")
    assert [os.environ.get(name) for name in OFFLINE] == ["0", None, None]


def test_the_installed_package_declares_the_ftc_backend_in_lm_evals_plugin_group():
    # lm-eval releases that read the group resolve `--model ftc` through this entry point
    declared = importlib.metadata.entry_points(group="lm_eval.models")
    assert [entry.value for entry in declared if entry.name == "ftc"] == ["ftc.evaluation.harness:FTCLM"]
    assert next(entry for entry in declared if entry.name == "ftc").load() is get_model("ftc")


def test_the_scored_tail_starts_where_the_first_continuation_starts_and_counts_every_possible_length():
    # (context, continuation): inputs of 5 and 4 tokens scoring 2 and 3 of them; a third ends in token 0
    requests = [(("", ""), [5, 6, 7], [8, 9]), (("", ""), [1, 2], [3, 4, 5]), (("", ""), [2, 3, 0], [4])]
    scored = scored_inputs(requests, max_length=64)
    assert scored == {(5, 6, 7, 8): 2, (1, 2, 3, 4): 3, (2, 3, 0): 1}
    batch = torch.tensor([[5, 6, 7, 8, 0, 0], [1, 2, 3, 4, 0, 0]])
    assert scored_tail(batch, scored) == 6 - min(4 - 2, 4 - 3)
    # the row that ends in 0 reads as 2 tokens or 3: if [2, 3] were also scored, both lengths count
    assert scored_tail(torch.tensor([[2, 3, 0, 0]]), scored) == 4 - (3 - 1)
    assert scored_tail(torch.tensor([[2, 3, 0, 0]]), {**scored, (2, 3): 2}) == 4 - 0
    assert scored_tail(torch.tensor([[9, 9, 0]]), scored) is None  # not a scored input: every position
    # inputs cut on the left to the window, the last token dropped, as HFLM builds them
    assert scored_inputs([(("", ""), [1, 2, 3], [4, 5])], max_length=3) == {(2, 3, 4): 2}


def test_the_backend_scores_from_the_tail_exactly_as_from_every_position(tiny_folder, monkeypatch):
    """Loglikelihoods with the head applied at the scored tail only equal lm-eval's own (every
    position), on rows of different lengths in one batch, and the tail is shorter than the batch."""
    from ftc.evaluation import harness

    model, tokenizer = load_model(resolve_model(str(tiny_folder("gqa"))))
    lm = harness.FTCLM(pretrained=model, tokenizer=tokenizer, batch_size=4)
    gen = torch.Generator().manual_seed(0)
    requests = []
    for context_len, cont_len in [(30, 3), (12, 5), (25, 1), (7, 2), (40, 6), (3, 3)]:
        tokens = torch.randint(1, model.config.vocab_size, (context_len + cont_len,), generator=gen).tolist()
        requests.append((("", ""), tokens[:context_len], tokens[context_len:]))
    tails = []
    monkeypatch.setattr(harness, "scored_tail", lambda inps, scored: tails.append(
        (found := scored_tail(inps, scored), inps.shape[1])) or found)
    forward, positions = lm._model_call, []
    monkeypatch.setattr(lm, "_model_call", lambda inps, **kw: positions.append(
        ((out := forward(inps, **kw)).shape[1], inps.shape[1])) or out)
    from_tail = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert any(tail < width for tail, width in tails)
    assert [(tail, width) for tail, width in tails] == positions  # the model computed the tail only
    monkeypatch.setattr(harness, "scored_tail", lambda inps, scored: None)
    everywhere = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [greedy for _, greedy in from_tail] == [greedy for _, greedy in everywhere]
    assert [score for score, _ in from_tail] == pytest.approx([score for score, _ in everywhere], rel=1e-5, abs=1e-5)


def test_a_model_that_takes_no_logits_to_keep_is_scored_at_every_position(tiny_folder, monkeypatch):
    """Any Hugging Face model may be scored; one whose forward has no `logits_to_keep` gets HFLM's
    call as it is (asking it for a tail would raise)."""
    from ftc.evaluation import harness

    model, tokenizer = load_model(resolve_model(str(tiny_folder("gqa"))))
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda input_ids: forward(input_ids))
    lm = harness.FTCLM(pretrained=model, tokenizer=tokenizer, batch_size=2)
    calls = []
    monkeypatch.setattr(lm, "_model_call", lambda inps, **kw: calls.append(
        ((out := type(lm)._model_call(lm, inps, **kw)).shape[1], inps.shape[1])) or out)
    lm._loglikelihood_tokens([(("", ""), [5, 6, 7, 8], [9]), (("", ""), [5, 6], [7, 8])], disable_tqdm=True)
    assert calls and all(positions == width for positions, width in calls)
