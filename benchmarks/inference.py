"""Serving speed and memory of FTC artifacts against the dense model they came from.

    .venv/bin/python benchmarks/inference.py                 # the full measurement (hours: see --help's epilog)
    .venv/bin/python benchmarks/inference.py --smoke         # under a minute: a small random model, plumbing only

What is measured, per model, dtype (float32, bfloat16) and thread count (one, and torch's default
of the machine, "all"):

- prefill: tokens/s of one forward over 4 x 512 tokens that fills the KV cache and computes the
  logits of the last position (what a server does before the first token);
- decode: tokens/s of greedy generation with the KV cache at batch 1 and 8, 128 new tokens after
  a 16-token prompt, timed from the first new token to the last (the prompt's own prefill is
  excluded);
- peak RSS: the high-water resident memory (`VmHWM`) of a fresh process that imports torch and
  transformers, loads the model and generates 128 tokens at batch 1; the interpreter's own
  (after the imports, the model family's classes included, before loading) is recorded beside it.

Variants: the dense model; FTC with attention-only compression at rho 0.8/0.6/0.4/0.2; FTC with
whole-model compression (`--scope model`) at keep ratios 0.8/0.6/0.4 (20/40/60% of the seven
linear projections removed), and the same with every core kept dense (`--ablate dense_core`,
ftc-method.md §9: the runtime then holds what is stored, `--dense-core-keeps`).
Artifacts load through `load_compressed` (the classes the transformers remote code runs) in their
default `speed` runtime; the dense model is the same weights saved as a float16 safetensors
folder, loaded with `AutoModelForCausalLM.from_pretrained`, so both read the same file format.

Each measurement is its own process: every repeat runs each variant once, in an order rotated
from repeat to repeat, so drift on the machine falls on all variants alike; tables give medians
of the repeats (at least 5 for the record) and the JSON keeps every sample. Nothing else may run
on the machine meanwhile: the load average before and after is recorded with the machine facts
and the command.

Models: SmolLM2-135M-Instruct (`smollm2-135m`: its GGUF dequantised; FTC artifacts compressed
with 8 x 512 calibration tokens), and a model of TinyLlama-1.1B's shape (hidden 2048, 32 query /
4 K/V heads, MLP 5632, vocabulary 32000, 22 layers) with random weights: its FTC factors come
from compressing one random layer of that shape (4 x 512 calibration tokens) and stand in every
layer of a full-depth artifact, since speed and memory depend on the shapes only.

Per FTC variant the JSON and the tables also give the form every group runs in (ftc-method.md
§9) and the values held at run time against the values stored, in the speed and memory runtimes,
computed from the artifact's shapes by the loader's own rule.

`--device cuda` runs the measured models on a GPU (artifacts are still compressed on the CPU):
timestamps are taken after the device's queue is drained, and the peak-memory processes add
`torch.cuda.max_memory_allocated` beside the host's RSS.

Writes benchmarks/results/inference.{json,md,png} (`--smoke`: a temporary folder). A block of
measurements (model, dtype, threads) is saved as soon as it is complete and skipped when the
command is run again with the same settings, so an interrupted run continues where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
ATTENTION_RATIOS = (0.8, 0.6, 0.4, 0.2)
MODEL_KEEPS = (0.8, 0.6, 0.4)
DTYPES = ("float32", "bfloat16")
REPEATS = 5
PREFILL = (4, 512)
PROMPT, NEW_TOKENS, DECODE_BATCHES = 16, 128, (1, 8)
ATTENTION = frozenset("qkvo")

TINYLLAMA_SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632,
                       vocab_size=32000, max_position_embeddings=2048, num_hidden_layers=22)
SMOKE_SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=352,
                   vocab_size=4000, max_position_embeddings=256, num_hidden_layers=2)
"""`--smoke`: the TinyLlama-shaped path at a size that compresses and runs in seconds."""

TARGETS = {
    "never_slower": 1.0,  # every FTC variant's prefill and decode tokens/s, x dense
    "model_0.6_decode_b1": 1.4,  # whole model, 40% smaller
    "model_0.6_prefill": 1.3,
    "model_0.6_rss": 0.75,  # peak RSS, x dense (at most)
    "held_speed": 1.6,  # attention values held / stored (at most)
    "held_memory": 1.25,
}
"""The targets of the runtime (SmolLM2-135M-Instruct on CPU, side by side in one run)."""
WHOLE_TARGETED = {"model-0.6": "whole model -40%", "model-dense-0.6": "whole model -40%, dense core"}
"""The variants the whole-model -40% targets are checked on, with their name in the verdicts: the
default compression, and the same with every core dense (`--ablate dense_core`)."""

QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1",
             "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


# ---------------------------------------------------------------------------------------------
# variants and the artifacts behind them


@dataclasses.dataclass(frozen=True)
class Variant:
    """One model to measure: the dense one, or an FTC artifact of one scope at one ratio."""

    name: str
    scope: str  # "dense" | "attention" | "model"
    ratio: float = 1.0
    folder: str | None = None
    unavailable: str | None = None
    unmapped: bool = False  # dense only: its weights read with `pread` as FTC's loader reads them
    dense_core: bool = False  # FTC only: compressed with `--ablate dense_core`
    own_kernel: bool = False  # dense only: one-token forwards off oneDNN, as a 16-bit FTC model's run

    @property
    def label(self) -> str:
        if self.scope == "dense":
            return ("dense, weights read unmapped" if self.unmapped else
                    "dense, one-token steps off oneDNN" if self.own_kernel else "dense")
        if self.scope == "attention":
            return f"attention rho {self.ratio}"
        core = ", dense core" if self.dense_core else ""
        return f"whole model keep {self.ratio} (-{round(100 * (1 - self.ratio))}%){core}"


def compress_to(folder: Path, model: str, ratio: float, scope: str, calib_samples: int, seq_len: int,
                dense_core: bool = False) -> Path:
    """An FTC artifact of `model` (compressed once; kept in `folder` for later runs)."""
    from ftc.compression.compress import CompressOptions, compress

    if (folder / "manifest.json").exists():
        return folder
    options = CompressOptions(model=model, ratio=ratio, calib_samples=calib_samples, seq_len=seq_len,
                              dtype="float16", device="cpu", scope=scope, ablate=("dense_core",) if dense_core else ())
    print(f"  compressing {model} ({scope}, {ratio}{', dense core' if dense_core else ''}) -> {folder}", flush=True)
    compress(options, folder, overwrite=True, progress=False)
    return folder


def dense_variants(folder: Path) -> list[Variant]:
    """The dense model loaded as transformers loads it (the reference of every ratio); the same
    weights read without mapping the file, as FTC's loader reads an artifact: the like-for-like
    control of the peak RSS (and a second dense process in each speed block, a measure of noise);
    and the dense model whose one-token forwards run off oneDNN, as an FTC model's do in 16-bit
    dtypes (ftc-method.md §9): what of a 16-bit FTC decode's gain is that kernel's alone.
    In float32 the switch changes nothing (MKL's GEMM either way): a third dense process."""
    return [Variant("dense", "dense", folder=str(folder)),
            Variant("dense-unmapped", "dense", folder=str(folder), unmapped=True),
            Variant("dense-own-kernel", "dense", folder=str(folder), own_kernel=True)]


def ftc_variants(make: Callable[[float, str, bool], Path], ratios: tuple[float, ...],
                 keeps: tuple[float, ...], dense_keeps: tuple[float, ...] = ()) -> list[Variant]:
    """The FTC variants, `make(ratio, scope, dense_core) -> folder`; a whole-model one whose compression
    fails is reported with the error instead of ending the run (its speed is then not measured)."""
    variants = [Variant(f"attention-{r}", "attention", r, str(make(r, "attention", False))) for r in ratios]
    for keep, dense_core in [*((k, False) for k in keeps), *((k, True) for k in dense_keeps)]:
        name = f"model-{'dense-' if dense_core else ''}{keep}"
        try:
            variants.append(Variant(name, "model", keep, str(make(keep, "model", dense_core)), dense_core=dense_core))
        except Exception as exc:  # a scope that exists but fails here is reported, not fatal
            variants.append(Variant(name, "model", keep, unavailable=f"{type(exc).__name__}: {exc}",
                                    dense_core=dense_core))
    return variants


def artifact_name(scope: str, ratio: float, dense_core: bool) -> str:
    """The folder name of a variant's artifact under `--artifacts` (kept between runs, so a dense-core
    artifact must not take the name of the default one)."""
    return f"{scope}-{ratio}" + ("-dense_core" if dense_core else "")


def save_dense(model, tokenizer, folder: Path) -> None:
    """`model` as a float16 safetensors folder (the dtype artifacts keep their untouched weights in).

    Saved from a plain model of the same config: one loaded from a GGUF keeps a quantizer that
    refuses to save, though its weights are dequantised.
    """
    import torch
    from transformers import AutoModelForCausalLM

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float16)
    plain.load_state_dict({k: v.to(torch.float16) for k, v in model.state_dict().items()})
    plain.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    os.replace(tmp, folder)


def smollm2(artifacts: Path, ratios, keeps, dense_keeps=()) -> tuple[list[Variant], dict]:
    from ftc.models.registry import resolve_model
    from ftc.runtime.loading import load_model

    dense = artifacts / "smollm2-dense"
    if not (dense / "config.json").exists():
        print(f"  writing the dense SmolLM2 folder {dense}", flush=True)
        save_dense(*load_model(resolve_model("smollm2-135m")), dense)

    def make(ratio: float, scope: str, dense_core: bool) -> Path:
        return compress_to(artifacts / f"smollm2-{artifact_name(scope, ratio, dense_core)}", "smollm2-135m", ratio,
                           scope, 8, 512, dense_core)

    variants = [*dense_variants(dense), *ftc_variants(make, ratios, keeps, dense_keeps)]
    return variants, {"title": "SmolLM2-135M-Instruct", "vocab": 49152,
                      "setup": "SmolLM2-135M-Instruct (its Q4_1 GGUF dequantised, saved as float16 safetensors); "
                               "FTC artifacts compressed from it with 8 x 512 WikiText-2 calibration tokens"}


def random_llama(shape: dict, layers: int, vocab: int, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(**{**shape, "num_hidden_layers": layers, "vocab_size": vocab})
    return AutoModelForCausalLM.from_config(config).eval()


def replicate(one_layer: Path, dense: Path, out: Path, layers: int) -> Path:
    """A full-depth artifact: `dense`'s weights, each layer's compressed projections replaced by
    the groups of `one_layer`'s (only) layer, the same in every layer.

    The folder is what `ftc compress` writes (config with the `ftc` block, weights, manifest, the
    modeling file), so it loads through `load_compressed` like any artifact.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ftc.runtime.artifact import CODE, CONFIG, MANIFEST, WEIGHTS, atomic_dir

    if (out / MANIFEST).exists():
        return out
    config = json.loads((one_layer / CONFIG).read_text())
    manifest = json.loads((one_layer / MANIFEST).read_text())
    prefix = config["ftc"]["layers_path"]
    source = load_file(str(one_layer / WEIGHTS))
    kept = [n[len(f"{prefix}.0."):] for n in source if n.startswith(f"{prefix}.0.")]
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(dense.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                if not name.startswith(f"{prefix}."):
                    tensors[name] = f.get_tensor(name)
                elif name.split(".", prefix.count(".") + 2)[-1] in kept:
                    tensors[name] = f.get_tensor(name)
    for index in range(layers):
        for suffix in kept:
            if suffix.startswith("ftc."):
                # one copy per layer, as compress writes them
                tensors[f"{prefix}.{index}.{suffix}"] = source[f"{prefix}.0.{suffix}"].clone()
    missing = [f"{prefix}.{i}.{s}" for i in range(layers) for s in kept if f"{prefix}.{i}.{s}" not in tensors]
    if missing:
        raise ValueError(f"{dense} lacks {missing[:3]}: not the shape {one_layer} was compressed at")
    dense_config = json.loads((dense / CONFIG).read_text())
    entry = manifest["layers"][0]
    config.update(num_hidden_layers=layers, vocab_size=dense_config["vocab_size"])
    config["ftc"]["layers"] = [{**config["ftc"]["layers"][0], "index": i} for i in range(layers)]
    manifest.update(layers=[{**entry, "index": i} for i in range(layers)],
                    stored_values=entry["stored_values"] * layers, runtime_values=entry["runtime_values"] * layers,
                    synthetic=f"layer 0 of {one_layer.name} in each of {layers} layers of {dense.name}")
    with atomic_dir(out, overwrite=True) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS), {"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        shutil.copyfile(one_layer / CODE, tmp / CODE)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


def llama_shape(artifacts: Path, ratios, keeps, shape: dict, tag: str, title: str,
                calib: tuple[int, int] = (4, 512), dense_keeps=()) -> tuple[list[Variant], dict]:
    """The dense random model of `shape` and its FTC artifacts (one compressed layer, replicated,
    calibrated with `calib` = (sequences, tokens))."""
    from ftc.models.registry import load_tokenizer, resolve_model

    layers, vocab = shape["num_hidden_layers"], shape["vocab_size"]
    dense = artifacts / f"{tag}-dense-{layers}"
    if not (dense / "config.json").exists():
        print(f"  writing the dense random {tag} folder {dense}", flush=True)
        save_dense(random_llama(shape, layers, vocab, seed=1), None, dense)
    source = artifacts / f"{tag}-source-1layer"
    if not (source / "config.json").exists():  # SmolLM2's vocabulary, so its tokenizer reads the calibration text
        save_dense(random_llama(shape, 1, 49152, seed=0), load_tokenizer(resolve_model("smollm2-135m")), source)

    def make(ratio: float, scope: str, dense_core: bool) -> Path:
        name = artifact_name(scope, ratio, dense_core)
        one = compress_to(artifacts / f"{tag}-1layer-{name}", str(source), ratio, scope, *calib, dense_core)
        return replicate(one, dense, artifacts / f"{tag}-{layers}-{name}", layers)

    variants = [*dense_variants(dense), *ftc_variants(make, ratios, keeps, dense_keeps)]
    return variants, {"title": title, "vocab": vocab,
                      "setup": f"random weights of the shape {shape}; FTC: one random layer of that shape "
                               f"compressed with {calib[0]} x {calib[1]} calibration tokens, its groups in every layer"}


# ---------------------------------------------------------------------------------------------
# held values and forms, from the artifact's shapes


def runtime_summary(folder: Path) -> dict:
    """Forms and values held per runtime, from the config's group specs by the loader's rule."""
    from ftc.runtime.hf.modeling_ftc import choose_form, form_costs

    block = json.loads((folder / "config.json").read_text())["ftc"]
    manifest = json.loads((folder / "manifest.json").read_text())
    stored = {(e["index"], "".join(g["proj"])): g["values"] for e in manifest["layers"] for g in e["groups"]}
    forms: dict[str, Counter] = {}
    totals = {part: {"stored": 0, "speed": 0, "memory": 0} for part in ("attention", "mlp")}
    for entry in block["layers"]:
        for spec in entry["groups"]:
            name = "".join(spec["proj"])
            form = choose_form(spec, "speed")
            forms.setdefault(name, Counter())[form] += 1
            costs = form_costs(spec)
            part = totals["attention" if set(spec["proj"]) <= ATTENTION else "mlp"]
            part["stored"] += stored[(entry["index"], name)]
            part["speed"] += costs[form].values
            part["memory"] += costs["stored"].values
    return {"forms": {name: dict(c) for name, c in forms.items()},
            "held": {part: {**t, "speed_x_stored": round(t["speed"] / t["stored"], 3) if t["stored"] else None,
                            "memory_x_stored": round(t["memory"] / t["stored"], 3) if t["stored"] else None}
                     for part, t in totals.items()}}


# ---------------------------------------------------------------------------------------------
# one measurement, in its own process


def _proc_status(field: str) -> int | None:
    """A `/proc/self/status` memory field in bytes (Linux), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss() -> int:
    peak = _proc_status("VmHWM")
    if peak is None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak


class _Clock:
    """A generation streamer that timestamps the prompt and every new token, once `sync` (the
    device's queue drained: kernels on an accelerator return before they finish) has returned."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.times: list[float] = []
        self.sync = sync

    def put(self, _value) -> None:
        self.sync()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def worker(job: dict) -> dict:
    """One fresh process's measurement: `speed` (prefill and decode) or `rss` (load and generate)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftc.runtime.artifact import ftc_block
    from ftc.runtime.hf.modeling_ftc import family

    # the model's classes imported before the interpreter's own RSS is read (transformers imports a
    # family's modules on first use: 140 MiB for Llama's), so "above the imports" is what loading adds
    if job["scope"] == "dense":
        config = AutoConfig.from_pretrained(job["folder"])
        dense_cls = AutoModelForCausalLM._model_mapping[type(config)]
    else:
        family(ftc_block(Path(job["folder"]))["base_model_type"])
    rss_imports = _proc_status("VmRSS")
    threads = job["threads"]
    torch.set_num_threads(threads)
    dtype = getattr(torch, job["dtype"])
    device = torch.device(job.get("device", "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    if job["scope"] == "dense" and job.get("unmapped"):
        from ftc.runtime.hf.modeling_ftc import load_unmapped, unmapped_weights

        weights = unmapped_weights((job["folder"],), {})
        model = load_unmapped(dense_cls.from_pretrained, weights, config, dtype=dtype).to(device).eval()
    elif job["scope"] == "dense":
        model = AutoModelForCausalLM.from_pretrained(job["folder"], dtype=dtype).to(device).eval()
        if job.get("own_kernel"):
            from ftc.runtime.hf.modeling_ftc import one_token_off_onednn

            model.forward = one_token_off_onednn(model.forward)
    else:
        from ftc.runtime.artifact import load_compressed

        model = load_compressed(Path(job["folder"]), dtype, device, runtime=job["runtime"])  # no tokenizer, as dense
    sync()
    load_seconds = time.perf_counter() - t0
    rss_loaded = _proc_status("VmRSS")
    generator = torch.Generator().manual_seed(0)
    batch, length = job["prefill"]
    ids = torch.randint(0, job["vocab"], (batch, length), generator=generator).to(device)
    prompts = {b: torch.randint(0, job["vocab"], (b, job["prompt"]), generator=generator).to(device)
               for b in job["batches"]}

    def generate(prompt, tokens: int) -> _Clock:
        clock = _Clock(sync)
        out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, use_cache=True,
                             pad_token_id=0, streamer=clock)
        assert out.shape[1] == prompt.shape[1] + tokens, out.shape
        return clock

    result = {"load_seconds": round(load_seconds, 3), "threads": torch.get_num_threads()}
    new = job["new_tokens"]
    with torch.inference_mode():
        if job["kind"] == "rss":
            generate(prompts[1], new)
            on_device = {"peak_device_bytes": torch.cuda.max_memory_allocated(device)} if device.type == "cuda" else {}
            return {**result, "peak_rss": peak_rss(), "rss_imports": rss_imports, "rss_loaded": rss_loaded,
                    **on_device}
        # warm-up at the measured shapes: kernels pick and cache their plans per shape on first use
        model(ids, use_cache=True, logits_to_keep=1)
        for prompt in prompts.values():
            generate(prompt, 4)
        sync()
        start = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        sync()
        result["prefill_tokens_per_s"] = batch * length / (time.perf_counter() - start)
        for b, prompt in prompts.items():
            clock = generate(prompt, new)
            # times[0]: the prompt handed over; times[1]: first new token (prompt prefill done)
            result[f"decode_b{b}_tokens_per_s"] = b * (new - 1) / (clock.times[-1] - clock.times[1])
            result[f"first_token_b{b}_seconds"] = clock.times[1] - clock.times[0]
    return result


def run_worker(job: dict, timeout: float) -> dict:
    threads = str(job["threads"])
    env = {**os.environ, **QUIET_ENV, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True,
                              env=env, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# the side-by-side loop


def median_of(samples: list[dict], key: str) -> float | None:
    values = [s[key] for s in samples if key in s]
    return statistics.median(values) if values else None


def spread_of(samples: list[dict], key: str) -> float | None:
    """Half the range of the samples, relative to their median (how far apart the repeats were)."""
    values = [s[key] for s in samples if key in s]
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / 2 / statistics.median(values)


SPEED_KEYS = ("prefill_tokens_per_s", *(f"decode_b{b}_tokens_per_s" for b in DECODE_BATCHES))
RSS_KEYS = ("peak_rss", "rss_imports", "rss_loaded", "peak_device_bytes")
"""`peak_device_bytes`: `torch.cuda.max_memory_allocated` of the same process, with `--device cuda` only."""


def measure_block(variants: list[Variant], base_job: dict, kind: str, repeats: int, timeout: float,
                  progress: dict) -> dict:
    """Every available variant once per repeat, each in a fresh process, the order rotated."""
    live = [v for v in variants if v.unavailable is None]
    samples: dict[str, list[dict]] = {v.name: [] for v in live}
    for repeat in range(repeats):
        shift = repeat % len(live)
        for variant in live[shift:] + live[:shift]:
            job = {**base_job, "kind": kind, "scope": variant.scope, "folder": variant.folder,
                   "unmapped": variant.unmapped, "own_kernel": variant.own_kernel}
            started = time.perf_counter()
            sample = run_worker(job, timeout)
            progress["done"] += 1
            progress["seconds"] += time.perf_counter() - started
            eta = progress["seconds"] / progress["done"] * (progress["total"] - progress["done"])
            print(f"    {kind} {variant.name} repeat {repeat + 1}/{repeats}: "
                  f"{sample.get('error') or _brief(sample)}  [{progress['done']}/{progress['total']}, "
                  f"about {eta / 60:.0f} min left]", flush=True)
            samples[variant.name].append(sample)
    keys = SPEED_KEYS if kind == "speed" else RSS_KEYS
    return {name: {"median": {k: median_of(s, k) for k in keys}, "spread": {k: spread_of(s, k) for k in keys},
                   "errors": [x["error"] for x in s if "error" in x], "samples": s} for name, s in samples.items()}


def _brief(sample: dict) -> str:
    if "peak_rss" in sample:
        return f"peak RSS {sample['peak_rss'] / 2**20:.0f} MiB"
    return " ".join(f"{k.split('_tokens')[0]} {sample[k]:.1f}" for k in SPEED_KEYS if k in sample)


def machine_facts(device: str = "cpu") -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    cores = None
    try:
        text = Path("/proc/cpuinfo").read_text()
        names = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
        cpu = names[0] if names else cpu
        ids, physical, core = set(), None, None
        for line in text.splitlines():
            if line.startswith("physical id"):
                physical = line.split(":")[1].strip()
            elif line.startswith("core id"):
                core = line.split(":")[1].strip()
                ids.add((physical, core))
        cores = len(ids) or None
    except OSError:
        pass
    memory = None
    try:
        memory = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=ROOT).stdout.strip())
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "physical_cores": cores,
            "torch_default_threads": torch.get_num_threads(), "memory_bytes": memory,
            "cpu_kernels": torch.backends.cpu.get_cpu_capability(), "os": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "git_commit": commit + (" (with uncommitted changes)" if dirty else ""),
            **({"accelerator": f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"}
               if torch.device(device).type == "cuda" else {})}


def settings_of(args, threads: list[int]) -> dict:
    return {"prefill": list(args.prefill), "prompt": PROMPT, "new_tokens": args.new_tokens,
            "decode_batches": list(DECODE_BATCHES), "repeats": args.repeats, "dtypes": list(args.dtypes),
            "threads": threads, "runtime": args.runtime, "ratios": list(args.ratios), "keeps": list(args.keeps),
            **({"dense_core_keeps": list(args.dense_core_keeps)} if args.dense_core_keeps else {}),
            "tiny_layers": args.tiny_layers,
            **({"device": args.device} if args.device != "cpu" else {})}  # a CPU run's settings as before


def run(args) -> dict:
    import torch

    check_device(args.device)
    threads = sorted({1, torch.get_num_threads()} if args.threads == "both" else {int(args.threads)})
    settings = settings_of(args, threads)
    results = json.loads(args.out.read_text()) if args.out.exists() and not args.fresh else {}
    if "settings" not in results:  # nothing yet, or the format before this benchmark's: start afresh
        results = {}
    elif results["settings"] != settings:
        raise SystemExit(f"{args.out} holds a run with other settings ({results['settings']}); pass --fresh to "
                         "replace it or --out for another file")
    python = Path(sys.executable)  # relative inside the checkout, so the record names no machine's paths
    python = python.relative_to(Path.cwd()) if python.is_relative_to(Path.cwd()) else python
    results.update(settings=settings, command=shlex.join([str(python), *sys.argv]),
                   machine=machine_facts(args.device))
    results.setdefault("models", {})
    args.artifacts.mkdir(parents=True, exist_ok=True)
    prepared = {}
    for name in args.models:
        print(f"{name}: preparing the variants", flush=True)
        if name == "smollm2":
            prepared[name] = smollm2(args.artifacts, args.ratios, args.keeps, args.dense_core_keeps)
        else:
            shape = {**TINYLLAMA_SHAPE, "num_hidden_layers": args.tiny_layers} if name == "tinyllama-shape" \
                else SMOKE_SHAPE
            title = ("TinyLlama-1.1B shape" + (f" ({args.tiny_layers} of its 22 layers)" if args.tiny_layers != 22
                                               else "") + ", random weights") if name == "tinyllama-shape" \
                else "small random Llama (smoke)"
            calib = (2, 64) if name == "smoke" else (4, 512)
            prepared[name] = llama_shape(args.artifacts, args.ratios, args.keeps, shape, name, title, calib,
                                         args.dense_core_keeps)
    blocks = [(name, dtype, t) for name in args.models for dtype in args.dtypes for t in [*threads, "rss"]]
    todo = [b for b in blocks if _block_key(*b[1:]) not in results["models"].get(b[0], {}).get("runs", {})]
    live = {name: len([v for v in variants if v.unavailable is None]) for name, (variants, _) in prepared.items()}
    progress = {"done": 0, "seconds": 0.0, "total": sum(live[b[0]] * args.repeats for b in todo)}
    for name, (variants, facts) in prepared.items():
        entry = results["models"].setdefault(name, {})
        entry.update(facts, variants={v.name: {**dataclasses.asdict(v), "label": v.label,
                                               **(runtime_summary(Path(v.folder)) if v.folder and v.scope != "dense"
                                                  else {})} for v in variants})
        entry.setdefault("runs", {})
    # read after the variants' own compression, so it shows the load the measurements start under
    results.update(load_average_before=os.getloadavg())
    started = time.time()
    for name, dtype, thread in todo:
        variants, facts = prepared[name]
        print(f"{name}, {dtype}, {'peak RSS' if thread == 'rss' else f'{thread} thread(s)'}:", flush=True)
        job = {"dtype": dtype, "threads": threads[-1] if thread == "rss" else thread, "vocab": facts["vocab"],
               "prefill": list(args.prefill), "prompt": PROMPT, "new_tokens": args.new_tokens,
               "batches": list(DECODE_BATCHES), "runtime": args.runtime, "device": args.device}
        block = measure_block(variants, job, "rss" if thread == "rss" else "speed", args.repeats, args.timeout,
                              progress)
        results["models"][name]["runs"][_block_key(dtype, thread)] = block
        _save(args.out, results)
    results.update(load_average_after=os.getloadavg(), measured_seconds=round(time.time() - started))
    _save(args.out, results)
    return results


def check_device(device: str) -> None:
    """`--device` at the edge: a device torch can name and, for CUDA, one this torch can reach."""
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise SystemExit(f"--device {device!r} is not a device torch knows; give cpu, cuda or cuda:N") from None
    if kind not in ("cpu", "cuda"):
        raise SystemExit(f"--device {device!r}: only cpu and cuda[:N] are measured here")
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device!r}: this torch ({torch.__version__}) sees no CUDA device; run it on a "
                         "machine with one, or give --device cpu")


def _block_key(dtype: str, thread) -> str:
    return f"{dtype}/rss" if thread == "rss" else f"{dtype}/threads={thread}"


def _save(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# report


def _ratio(value, reference) -> float | None:
    return None if value is None or not reference else value / reference


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def verdicts(entry: dict) -> list[str]:
    """The targets, checked on one model's runs; a target nobody measured says so."""
    lines = []
    variants = entry["variants"]
    ftc = [n for n, v in variants.items() if v["scope"] != "dense" and v["unavailable"] is None]
    for key, block in entry["runs"].items():
        if key.endswith("/rss"):
            continue
        dense = block.get("dense", {}).get("median", {})
        slower = [f"{n} {k.split('_tokens')[0]} {_x(_ratio(block[n]['median'][k], dense.get(k)))}"
                  for n in ftc if n in block for k in SPEED_KEYS
                  if (r := _ratio(block[n]["median"][k], dense.get(k))) is not None and r < TARGETS["never_slower"]]
        verdict = "met" if not slower else f"MISSED ({'; '.join(slower)})"
        lines.append(f"- {key}: never slower than dense: {verdict}")
        for name, tag in WHOLE_TARGETED.items():
            whole = block.get(name)
            if whole is None:
                if name in variants:
                    lines.append(f"- {key}: {tag}: not available ({variants[name].get('unavailable')})")
                continue
            for k, target, label in (("decode_b1_tokens_per_s", TARGETS["model_0.6_decode_b1"], "decode b1"),
                                     ("prefill_tokens_per_s", TARGETS["model_0.6_prefill"], "prefill")):
                r = _ratio(whole["median"][k], dense.get(k))
                lines.append(f"- {key}: {tag} {label} {_x(r)} dense (target >= {target}x): "
                             f"{'met' if r is not None and r >= target else 'MISSED'}")
    for key, block in entry["runs"].items():
        for name, tag in WHOLE_TARGETED.items():
            if not key.endswith("/rss") or name not in block:
                continue
            r = _ratio(block[name]["median"]["peak_rss"], block["dense"]["median"]["peak_rss"])
            lines.append(f"- {key}: {tag} peak RSS {_x(r)} dense (target <= {TARGETS['model_0.6_rss']}x): "
                         f"{'met' if r is not None and r <= TARGETS['model_0.6_rss'] else 'MISSED'}")
            if "dense-unmapped" in block:  # the same against a dense model whose file is read as FTC's is
                r = _ratio(block[name]["median"]["peak_rss"], block["dense-unmapped"]["median"]["peak_rss"])
                lines.append(f"- {key}: like for like, {tag} peak RSS {_x(r)} the dense model read "
                             "unmapped (not the target's reference; shown for how much is the loader)")
    for runtime in ("speed", "memory"):
        worst = max((v["held"]["attention"][f"{runtime}_x_stored"] or 0 for n, v in variants.items() if n in ftc),
                    default=None)
        target = TARGETS[f"held_{runtime}"]
        lines.append(f"- attention held at run time, {runtime} runtime: at most {_x(worst)} the stored values "
                     f"(target <= {target}x): {'met' if worst is not None and worst <= target else 'MISSED'}")
    return lines


def render(results: dict) -> str:
    m, s = results["machine"], results["settings"]
    lines = [
        "# Inference: FTC artifacts against the dense model, side by side", "",
        f"Command: `{results['command']}`", "",
        f"Machine: {m['cpu']}, {m['physical_cores']} cores / {m['logical_cpus']} logical CPUs, "
        f"{(m['memory_bytes'] or 0) / 2**30:.0f} GiB; torch {m['torch']} ({m['cpu_kernels']} kernels, "
        f"{m['torch_default_threads']} threads by default), transformers {m['transformers']}, Python {m['python']}, "
        f"{m['os']}" + (f"; measured on {m['accelerator']} (`--device {s['device']}`)" if "accelerator" in m else "")
        + f"; code at {m['git_commit']}. Load average before {_loads(results.get('load_average_before'))}, "
        f"after {_loads(results.get('load_average_after'))}.", "",
        f"Each cell is the median of {s['repeats']} processes, one per repeat and variant, variants interleaved. "
        f"Prefill: {s['prefill'][0]} x {s['prefill'][1]} tokens into the KV cache, last-position logits. Decode: "
        f"greedy, KV cache, {s['new_tokens']} new tokens after a {s['prompt']}-token prompt, tokens/s from the first "
        f"new token to the last. Peak RSS: VmHWM of a fresh process that loads the model and generates "
        f"{s['new_tokens']} tokens at batch 1 ({s['threads'][-1]} threads). FTC runs in the `{s['runtime']}` runtime. "
        "(x) is against dense in the same block; +-% is half the range of the repeats.", ""]
    for entry in results["models"].values():
        lines += [f"## {entry['title']}", "", entry["setup"], ""]
        variants = entry["variants"]
        for key, block in entry["runs"].items():
            dense = block.get("dense", {}).get("median", {})
            if key.endswith("/rss"):
                on_device = dense.get("peak_device_bytes") is not None  # a --device cuda run
                lines += [f"### {key.split('/')[0]}, peak RSS", "",
                          "| variant | peak RSS MiB | x dense | peak above the imports MiB | x dense "
                          "| after imports MiB | after load MiB |" + (" peak device memory MiB | x dense |" if on_device
                                                                       else ""),
                          "|---|---|---|---|---|---|---|" + ("---|---|" if on_device else "")]
                for name, v in variants.items():
                    if name not in block:
                        lines.append(f"| {v['label']} | not available | | | | | |" + (" | |" if on_device else ""))
                        continue
                    med = block[name]["median"]
                    above = _above(med)
                    device_cells = (f" {_mib(med['peak_device_bytes'])} | "
                                    f"{_x(_ratio(med['peak_device_bytes'], dense['peak_device_bytes']))} |"
                                    if on_device else "")
                    lines.append(f"| {v['label']} | {_mib(med['peak_rss'])} | "
                                 f"{_x(_ratio(med['peak_rss'], dense.get('peak_rss')))} | {_mib(above)} | "
                                 f"{_x(_ratio(above, _above(dense)))} | {_mib(med['rss_imports'])} | "
                                 f"{_mib(med['rss_loaded'])} |" + device_cells)
            else:
                dtype, threads = key.split("/")
                lines += [f"### {dtype}, {threads.replace('threads=', '')} thread(s)", "",
                          "| variant | prefill tok/s | decode b1 tok/s | decode b8 tok/s |", "|---|---|---|---|"]
                for name, v in variants.items():
                    if name not in block:
                        lines.append(f"| {v['label']} | not available | | |")
                        continue
                    cells = []
                    for k in SPEED_KEYS:
                        med, spread = block[name]["median"][k], block[name]["spread"][k]
                        ratio = "" if name == "dense" else f" ({_x(_ratio(med, dense.get(k)))})"
                        cells.append("error" if med is None else f"{med:.1f}{ratio}"
                                     + ("" if spread is None else f" +-{100 * spread:.0f}%"))
                    lines.append(f"| {v['label']} | " + " | ".join(cells) + " |")
                errors = {n: b["errors"] for n, b in block.items() if b["errors"]}
                if errors:
                    lines += ["", f"Errors: {errors}"]
            lines.append("")
        lines += ["### Forms and values held (from the shapes)", "",
                  "| variant | forms (speed runtime) | attention held / stored: speed | memory | MLP: speed | memory |",
                  "|---|---|---|---|---|---|"]
        for v in variants.values():
            if v["scope"] == "dense":
                continue
            if v["unavailable"]:
                lines.append(f"| {v['label']} | not available: {v['unavailable']} | | | | |")
                continue
            forms = "; ".join(f"{g}: " + ", ".join(f"{f} x{n}" for f, n in c.items()) for g, c in v["forms"].items())
            att, mlp = v["held"]["attention"], v["held"]["mlp"]
            lines.append(f"| {v['label']} | {forms} | {_x(att['speed_x_stored'])} | {_x(att['memory_x_stored'])} | "
                         f"{_x(mlp['speed_x_stored'])} | {_x(mlp['memory_x_stored'])} |")
        lines += ["", "### Targets", "", *verdicts(entry), ""]
    if results.get("notes"):  # written into the JSON by whoever ran it, kept across renders
        lines += ["## Notes on this run", "", *(f"- {note}" for note in results["notes"]), ""]
    return "\n".join(lines)


def _above(median: dict) -> float | None:
    """Peak RSS less the interpreter's own after importing torch, transformers and ftc."""
    if median.get("peak_rss") is None or median.get("rss_imports") is None:
        return None
    return median["peak_rss"] - median["rss_imports"]


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _loads(loads) -> str:
    return "-" if not loads else " / ".join(f"{x:.2f}" for x in loads)


def plot(results: dict) -> bytes:
    """Speed and peak RSS against dense, per model (rows) and dtype/threads block (columns)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    models = list(results["models"].values())
    columns = max(len([k for k in e["runs"] if not k.endswith("/rss")]) for e in models)
    figure = Figure(figsize=(3.6 * columns, 3.2 * len(models)))
    FigureCanvasAgg(figure)
    for row, entry in enumerate(models):
        speed_blocks = [k for k in entry["runs"] if not k.endswith("/rss")]
        for col, key in enumerate(speed_blocks):
            ax = figure.add_subplot(len(models), columns, row * columns + col + 1)
            block = entry["runs"][key]
            rss = entry["runs"].get(f"{key.split('/')[0]}/rss", {})
            for scope, dense_core, style in (("attention", False, "-"), ("model", False, "--"), ("model", True, ":")):
                names = [n for n, v in entry["variants"].items()
                         if v["scope"] == scope and v.get("dense_core", False) == dense_core and n in block]
                if dense_core:
                    scope = "model, dense core"
                ratios = [entry["variants"][n]["ratio"] for n in names]
                for k, label, color in (("prefill_tokens_per_s", "prefill", "C0"),
                                        ("decode_b1_tokens_per_s", "decode b1", "C1"),
                                        ("decode_b8_tokens_per_s", "decode b8", "C2")):
                    values = [_ratio(block[n]["median"][k], block["dense"]["median"][k]) for n in names]
                    ax.plot(ratios, values, style, marker="o", color=color,
                            label=f"{label} ({scope})" if names else None)
                if rss:
                    values = [_ratio(rss["dense"]["median"]["peak_rss"], rss[n]["median"]["peak_rss"])
                              for n in names if n in rss]
                    ax.plot([r for n, r in zip(names, ratios, strict=True) if n in rss], values, style, marker="s",
                            color="C3", label=f"1 / peak RSS ({scope})" if values else None)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_title(f"{entry['title']}\n{key}", fontsize=8)
            ax.set_xlabel("kept fraction (rho, keep)", fontsize=8)
            ax.set_ylabel("x dense", fontsize=8)
            ax.invert_xaxis()
            ax.legend(fontsize=5)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


EPILOG = """\
Duration (estimates: per-process times measured on a shared 2-core machine, scaled to a quiet
8-core server): SmolLM2 about 2 hours (8 variants x 2 dtypes x 5 repeats x three processes each:
one thread about 45 s, all threads about 15 s, peak RSS about 15 s), plus about 10 minutes
compressing its 7 artifacts once. The TinyLlama-shaped model at its 22 layers about 13 hours (a
one-thread process about 5 minutes: the 4 x 512 prefill, run twice with its warm-up, is 4.5 TFLOP
each time); `--tiny-layers 6` about 3.5 hours. Progress lines give the time left as the run goes.
"""


def _prefill(text: str) -> tuple[int, int]:
    batch, _, length = text.partition("x")
    return int(batch), int(length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("smollm2", "tinyllama-shape"),
                        default=["smollm2", "tinyllama-shape"])
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--threads", default="both", help="'both' (1 and torch's default), or one count")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--ratios", type=float, nargs="*", default=list(ATTENTION_RATIOS),
                        help="attention-only keep ratios rho")
    parser.add_argument("--keeps", type=float, nargs="*", default=list(MODEL_KEEPS), help="whole-model keep ratios")
    parser.add_argument("--dense-core-keeps", type=float, nargs="*", default=list(MODEL_KEEPS),
                        help="whole-model keep ratios compressed with every core dense (`--ablate dense_core`)")
    parser.add_argument("--tiny-layers", type=int, default=22, help="decoder layers of the 1.1B-shaped model")
    parser.add_argument("--prefill", type=_prefill, default=PREFILL, help="BATCHxTOKENS of the prefill")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--runtime", choices=("speed", "memory"), default="speed", help="the FTC runtime measured")
    parser.add_argument("--device", default="cpu",
                        help="where the measured models run: cpu or cuda[:N] (artifacts are compressed on the CPU)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one measuring process may take")
    parser.add_argument("--artifacts", type=Path, default=Path(tempfile.gettempdir()) / "ftc-inference-bench",
                        help="where models and artifacts are kept between runs (made when missing)")
    parser.add_argument("--out", type=Path, default=RESULTS / "inference.json")
    parser.add_argument("--fresh", action="store_true", help="ignore the results already in --out")
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="a small random model, one repeat, one thread, short runs, into a temporary folder")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.smoke:
        smoke = Path(tempfile.gettempdir()) / "ftc-inference-smoke"
        args.models, args.dtypes, args.threads, args.repeats = ["smoke"], ["float32"], "1", 1
        args.ratios, args.keeps, args.prefill, args.new_tokens = [0.4], [0.6], (2, 32), 8
        args.dense_core_keeps = [0.6]
        args.artifacts, args.out, args.fresh = smoke / "artifacts", smoke / "inference.json", True
    args.ratios, args.keeps, args.dense_core_keeps = tuple(args.ratios), tuple(args.keeps), tuple(args.dense_core_keeps)
    results = json.loads(args.out.read_text()) if args.render_only else run(args)
    args.out.with_suffix(".md").write_text(render(results))
    args.out.with_suffix(".png").write_bytes(plot(results))
    print(render(results))


if __name__ == "__main__":
    main()
