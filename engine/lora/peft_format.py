"""The PEFT LoRA file format, shared by the engine's loader and the registry's validation.

Pure functions, no I/O: `parse_adapter_config` turns the dict of an `adapter_config.json` into a
`PeftAdapterConfig` (or raises `UnsupportedAdapterError` naming what is unsupported);
`expected_tensor_shapes` gives the tensor name -> shape map an adapter must have for a base
model's dimensions; `parse_tensor_name` maps a PEFT tensor name to (layer, module, "A"|"B").

Module names are canonical short names: q, k, v, o (attention) and gate, up, down (MLP), the
Llama-family linear layers that the engine's LoRA layers wrap. Supported adapters put LoRA on a
set of those modules in every layer, with one rank and alpha, or per-module ones (PEFT's
rank_pattern / alpha_pattern, resolved per (layer, module) by `module_rank` / `module_scale`).
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

# Canonical module name -> (parent block, HF module name), in the engine's order.
MODULES: dict[str, tuple[str, str]] = {
    "q": ("self_attn", "q_proj"),
    "k": ("self_attn", "k_proj"),
    "v": ("self_attn", "v_proj"),
    "o": ("self_attn", "o_proj"),
    "gate": ("mlp", "gate_proj"),
    "up": ("mlp", "up_proj"),
    "down": ("mlp", "down_proj"),
}
CANONICAL_MODULES: tuple[str, ...] = tuple(MODULES)
_HF_TO_CANONICAL = {hf: canon for canon, (_, hf) in MODULES.items()}

# Files a PEFT adapter may arrive as. Pickle formats are refused by name: torch.load on them runs
# arbitrary code from the file.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_(A|B)\.weight$"
)

# How many layers a regex target_modules is checked against when the base is not known: enough
# to tell "every layer" from "some layers" for any base we serve.
_DEFAULT_LAYERS_FOR_MATCHING = 128
# Longest regex target_modules accepted. PEFT's own patterns are tens of characters; the cap keeps
# compiling (RE2 programs grow with the pattern) cheap whatever a config holds.
MAX_TARGET_PATTERN_CHARS = 1024


class UnsupportedAdapterError(ValueError):
    """The adapter uses a PEFT feature or layout that Tessera does not serve; the message says which."""


@dataclass(frozen=True)
class BaseModelShape:
    """The dimensions of a Llama-family base model that a LoRA adapter's tensors must fit."""

    name: str  # canonical name, as in adapter_config.json's base_model_name_or_path
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of the base linear layer `module` (canonical name)."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        dims = {
            "q": (self.hidden_size, q_out),
            "k": (self.hidden_size, kv_out),
            "v": (self.hidden_size, kv_out),
            "o": (q_out, self.hidden_size),
            "gate": (self.hidden_size, self.intermediate_size),
            "up": (self.hidden_size, self.intermediate_size),
            "down": (self.intermediate_size, self.hidden_size),
        }
        if module not in dims:
            raise KeyError(f"unknown module {module!r}; expected one of {CANONICAL_MODULES}")
        return dims[module]


SMOLLM2_135M_INSTRUCT = BaseModelShape(
    name="HuggingFaceTB/SmolLM2-135M-Instruct",
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
)
# Not served by default; used by benchmarks and by deployments that serve a 7B base.
LLAMA2_7B = BaseModelShape(
    name="meta-llama/Llama-2-7b-hf",
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
)
KNOWN_BASE_MODELS: dict[str, BaseModelShape] = {
    s.name: s for s in (SMOLLM2_135M_INSTRUCT, LLAMA2_7B)
}


@dataclass(frozen=True)
class PeftAdapterConfig:
    """What the engine needs from an adapter_config.json (a supported LoRA adapter)."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # canonical names, in CANONICAL_MODULES order
    fan_in_fan_out: bool
    base_model_name_or_path: str | None
    # PEFT's per-module overrides, pattern -> rank / alpha, in the config's order (the first
    # matching pattern wins, as in PEFT); empty when the adapter has one rank and alpha.
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        """The factor applied to B @ A of a module no pattern names: alpha/sqrt(r) with rsLoRA,
        else alpha/r."""
        return _scale(self.alpha, self.rank, self.use_rslora)

    def module_rank(self, layer: int, module: str) -> int:
        """The rank of canonical `module` in `layer` (rank_pattern's, else r)."""
        key = _pattern_key(self.rank_pattern, module_key(layer, module))
        return self.rank if key is None else self.rank_pattern[key]

    def module_alpha(self, layer: int, module: str) -> float:
        """The alpha of canonical `module` in `layer` (alpha_pattern's, else lora_alpha)."""
        key = _pattern_key(self.alpha_pattern, module_key(layer, module))
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


def module_key(layer: int, module: str) -> str:
    """The module's full name in the HF model, the name PEFT matches patterns against."""
    parent, hf = MODULES[module]
    return f"model.layers.{layer}.{parent}.{hf}"


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


def _module_universe(num_layers: int) -> list[tuple[str, str | None]]:
    """Every module name PEFT would match targets against in a Llama model, with its canonical
    linear name (None for modules we cannot put LoRA on)."""
    names: list[tuple[str, str | None]] = [("model.embed_tokens", None), ("lm_head", None), ("model.norm", None)]
    for i in range(num_layers):
        for canon, (parent, hf) in MODULES.items():
            names.append((f"model.layers.{i}.{parent}.{hf}", canon))
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


def _resolve_targets(target_modules: Any, num_layers: int) -> tuple[str, ...]:
    if target_modules is None:
        raise UnsupportedAdapterError("adapter_config.json has no target_modules")
    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
        return CANONICAL_MODULES
    universe = _module_universe(num_layers)
    if isinstance(target_modules, str):
        # PEFT treats a string as a regex that must match the whole module name.
        pattern = _compile_target_pattern(target_modules)
        matched = [(key, canon) for key, canon in universe if pattern.fullmatch(key)]
        label = f"target_modules regex {_shorten(target_modules)!r}"
    elif isinstance(target_modules, (list, tuple, set)) and all(isinstance(t, str) for t in target_modules):
        # PEFT's list form: a module matches an entry if its name equals it or ends with "." + it.
        matched = []
        for t in target_modules:
            hits = [(key, canon) for key, canon in universe if key == t or key.endswith("." + t)]
            if not hits:
                raise UnsupportedAdapterError(
                    f"target module {t!r} is not supported: supported targets are "
                    f"{', '.join(hf for _, hf in MODULES.values())}"
                )
            matched.extend(hits)
        label = f"target_modules {sorted(target_modules)!r}"
    else:
        raise UnsupportedAdapterError(f"target_modules must be a list of names or a string, got {target_modules!r}")

    bad = sorted({key for key, canon in matched if canon is None})
    if bad:
        kind = "embedding/lm_head" if any(k in ("model.embed_tokens", "lm_head") for k in bad) else "non-linear"
        raise UnsupportedAdapterError(f"{label} targets {kind} modules ({', '.join(bad[:3])}), which are not supported")
    if not matched:
        raise UnsupportedAdapterError(f"{label} matches no supported module")
    per_module: dict[str, set[int]] = {}
    for key, canon in matched:
        per_module.setdefault(canon, set()).add(int(key.split(".")[2]))
    partial = sorted(c for c, layers in per_module.items() if len(layers) != num_layers)
    if partial:
        raise UnsupportedAdapterError(
            f"{label} puts LoRA on {', '.join(partial)} in only some layers; "
            "adapters must target the same modules in every layer"
        )
    return tuple(c for c in CANONICAL_MODULES if c in per_module)


def _refuse_if_set(config: Mapping[str, Any], key: str, what: str) -> None:
    value = config.get(key)
    if value not in (None, False, [], {}, ""):
        raise UnsupportedAdapterError(f"{what} ({key}={value!r}) is not supported")


def parse_adapter_config(config: Mapping[str, Any], *, num_layers: int | None = None) -> PeftAdapterConfig:
    """Parse the dict of a PEFT adapter_config.json into a PeftAdapterConfig.

    `num_layers` (the base model's) lets a regex target_modules be checked against exactly the
    layers that exist; without it, layers 0..127 are used. Raises UnsupportedAdapterError, naming
    the feature, for anything the engine cannot serve: non-LoRA PEFT types, DoRA,
    modules_to_save, embedding/lm_head targets, LoRA biases, per-layer selection, a rank/alpha
    pattern that is not a string -> positive number map or does not compile with RE2, fan_in_fan_out (GPT-2 Conv1D layout), a missing or non-positive rank.
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
        raise UnsupportedAdapterError("fan_in_fan_out=true (GPT-2 Conv1D layout) is not supported for Llama-family bases")

    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise UnsupportedAdapterError(f"rank r must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise UnsupportedAdapterError(f"lora_alpha must be a positive number, got {alpha!r}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise UnsupportedAdapterError(f"use_rslora must be true or false, got {use_rslora!r}")
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise UnsupportedAdapterError(f"base_model_name_or_path must be a string, got {base!r}")

    targets = _resolve_targets(config.get("target_modules"), num_layers or _DEFAULT_LAYERS_FOR_MATCHING)
    rank_pattern = _parse_pattern(config.get("rank_pattern"), "rank_pattern", integer=True)
    alpha_pattern = _parse_pattern(config.get("alpha_pattern"), "alpha_pattern", integer=False)
    return PeftAdapterConfig(
        rank=rank,
        alpha=float(alpha),
        use_rslora=use_rslora,
        target_modules=targets,
        fan_in_fan_out=False,
        base_model_name_or_path=base or None,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
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


def tensor_name(layer: int, module: str, which: Literal["A", "B"]) -> str:
    """The PEFT tensor name of LoRA matrix `which` of canonical `module` in `layer`."""
    parent, hf = MODULES[module]
    return f"base_model.model.model.layers.{layer}.{parent}.{hf}.lora_{which}.weight"


def parse_tensor_name(name: str) -> tuple[int, str, Literal["A", "B"]]:
    """Map a saved PEFT tensor name to (layer, canonical module, "A"|"B").

    Raises UnsupportedAdapterError for any other tensor (DoRA magnitudes, biases, embeddings,
    adapter-named keys such as `...lora_A.default.weight`).
    """
    m = _TENSOR_NAME.match(name)
    if m is None:
        raise UnsupportedAdapterError(f"unexpected tensor {name!r}: not a LoRA A/B weight of a supported module")
    layer, parent, hf, which = m.groups()
    canon = _HF_TO_CANONICAL[hf]
    if MODULES[canon][0] != parent:
        raise UnsupportedAdapterError(f"unexpected tensor {name!r}: {hf} is not under {parent}")
    return int(layer), canon, which  # type: ignore[return-value]


def expected_tensor_shapes(base: BaseModelShape, config: PeftAdapterConfig) -> dict[str, tuple[int, int]]:
    """Tensor name -> shape for `config` on `base`: lora_A is [r, in_features], lora_B is
    [out_features, r] with r the module's rank (config.module_rank), for each target module in
    every layer."""
    shapes: dict[str, tuple[int, int]] = {}
    for layer in range(base.num_layers):
        for module in config.target_modules:
            fan_in, fan_out = base.module_dims(module)
            r = config.module_rank(layer, module)
            shapes[tensor_name(layer, module, "A")] = (r, fan_in)
            shapes[tensor_name(layer, module, "B")] = (fan_out, r)
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
