"""Factorized projections for FTC-compressed checkpoints, loadable through transformers.

A compressed checkpoint keeps the base model's architecture and tensor names for everything that
was not compressed. Each decoder layer gains a `ftc` child holding its stored groups under their
stored names (`{layer}.ftc.{group}.{tensor}`), and its compressed projections (attention `q`, `k`,
`v`, `o`; MLP `gate`, `up`, `down`) become thin views that read their columns out of the group
they belong to (their biases keep their names).

Stored groups (ftc-method.md §9):

- Tucker (`U1 (d x r1)`, `U2 (w x r2)`, core `(S, r1, r2)`, dense as `core` or sparse as
  `core_values` + the bit-packed `core_mask`): slice `s` is `U1 G_s U2^T`, `w` wide (a head for
  Q/K/V, the intermediate size for the MLP's gate/up). Without a stored `U2` the second factor is
  the identity (ftc-method.md §17): slice `s` is `U1 G_s`, `w = r2`.
- CP (`A (d x R)`, `B (w x R)`, `C (S x R)`): slice `s` is `A diag(c_s) B^T`.
- Low-rank (`A (in x r)`, `B (r x out)`): one projection, `A B`.

Each group runs in one *form*, chosen once when the model is loaded (`prepare_groups`) by the rule
in `choose_form`, a pure function of the group's shapes:

- `stored`: the stored tensors as they are, the sparse core scattered into a dense buffer at every
  forward. The smallest resident size; the `memory` runtime.
- `factored`: the stored chain with the core scattered once (`x @ U1`, `@ G`, `@ U2^T`), or for
  CP and low-rank exactly the stored tensors.
- `merged`: the factors after the first multiplied into one matrix: Tucker `M = [G_s U2^T]_s`
  (`r1 x S*w`), CP `M = [diag(c_s) B^T]_s` (`R x S*w`): `x @ U1` (or `x @ A`) then one GEMM.
- `dense`: the whole group as one `d x S*w` matrix: one GEMM.

The `speed` runtime (the default) takes, of the forms with no per-forward rebuild, the one with
the lowest cost per token: multiply-adds plus values read (`FormCost`). The prepared tensors are
in the compute dtype, so a forward converts nothing and scatters nothing; `.to()` converts them
like any parameter. Loaded in a 16-bit dtype on the CPU they are held output-major, and a
one-token forward runs off oneDNN, on PyTorch's own kernel (`one_row_ready`). A group keeps only
its form's tensors, so only the `stored` form can be saved back (`state_dict` of another form
raises and says how to load for saving).

Self-contained on purpose: this file is copied next to the weights and imports only torch and
transformers, so `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` works
wherever transformers does; `ftc_runtime="memory"` there selects the stored form.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

FORMAT_VERSION = 2
"""Layout of the compressed checkpoint (config `ftc` block + tensor names)."""

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
"""Every projection a group may cover, in the order their outputs sit side by side in a fused
module (Phi-3's `qkv_proj`: Q, K, V rows; its `gate_up_proj`: gate, then up rows)."""

RUNTIMES = ("speed", "memory")
"""`speed` runs each group in its cheapest form (`choose_form`); `memory` in its stored form."""

FORMS = ("stored", "factored", "merged", "dense")

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# the rule: which form each group runs in


@dataclass(frozen=True)
class FormCost:
    """One form of a group, counted from its shapes.

    `macs`: multiply-adds per token. `values`: elements the form holds; every one is read once per
    forward, so at batch 1 (decoding) they are also what a token reads. `gemms`: matrix products
    per forward, a split form's last one counted per member (`SPLIT_FORMS`, as a prefill runs it).
    `rebuilt`: elements written at every forward before the first product (the stored form's
    scatter of a sparse core, or the permuted copy of a dense one).
    """

    macs: int
    values: int
    gemms: int
    rebuilt: int = 0

    @property
    def per_token(self) -> int:
        """Multiply-adds plus values read for one decoded token: the rule's cost.

        A large batch (prefill) pays the multiply-adds; one token at a time pays the reads too,
        since every held value streams from memory once per forward. For a chain of plain
        products (merged, dense, low-rank) the two are equal; they differ where a factor is used
        for several slices (Tucker's `U2`, CP's `B`), which is cheap to hold and costly to apply.
        """
        return self.macs + self.values


SPLIT_FORMS = ("merged", "dense")
"""Forms whose last product is one matrix over every output column (`M`, `W`). From `SPLIT_ROWS`
input rows on, each member of a group multiplies its own columns of that matrix (after the latent
`merged` shares) and gets a contiguous output; the other forms apply a factor every slice shares
last (`U2`, `B`) and hand out column views of the whole output, as the split forms do below
`SPLIT_ROWS` rows. Why (ftc-method.md §9): on strided column views the attention's reshapes and the
MLP's `act(gate) * up` run slower, which in a bfloat16 prefill outweighs the one GEMM saved; at one
decoded token the extra product's call costs more than the views."""

ONE_ROW_DTYPES = (torch.bfloat16, torch.float16)
"""Compute dtypes whose forms are held output-major on the CPU and whose one-token forwards run off
oneDNN (`one_row_ready`): oneDNN's matmul, which PyTorch picks for every 16-bit product, streams a
decoded token's weights at a fraction of memory speed, and PyTorch's own kernel, a dot product per
output of an output-major matrix (`nn.Linear`'s layout), at 1.8-4x that (ftc-method.md §9,
`benchmarks/results/gemv_layouts.md`). From two rows on oneDNN is faster, so it keeps them."""

SPLIT_ROWS = 16
"""Input rows (tokens in the batch) from which the split forms split: a prefill splits, a decoding
step of batch 1 or 8 does not (measured on a SmolLM2-shaped gate/up block, ftc-method.md §9)."""


def held_values(spec: dict) -> int:
    """Elements the stored form holds for a group: every stored tensor, the packed mask as bytes."""
    return sum(math.prod(shape) for shape in spec["shapes"].values())


def form_costs(spec: dict) -> dict[str, FormCost]:
    """The cost of every form a group can run in, from its spec and tensor shapes alone.

    Tucker (`U1 d x r1`, `U2 w x r2`, `S` stored slices, `S'` output slices: `S` unless the
    `kv_repeat` ablation repeats K/V heads, whose copies the runtime forms average in advance):
    stored `d r1 + S r1 r2 + S r2 w`; factored the same over `S'`; merged `d r1 + r1 S' w`;
    dense `d S' w`. Without `U2` (the identity, `w = r2`) there is no `U2` product: stored
    `d r1 + S r1 r2`, and merged is the core scattered once (no factored form). CP (`A d x R`,
    `B w x R`, `C S x R`): stored = factored `d R + S R + S R w`, holding `(d + w + S) R`; merged
    `d R + R S w`; dense `d S w`. Low-rank (`A in x r`, `B r x out`): stored = factored
    `r (in + out)`; dense `in out`.
    """
    kind, shapes = spec["kind"], spec["shapes"]
    stored = held_values(spec)
    if kind == "lowrank":
        (inputs, rank), (_, outputs) = shapes["A"], shapes["B"]
        chain = FormCost(rank * (inputs + outputs), stored, 2)
        return {"stored": chain, "factored": chain, "dense": FormCost(inputs * outputs, inputs * outputs, 1)}
    out_slices, members = sum(spec["heads"]), len(spec["proj"])
    if kind == "cp":
        (inputs, rank), (width, _), (slices, _) = shapes["A"], shapes["B"], shapes["C"]
        chain = FormCost(inputs * rank + slices * rank + slices * rank * width, stored, 2)
        merged = inputs * rank + rank * out_slices * width
        return {"stored": chain, "factored": chain, "merged": FormCost(merged, merged, 1 + members),
                "dense": FormCost(inputs * out_slices * width, inputs * out_slices * width, members)}
    if kind != "tucker":
        raise ValueError(f"unknown group kind {kind!r}; expected tucker, cp or lowrank")
    slices, r1, r2 = spec["shape"]
    inputs = shapes["U1"][0]
    dense = FormCost(inputs * out_slices * r2, inputs * out_slices * r2, members)
    if "U2" not in shapes:
        merged = inputs * r1 + r1 * out_slices * r2
        return {"stored": FormCost(inputs * r1 + slices * r1 * r2, stored, 2, slices * r1 * r2),
                "merged": FormCost(merged, merged, 1 + members), "dense": dense}
    width = shapes["U2"][0]
    factored = inputs * r1 + out_slices * r1 * r2
    merged = inputs * r1 + r1 * out_slices * width
    return {
        "stored": FormCost(inputs * r1 + slices * r1 * r2 + slices * r2 * width, stored, 3, slices * r1 * r2),
        "factored": FormCost(factored + out_slices * r2 * width, factored + r2 * width, 3),
        "merged": FormCost(merged, merged, 1 + members),
        "dense": FormCost(inputs * out_slices * width, inputs * out_slices * width, members),
    }


def check_runtime(runtime: str) -> str:
    if runtime not in RUNTIMES:
        raise ValueError(f"ftc_runtime must be one of {', '.join(RUNTIMES)}; got {runtime!r}")
    return runtime


def choose_form(spec: dict, runtime: str = "speed") -> str:
    """The form a group runs in under `runtime` (ftc-method.md §9).

    `memory`: `stored`, the smallest resident size. `speed`: of the forms that rebuild nothing per
    forward (all but `stored`), the one with the lowest `FormCost.per_token`; ties go to fewer
    products, then to fewer values held.
    """
    if check_runtime(runtime) == "memory":
        return "stored"
    costs = form_costs(spec)
    return min((f for f in costs if f != "stored"),
               key=lambda f: (costs[f].per_token, costs[f].gemms, costs[f].values))


# ---------------------------------------------------------------------------------------------
# runtime modules


def unpack_bits(bits: torch.Tensor, count: int) -> torch.Tensor:
    """First `count` bits of a packed uint8 tensor (big-endian within a byte) as a bool vector."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).flatten()[:count].bool()


def off_onednn(run: Callable[[], T]) -> T:
    """`run()` with oneDNN switched off, so its 16-bit products go to PyTorch's own kernel.

    The switch (`torch.backends.mkldnn.enabled`) is process-wide: a second thread running a
    product meanwhile also runs it off oneDNN (the same result within float rounding, maybe slower)."""
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        return run()
    finally:
        torch.backends.mkldnn.enabled = enabled


def one_row_ready(model: nn.Module) -> bool:
    """Whether `model`'s one-token forwards (decoding at batch 1) run off oneDNN (`off_onednn`): its
    output head is in a 16-bit dtype on the CPU and every factor group is `one_row_ready`. The
    other products of such a step (the head, projections left whole) are `nn.Linear`s, output-major
    already. A group converted after loading stays input-major, and the step stays on oneDNN."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return (weight is not None and weight.dtype in ONE_ROW_DTYPES and weight.device.type == "cpu"
            and all(g.one_row_ready for g in model.modules() if isinstance(g, FactorGroup)))


def one_token_off_onednn(forward: Callable[..., T]) -> Callable[..., T]:
    """A causal LM's bound `forward` that runs a one-token call off oneDNN: what an FTC model does
    when `one_row_ready`, for any model (`benchmarks/inference.py`'s dense control)."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if _one_token(args, kwargs):
            return off_onednn(lambda: forward(*args, **kwargs))
        return forward(*args, **kwargs)

    return run


def _one_token(args: tuple, kwargs: dict) -> bool:
    """Whether a causal LM's forward call is one token of one sequence."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        embeds = kwargs.get("inputs_embeds")
        return embeds is not None and embeds.shape[:-1].numel() == 1
    return ids.numel() == 1


def _version(x: torch.Tensor) -> int:
    # inference-mode tensors keep no version counter (reading it raises, at the cost of a C++
    # exception per call: asked first)
    return -1 if x.is_inference() else x._version


class FactorGroup(nn.Module):
    """Factors shared by one or more projections; the output of all of them at once.

    Built holding the stored tensors (the `stored` form, which `load_state_dict` and
    `from_pretrained` fill); `prepare` then replaces them by the tensors of the form its runtime
    chooses. The projections of a group are called one after another on the same input
    (`q_proj(x)`, `k_proj(x)`, `v_proj(x)`); the first call computes every column and keeps the
    result until the other members have taken theirs, so the shared work runs once per forward.
    """

    first = "A"
    """The factor applied to the input first, kept as stored by the `factored` and `merged` forms."""

    operands: frozenset[str] = frozenset({"A", "B", "W"})
    """The form tensors a forward applies as `x @ T`: held output-major in `ONE_ROW_DTYPES` on the CPU."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.spec = {key: value for key, value in spec.items() if key != "values"}
        self.kind = spec["kind"]
        self.members = tuple(spec["proj"])
        self.single = len(self.members) == 1
        self.form = "stored"
        self._run = self._stored
        self._pending: tuple[torch.Tensor, int, set[str], torch.Tensor] | None = None
        self.in_features = spec["shapes"][self.first][0]
        for name, shape in spec["shapes"].items():
            tensor = torch.empty(shape, dtype=torch.uint8 if name == "core_mask" else None)
            if name == "core_mask":
                self.register_buffer(name, tensor)
            else:
                self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x)

    def output_for(self, proj: str, x: torch.Tensor, columns: tuple[int, int]) -> torch.Tensor:
        """Member `proj`'s output columns `columns` for input `x`, the work the members share done
        once: in a split form (`SPLIT_FORMS`) and from `SPLIT_ROWS` rows on, its own product after
        the latent `merged` shares; otherwise a view of the whole output, which the first member's
        call computes."""
        start, stop = columns
        if self.single or columns == (0, self.out_features):
            return self(x)
        if self.form not in SPLIT_FORMS or x.numel() < SPLIT_ROWS * x.shape[-1]:
            return self._shared(proj, x, lambda: self(x))[..., start:stop]
        if self.form == "dense":
            return x @ self.W[:, start:stop]
        return self._shared(proj, x, lambda: x @ getattr(self, self.first)) @ self.M[:, start:stop]

    def _shared(self, proj: str, x: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`compute()` for the first member called on `x`, kept until every other member took it."""
        held = self._pending
        if held is not None and held[0] is x and held[1] == _version(x) and proj in held[2]:
            held[2].discard(proj)
            if not held[2]:
                self._pending = None
            return held[3]
        y = compute()
        rest = set(self.members) - {proj}
        self._pending = (x, _version(x), rest, y) if rest else None
        return y

    @property
    def out_features(self) -> int:
        raise NotImplementedError

    def column_ranges(self, head_dim: int | None = None) -> dict[str, tuple[int, int]]:
        """Each member's columns of the group output. `head_dim` is not used (a group's slice width
        is its own: `U2`/`B` rows, a head for Q/K/V, the intermediate size for gate/up); it is
        accepted for callers written when every group was attention."""
        raise NotImplementedError

    # the forms: `stored` is each kind's own; `_factored` of CP and low-rank is the stored chain
    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _merged(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ getattr(self, self.first)) @ self.M

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.W

    def form_tensors(self, form: str) -> dict[str, torch.Tensor]:
        """The tensors `form` holds, computed from the stored ones (in at least float32) and
        returned in the compute dtype (the stored tensors' own)."""
        raise NotImplementedError

    def prepare(self, runtime: str) -> str:
        """Run in the form `runtime` chooses for this group's shapes (`choose_form`); returns it."""
        return self.use_form(choose_form(self.spec, runtime))

    def use_form(self, form: str) -> str:
        """Run in `form` (one of `form_costs(spec)`); returns it.

        The stored tensors the form does not keep are released, so a group holds one form only;
        a group already moved off the stored form cannot move again (reload the model).
        """
        if form not in form_costs(self.spec):
            raise ValueError(f"a {self.kind} group has no {form!r} form; it has {', '.join(form_costs(self.spec))}")
        if form == self.form:
            return form
        if self.form != "stored":
            raise RuntimeError(f"this {self.kind} group already runs in its {self.form!r} form; load the model "
                               f"again to run it as {form!r}")
        with torch.no_grad():
            tensors = self.form_tensors(form)
        for name in [*self._parameters, *self._buffers]:
            delattr(self, name)
        some = next(iter(tensors.values()))
        output_major = some.dtype in ONE_ROW_DTYPES and some.device.type == "cpu"
        for name, tensor in tensors.items():
            held = tensor.T.contiguous().T if output_major and name in self.operands else tensor.contiguous()
            self.register_parameter(name, nn.Parameter(held, requires_grad=False))
        self.form, self._run = form, getattr(self, f"_{form}")
        return form

    @property
    def one_row_ready(self) -> bool:
        """Every operand held output-major, in a 16-bit dtype, on the CPU, so a one-row product may
        leave oneDNN (`one_row_ready` of the model). Not otherwise: PyTorch's own kernel reads an
        input-major matrix a column at a time, 2-8x slower than oneDNN (ftc-method.md §9), and the
        stored form is kept as stored. Read from the tensors, so a `.to()` after loading (which keeps
        the layout but may change the dtype or the device) is seen as it is."""
        held = [t for n, t in self._parameters.items() if n in self.operands and t is not None]
        return bool(held) and self.form != "stored" and all(
            t.dtype in ONE_ROW_DTYPES and t.device.type == "cpu" and t.ndim == 2 and t.stride(0) == 1 for t in held)

    def _work(self) -> tuple[torch.dtype, torch.dtype]:
        """`(compute dtype, dtype the form tensors are computed in)`."""
        dtype = getattr(self, self.first).dtype
        return dtype, torch.promote_types(dtype, torch.float32)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        if self.form != "stored":
            raise RuntimeError(
                f"{prefix.rstrip('.')} runs in its {self.form!r} form and no longer holds the stored tensors; load "
                "the model with ftc_runtime='memory' (load_artifact(..., runtime='memory')) to save or export it")
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in [*self.named_parameters(), *self.named_buffers()])
        return f"{'/'.join(self.members)}: {self.kind}, {self.form} form ({shapes})"


class LowRankGroup(FactorGroup):
    """`y = (x @ A) @ B`: one projection as two thin GEMMs, or `x @ W` where that is cheaper."""

    @property
    def out_features(self) -> int:
        return self.spec["shapes"]["B"][1]

    def column_ranges(self, head_dim: int | None = None) -> dict[str, tuple[int, int]]:
        return {self.members[0]: (0, self.out_features)}

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.A) @ self.B

    _factored = _stored

    def form_tensors(self, form: str) -> dict[str, torch.Tensor]:
        if form == "factored":
            return {"A": self.A, "B": self.B}
        dtype, work = self._work()
        return {"W": (self.A.to(work) @ self.B.to(work)).to(dtype)}


class SlicedGroup(FactorGroup):
    """A group whose output is slices of one width, side by side: query heads, then key heads,
    then value heads; or the MLP's gate, then up (one slice each)."""

    def __init__(self, spec: dict) -> None:
        super().__init__(spec)
        self.heads = tuple(spec["heads"])
        self.out_slices = sum(self.heads)

    @property
    def width(self) -> int:
        raise NotImplementedError

    @property
    def out_features(self) -> int:
        return self.out_slices * self.width

    def column_ranges(self, head_dim: int | None = None) -> dict[str, tuple[int, int]]:
        ranges, start = {}, 0
        for proj, heads in zip(self.members, self.heads, strict=True):
            ranges[proj] = (start, start + heads * self.width)
            start += heads * self.width
        return ranges


class TuckerGroup(SlicedGroup):
    """`y_s = (x @ U1) G_s U2^T` for every slice `s`, the latent `x @ U1` computed once.

    With the `kv_repeat` ablation each key/value head appears `kv_repeat` times and the copies
    are averaged (the stored form averages outputs; the others average the copies' cores once).
    """

    first = "U1"
    operands = frozenset({"U1", "G", "U2t", "M", "W"})

    def __init__(self, spec: dict) -> None:
        super().__init__(spec)
        self.kv_repeat = int(spec.get("kv_repeat", 1))
        self.slices, self.r1, self.r2 = spec["shape"]

    @property
    def width(self) -> int:
        shapes = self.spec["shapes"]
        return shapes["U2"][0] if "U2" in shapes else self.r2  # no `U2`: the identity (§17)

    def _copies(self, proj: str) -> int:
        return self.kv_repeat if proj in ("k", "v") else 1

    def core_tensor(self) -> torch.Tensor:
        """The stored core as a dense `(S, r1, r2)` tensor; a sparse core is scattered into it here."""
        if "core" in self._parameters:
            return self.core
        count = self.slices * self.r1 * self.r2
        core = torch.zeros(count, dtype=self.core_values.dtype, device=self.core_values.device)
        core.masked_scatter_(unpack_bits(self.core_mask, count), self.core_values)
        return core.view(self.slices, self.r1, self.r2)

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        core = self.core_tensor().permute(1, 0, 2).reshape(self.r1, self.slices * self.r2)
        y = ((x @ self.U1) @ core).unflatten(-1, (self.slices, self.r2))
        if "U2" in self._parameters:
            y = y @ self.U2.T  # (..., S, w)
        if self.kv_repeat > 1:
            parts, start = [], 0
            for proj, heads in zip(self.members, self.heads, strict=True):
                copies = self._copies(proj)
                part = y[..., start : start + heads * copies, :]
                start += heads * copies
                parts.append(part.unflatten(-2, (heads, copies)).mean(-2) if copies > 1 else part)
            y = torch.cat(parts, dim=-2)
        return y.flatten(-2)

    def _factored(self, x: torch.Tensor) -> torch.Tensor:
        return (((x @ self.U1) @ self.G).unflatten(-1, (self.out_slices, self.r2)) @ self.U2t).flatten(-2)

    def output_core(self, dtype: torch.dtype) -> torch.Tensor:
        """The `(S', r1, r2)` core of the output slices, in `dtype`: repeated K/V copies averaged."""
        core = self.core_tensor().to(dtype)
        if self.kv_repeat == 1:
            return core
        parts, start = [], 0
        for proj, heads in zip(self.members, self.heads, strict=True):
            copies = self._copies(proj)
            parts.append(core[start : start + heads * copies].unflatten(0, (heads, copies)).mean(1))
            start += heads * copies
        return torch.cat(parts)

    def form_tensors(self, form: str) -> dict[str, torch.Tensor]:
        dtype, work = self._work()
        core = self.output_core(work)  # (S', r1, r2)
        if form == "factored":
            return {"U1": self.U1, "G": core.permute(1, 0, 2).reshape(self.r1, -1).to(dtype),
                    "U2t": self.U2.T.to(dtype)}
        if "U2" in self._parameters:
            core = core @ self.U2.T.to(work)  # [G_s U2^T]_s
        merged = core.permute(1, 0, 2).reshape(self.r1, -1)
        if form == "merged":
            return {"U1": self.U1, "M": merged.to(dtype)}
        return {"W": (self.U1.to(work) @ merged).to(dtype)}


class CPGroup(SlicedGroup):
    """`y_s = ((x @ A) * c_s) @ B^T` for every slice `s`: the rank-R CP `W_s = A diag(c_s) B^T`.

    The latent `x @ A` is computed once for all slices; the per-slice scaling and `B^T` are one
    broadcast product and one GEMM over every slice at once.
    """

    operands = frozenset({"A", "M", "W"})  # `B` is applied transposed, `C` element-wise

    @property
    def width(self) -> int:
        return self.spec["shapes"]["B"][0]

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        return (((x @ self.A).unsqueeze(-2) * self.C) @ self.B.T).flatten(-2)  # (..., S, w) flattened

    _factored = _stored

    def form_tensors(self, form: str) -> dict[str, torch.Tensor]:
        if form == "factored":
            return {"A": self.A, "B": self.B, "C": self.C}
        dtype, work = self._work()
        b, c = self.B.to(work), self.C.to(work)
        merged = (c.T.unsqueeze(-1) * b.T.unsqueeze(1)).flatten(1)  # M[r, s*w + j] = c[s, r] b[j, r]
        if form == "merged":
            return {"A": self.A, "M": merged.to(dtype)}
        return {"W": (self.A.to(work) @ merged).to(dtype)}


class GroupProjection(nn.Module):
    """Stands where a projection (`q_proj`, ..., `down_proj`) stood: its columns of a group, plus
    its bias.

    The group is referenced, not registered, so its tensors appear once in the state dict (under
    the layer's `ftc` child) however many projections read them.
    """

    def __init__(self, group: FactorGroup, proj: str, columns: tuple[int, int], bias: torch.Tensor | None) -> None:
        super().__init__()
        object.__setattr__(self, "group", group)
        self.proj = proj
        self.start, self.stop = columns
        self.in_features, self.out_features = group.in_features, self.stop - self.start
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.output_for(self.proj, x, (self.start, self.stop))
        return y if self.bias is None else y + self.bias

    def _apply(self, fn, recurse: bool = True):
        # the group lives elsewhere in a loaded model, but a projection installed on its own
        # (while compressing) must still move with `.to()`
        self.group._apply(fn, recurse)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"{self.proj}: columns {self.start}:{self.stop} of a {type(self.group).__name__}"


class FusedProjection(nn.Module):
    """Stands where a fused projection stood (Phi-3's `qkv_proj`, rows Q, then K, then V; its
    `gate_up_proj`, gate then up): its members' outputs side by side, in that order.

    Members that are, in order and without biases, every column of one group are that group's
    output as it is: one call, no concatenation. Otherwise members of one group still share its
    forward (`FactorGroup.output_for`) and only the concatenation is added.
    """

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        self.in_features = members[0].in_features
        self.out_features = sum(m.out_features for m in members)
        group = getattr(members[0], "group", None)
        whole = (group is not None and all(getattr(m, "group", None) is group and m.bias is None for m in members)
                 and tuple(m.proj for m in members) == group.members)  # a group's columns follow its members
        object.__setattr__(self, "group", group if whole else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            return self.group(x)
        return torch.cat([m(x) for m in self.members], dim=-1)


def modules_of(names: dict[str, str], projs) -> dict[str, list[str]]:
    """The projections (of `projs`) held by each module name, in `PROJECTIONS` order: one per
    module, or several row blocks of one fused module (Phi-3: `q`, `k` and `v` all name
    `qkv_proj`; `gate` and `up` name `gate_up_proj`)."""
    held: dict[str, list[str]] = {}
    for proj in sorted(projs, key=PROJECTIONS.index):
        held.setdefault(names[proj], []).append(proj)
    return held


def place(layer: nn.Module, names: dict[str, str], modules: dict[str, nn.Module]) -> None:
    """Install projection modules (keyed by `PROJECTIONS`) in `layer` under their module names;
    the members of a fused module are installed together as one `FusedProjection`."""
    for name, members in modules_of(names, modules).items():
        fused = [p for p in PROJECTIONS if names.get(p) == name]
        if members != fused:
            raise ValueError(f"{name} holds {fused} as one fused projection; got modules for {members} only")
        module = modules[members[0]] if len(members) == 1 else FusedProjection([modules[p] for p in members])
        parent, _, leaf = name.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, leaf, module)


GROUP_KINDS: dict[str, type[FactorGroup]] = {"tucker": TuckerGroup, "cp": CPGroup, "lowrank": LowRankGroup}
"""Runtime class of each stored group kind."""


def make_group(spec: dict) -> FactorGroup:
    return GROUP_KINDS[spec["kind"]](spec)


def group_name(spec: dict) -> str:
    return "".join(spec["proj"])


def projections(group: FactorGroup, biases: dict[str, torch.Tensor | None]) -> dict[str, GroupProjection]:
    """The projection modules (keyed by `PROJECTIONS`) that read from `group`."""
    return {proj: GroupProjection(group, proj, cols, biases.get(proj))
            for proj, cols in group.column_ranges().items()}


def install_groups(model: nn.Module, block: dict) -> None:
    """Replace the compressed projections of `model` by views of (still empty) stored groups."""
    layers = model.get_submodule(block["layers_path"])
    names = block["projections"]
    for entry in block["layers"]:
        layer = layers[entry["index"]]
        groups = nn.ModuleDict()
        modules: dict[str, GroupProjection] = {}
        for spec in entry["groups"]:
            group = groups[group_name(spec)] = make_group(spec)
            for proj, module in projections(group, {}).items():
                old = layer.get_submodule(names[proj])
                if getattr(old, "bias", None) is not None:
                    module.bias = nn.Parameter(torch.empty_like(old.bias), requires_grad=False)
                modules[proj] = module
        place(layer, names, modules)
        layer.ftc = groups


def prepare_groups(model: nn.Module, runtime: str = "speed") -> list[dict]:
    """Run every factor group of `model` in the form `runtime` chooses (`choose_form`), one group
    at a time (so the extra memory at any moment is one group's); returns `runtime_forms`.

    The freed stored tensors and the forms' float32 temporaries are handed back to the OS after
    each group (`trim_heap`): glibc keeps freed blocks of this size in its heap, so trimmed only at
    the end they piled up between the forms and set the process's peak, above what generating adds
    after (SmolLM2 keep 0.6, the load's peak: 877 MiB in float32 and 737 in bfloat16 trimmed once
    at the end, 837 and 640 trimmed per group, for 0.1-0.2 s more of a 0.7-0.8 s load; never
    trimmed, 738 MiB stayed resident in bfloat16; docs/results.md)."""
    for group in model.modules():
        if isinstance(group, FactorGroup):
            group.prepare(runtime)
            trim_heap()
    return runtime_forms(model)


def trim_heap() -> None:
    """glibc's `malloc_trim(0)`: return the heap's free pages to the OS; nothing elsewhere. Also
    what the compression calls between layers, whose per-layer buffers would otherwise stay resident."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): freed pages stay with the allocator
        pass


def runtime_forms(model: nn.Module) -> list[dict]:
    """Per group of `model`: where it sits, the form it runs in, that form's `FormCost` and the
    values the stored form holds, for reports and benchmarks."""
    records = []
    for name, group in model.named_modules():
        if isinstance(group, FactorGroup):
            cost = form_costs(group.spec)[group.form]
            records.append({"group": name, "kind": group.kind, "proj": list(group.members), "form": group.form,
                            "macs_per_token": cost.macs, "values": cost.values, "gemms": cost.gemms,
                            "stored_values": held_values(group.spec)})
    return records


# ---------------------------------------------------------------------------------------------
# transformers classes, one config and one causal LM per base family (created on first use)

CODE_FILE = "modeling_ftc"
_CLASSES: dict[str, type] = {}


WEIGHTS_FILE = "model.safetensors"
STOCK_LOADING = frozenset(("state_dict", "gguf_file", "subfolder", "device_map", "quantization_config", "tp_plan"))
"""`from_pretrained` arguments whose loading only transformers' own reading of the folder handles."""


def unmapped_weights(args: tuple, kwargs: dict):
    """The checkpoint of a local artifact folder opened for reading with `pread`, or None where
    transformers must read it itself (a hub id, a sharded or non-safetensors checkpoint, arguments
    in `STOCK_LOADING`, transformers before 5 or a safetensors without the `pread` backend).

    Why: transformers maps the file, and every page it touches stays resident until loading ends,
    on top of the weights in the compute dtype; a float16 file under float32 weights raises the
    load's peak by half the weights' size, the peak a serving process is sized for. Read with
    `pread`, each tensor's bytes pass through one buffer that is freed once the tensor is in place.
    """
    import os

    import transformers

    stock = any(kwargs.get(name) for name in STOCK_LOADING)  # `subfolder=""` (the auto classes') is none
    if len(args) != 1 or stock or int(transformers.__version__.split(".")[0]) < 5:
        return None
    path = os.path.join(os.fspath(args[0]), WEIGHTS_FILE)
    if not os.path.isfile(path):
        return None
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu", backend="pread")
    except TypeError:  # a safetensors before the `backend` argument
        return None


def load_unmapped(load, weights, config, **kwargs):
    """`load(None, config=config, state_dict=..., **kwargs)` (a `from_pretrained`) over the tensors of
    an `unmapped_weights` file, each a lazy slice read when placed; the file is closed after."""
    with weights:
        return load(None, config=config, state_dict={name: weights.get_slice(name) for name in weights.keys()},
                    **kwargs)


def family_names(base_type: str) -> tuple[str, str]:
    """Class names for a base `model_type`: `FtcLlamaConfig`, `FtcLlamaForCausalLM`, ...

    Named after the base family's own config and causal LM classes, which need not share a stem
    (`gemma3_text`: `Gemma3TextConfig`, `Gemma3ForCausalLM`).
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return f"Ftc{CONFIG_MAPPING_NAMES[base_type]}", f"Ftc{MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[base_type]}"


def _build_family(base_type: str) -> None:
    import transformers
    from transformers import CONFIG_MAPPING

    config_name, model_name = family_names(base_type)
    base_config = CONFIG_MAPPING[base_type]
    base_model = getattr(transformers, model_name[len("Ftc"):])

    config_cls = type(config_name, (base_config,), {
        "model_type": f"ftc_{base_type}",
        "_auto_class": "AutoConfig",
        "__module__": __name__,
        "__doc__": f"{base_config.__name__} plus the `ftc` block describing the stored factor groups.",
    })

    def __init__(self, config, *args, **kwargs):
        base_model.__init__(self, config, *args, **kwargs)
        install_groups(self, config.ftc)
        self.ftc_one_row = False  # set once the groups are prepared (`one_row_ready`)

    @functools.wraps(base_model.forward)  # generate reads the base signature's arguments
    def forward(self, *args, **kwargs):
        if self.ftc_one_row and _one_token(args, kwargs):
            return off_onednn(lambda: base_model.forward(self, *args, **kwargs))
        return base_model.forward(self, *args, **kwargs)

    def _apply(self, fn, recurse: bool = True):
        module = base_model._apply(self, fn, recurse)
        if hasattr(self, "ftc_one_row"):  # a conversion after loading: the dtype or device may change
            self.ftc_one_row = one_row_ready(self)
        return module

    def from_pretrained(cls, *args, ftc_runtime: str | None = None, **kwargs):
        """The base class's loading, then every group moved to the form of `ftc_runtime` ("speed",
        the default, or "memory"; else the config's `ftc_runtime` attribute, if set).

        A local folder's weights are read without mapping the file (`unmapped_weights`)."""
        if ftc_runtime is not None:
            check_runtime(ftc_runtime)  # before the weights are read
        load = super(model_cls, cls).from_pretrained
        weights = unmapped_weights(args, kwargs)
        if weights is None:
            model = load(*args, **kwargs)
        else:
            config = kwargs.pop("config", None) or cls.config_class.from_pretrained(args[0])
            model = load_unmapped(load, weights, config, **kwargs)
            model.name_or_path = model.config.name_or_path = str(args[0])
        prepare_groups(model, ftc_runtime or getattr(model.config, "ftc_runtime", None) or "speed")
        model.ftc_one_row = one_row_ready(model)
        return model

    def ftc_forms(self) -> list[dict]:
        """What each factor group runs as (`runtime_forms`)."""
        return runtime_forms(self)

    model_cls = type(model_name, (base_model,), {
        "config_class": config_cls,
        "_auto_class": "AutoModelForCausalLM",  # save_pretrained copies this file and keeps `auto_map`
        "__init__": __init__,
        "forward": forward,
        "_apply": _apply,
        "from_pretrained": classmethod(from_pretrained),
        "ftc_forms": ftc_forms,
        "__module__": __name__,
        "__doc__": f"{base_model.__name__} whose projections run from FTC factor groups.",
    })
    _CLASSES[config_name], _CLASSES[model_name] = config_cls, model_cls


def __getattr__(name: str) -> type:
    """Module attribute lookup for `auto_map` entries such as `modeling_ftc.FtcLlamaForCausalLM`."""
    if name.startswith("Ftc") and name not in _CLASSES:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        candidates = [t for t in CONFIG_MAPPING_NAMES if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                      and name in family_names(t)]
        # families may share a causal LM class (exaone runs LlamaForCausalLM): the one whose config
        # class carries the same stem is that class's own family
        candidates.sort(key=lambda t: not MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t].startswith(
            CONFIG_MAPPING_NAMES[t][: -len("Config")]))
        if candidates:
            _build_family(candidates[0])
    if name in _CLASSES:
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def family(base_type: str) -> tuple[type, type]:
    """`(config class, causal LM class)` of the compressed form of a base family."""
    config_name, model_name = family_names(base_type)
    return __getattr__(config_name), __getattr__(model_name)
