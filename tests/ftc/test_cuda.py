"""The CUDA path against the CPU's: the same compression and the same model on either device.

Every other test runs on the CPU, where CI and the development machine run. These need a CUDA
device and are skipped without one; on a GPU machine, `pytest tests/ftc/test_cuda.py -s` runs them
(the root conftest imports no service module, so torch, transformers and gguf are enough).

What the GPU changes is where tensors live (pinned host buffers, layers streamed to the device and
back, factors brought home to be written, a loaded model's prepared forms moved by `.to`) and the
kernels' rounding; the plan, the ranks and the model's outputs must not change beyond that rounding.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ftc.compression.compress import CompressOptions, compress
from ftc.compression.sensitivity import CACHE_ENV
from ftc.runtime.artifact import load_artifact

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device; the CPU path is what the rest of the suite tests")

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
FIELDS = dict(calib_samples=6, seq_len=32, dtype="float32", batch_size=4, ratio=0.4)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.to(model.device)).logits.cpu()


def _greedy(model, cache: bool = True) -> torch.Tensor:
    out = model.generate(IDS[:1, :6].to(model.device), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                         use_cache=cache, pad_token_id=0)
    return out.cpu()


def _ranks(manifest: dict) -> list:
    """Per group: its kind, projections, factor shapes and kept core values (what the plan and the
    rank choices decide)."""
    return [[(g["kind"], g["proj"], g["shapes"], g.get("kept")) for g in layer["groups"]]
            for layer in manifest["layers"]]


@pytest.mark.parametrize(("layout", "scope", "allocation"), [
    ("gqa", "attention", "sensitivity"),  # the default options
    ("gemma3", "model", "sensitivity"),  # sliding and global layers, q/k norm, MQA; MLP groups
    ("phi3", "model", "uniform"),  # fused qkv and gate_up written back
    ("gptj", "attention", "uniform"),  # parallel attention and MLP
])
def test_compressing_on_cuda_gives_the_cpus_artifact(layout, scope, allocation, tiny_folder, tmp_path, monkeypatch):
    """Streamed from the folder on disk as `ftc compress` does: the same plan and ranks on both
    devices, and two artifacts (both read on the CPU) that approximate the dense model alike.

    Their logits agree to about 1e-5 where no discrete choice sits near a tie. Where one does (the
    sparse core's support, the outcome guard's pick), rounding can tip it: on the tiny Phi-3 at
    whole-model 0.4, a 1e-7 relative change of the weights moves the CPU's own artifact's logits by
    4%, against a 72% distance from dense. So the gap is bounded by a share of that distance."""
    folder = tiny_folder(layout, layers=3)
    manifests, logits = {}, {}
    for device in ("cpu", "cuda"):
        monkeypatch.setenv(CACHE_ENV, str(tmp_path / f"cache-{device}"))  # each device measures its own plan
        options = CompressOptions(model=str(folder), device=device, scope=scope, allocation=allocation, **FIELDS)
        manifests[device] = compress(options, tmp_path / device, progress=False)
        model, _, _ = load_artifact(tmp_path / device)
        logits[device] = _logits(model)
    assert manifests["cuda"]["device"].startswith("cuda")
    assert manifests["cuda"]["allocation"] == manifests["cpu"]["allocation"]
    assert _ranks(manifests["cuda"]) == _ranks(manifests["cpu"])
    dense = _logits(AutoModelForCausalLM.from_pretrained(folder))
    gap, far = _rel(logits["cuda"], logits["cpu"]), _rel(logits["cpu"], dense)
    print(f"{layout} {scope} {allocation}: cuda vs cpu artifact logits, relative {gap:.2e}; cpu vs dense {far:.2e}")
    assert gap < 0.05 * far
    assert abs(_rel(logits["cuda"], dense) - far) < 0.02 * far


@pytest.mark.parametrize("layout", ["gqa", "gemma3", "phi3", "qwen2_bias"])
def test_an_artifact_runs_on_cuda_as_on_the_cpu(layout, tiny_artifact):
    """Both runtimes on the GPU: every tensor there (the speed forms' prepared ones too), logits as
    on the CPU, greedy generation with the KV cache as without it and as on the CPU; bfloat16 runs."""
    folder = tiny_artifact(layout)
    cpu, _, _ = load_artifact(folder)
    reference, tokens = _logits(cpu), _greedy(cpu)
    for runtime in ("speed", "memory"):
        model, _, _ = load_artifact(folder, device="cuda", runtime=runtime)
        held = [*model.parameters(), *model.buffers()]
        assert held and all(t.device.type == "cuda" for t in held), runtime
        gap = _rel(_logits(model), reference)
        print(f"{layout} {runtime}: cuda vs cpu logits, relative {gap:.2e}")
        assert gap < 1e-4, runtime
        assert torch.equal(_greedy(model), tokens) and torch.equal(_greedy(model, cache=False), tokens), runtime
    half, _, _ = load_artifact(folder, torch.bfloat16, device="cuda")
    gap = _rel(_logits(half), reference)
    print(f"{layout} bfloat16: cuda vs cpu float32 logits, relative {gap:.2e}")
    assert gap < 0.05
