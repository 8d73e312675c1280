"""A multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`, `model_type` `gemma3`) is
compressed as its text decoder: the weight source presents a `gemma3_text` checkpoint, so the
artifact and its dense export are text-only `Gemma3ForCausalLM` models computing the multimodal
model's logits on text-only input (exactly so where the compression is exact)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

from ftc.compression.compress import CompressOptions, calibration_batch, compress
from ftc.models.arch import TEXT_PARTS, UnsupportedModel, layout_of
from ftc.models.registry import ModelSource
from ftc.models.weights import text_part
from ftc.options import InputError
from ftc.runtime.artifact import load_artifact
from ftc.runtime.export import export_dense
from tests.support.pipeline import compress_model, method_of
from tests.support.tiny import tiny_multimodal

LOW_RANK = 8
"""Rank of the attention weights in the exactness tests: below every projection's rank at ratio 1.0
(19 for K and V, 27 for Q and O), so the SVD at ratio 1.0 reconstructs them."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _text_ids(vocab_size: int) -> torch.Tensor:
    """Text tokens only: the image token (the last id) never occurs."""
    return torch.randint(0, vocab_size - 1, (2, 40), generator=torch.Generator().manual_seed(5))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _low_rank_attention(model) -> None:
    """Every attention projection of the text decoder becomes a random rank-`LOW_RANK` matrix."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if ".self_attn." in name and name.endswith("_proj.weight"):
                rows, cols = p.shape
                p.copy_(torch.randn(rows, LOW_RANK, generator=generator) @ torch.randn(LOW_RANK, cols,
                                                                                      generator=generator) / cols)


def _save(model, tokenizer, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_both_checkpoint_spellings_map_to_the_text_model_and_the_vision_tower_is_left_out():
    part = TEXT_PARTS["gemma3"]
    saved = "language_model.model.layers.3.self_attn.q_proj.weight"
    assert part.text_name(saved) == "model.layers.3.self_attn.q_proj.weight"
    assert part.text_name("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert part.text_name("language_model.lm_head.weight") == "lm_head.weight"
    assert part.text_name("lm_head.weight") == "lm_head.weight"
    for outside in ("vision_tower.encoder.layers.0.self_attn.q_proj.weight", "model.vision_tower.head.probe",
                    "multi_modal_projector.mm_input_projection_weight",
                    "model.multi_modal_projector.mm_soft_emb_norm.weight"):
        assert part.text_name(outside) is None


def test_a_saved_multimodal_checkpoint_compresses_like_its_text_decoder_in_memory(tmp_path, smollm2_tokenizer,
                                                                                   capsys):
    """`ftc compress` on the folder; the reference is a `Gemma3ForCausalLM` built by hand from the
    multimodal model's language model and compressed in memory on the same calibration."""
    from cli.main import main

    tokenizer = smollm2_tokenizer
    vocab = len(tokenizer)
    mm = tiny_multimodal(vocab_size=vocab, layers=3)
    folder = _save(mm, tokenizer, tmp_path / "mm")
    flags = dict(method="ftc", ratio=0.5, calib="wikitext2", calib_samples=4, seq_len=32, batch_size=2,
                 dtype="float32", device="cpu")
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    assert main(["compress", "--model", str(folder), *argv, "--out", str(tmp_path / "a"), "--quiet"]) == 0
    capsys.readouterr()

    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["base_model"]["model_type"] == "gemma3_text"
    assert manifest["base_model"]["text_part_of"] == "gemma3"
    with safe_open(tmp_path / "a" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert names and not {n for n in names if not n.startswith(("model.layers.", "model.embed_tokens.", "model.norm."))}

    text = Gemma3ForCausalLM(copy.deepcopy(mm.config.text_config)).eval()
    text.model.load_state_dict(mm.model.language_model.state_dict())
    ids = _text_ids(vocab)
    assert _rel(_logits(text, ids), _logits(mm, ids)) < 1e-6  # the reference is the multimodal model's text path
    calib = calibration_batch(tokenizer, CompressOptions(model=str(folder), **flags), text.config.hidden_size)
    compress_model(text, layout_of(text.config), method_of(manifest), calib,
                   device=torch.device("cpu"), batch_size=2)
    artifact, _, _ = load_artifact(tmp_path / "a")
    assert type(artifact).__name__ == "FtcGemma3ForCausalLM"
    assert _rel(_logits(artifact, ids), _logits(text, ids)) < 1e-4
    assert _rel(_logits(artifact, ids), _logits(mm, ids)) > 1e-4  # compressed for real


@pytest.mark.parametrize("tied", [True, False], ids=["tied_head", "own_head"])
@pytest.mark.parametrize("form", ["saved", "in_memory"])
def test_an_exact_compression_computes_the_multimodal_models_text_logits(form, tied, tmp_path, smollm2_tokenizer):
    """Low-rank attention and an SVD at ratio 1.0: nothing is lost, so the artifact and its stock dense
    export must give the multimodal model's own logits; a wrong name, layer or head would not.
    A saved checkpoint says `language_model.model.*` (+ `language_model.lm_head`); a model in
    memory says `model.language_model.*` (+ `lm_head`)."""
    tokenizer = smollm2_tokenizer
    mm = tiny_multimodal(vocab_size=len(tokenizer), layers=3, tied=tied)
    _low_rank_attention(mm)
    options = CompressOptions(method="svd", ratio=1.0, dtype="float32", device="cpu")
    if form == "saved":
        options.model = str(_save(mm, tokenizer, tmp_path / "mm"))
        manifest = compress(options, tmp_path / "a", progress=False)
    else:
        source = ModelSource(spec="in-memory", kind="hf", path=tmp_path / "mm")
        manifest = compress(options, tmp_path / "a", loaded=(mm, tokenizer, source), progress=False)
    assert manifest["base_model"]["text_part_of"] == "gemma3"
    ids = _text_ids(len(tokenizer))
    expected = _logits(mm, ids)
    artifact, _, _ = load_artifact(tmp_path / "a")
    assert _rel(_logits(artifact, ids), expected) < 1e-5
    export_dense(tmp_path / "a", tmp_path / "dense", dtype="float32")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    assert type(stock) is Gemma3ForCausalLM and stock.config.tie_word_embeddings is tied
    assert _rel(_logits(stock, ids), expected) < 1e-5


def test_the_dry_run_says_only_the_text_decoder_is_compressed(tmp_path, smollm2_tokenizer, tiny_folder, capsys):
    from cli.main import main

    folder = _save(tiny_multimodal(vocab_size=len(smollm2_tokenizer), layers=4), smollm2_tokenizer, tmp_path / "mm")
    capsys.readouterr()
    assert main(["compress", "--model", str(folder), "--ratio", "0.3", "--device", "cpu", "--dry-run", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["model_type"] == "gemma3_text" and shown["text_part_of"] == "gemma3" and shown["layers"] == 4
    assert shown["layer_types"] == {"sliding_attention": 2, "full_attention": 2}
    assert shown["projections"]["q"] == "self_attn.q_proj" and shown["heads"] == 2 and shown["kv_heads"] == 1
    assert main(["compress", "--model", str(tiny_folder("gemma3")), "--device", "cpu", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text_part_of"] is None


def test_the_wrapper_reaches_the_pipeline_only_as_its_text_decoder():
    """`layout_of` on the wrapper's own config (whose module tree nests the decoder) points to the
    source that unwraps it; a checkpoint with none of the decoder's names fails in one line."""
    config = tiny_multimodal().config
    with pytest.raises(UnsupportedModel, match="open_weights, which presents its text decoder as a 'gemma3_text'"):
        layout_of(config)
    vision_only = SimpleNamespace(config=config, resident=True, names=lambda: ["vision_tower.head.probe"])
    with pytest.raises(InputError, match="holds no tensor of its text decoder") as raised:
        text_part(vision_only)
    assert len(str(raised.value).splitlines()) == 1
