"""Factorized attention for FTC-compressed checkpoints, loadable through transformers.

A compressed checkpoint keeps the base model's architecture and tensor names for everything that
was not compressed. Each decoder layer gains a `ftc` child holding its stored groups under their
stored names (`{layer}.ftc.{group}.{tensor}`), and its Q/K/V/O projections become thin views
that read their columns out of the group they belong to (their biases keep their names).

- A Tucker group (`U1 (d x r1)`, `U2 (dh x r2)`, core `(S, r1, r2)`, dense as `core` or sparse as
  `core_values` + the bit-packed `core_mask`) computes the latent `x @ U1` once per forward for all
  its projections, then every slice through the core and `U2^T` in two more GEMMs. The sparse core
  stays in its stored form; each forward scatters it into a transient dense matrix.
- A CP group (`A (d x R)`, `B (dh x R)`, `C (S x R)`) computes the latent `x @ A` once, scales it
  per slice by the rows of `C` and maps every slice back through `B^T` in one more GEMM.
- A low-rank group (`A (in x r)`, `B (r x out)`) runs as two thin GEMMs.

The runtime holds exactly the stored tensors (the mask as bytes), so `runtime_values` equals the
stored values up to the mask counted in bytes rather than 16-bit units.

Self-contained on purpose: this file is copied next to the weights and imports only torch and
transformers, so `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` works
wherever transformers does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

FORMAT_VERSION = 2
"""Layout of the compressed checkpoint (config `ftc` block + tensor names)."""


# ---------------------------------------------------------------------------------------------
# runtime modules


def unpack_bits(bits: torch.Tensor, count: int) -> torch.Tensor:
    """First `count` bits of a packed uint8 tensor (big-endian within a byte) as a bool vector."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).flatten()[:count].bool()


def _version(x: torch.Tensor) -> int:
    try:
        return x._version
    except RuntimeError:  # inference-mode tensors keep no version counter (and cannot change in place)
        return -1


class FactorGroup(nn.Module):
    """Stored factors shared by one or more projections; the output of all of them at once.

    The projections of a group are called one after another on the same input (`q_proj(x)`,
    `k_proj(x)`, `v_proj(x)`); the first call computes every column and keeps the result until
    the other members have taken theirs, so the shared work runs once per forward.
    """

    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.members = tuple(spec["proj"])
        self._pending: tuple[torch.Tensor, int, set[str], torch.Tensor] | None = None
        self.in_features = spec["shapes"]["U1" if spec["kind"] == "tucker" else "A"][0]
        for name, shape in spec["shapes"].items():
            tensor = torch.empty(shape, dtype=torch.uint8 if name == "core_mask" else None)
            if name == "core_mask":
                self.register_buffer(name, tensor)
            else:
                self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def output_for(self, proj: str, x: torch.Tensor) -> torch.Tensor:
        held = self._pending
        if held is not None and held[0] is x and held[1] == _version(x) and proj in held[2]:
            held[2].discard(proj)
            if not held[2]:
                self._pending = None
            return held[3]
        y = self(x)
        rest = set(self.members) - {proj}
        self._pending = (x, _version(x), rest, y) if rest else None
        return y

    def column_ranges(self, head_dim: int) -> dict[str, tuple[int, int]]:
        raise NotImplementedError


class LowRankGroup(FactorGroup):
    """`y = (x @ A) @ B`: one projection as two thin GEMMs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.A.to(x.dtype)) @ self.B.to(x.dtype)

    def column_ranges(self, head_dim: int) -> dict[str, tuple[int, int]]:
        return {self.members[0]: (0, self.B.shape[1])}


class SlicedGroup(FactorGroup):
    """A group whose output is head slices: query heads, then key heads, then value heads."""

    def __init__(self, spec: dict) -> None:
        super().__init__(spec)
        self.heads = tuple(spec["heads"])

    def column_ranges(self, head_dim: int) -> dict[str, tuple[int, int]]:
        ranges, start = {}, 0
        for proj, heads in zip(self.members, self.heads, strict=True):
            ranges[proj] = (start, start + heads * head_dim)
            start += heads * head_dim
        return ranges


class TuckerGroup(SlicedGroup):
    """`y_s = (x @ U1) G_s U2^T` for every slice `s`, the latent `x @ U1` computed once.

    With the `kv_repeat` ablation each key/value head appears `kv_repeat` times and the copies
    are averaged.
    """

    def __init__(self, spec: dict) -> None:
        super().__init__(spec)
        self.kv_repeat = int(spec.get("kv_repeat", 1))
        self.slices, self.r1, self.r2 = spec["shape"]

    def _copies(self, proj: str) -> int:
        return self.kv_repeat if proj in ("k", "v") else 1

    def core_matrix(self, dtype: torch.dtype) -> torch.Tensor:
        """The core as one `(r1, S*r2)` matrix; a sparse core is scattered into it here."""
        if hasattr(self, "core"):
            core = self.core.to(dtype)
        else:
            count = self.slices * self.r1 * self.r2
            core = torch.zeros(count, dtype=dtype, device=self.core_values.device)
            core.masked_scatter_(unpack_bits(self.core_mask, count), self.core_values.to(dtype))
            core = core.view(self.slices, self.r1, self.r2)
        return core.permute(1, 0, 2).reshape(self.r1, self.slices * self.r2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        latent = (x @ self.U1.to(x.dtype)) @ self.core_matrix(x.dtype)  # (..., S*r2)
        y = latent.unflatten(-1, (self.slices, self.r2)) @ self.U2.to(x.dtype).T  # (..., S, dh)
        if self.kv_repeat > 1:
            parts, start = [], 0
            for proj, heads in zip(self.members, self.heads, strict=True):
                copies = self._copies(proj)
                part = y[..., start : start + heads * copies, :]
                start += heads * copies
                parts.append(part.unflatten(-2, (heads, copies)).mean(-2) if copies > 1 else part)
            y = torch.cat(parts, dim=-2)
        return y.flatten(-2)


class CPGroup(SlicedGroup):
    """`y_s = ((x @ A) * c_s) @ B^T` for every slice `s`: the rank-R CP `W_s = A diag(c_s) B^T`.

    The latent `x @ A` is computed once for all slices; the per-slice scaling and `B^T` are one
    broadcast product and one GEMM over every slice at once.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        latent = x @ self.A.to(x.dtype)  # (..., R)
        y = (latent.unsqueeze(-2) * self.C.to(x.dtype)) @ self.B.to(x.dtype).T  # (..., S, dh)
        return y.flatten(-2)


class GroupProjection(nn.Module):
    """Stands where `q_proj`/`k_proj`/`v_proj`/`o_proj` stood: its columns of a group, plus its bias.

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
        y = self.group.output_for(self.proj, x)
        if self.start != 0 or self.stop != y.shape[-1]:
            y = y[..., self.start : self.stop]
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _apply(self, fn, recurse: bool = True):
        # the group lives elsewhere in a loaded model, but a projection installed on its own
        # (while compressing) must still move with `.to()`
        self.group._apply(fn, recurse)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"{self.proj}: columns {self.start}:{self.stop} of a {type(self.group).__name__}"


class FusedProjection(nn.Module):
    """Stands where a fused projection stood (Phi-3's `qkv_proj`, rows Q, then K, then V): its
    members' outputs side by side, in that order.

    Members of one group share its forward (`FactorGroup.output_for`), so a Tucker Q/K/V group
    still runs once; only the concatenation is added.
    """

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        self.in_features = members[0].in_features
        self.out_features = sum(m.out_features for m in members)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.members], dim=-1)


def modules_of(names: dict[str, str], projs) -> dict[str, list[str]]:
    """The projections (of `projs`) held by each module name, in q, k, v, o order: one per module,
    or several row blocks of one fused module (Phi-3: `q`, `k` and `v` all name `qkv_proj`)."""
    held: dict[str, list[str]] = {}
    for proj in sorted(projs, key="qkvo".index):
        held.setdefault(names[proj], []).append(proj)
    return held


def place(layer: nn.Module, names: dict[str, str], modules: dict[str, nn.Module]) -> None:
    """Install projection modules (keyed `q`/`k`/`v`/`o`) in `layer` under their module names; the
    members of a fused module are installed together as one `FusedProjection`."""
    for name, members in modules_of(names, modules).items():
        fused = [p for p in "qkvo" if names.get(p) == name]
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


def projections(group: FactorGroup, head_dim: int,
                biases: dict[str, torch.Tensor | None]) -> dict[str, GroupProjection]:
    """The projection modules (keyed `q`/`k`/`v`/`o`) that read from `group`."""
    return {proj: GroupProjection(group, proj, cols, biases.get(proj))
            for proj, cols in group.column_ranges(head_dim).items()}


def held_values(spec: dict) -> int:
    """Elements the runtime holds for a group: every stored tensor, the packed mask as bytes."""
    return sum(math.prod(shape) for shape in spec["shapes"].values())


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
            for proj, module in projections(group, block["head_dim"], {}).items():
                old = layer.get_submodule(names[proj])
                if getattr(old, "bias", None) is not None:
                    module.bias = nn.Parameter(torch.empty_like(old.bias), requires_grad=False)
                modules[proj] = module
        place(layer, names, modules)
        layer.ftc = groups


# ---------------------------------------------------------------------------------------------
# transformers classes, one config and one causal LM per base family (created on first use)

CODE_FILE = "modeling_ftc"
_CLASSES: dict[str, type] = {}


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

    model_cls = type(model_name, (base_model,), {
        "config_class": config_cls,
        "_auto_class": "AutoModelForCausalLM",  # save_pretrained copies this file and keeps `auto_map`
        "__init__": __init__,
        "__module__": __name__,
        "__doc__": f"{base_model.__name__} whose attention projections run from FTC factor groups.",
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
