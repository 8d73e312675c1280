"""benchmarks/generation.py: the shipped prompts, how an answer is cut from what a model generates,
and the three agreement scores against the dense model's answers."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.benchmarks import load_benchmark

generation = load_benchmark("generation")


def test_the_shipped_prompts_are_fifty_with_unique_ids_and_accepted_answers():
    prompts, sha = generation.read_prompts(generation.PROMPTS)
    assert len(prompts) == 50 and len({p["id"] for p in prompts}) == 50
    assert {p["kind"] for p in prompts} == {"fact", "arithmetic", "word", "instruction"}
    assert all(p["prompt"].strip() and p["answers"] and all(a.strip() for a in p["answers"]) for p in prompts)
    first, first_sha = generation.read_prompts(generation.PROMPTS, 3)
    assert first == prompts[:3] and first_sha != sha  # a smoke run's file is never mistaken for the full set's


def test_prefix_match_takes_a_shorter_or_longer_version_of_the_same_answer_only():
    assert generation.prefix_match("Paris.", "paris is the capital of France")
    assert generation.prefix_match("The capital is  PARIS!", "the capital is paris")
    assert not generation.prefix_match("Par", "Paris")  # on a word boundary
    assert not generation.prefix_match("", "Paris") and not generation.prefix_match("...", "")
    assert not generation.prefix_match("Rome", "Paris")


def test_an_answer_is_correct_when_an_accepted_answer_appears_in_it_as_whole_words():
    assert generation.correct("The capital of France is Paris.", ["Paris"])
    assert generation.correct("It has 8 legs", ["eight", "8"])
    assert generation.correct("1, 2, 3, 4, 5.", ["1, 2, 3, 4, 5"])
    assert not generation.correct("Parisian food", ["Paris"])
    assert not generation.correct("", ["Paris"])


def test_scores_are_shares_of_the_prompts_against_the_dense_answers():
    prompts = [{"answers": ["Paris"]}, {"answers": ["Tokyo"]}, {"answers": ["Rome"]}, {"answers": ["4"]}]
    dense = ["Paris.", "The capital of Japan is Tokyo.", "Milan", "4"]
    mine = ["Paris.", "The capital of Japan is", "Rome", "5"]
    assert generation.scores(mine, dense, prompts) == {"correct": 0.5, "exact": 0.25, "prefix": 0.5}
    assert generation.scores(dense, None, prompts) == {"correct": 0.75}


class Scripted:
    """A model whose generation is fixed text after the prompt, recording what it was asked with."""

    def __init__(self, tokenizer, text: str) -> None:
        self.continuation = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        self.calls: list[dict] = []

    def generate(self, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        self.calls.append({"prompt": ids, **kwargs})
        return torch.cat([ids, self.continuation], dim=1)


def test_a_chat_answer_is_the_new_text_and_a_plain_one_ends_at_the_first_line_break(smollm2_tokenizer):
    chat = Scripted(smollm2_tokenizer, "Paris.\nIt is also the largest city.<|im_end|>")
    assert generation.answer(chat, smollm2_tokenizer, "What is the capital of France?", 32) == (
        "Paris.\nIt is also the largest city.")
    call = chat.calls[0]
    assert call["max_new_tokens"] == 32 and call["do_sample"] is False
    assert "<|im_start|>assistant" in smollm2_tokenizer.decode(call["prompt"][0])

    plain_tokenizer = copy.deepcopy(smollm2_tokenizer)
    plain_tokenizer.chat_template = None
    plain = Scripted(plain_tokenizer, " Paris\nQuestion: What is the capital of Spain?")
    assert generation.answer(plain, plain_tokenizer, "What is the capital of France?", 32) == "Paris"
    assert plain_tokenizer.decode(plain.calls[0]["prompt"][0]).endswith(
        "Question: What is the capital of France?\nAnswer:")


def test_examples_show_each_kind_of_prompt():
    kinds = ["fact"] * 5 + ["arithmetic"] * 3 + ["word"] * 3 + ["instruction"] * 3
    prompts = [{"kind": kind} for kind in kinds]
    chosen = generation.example_indices(prompts, 6)
    assert len(chosen) == 6 and {prompts[i]["kind"] for i in chosen} == set(kinds)


def test_the_table_lists_every_cell_and_shows_answers_side_by_side():
    prompts = [{"id": "a", "kind": "fact", "prompt": "Capital of France?", "answers": ["Paris"]}]
    results = {"model": "smollm2-135m", "scope": "attention", "max_new_tokens": 32, "prompts_sha256": "ab" * 32,
               "gsm8k_limit": 2, "format": "the tokenizer's chat template", "commands": ["generation.py"],
               "dense": {"answers": ["Paris"], "correct": 1.0,
                         "gsm8k": {"exact_match": 0.5, "flexible_exact_match": 1.0}},
               "cells": {"ftc@0.4": {"method": "ftc", "ratio": 0.4, "answers": ["Paris | France\nok"], "exact": 0.0,
                                     "prefix": 1.0, "correct": 1.0,
                                     "gsm8k": {"exact_match": 0.0, "flexible_exact_match": 0.5,
                                               "recompressed": True}}}}
    text = generation.render(results, prompts, {"dense": {"ppl": 29.89}, "cells": {"ftc@0.4": {"ppl": 41.68}}})
    assert "| 1.0 | dense | 100 | 100 | 100 | 50 / 100 | 29.89 |" in text
    assert "| 0.4 | ftc | 0 | 100 | 100 | 0 / 50 ° | 41.68 |" in text
    assert "| 0.4 | ftc | Paris \\| France ⏎ ok |" in text  # a pipe or line break never breaks the table
    assert "° GSM8K measured after" in text


@pytest.mark.parametrize(("scope", "name"), [("attention", "generation_gemma3-270m.json"),
                                             ("model", "generation_gemma3-270m_model_scope.json")])
def test_results_go_to_one_file_per_model_and_scope(scope, name):
    assert generation.generation_file("gemma3-270m", scope).name == name
