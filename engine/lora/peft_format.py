"""The PEFT LoRA file format, shared by the engine's loader and the registry's validation.

Pure functions on plain data, no I/O, no torch (the registry validates uploads in a child process
capped at 1 GiB of address space, which imports this module and numpy only).

The served model describes itself for LoRA as a `BaseModelShape`: its name, architecture,
dimensions and its LoRA-able linear layers by their checkpoint names (`LoRAModule`: q_proj ...
down_proj for Llama-family checkpoints; qkv_proj, o_proj, gate_up_proj, down_proj for Phi-3's
fused ones), each with its parent block, its in/out features and the slices of the engine's
canonical LoRA slots (q, k, v, o, gate, up, down) its output rows cover. The engine builds it from
its ModelConfig (engine.lora.weights.base_shape_of); the registry receives it as JSON
(`to_dict`/`from_dict`) and validates uploads against it. No model's shape is written here.

`parse_adapter_config(config, base)` turns the dict of an `adapter_config.json` into a
`PeftAdapterConfig` whose target_modules are the base's module names (or raises
`UnsupportedAdapterError` naming what is unsupported, e.g. a module the base does not have);
`expected_tensor_shapes` gives the tensor name -> shape map an adapter must have on that base;
`parse_tensor_name` maps a PEFT tensor name to (layer, module, "A"|"B"). Supported adapters put
LoRA on a set of the base's modules in every layer, with one rank and alpha, or per-module ones
(PEFT's rank_pattern / alpha_pattern, resolved per (layer, module) by `module_rank` /
`module_scale`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

try:  # google-re2: linear-time matching, so a tenant's pattern cannot backtrack catastrophically
    import re2
except ImportError:  # images without it refuse regex target_modules (never Python `re` on them)
    re2 = None

#: The engine's LoRA slots (engine/lora/layers.py): every base module's output rows are one or
#: more of these slices (a fused qkv_proj covers q, k and v).
CANONICAL_SLICES: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
#: The decoder blocks that hold LoRA-able linear layers.
PARENTS: tuple[str, ...] = ("self_attn", "mlp")

# Files a PEFT adapter may arrive as. Pickle formats are refused by name: torch.load on them runs
# arbitrary code from the file.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

# A LoRA A/B weight as PEFT saves it: layer, parent block, module, A|B.
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)\.lora_(A|B)\.weight$"
)
# What a module name of a description may be (it becomes part of tensor names and patterns).
_MODULE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
# Longest regex target_modules accepted. PEFT's own patterns are tens of characters; the cap keeps
# compiling (RE2 programs grow with the pattern) cheap whatever a config holds.
MAX_TARGET_PATTERN_CHARS = 1024
# Most layers and modules a description may state (far above any served model; bounds the work a
# malformed description could cause).
MAX_LAYERS = 1024
MAX_MODULES = 64


class UnsupportedAdapterError(ValueError):
    """The adapter uses a PEFT feature or layout that Tessera does not serve; the message says which."""


class ModuleNotInBase(UnsupportedAdapterError):
    """The adapter names a module (in target_modules) that the base model does not have; the
    message names it and the base's LoRA-able modules."""


@dataclass(frozen=True)
class LoRAModule:
    """One LoRA-able linear layer of every decoder layer, as the checkpoint names it.

    A LoRA on it adds scale * B @ (A @ x) with A [r, in_features] and B [out_features, r].
    `slices` are the engine's canonical slots its output rows feed, in row order, with their
    widths (summing to out_features): ("q", 3072), ("k", 1024), ("v", 1024) for a fused
    qkv_proj; one slice of the full width for a plain projection."""

    name: str  # "q_proj", "qkv_proj", ...
    parent: str  # "self_attn" | "mlp"
    in_features: int
    out_features: int
    slices: tuple[tuple[str, int], ...]

    def key(self, layer: int) -> str:
        """Its full name in layer `layer` of the HF model (what PEFT matches patterns against)."""
        return f"model.layers.{layer}.{self.parent}.{self.name}"

    def tensor_name(self, layer: int, which: Literal["A", "B"]) -> str:
        """The PEFT tensor name of its LoRA matrix `which` in `layer`."""
        return tensor_name(layer, self.parent, self.name, which)

    def slice_rows(self) -> list[tuple[str, int, int]]:
        """(canonical slice, first row, width) of each slice, in row order."""
        rows, start = [], 0
        for canon, width in self.slices:
            rows.append((canon, start, width))
            start += width
        return rows


@dataclass(frozen=True)
class BaseModelShape:
    """The served model's self-description for LoRA: what an adapter's config and tensors must fit.

    Plain data (JSON through `to_dict`/`from_dict`): the engine builds it from its ModelConfig
    (engine.lora.weights.base_shape_of, or `for_decoder` from the dimensions), engine workers
    publish it, the registry stores it with each adapter version and validates against it."""

    name: str  # the served name (ModelConfig.name), e.g. "Qwen/Qwen2.5-7B-Instruct"
    architecture: str  # HF model_type, e.g. "qwen2"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    modules: tuple[LoRAModule, ...]

    @classmethod
    def for_decoder(cls, *, name: str, architecture: str, num_layers: int, hidden_size: int,
                    intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    fused_projections: bool = False) -> "BaseModelShape":
        """The description of a decoder of these dimensions: Llama-family checkpoint modules
        (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), or with
        `fused_projections` Phi-3's (qkv_proj [in hidden, out (heads + 2 kv_heads) * head_dim],
        o_proj, gate_up_proj [out 2 * intermediate], down_proj). Widths come from the heads and
        head_dim, so a head_dim other than hidden / heads (Gemma) and narrow k/v (grouped-query
        attention) are right by construction."""
        q, kv, hidden, inter = num_heads * head_dim, num_kv_heads * head_dim, hidden_size, intermediate_size
        if fused_projections:
            attn = [LoRAModule("qkv_proj", "self_attn", hidden, q + 2 * kv, (("q", q), ("k", kv), ("v", kv)))]
            mlp = [LoRAModule("gate_up_proj", "mlp", hidden, 2 * inter, (("gate", inter), ("up", inter)))]
        else:
            attn = [LoRAModule(f"{c}_proj", "self_attn", hidden, w, ((c, w),)) for c, w in (("q", q), ("k", kv), ("v", kv))]
            mlp = [LoRAModule(f"{c}_proj", "mlp", hidden, inter, ((c, inter),)) for c in ("gate", "up")]
        modules = (*attn, LoRAModule("o_proj", "self_attn", q, hidden, (("o", hidden),)),
                   *mlp, LoRAModule("down_proj", "mlp", inter, hidden, (("down", hidden),)))
        return cls(name=name, architecture=architecture, num_layers=num_layers, hidden_size=hidden,
                   intermediate_size=inter, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   modules=modules)

    def __post_init__(self) -> None:
        _check_description(self)

    @property
    def module_names(self) -> tuple[str, ...]:
        """The LoRA-able modules' checkpoint names, in the checkpoint's order."""
        return tuple(m.name for m in self.modules)

    def module(self, name: str) -> LoRAModule:
        """The module called `name`; KeyError naming the base's modules otherwise."""
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"{self.label} has no module {name!r}; its LoRA-able modules are {', '.join(self.module_names)}")

    def module_dims(self, name: str) -> tuple[int, int]:
        """(in_features, out_features) of module `name` (checkpoint name)."""
        m = self.module(name)
        return m.in_features, m.out_features

    def slice_dims(self, canonical: str) -> tuple[int, int]:
        """(in_features, width) of the canonical slot `canonical` (q, k, ...): the engine's LoRA
        slot shapes."""
        for m in self.modules:
            for c, width in m.slices:
                if c == canonical:
                    return m.in_features, width
        raise KeyError(f"{self.label} has no {canonical!r} slice")

    def module_of_slice(self) -> dict[str, LoRAModule]:
        """Canonical slice -> the module whose output rows hold it."""
        return {c: m for m in self.modules for c, _ in m.slices}

    def tensor_name(self, layer: int, module: str, which: Literal["A", "B"]) -> str:
        """The PEFT tensor name of LoRA matrix `which` of module `module` in `layer`."""
        return self.module(module).tensor_name(layer, which)

    @property
    def label(self) -> str:
        """How messages name it: "Qwen2.5-7B-Instruct (qwen2)"."""
        return f"{self.name} ({self.architecture})"

    def dims_text(self) -> str:
        """Its dimensions in words, for messages: "hidden 3584, intermediate 18944, 28 heads,
        4 KV heads, head dim 128, 28 layers"."""
        return (f"hidden {self.hidden_size}, intermediate {self.intermediate_size}, {self.num_heads} heads, "
                f"{self.num_kv_heads} KV heads, head dim {self.head_dim}, {self.num_layers} layers")

    def module_text(self, name: str) -> str:
        """Module `name`'s shape in words, for messages: "k_proj maps 3584 -> 512 (4 KV heads x
        head dim 128)", "qkv_proj maps 3072 -> 9216 (q 3072 + k 3072 + v 3072)"."""
        m = self.module(name)
        if len(m.slices) > 1:
            detail = " + ".join(f"{c} {w}" for c, w in m.slices)
        else:
            c = m.slices[0][0]
            detail = {"q": f"{self.num_heads} heads x head dim {self.head_dim}",
                      "k": f"{self.num_kv_heads} KV heads x head dim {self.head_dim}",
                      "v": f"{self.num_kv_heads} KV heads x head dim {self.head_dim}",
                      "o": f"{self.num_heads} heads x head dim {self.head_dim} -> hidden",
                      "gate": "hidden -> intermediate", "up": "hidden -> intermediate",
                      "down": "intermediate -> hidden"}.get(c, c)
        return f"{m.name} maps {m.in_features} -> {m.out_features} ({detail})"

    def to_dict(self) -> dict:
        """The JSON form (`from_dict` reads it back to an equal description)."""
        return {"name": self.name, "architecture": self.architecture, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "modules": [{"name": m.name, "parent": m.parent, "in_features": m.in_features,
                             "out_features": m.out_features, "slices": [[c, w] for c, w in m.slices]}
                            for m in self.modules]}

    @classmethod
    def from_dict(cls, data: Any) -> "BaseModelShape":
        """A description from its JSON form (`to_dict`), e.g. as an engine worker published it.
        ValueError naming the first field that is missing or malformed."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a base model description must be a JSON object, got {type(data).__name__}")
        ints = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")
        for key in ("name", "architecture", *ints, "modules"):
            if key not in data:
                raise ValueError(f"base model description has no {key!r}")
        modules = data["modules"]
        if not isinstance(modules, list):
            raise ValueError("base model description: 'modules' must be a list")
        parsed = []
        for i, m in enumerate(modules[:MAX_MODULES + 1]):
            if not isinstance(m, Mapping) or not isinstance(m.get("slices"), list):
                raise ValueError(f"base model description: module {i} must be an object with a list of slices")
            try:
                slices = tuple((s[0], s[1]) for s in m["slices"] if isinstance(s, (list, tuple)) and len(s) == 2)
            except (TypeError, IndexError):
                slices = ()
            if len(slices) != len(m["slices"]):
                raise ValueError(f"base model description: module {i}'s slices must be [name, width] pairs")
            parsed.append(LoRAModule(name=m.get("name"), parent=m.get("parent"), in_features=m.get("in_features"),
                                     out_features=m.get("out_features"), slices=slices))
        return cls(name=data["name"], architecture=data["architecture"],
                   **{k: data[k] for k in ints}, modules=tuple(parsed))


def _is_count(value: Any, *, most: int | None = None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value > 0
            and (most is None or value <= most))


def _check_description(base: BaseModelShape) -> None:
    """ValueError naming the first thing wrong with `base` (types, dimensions, module names,
    slices that do not cover a module's output rows or name a slot twice)."""
    for key in ("name", "architecture"):
        value = getattr(base, key)
        if not isinstance(value, str) or not value.strip() or len(value) > 256:
            raise ValueError(f"base model description: {key!r} must be a non-empty string of at most 256 characters")
    if not _is_count(base.num_layers, most=MAX_LAYERS):
        raise ValueError(f"base model description: num_layers must be an integer in 1..{MAX_LAYERS}")
    for key in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
        if not _is_count(getattr(base, key), most=1 << 24):
            raise ValueError(f"base model description: {key} must be a positive integer")
    if not isinstance(base.modules, tuple) or not base.modules or len(base.modules) > MAX_MODULES:
        raise ValueError(f"base model description: it must have 1..{MAX_MODULES} modules")
    names, slots = set(), set()
    for m in base.modules:
        if not isinstance(m, LoRAModule):
            raise ValueError("base model description: modules must be LoRAModule entries")
        if not isinstance(m.name, str) or not _MODULE_NAME.match(m.name) or m.name in names:
            raise ValueError(f"base model description: module name {m.name!r} is not a unique identifier")
        names.add(m.name)
        if m.parent not in PARENTS:
            raise ValueError(f"base model description: module {m.name} has parent {m.parent!r}; "
                             f"expected one of {', '.join(PARENTS)}")
        if not _is_count(m.in_features, most=1 << 24) or not _is_count(m.out_features, most=1 << 24):
            raise ValueError(f"base model description: module {m.name} needs positive in/out features")
        if not m.slices:
            raise ValueError(f"base model description: module {m.name} covers no slice")
        for canon, width in m.slices:
            if canon not in CANONICAL_SLICES or canon in slots:
                raise ValueError(f"base model description: module {m.name} names slice {canon!r}, which is not "
                                 f"one of {', '.join(CANONICAL_SLICES)} or is covered twice")
            if not _is_count(width):
                raise ValueError(f"base model description: module {m.name}'s slice {canon} needs a positive width")
            slots.add(canon)
        if sum(w for _, w in m.slices) != m.out_features:
            raise ValueError(f"base model description: module {m.name}'s slices do not add up to its "
                             f"{m.out_features} output rows")


@dataclass(frozen=True)
class PeftAdapterConfig:
    """What the engine needs from an adapter_config.json (a supported LoRA adapter), as parsed
    against one base model (`parse_adapter_config`)."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # the base's module names it targets, in the base's order
    fan_in_fan_out: bool
    base_model_name_or_path: str | None
    # PEFT's per-module overrides, pattern -> rank / alpha, in the config's order (the first
    # matching pattern wins, as in PEFT); empty when the adapter has one rank and alpha.
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    # Each target module's parent block in the base (its full name is what patterns match).
    module_parents: dict[str, str] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        """The factor applied to B @ A of a module no pattern names: alpha/sqrt(r) with rsLoRA,
        else alpha/r."""
        return _scale(self.alpha, self.rank, self.use_rslora)

    def module_key(self, layer: int, module: str) -> str:
        """Target `module`'s full name in `layer` (model.layers.{layer}.{parent}.{module})."""
        return f"model.layers.{layer}.{self.module_parents[module]}.{module}"

    def module_rank(self, layer: int, module: str) -> int:
        """The rank of target `module` (checkpoint name) in `layer` (rank_pattern's, else r)."""
        key = _pattern_key(self.rank_pattern, self.module_key(layer, module))
        return self.rank if key is None else self.rank_pattern[key]

    def module_alpha(self, layer: int, module: str) -> float:
        """The alpha of target `module` in `layer` (alpha_pattern's, else lora_alpha)."""
        key = _pattern_key(self.alpha_pattern, self.module_key(layer, module))
        return self.alpha if key is None else float(self.alpha_pattern[key])

    def module_scale(self, layer: int, module: str) -> float:
        """The factor applied to B @ A of `module` in `layer`: its alpha over its rank (or sqrt)."""
        return _scale(self.module_alpha(layer, module), self.module_rank(layer, module), self.use_rslora)

    def largest_rank(self, num_layers: int) -> tuple[int, int, str]:
        """(rank, layer, module) of the adapter's largest-rank targeted module (the first such)."""
        best = (0, 0, "")
        for layer in range(num_layers):
            for m in self.target_modules:
                r = self.module_rank(layer, m)
                if r > best[0]:
                    best = (r, layer, m)
        return best


def _scale(alpha: float, rank: int, use_rslora: bool) -> float:
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _pattern_key(patterns: Mapping[str, Any], name: str) -> str | None:
    r"""PEFT's get_pattern_key: the first pattern `key` (in order) for which
    re.match(rf"(.*\.)?({key})$", name) matches, run with RE2 on the same expression; None if none."""
    for key in patterns:
        if _compile_pattern_key(key).match(name):
            return key
    return None


_PATTERN_CACHE: dict[str, Any] = {}


def _compile_pattern_key(key: str):
    compiled = _PATTERN_CACHE.get(key)
    if compiled is None:
        compiled = _compile_regex(rf"(.*\.)?({key})$", what=f"rank/alpha pattern {_shorten(key)!r}", length=len(key))
        if len(_PATTERN_CACHE) < 4096:
            _PATTERN_CACHE[key] = compiled
    return compiled


def _module_universe(base: BaseModelShape) -> list[tuple[str, str | None]]:
    """Every module name PEFT would match targets against in `base`, with the base's module name
    for its LoRA-able linear layers (None for modules we cannot put LoRA on)."""
    names: list[tuple[str, str | None]] = [("model.embed_tokens", None), ("lm_head", None), ("model.norm", None)]
    for i in range(base.num_layers):
        for m in base.modules:
            names.append((m.key(i), m.name))
        names.append((f"model.layers.{i}.input_layernorm", None))
        names.append((f"model.layers.{i}.post_attention_layernorm", None))
    return names


def _shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _compile_target_pattern(pattern: str):
    """`pattern` compiled by RE2 (linear-time matching whatever the pattern: no backtracking).

    Raises UnsupportedAdapterError when RE2 is not installed (Python's `re` is never run on a
    tenant's pattern: a pattern such as (a+)+$ backtracks for exponential time), when the
    pattern is longer than MAX_TARGET_PATTERN_CHARS, or when RE2 cannot compile it (it has no
    backreferences or lookaround; PEFT's patterns need neither)."""
    return _compile_regex(pattern, what=f"target_modules regex {_shorten(pattern)!r}", length=len(pattern),
                          alternative="list the module names instead, e.g. [\"q_proj\", \"v_proj\"]")


def _compile_regex(expression: str, *, what: str, length: int | None = None,
                   alternative: str = "name the modules plainly, e.g. \"q_proj\""):
    """`expression` compiled by RE2 for the tenant pattern `what` (see _compile_target_pattern)."""
    length = len(expression) if length is None else length
    if length > MAX_TARGET_PATTERN_CHARS:
        raise UnsupportedAdapterError(
            f"{what} is {length} characters long; at most {MAX_TARGET_PATTERN_CHARS} are accepted ({alternative})"
        )
    if re2 is None:
        raise UnsupportedAdapterError(
            f"{what} needs the google-re2 package (linear-time matching), which is not installed here; {alternative}"
        )
    options = re2.Options()
    options.log_errors = False
    try:
        return re2.compile(expression, options=options)
    except re2.error as e:
        detail = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise UnsupportedAdapterError(
            f"{what} does not compile with RE2 (linear-time regex: no backreferences or lookaround): {detail}"
        ) from None


def _not_in_base(target: str, base: BaseModelShape) -> ModuleNotInBase:
    """The refusal of list entry `target`, which names no module of `base`."""
    fused = next((m.name for m in base.modules if len(m.slices) > 1 and target in {f"{c}_proj" for c, _ in m.slices}),
                 None)
    hint = f" ({target} is part of its fused {fused})" if fused else ""
    return ModuleNotInBase(
        f"target module {_shorten(target)!r} is not supported: {base.label} has no such module{hint}; "
        f"its LoRA-able modules are {', '.join(base.module_names)}"
    )


def listed_target_misfit(target_modules: Any, base: BaseModelShape) -> ModuleNotInBase | None:
    """For target_modules in PEFT's list form, the refusal of its first entry that names no
    module of `base` (None when each names one, or target_modules is not a list of names: a regex
    or "all-linear" is resolved, with RE2, only by `parse_adapter_config`)."""
    if not isinstance(target_modules, (list, tuple)) or not all(isinstance(t, str) for t in target_modules):
        return None
    index = _suffix_index(_module_universe(base))
    for t in target_modules:
        if t not in index:
            return _not_in_base(t, base)
    return None


def _suffix_index(universe: list[tuple[str, str | None]]) -> dict[str, list[tuple[str, str | None]]]:
    """PEFT's list matching as a lookup: each entry's name and every dot-separated tail of it
    ("q_proj", "self_attn.q_proj", ...) -> the entries that a target_modules item of that text
    matches (it equals the name or ends with "." + it)."""
    index: dict[str, list[tuple[str, str | None]]] = {}
    for key, name in universe:
        parts = key.split(".")
        for i in range(len(parts)):
            index.setdefault(".".join(parts[i:]), []).append((key, name))
    return index


def _resolve_targets(target_modules: Any, base: BaseModelShape) -> tuple[str, ...]:
    if target_modules is None:
        raise UnsupportedAdapterError("adapter_config.json has no target_modules")
    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
        return base.module_names
    universe = _module_universe(base)
    if isinstance(target_modules, str):
        # PEFT treats a string as a regex that must match the whole module name.
        pattern = _compile_target_pattern(target_modules)
        matched = [(key, name) for key, name in universe if pattern.fullmatch(key)]
        label = f"target_modules regex {_shorten(target_modules)!r}"
    elif isinstance(target_modules, (list, tuple, set)) and all(isinstance(t, str) for t in target_modules):
        # PEFT's list form: a module matches an entry if its name equals it or ends with "." + it.
        matched = []
        index = _suffix_index(universe)
        for t in dict.fromkeys(target_modules):
            hits = index.get(t)
            if not hits:
                raise _not_in_base(t, base)
            matched.extend(hits)
        label = f"target_modules {sorted(target_modules)!r}"
    else:
        raise UnsupportedAdapterError(f"target_modules must be a list of names or a string, got {target_modules!r}")

    bad = sorted({key for key, name in matched if name is None})
    if bad:
        kind = "embedding/lm_head" if any(k in ("model.embed_tokens", "lm_head") for k in bad) else "non-linear"
        raise UnsupportedAdapterError(f"{label} targets {kind} modules ({', '.join(bad[:3])}), which are not supported")
    if not matched:
        raise UnsupportedAdapterError(f"{label} matches no supported module of {base.label} "
                                      f"(its LoRA-able modules are {', '.join(base.module_names)})")
    per_module: dict[str, set[int]] = {}
    for key, name in matched:
        per_module.setdefault(name, set()).add(int(key.split(".")[2]))
    partial = [n for n in base.module_names if n in per_module and len(per_module[n]) != base.num_layers]
    if partial:
        raise UnsupportedAdapterError(
            f"{label} puts LoRA on {', '.join(partial)} in only some layers; "
            "adapters must target the same modules in every layer"
        )
    return tuple(n for n in base.module_names if n in per_module)


def _refuse_if_set(config: Mapping[str, Any], key: str, what: str) -> None:
    value = config.get(key)
    if value not in (None, False, [], {}, ""):
        raise UnsupportedAdapterError(f"{what} ({key}={value!r}) is not supported")


def parse_adapter_config(config: Mapping[str, Any], base: BaseModelShape) -> PeftAdapterConfig:
    """Parse the dict of a PEFT adapter_config.json into a PeftAdapterConfig for `base`.

    target_modules (a list of names, a regex fullmatched by RE2 against every module's full name,
    or "all-linear") is resolved against the base's own modules and layers. Raises
    UnsupportedAdapterError, naming the feature, for anything the engine cannot serve: non-LoRA
    PEFT types, DoRA, modules_to_save, a target the base does not have (ModuleNotInBase, naming
    the base's modules), embedding/lm_head targets, LoRA biases, per-layer selection, a
    rank/alpha pattern that is not a string -> positive number map or does not compile with RE2,
    fan_in_fan_out (GPT-2 Conv1D layout), a missing or non-positive rank.
    """
    if not isinstance(config, Mapping):
        raise UnsupportedAdapterError("adapter_config.json must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise UnsupportedAdapterError(f"PEFT type {peft_type!r} is not supported (only LORA)")
    _refuse_if_set(config, "use_dora", "DoRA")
    _refuse_if_set(config, "modules_to_save", "modules_to_save (fully trained extra modules)")
    _refuse_if_set(config, "layers_to_transform", "LoRA on selected layers only")
    _refuse_if_set(config, "lora_bias", "LoRA bias terms")
    _refuse_if_set(config, "exclude_modules", "exclude_modules")
    _refuse_if_set(config, "target_parameters", "LoRA on parameters")
    _refuse_if_set(config, "trainable_token_indices", "trainable token embeddings")
    bias = config.get("bias", "none")
    if bias != "none":
        raise UnsupportedAdapterError(f"bias={bias!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise UnsupportedAdapterError("fan_in_fan_out=true (GPT-2 Conv1D layout) is not supported")

    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise UnsupportedAdapterError(f"rank r must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise UnsupportedAdapterError(f"lora_alpha must be a positive number, got {alpha!r}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise UnsupportedAdapterError(f"use_rslora must be true or false, got {use_rslora!r}")
    named_base = config.get("base_model_name_or_path")
    if named_base is not None and not isinstance(named_base, str):
        raise UnsupportedAdapterError(f"base_model_name_or_path must be a string, got {named_base!r}")

    targets = _resolve_targets(config.get("target_modules"), base)
    rank_pattern = _parse_pattern(config.get("rank_pattern"), "rank_pattern", integer=True)
    alpha_pattern = _parse_pattern(config.get("alpha_pattern"), "alpha_pattern", integer=False)
    return PeftAdapterConfig(
        rank=rank,
        alpha=float(alpha),
        use_rslora=use_rslora,
        target_modules=targets,
        fan_in_fan_out=False,
        base_model_name_or_path=named_base or None,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        module_parents={n: base.module(n).parent for n in targets},
    )


# At most this many entries in a rank/alpha pattern: PEFT writes one per distinct value.
MAX_PATTERN_ENTRIES = 1024


def _parse_pattern(value: Any, key: str, *, integer: bool) -> dict:
    """A rank_pattern / alpha_pattern: {} for none, else its entries in order, each key compiled
    once here so a bad pattern is refused at parse time, not at the first lookup."""
    if value in (None, {}):
        return {}
    if not isinstance(value, Mapping):
        raise UnsupportedAdapterError(f"{key} must map module patterns to numbers, got {_shorten(repr(value))}")
    if len(value) > MAX_PATTERN_ENTRIES:
        raise UnsupportedAdapterError(f"{key} has {len(value)} entries; at most {MAX_PATTERN_ENTRIES} are accepted")
    out: dict = {}
    for pattern, number in value.items():
        if not isinstance(pattern, str) or not pattern:
            raise UnsupportedAdapterError(f"{key} keys must be non-empty module patterns, got {pattern!r}")
        ok_type = (int,) if integer else (int, float)
        if (isinstance(number, bool) or not isinstance(number, ok_type) or not math.isfinite(number)
                or number <= 0):
            what = "a positive integer" if integer else "a positive number"
            raise UnsupportedAdapterError(f"{key}[{_shorten(pattern)!r}] must be {what}, got {number!r}")
        _compile_pattern_key(pattern)
        out[pattern] = number if integer else float(number)
    return out


def tensor_name(layer: int, parent: str, module: str, which: Literal["A", "B"]) -> str:
    """The PEFT tensor name of LoRA matrix `which` of `parent`.`module` in `layer`."""
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{which}.weight"


def parse_tensor_name(name: str, base: BaseModelShape) -> tuple[int, str, Literal["A", "B"]]:
    """Map a saved PEFT tensor name to (layer, module name in `base`, "A"|"B").

    Raises UnsupportedAdapterError for any other tensor (DoRA magnitudes, biases, embeddings,
    adapter-named keys such as `...lora_A.default.weight`), and ModuleNotInBase for a LoRA weight
    of a module `base` does not have (or not under that parent). The layer is not checked.
    """
    m = _TENSOR_NAME.match(name)
    if m is None:
        raise UnsupportedAdapterError(f"unexpected tensor {_shorten(name)!r}: not a LoRA A/B weight of a linear layer")
    layer, parent, module, which = m.groups()
    if module not in base.module_names:
        raise ModuleNotInBase(f"tensor {_shorten(name)!r} is for module {module}, which {base.label} does not have; "
                              f"its LoRA-able modules are {', '.join(base.module_names)}")
    if base.module(module).parent != parent:
        raise ModuleNotInBase(f"tensor {_shorten(name)!r}: {base.label}'s {module} is under "
                              f"{base.module(module).parent}, not {parent}")
    return int(layer), module, which  # type: ignore[return-value]


def expected_tensor_shapes(base: BaseModelShape, config: PeftAdapterConfig) -> dict[str, tuple[int, int]]:
    """Tensor name -> shape for `config` on `base`: lora_A is [r, in_features], lora_B is
    [out_features, r] with r the module's rank (config.module_rank), for each target module in
    every layer."""
    shapes: dict[str, tuple[int, int]] = {}
    targets = [base.module(name) for name in config.target_modules]
    for layer in range(base.num_layers):
        for m in targets:
            r = config.module_rank(layer, m.name)
            shapes[m.tensor_name(layer, "A")] = (r, m.in_features)
            shapes[m.tensor_name(layer, "B")] = (m.out_features, r)
    return shapes


def check_not_pickle(filename: str) -> None:
    """Raise UnsupportedAdapterError if `filename` is a pickle checkpoint (adapter_model.bin,
    *.pt, ...): unpickling runs arbitrary code, so only safetensors weights are accepted."""
    lower = filename.lower()
    if lower.endswith(PICKLE_SUFFIXES):
        raise UnsupportedAdapterError(
            f"{filename} is a pickle file, which is refused because loading one runs arbitrary code; "
            "save the adapter as adapter_model.safetensors (save_pretrained(..., safe_serialization=True))"
        )
