"""An artifact is a transformers model: its own architecture, loaded with `trust_remote_code=True`
through the modeling file it carries, computing what `load_artifact` computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from ftc.runtime.artifact import load_artifact
from ftc.runtime.hf import modeling_ftc
from ftc.runtime.hf.modeling_ftc import FactorGroup, choose_form, form_costs
from tests.support.tiny import LAYOUTS

IDS = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(7))


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _groups(model) -> list:
    """Factor groups by class name: the remote-code copy of a class is not ftc's class."""
    return [m for m in model.modules() if type(m).__name__ in ("TuckerGroup", "LowRankGroup")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_remote_code_loads_the_factorized_model_with_load_artifacts_logits(layout, tiny_artifact):
    folder = tiny_artifact(layout)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"].startswith("ftc_") and config["auto_map"]["AutoModelForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert type(model).__name__ == config["architectures"][0]
    assert _groups(model) and type(model).__module__.startswith("transformers_modules.")
    reference, _, _ = load_artifact(folder)
    assert _rel(_logits(model), _logits(reference)) < 1e-4


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_without_trust_remote_code_loading_fails_and_says_how(layout, tiny_artifact):
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoModelForCausalLM.from_pretrained(tiny_artifact(layout))


def test_generate_uses_the_kv_cache_and_save_pretrained_keeps_the_compressed_form(tiny_artifact, tmp_path):
    # the stored form is the one a loaded model can be saved from (test_runtime covers the other)
    model = AutoModelForCausalLM.from_pretrained(tiny_artifact("qwen2_bias"), trust_remote_code=True,
                                                 ftc_runtime="memory")
    prompt = IDS[:1, :6]
    cached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
    assert cached.shape[1] == 18 and torch.equal(cached, uncached)

    model.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "modeling_ftc.py").is_file()
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["model_type"] == "ftc_qwen2" and saved["ftc"]["layers"]
    with safe_open(tmp_path / "saved" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert any(".ftc.qkv.U1" in n for n in names) and not any(n.endswith("q_proj.weight") for n in names)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", trust_remote_code=True, ftc_runtime="memory")
    assert _rel(_logits(again), _logits(model)) < 1e-6


def test_dtype_and_device_map_behave_as_for_the_base_model(tiny_artifact):
    folder = tiny_artifact("gqa")
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.bfloat16,
                                                 device_map="cpu")
    groups = _groups(model)
    assert {p.dtype for g in groups for p in g.parameters()} == {torch.bfloat16}
    assert {b.dtype for g in groups for b in g.buffers()} <= {torch.uint8}  # the packed mask stays bits
    assert model.device.type == "cpu"
    full = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert _rel(_logits(model), _logits(full)) < 5e-2  # bfloat16 rounding only


def _held(group: FactorGroup) -> int:
    """Every tensor a group module keeps: parameters, buffers and anything left in its attributes."""
    tensors = {id(t): t for t in [*group.parameters(), *group.buffers()]}
    for value in vars(group).values():
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, torch.Tensor):
                tensors[id(item)] = item
    return sum(t.numel() for t in tensors.values())


@pytest.mark.parametrize("ratio", [0.2, 0.5, 0.8])
def test_runtime_values_are_the_tensors_held_and_within_a_quarter_of_the_stored(ratio, tiny_artifact):
    """The manifest's `runtime_values` are what the stored (`memory`) form holds."""
    folder = tiny_artifact("mha", ratio=ratio, dtype="float16")
    manifest = json.loads((folder / "manifest.json").read_text())
    model, _, _ = load_artifact(folder, runtime="memory")
    _logits(model)  # whatever a forward leaves behind counts too
    layers = model.get_submodule("model.layers")
    for entry in manifest["layers"]:
        held = sum(_held(g) for g in layers[entry["index"]].ftc.values())
        assert held == entry["runtime_values"]
        assert entry["runtime_values"] <= 1.25 * entry["stored_values"]
    assert manifest["runtime_values"] == sum(e["runtime_values"] for e in manifest["layers"])
    assert manifest["stored_values"] == sum(e["stored_values"] for e in manifest["layers"])


@pytest.mark.parametrize("ratio", [0.2, 0.5, 0.8])
def test_the_speed_form_holds_what_its_rule_counts(ratio, tiny_artifact):
    """Each group of a default load runs in the form `choose_form` names, holding exactly the values
    `form_costs` counts for it (nothing of the stored form left, nothing kept by a forward)."""
    model, _, _ = load_artifact(tiny_artifact("mha", ratio=ratio, dtype="float16"))
    _logits(model)
    records = model.ftc_forms()
    assert records and {r["form"] for r in records} <= {"factored", "merged", "dense"}
    for record in records:
        group = model.get_submodule(record["group"])
        assert record["form"] == group.form == choose_form(group.spec, "speed")
        assert _held(group) == record["values"] == form_costs(group.spec)[group.form].values


def test_sparse_cores_occur_in_the_accounting_test(tiny_artifact):
    """The accounting above covers the sparse form: some group at those ratios keeps a mask."""
    specs = [g for r in (0.2, 0.5, 0.8)
             for e in json.loads((tiny_artifact("mha", ratio=r, dtype="float16") / "manifest.json").read_text())[
                 "layers"] for g in e["groups"]]
    assert any("core_mask" in g["shapes"] for g in specs)


def test_remote_code_load_does_not_import_ftc(tiny_artifact, tmp_path):
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tiny_artifact('gqa'))!r}, trust_remote_code=True)\n"
        "m(torch.tensor([[1, 2, 3]]))\n"
        "print(type(m).__module__)\n"
        "print(sorted(k for k in sys.modules if k == 'ftc' or k.startswith('ftc.')))\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    module, imported = done.stdout.strip().splitlines()[-2:]
    assert module.startswith("transformers_modules.") and imported == "[]"


def _mapped(path) -> bool:
    """Whether `path` is memory-mapped into this process now."""
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_a_local_artifact_is_read_without_mapping_its_file(tiny_artifact):
    folder = tiny_artifact("gqa")
    weights_file = folder / modeling_ftc.WEIGHTS_FILE
    with modeling_ftc.unmapped_weights((folder,), {"subfolder": ""}) as weights:
        read = {name: weights.get_slice(name)[:] for name in weights.keys()}
        assert not _mapped(weights_file)
    with safe_open(weights_file, "pt") as stock:  # the control: transformers' own reader maps the file
        assert _mapped(weights_file)
        expected = {name: stock.get_tensor(name).clone() for name in stock.keys()}
    assert read.keys() == expected.keys() and all(torch.equal(read[n], expected[n]) for n in expected)
    # what only transformers' own reading handles goes there
    for args, kwargs in [(("someone/some-model",), {}), ((folder,), {"subfolder": "inner"}),
                         ((folder,), {"gguf_file": "x.gguf"}), ((folder, "extra"), {}), ((folder.parent,), {})]:
        assert modeling_ftc.unmapped_weights(args, kwargs) is None, (args, kwargs)


def test_loading_an_artifact_reads_its_weights_unmapped(tiny_artifact, monkeypatch):
    folder = tiny_artifact("gqa")
    opened = []

    def spy(args, kwargs):
        weights = unmapped_weights(args, kwargs)
        opened.append(weights)
        return weights

    unmapped_weights = modeling_ftc.unmapped_weights
    monkeypatch.setattr(modeling_ftc, "unmapped_weights", spy)
    model, _, _ = load_artifact(folder, runtime="memory")
    assert len(opened) == 1 and opened[0] is not None
    with pytest.raises(Exception, match="closed"):  # read through and closed, not left aside
        opened[0].keys()
    assert model.name_or_path == model.config.name_or_path == str(folder)
    monkeypatch.undo()
    stock = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, ftc_runtime="memory",
                                                 device_map="cpu")  # `device_map`: transformers reads it
    assert torch.equal(_logits(model), _logits(stock))
