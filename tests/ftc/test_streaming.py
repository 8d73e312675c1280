"""Layer streaming: sharded and GGUF sources, one layer resident at a time, resumable runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from cli.main import main
from ftc.compression.compress import CompressOptions, compress
from ftc.models.arch import UnsupportedModel, layout_of
from ftc.numerics.metric import spilling
from ftc.options import InputError
from ftc.runtime.artifact import load_artifact
from tests.support.pipeline import compress_loaded
from tests.support.tiny import tiny_model

FTC = [sys.executable, "-m", "cli"]
IDS = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(5))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("layout_name", ["gqa", "phi3", "gemma3", "olmo2"])
def test_streamed_sharded_run_equals_the_in_memory_run(layout_name, tiny_folder, smollm2_tokenizer, tmp_path):
    """Streamed from disk, one layer resident, equals the model held in memory: for the plain layout,
    a fused Q/K/V projection (Phi-3), per-layer-type kwargs (Gemma 3) and post-norms (OLMo 2)."""
    folder = tiny_folder(layout_name, layers=3, shard_bytes=200_000)
    assert (folder / "model.safetensors.index.json").is_file()
    options = CompressOptions(model=str(folder), ratio=0.4, calib_samples=4, seq_len=64, dtype="float32",
                              device="cpu", batch_size=2)
    spilled = []  # whether the Grams spill to files while each layer is compressed (from disk: yes)
    manifest = compress(options, tmp_path / "streamed", progress=False, on_layer=lambda _: spilled.append(spilling()))
    streamed, _, _ = load_artifact(tmp_path / "streamed")
    assert spilled == [True] * 3 and not spilling()

    # the same model held in memory (as the benchmarks pass it), through the same compress()
    model = tiny_model(layout_name, vocab_size=len(smollm2_tokenizer), layers=3)
    in_memory, _, _ = compress_loaded(model, smollm2_tokenizer, tmp_path / "in-memory", ratio=0.4, calib_samples=4,
                                      seq_len=64, dtype="float32", batch_size=2)
    torch.testing.assert_close(_logits(streamed), _logits(in_memory), rtol=1e-5, atol=1e-5)
    assert manifest["resumed_from_layer"] == 0 and len(manifest["layers"]) == 3


def _compress_args(folder, out, work, ratio="0.4"):
    return ["compress", "--model", str(folder), "--ratio", ratio, "--calib-samples", "8", "--seq-len", "128",
            "--device", "cpu", "--dtype", "float32", "--batch-size", "2", "--quiet", "--out", str(out),
            "--work-dir", str(work)]


def test_a_killed_run_resumes_and_matches_an_uninterrupted_one(tiny_folder, tmp_path, capsys):
    """The run that is killed is a process of its own (SIGKILL); the resumed, uninterrupted and refused
    runs go through the same command line in process (`cli.main`), without an interpreter each."""
    folder = tiny_folder("gqa", layers=8, hidden=256)
    work = tmp_path / "work"
    proc = subprocess.Popen([*FTC, *_compress_args(folder, tmp_path / "resumed", work)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (work / "layer-001.json").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "resumed").exists()
    assert main(_compress_args(folder, tmp_path / "resumed", work)) == 0
    manifest = json.loads((tmp_path / "resumed" / "manifest.json").read_text())
    assert 2 <= manifest["resumed_from_layer"] < 8
    assert main(_compress_args(folder, tmp_path / "straight", tmp_path / "work2")) == 0
    resumed, _, _ = load_artifact(tmp_path / "resumed")
    uninterrupted, _, _ = load_artifact(tmp_path / "straight")
    torch.testing.assert_close(_logits(resumed), _logits(uninterrupted), rtol=0, atol=0)
    # the same work dir refuses a different run
    capsys.readouterr()
    assert main(_compress_args(folder, tmp_path / "other", work, ratio="0.5")) == 2
    err = capsys.readouterr().err
    assert "different run" in err and "Traceback" not in err


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_folder, tmp_path):
    folder = tiny_folder("gemma_mqa")
    done = subprocess.run([*FTC, "compress", "--model", str(folder), "--ratio", "0.3", "--dry-run", "--json",
                           "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["layers"] == 2 and plan["slices"] == 2 + 2 * 1 and plan["qkv_shape"] == [48, 32, 4]
    assert plan["qkv_budget_values_per_layer"] == int(0.3 * 48 * 32 * 4)
    assert plan["estimated_peak_bytes"]["total"] > 0 and not (tmp_path / "x").exists()


def test_the_dry_run_counts_the_whole_model_where_the_plan_needs_it(tiny_folder, smollm2_tokenizer):
    """asvd's search holds the whole float32 model; the streamed plans (global, sensitivity) do not, nor
    does the loss metric's backward pass, which holds the gradients beside the stream instead."""
    from ftc.compression.compress import CompressOptions, plan

    folder = tiny_folder("gqa")
    model = tiny_model("gqa", vocab_size=len(smollm2_tokenizer))
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    for method, allocation, whole in [("ftc", "uniform", 0), ("ftc", "global", 0), ("asvd", "uniform", 4 * params),
                                      ("cp", "sensitivity", 0), ("ftc", "sensitivity", 0)]:
        peak = plan(CompressOptions(model=str(folder), method=method, allocation=allocation))["estimated_peak_bytes"]
        assert peak["whole_model_for_the_plan"] == whole
        assert peak["total"] == peak["one_layer_float32"] + peak["calibration_stream"] + peak["workspace"] + whole
    base, loss = (plan(CompressOptions(model=str(folder), allocation="uniform", ablate=ablate))["estimated_peak_bytes"]
                  for ablate in ((), ("loss_metric",)))
    assert loss["whole_model_for_the_plan"] == 0
    assert loss["workspace"] >= base["workspace"] + base["calibration_stream"]


def test_an_unsupported_architecture_fails_fast_naming_the_supported_ones():
    from transformers import GPT2Config

    supported = "gemma, gemma2, gemma3_text, gptj, llama, mistral, olmo2, phi3, qwen2, qwen3"
    with pytest.raises(UnsupportedModel, match=f"supported: {supported}"):
        layout_of(GPT2Config())


def test_gguf_tensors_stream_exactly_as_transformers_loads_them(monkeypatch):
    """Against transformers' own GGUF loading (`load_model`'s), each side reading one parse of the file
    (`gguf_parsed_once`): our config and reader; `load_model`'s tokenizer, config and weights."""
    import gguf

    from ftc.models.registry import resolve_model
    from ftc.models.weights import gguf_parsed_once, open_weights
    from ftc.runtime.loading import load_model

    parsed, built = [], gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *rest: parsed.append(path) or built(path, *rest))
    source = resolve_model("smollm2-135m")
    with gguf_parsed_once():  # as `compress` runs
        streamed = open_weights(source)
    assert len(parsed) == 1, parsed
    dense, _ = load_model(source)
    assert len(parsed) == 2, parsed
    state = dense.state_dict()
    assert set(streamed.names()) == set(state) - {"lm_head.weight"}  # tied head stored once
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        assert torch.equal(streamed.get(name), state[name]), name
    assert streamed.nbytes == os.path.getsize(source.path / source.gguf_file)


def test_joined_safetensors_hold_every_input_tensor_unchanged(tmp_path):
    """The artifact's weights file is the inputs' data sections copied verbatim under a merged header."""
    from safetensors.torch import load_file, save_file

    from ftc.runtime.artifact import concat_safetensors

    gen = torch.Generator().manual_seed(0)
    parts = [
        {"mask": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=gen),  # odd size: offsets shift
         "a": torch.randn(3, 5, generator=gen)},
        {"b": torch.randn(7, generator=gen).half(), "empty": torch.zeros(0, 4), "ids": torch.arange(6)},
        {"c": torch.randn(2, 2, generator=gen).double()},
    ]
    sources = []
    for i, part in enumerate(parts):
        save_file(part, str(tmp_path / f"{i}.safetensors"))
        sources.append(tmp_path / f"{i}.safetensors")
    size = concat_safetensors(sources, tmp_path / "joined.safetensors", {"format": "test"})
    joined = load_file(str(tmp_path / "joined.safetensors"))
    expected = {k: v for part in parts for k, v in part.items()}
    assert size == (tmp_path / "joined.safetensors").stat().st_size
    assert joined.keys() == expected.keys()
    for name, tensor in expected.items():
        assert joined[name].dtype == tensor.dtype and torch.equal(joined[name], tensor), name


def test_a_work_dir_is_not_resumed_by_a_method_with_other_fixed_choices(tiny_folder, tmp_path, monkeypatch):
    """The fingerprint holds the method's fixed choices: checkpoints made with another key weight
    (say, by an earlier version) are refused, not mixed into the artifact."""
    fields = dict(model=str(tiny_folder("gqa")), device="cpu", ratio=0.4, calib_samples=4, seq_len=32,
                  dtype="float32")
    work = tmp_path / "work"
    compress(CompressOptions(**fields), tmp_path / "a", work_dir=work, progress=False)
    assert compress(CompressOptions(**fields), tmp_path / "b", work_dir=work, progress=False)["resumed_from_layer"] == 2
    monkeypatch.setattr("ftc.compression.methods.KEY_WEIGHT", 2.0)
    with pytest.raises(InputError, match="different run"):
        compress(CompressOptions(**fields), tmp_path / "c", work_dir=work, progress=False)
