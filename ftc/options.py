"""Names shared by the library, the CLI and the job service: the one registry of each choice.

This module imports nothing heavy so the API process can validate requests without torch.

Adding a compression method is a one-place change: add its name and one-line description to
`METHOD_DESCRIPTIONS` below, then write its class in `ftc/compression/methods.py` under
`@register("<name>")` (the decorator refuses a name that is not listed here, and a test checks
that every listed name has a class). The CLI choices, the REST schema and the sweep schema all
read `METHODS`, so nothing else changes.
"""

from __future__ import annotations


class InputError(ValueError):
    """A problem with what the user asked for; the message says what to change."""


METHOD_DESCRIPTIONS: dict[str, str] = {
    "ftc": "FTC: joint head-concat Tucker for Q/K/V, calibrated W_O (ftc-method.md §1-§9)",
    "svd": "plain truncated SVD of each projection (§11)",
    "asvd": "ASVD: SVD of input channels scaled by mean|x|^0.5, ranks from a perplexity-sensitivity search (§11)",
    "svd_llm": "SVD-LLM: Cholesky-whitened SVD of each projection (§11)",
    "svd_llm_v2": "SVD-LLM V2: per-matrix ratios from the truncation loss, eigen-whitened SVD (§11)",
    "per_matrix": "FTC's metric and W_O with Q, K and V each compressed alone (control)",
    "cp": "FTC's tensor, metric and W_O with a rank-R CP (Kronecker-product) Q/K/V instead of Tucker",
}
"""Compression methods by name: FTC and the baselines of ftc-method.md §11."""

METHODS: tuple[str, ...] = tuple(METHOD_DESCRIPTIONS)

ABLATIONS: tuple[str, ...] = (
    "no_whiten",
    "no_sequential",
    "no_slice_norm",
    "no_wo_target",
    "no_anchor",
    "fixed_ranks",
    "kv_repeat",
    "wo_student_metric",
    "no_sink",
    "no_key_weight",
    "mlp_per_matrix",
    "mlp_mode2",
    "wo_loss_metric",
    "loss_metric",
    "dense_core",
)
"""One-at-a-time removals of FTC components (ftc-method.md §3-§8, §17), and variants of one
(`kv_repeat`, `wo_student_metric`, `mlp_mode2`, `dense_core`, §9; `wo_loss_metric`, which adds the loss gradient's
metric to `W_O`'s truncation, §8, and `loss_metric`, which adds it to Q/K/V's head dimension too, §5)."""
MLP_ABLATIONS: tuple[str, ...] = ("mlp_per_matrix", "mlp_mode2")
"""Ablations of how the MLP is compressed: they need scope `model`."""

ALLOCATION_METHODS: dict[str, tuple[str, ...]] = {"global": ("ftc",), "sensitivity": ("ftc", "cp")}
"""How `rho` is spread over layers, beyond `uniform` (the same in every layer, the paper, for every
method), and the methods each applies to: `global`, one model-wide budget split by measured
error-versus-budget curves (ftc-method.md §13); `sensitivity`, layer budgets from the KL
divergence each layer's attention causes when the method compresses it alone (§15)."""
ALLOCATIONS: tuple[str, ...] = ("uniform", *ALLOCATION_METHODS)
DEFAULT_ALLOCATION = "sensitivity"
"""The allocation of a request that names none, for the methods that take it (`default_allocation`).
Chosen on the tuning split (benchmarks/results/tuning.md, `allocation`): FTC at rho 0.4 34.25 against
`uniform`'s 35.77, at rho 0.2 61.59 against 70.64. Its layer list streams like the compression and is
measured once per model, calibration, method and scope (ftc-method.md §15)."""


def default_allocation(method: str) -> str:
    """The allocation a request for `method` gets when it names none: `DEFAULT_ALLOCATION` where the
    method takes it, `uniform` (which every method takes) elsewhere. The CLI, jobs and sweeps all
    resolve an absent allocation through this one function."""
    return DEFAULT_ALLOCATION if method in ALLOCATION_METHODS.get(DEFAULT_ALLOCATION, METHODS) else "uniform"

SCOPES: tuple[str, ...] = ("attention", "model")
"""What `rho` is the keep ratio of: the attention projections of every decoder layer (Q, K, V, O; the
paper's), or all seven linear projections (the MLP's gate, up and down too; the whole-model ratio
the SVD papers quote as `1 - rho`). ftc-method.md §1, §17."""
MODEL_SCOPE_ALLOCATIONS: tuple[str, ...] = ("uniform", "sensitivity")
"""Allocations that plan a `model` scope: `global` surveys the attention only."""


def scope_problem(method: str, allocation: str, ablations: tuple[str, ...] | list[str], scope: str) -> str | None:
    """Why `scope` does not go with the other options, else None (checked where requests enter)."""
    if scope == "model" and allocation not in MODEL_SCOPE_ALLOCATIONS:
        return (f"allocation {allocation!r} plans the attention only; use "
                f"{' or '.join(repr(a) for a in MODEL_SCOPE_ALLOCATIONS)} with scope 'model'")
    if scope != "model" and (mlp := [a for a in ablations if a in MLP_ABLATIONS]):
        return f"ablation {', '.join(mlp)} changes how the MLP is compressed: it needs scope 'model'"
    return None


DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
BATCH_SIZE = 4
"""Default calibration sequences per forward. Each statistics pass holds one batch's attention
activations beside the layer's Grams: 4 x 512 tokens keep a 7B-shaped layer's peak under 1.6 GB
(benchmarks/results/memory.md); on a GPU with memory to spare, more is faster."""
DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")
"""Storage dtypes of the compressed factors (the unit of the budget); each is the name of the
`torch` dtype it stands for, so `ftc.compression.compress.storage_dtype` maps it without a second table."""
MODEL_ALIASES: tuple[str, ...] = ("smollm2-135m", "gemma3-270m")
"""Built-in model names (`ftc.models.registry.ALIASES` says where each file is and what installs it)."""
DATASETS: tuple[str, ...] = ("wikitext2", "wikitext2-tune", "wikitext2-tokenized", "ptb")
"""Built-in dataset names; a path to a .txt or .jsonl file is accepted too. `wikitext2-tune` (the
validation articles kept out of calibration) is for evaluation only, `wikitext2-tokenized` (the
`<unk>` variant of the calibration articles) for calibration only (`ftc.evaluation.data.load_text`)."""
EVALUATION_ONLY: tuple[str, ...] = ("wikitext2-tune",)
CALIBRATION_ONLY: tuple[str, ...] = ("wikitext2-tokenized",)


def dataset_split_problem(dataset: str, split: str) -> str | None:
    """Why built-in `dataset` has nothing for `split` ("test": evaluation, "validation":
    calibration), else None; checked where requests enter and where text is read."""
    if split == "validation" and dataset in EVALUATION_ONLY:
        return (f"{dataset} holds the validation articles kept out of calibration, for evaluation only; "
                f"calibrate on wikitext2")
    if split == "test" and dataset in CALIBRATION_ONLY:
        return f"{dataset} is a calibration set only; evaluate on wikitext2 or wikitext2-tune"
    return None


ASVD_RATIO_CANDIDATES: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
"""Parameter ratios ASVD's rank search measures per matrix (ASVD's list; ftc-method.md §11): the
share of the matrix's values its two factors keep. The smallest is a floor for `asvd`'s `rho`."""

LAYER_RATIO_CANDIDATES: tuple[float, ...] = (0.1, 0.15, 0.2, 0.3, 0.4, 0.55, 0.7, 0.9)
"""Keep ratios at which `--allocation sensitivity` measures each layer's attention compressed alone
(ftc-method.md §15), denser where the curves bend; the smallest is a floor for that allocation's `rho`."""
PLAN_REFERENCE_RATIO = 0.3
"""The candidate at which `--allocation sensitivity` measures each unit's divergence (ftc-method.md
§15) **[choice]**: the middle of the candidates on a log scale, where the predicted error and the
divergence are both well above rounding; the rest of each curve is the predicted error, scaled."""
PLAN_WHOLE_UNITS = True
"""Whether `--allocation sensitivity` may keep a unit (a layer's attention, or its MLP) uncompressed,
its dense weights costing its whole size and causing no divergence (ftc-method.md §15) **[choice]**.
Two factors of a matrix at keep 0.9 already drop a third of its rank, so near a whole-model keep of
0.8 a unit is better left whole and its values spent where factors lose little. Chosen on the tuning
split (benchmarks/results/tuning.md, `plan_whole_units`)."""

ASVD_UNLISTED_RATIO = 1.0
"""Ratio of a matrix none of whose candidates is under the threshold (ASVD leaves it dense). The
artifact stores every projection as two factors, so here it is the rank that fits all `m n` values."""

ASVD_SENSITIVITY_SEQUENCES = 4
"""Calibration sequences the perplexity is measured on: the first ones of the calibration batch.
ASVD measures on 32 sequences of 2048 tokens; 4 keeps the `36 L` partial forwards affordable on a CPU."""


def method_ratio_problem(method: str, ratio: float, allocation: str = "uniform") -> str | None:
    """Why `method` under `allocation` cannot meet keep ratio `ratio`, else None: an allocation the
    method does not take, or a ratio below the smallest candidate of the sensitivity list it plans
    from (ASVD's for `asvd`, the layer list for `--allocation sensitivity`).

    Checked where requests enter (CLI options, job and sweep schemas), so such a job is refused
    before it is queued instead of failing after its statistics pass.
    """
    takers = ALLOCATION_METHODS.get(allocation)
    if takers is not None and method not in takers:
        return (f"allocation {allocation!r} applies to method {' or '.join(repr(m) for m in takers)} only, "
                f"not {method!r}; leave the allocation at 'uniform'")
    if method == "asvd" or allocation == "sensitivity":
        smallest = min(ASVD_RATIO_CANDIDATES if method == "asvd" else LAYER_RATIO_CANDIDATES)
        search = "asvd's rank search" if method == "asvd" else "the sensitivity search"
        user = "asvd" if method == "asvd" else "allocation 'sensitivity'"
        if ratio < smallest:
            return (f"ratio {ratio:g} is below the smallest ratio {search} measures ({smallest}); "
                    f"use a ratio of at least {smallest} with {user}")
    return None


def validate_ratio(ratio: float) -> float:
    """Keep ratio rho must lie in (0, 1] (ftc-method.md §1)."""
    if not (0.0 < ratio <= 1.0):
        raise InputError(f"ratio must be in (0, 1]; got {ratio}")
    return ratio


def parse_ablations(text: str | list[str] | None) -> tuple[str, ...]:
    """Parse `a,b,c` into known ablation names, rejecting unknown ones with the valid list."""
    if not text:
        return ()
    items = text.split(",") if isinstance(text, str) else list(text)
    names = tuple(dict.fromkeys(s.strip() for s in items if s.strip()))
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        raise InputError(f"unknown ablation {', '.join(unknown)}; choose from {', '.join(ABLATIONS)}")
    return names
