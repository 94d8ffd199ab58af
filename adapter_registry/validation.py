"""Content validation of a PEFT adapter, run before a version may become ready.

Everything is checked against the served base model's description (peft_format.BaseModelShape:
its module names and shapes, as its engine describes it; no shape is written in the code).

At upload, before anything is stored (`base_of_upload`, `check_fits_base`): the base model the
upload names resolves to a served one (adapter_registry.base_models), and the adapter fits it: the
modules its target_modules list are the base's, and its tensors' module names, layers and
in/out features are the base's (rank-independent, from the safetensors header when it is at most
FIT_CHECK_HEADER_BYTES). Either refusal names what does not fit and the base's dimensions.

Then `validate_adapter_files` checks, in order, and stops at the first failure with a message
naming the rule: config parses against the base (JSON, a supported LoRA variant:
engine.lora.peft_format), rank <= the configured maximum, the safetensors header is sound, one
allowed dtype, every tensor is a LoRA A/B of a targeted module with the shape the base's module
and the module's rank require and none is missing, no value is NaN or Inf, and the adapter cannot
overflow the engine's arithmetic (below). Archive safety, pickle refusal and size limits happen
earlier, at upload (adapter_registry.archive).

The registry runs it through `validate_in_sandbox`: in a child process (adapter_registry.sandbox)
with a deadline and memory/CPU limits, so a hostile file costs at most those, never the caller's
process; a deadline, crash or limit hit is a rejection with its reason.

Overflow bound. Per module, the adapter adds `scale * B @ (A @ x)` to the base layer's output. With
the infinity norm (largest row sum of absolute values), every output entry is at most
`gain * max|x|` where `gain = |scale| * ||B||inf * ||A||inf`. The engine may compute in fp16
(max 65504), so an adapter is refused when `gain * activation_bound > 65504` for some module,
`activation_bound` being the largest activation entry we plan for (settings'
validation_activation_bound, 64 by default: the inputs of LoRA'd layers are RMSNorm outputs,
attention outputs and SwiGLU products, whose entries stay well under that in Llama-family
models). The bound is worst-case (every input entry at its maximum, signs aligned), so trained
adapters sit far below it: the demo adapters' largest gain is ~18 against a limit of ~1024, a
freshly initialized PEFT adapter (B = 0) has gain 0. Also refused: any weight beyond fp16's range
(the engine may store adapters in fp16) and a scale beyond it.
"""
from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from adapter_registry.base_models import ALIASES_ENV, final_segment_matches, match_base_model
from adapter_registry.sandbox import SandboxFailure, run_sandboxed
from engine.lora.peft_format import (
    BaseModelShape,
    ModuleNotInBase,
    PeftAdapterConfig,
    UnsupportedAdapterError,
    expected_tensor_shapes,
    listed_target_misfit,
    parse_adapter_config,
    parse_tensor_name,
)

if TYPE_CHECKING:  # the sandboxed child imports this module; pydantic-settings stays out of it
    from adapter_registry.settings import RegistrySettings

MAX_CONFIG_BYTES = 1024 * 1024
# Largest safetensors header the upload's fit check reads in the caller's process (a real PEFT
# adapter's is tens of KB); a larger one is left to the bounded validation child.
FIT_CHECK_HEADER_BYTES = 1024 * 1024
# safetensors' own cap on the JSON header; a larger claimed header is a malformed file.
MAX_HEADER_BYTES = 100 * 1024 * 1024
CHUNK_BYTES = 8 * 1024 * 1024
# dtype -> (bytes per element, unsigned view, exponent mask). A float is NaN or Inf exactly when
# all its exponent bits are set, so one integer AND/compare per element finds both, vectorized,
# on raw bytes read in chunks (no tensor is materialized; fp16 isfinite in torch is far slower).
_EXPONENT = {"F16": (2, np.uint16, 0x7C00), "BF16": (2, np.uint16, 0x7F80), "F32": (4, np.uint32, 0x7F800000)}
# Largest finite fp16 value: the narrowest float the engine may store adapters or compute in.
FP16_MAX = 65504.0


class AdapterRejected(Exception):
    """The adapter fails a validation rule; str(e) is the reason kept on the rejected version."""


@dataclass(frozen=True)
class ValidatedAdapter:
    config: PeftAdapterConfig
    base: BaseModelShape
    dtype: str  # safetensors dtype name, e.g. "F16"


@dataclass(frozen=True)
class ValidationLimits:
    """The settings validation reads (field names as in RegistrySettings), plain data so they
    cross into the sandboxed child as JSON."""

    max_rank: int
    allowed_dtypes: list[str]
    validation_activation_bound: float

    @classmethod
    def of(cls, settings: "RegistrySettings | ValidationLimits") -> "ValidationLimits":
        return cls(max_rank=settings.max_rank, allowed_dtypes=list(settings.allowed_dtypes),
                   validation_activation_bound=settings.validation_activation_bound)


# Longest base model name a refusal quotes; a config may hold a name of any length.
_QUOTED_NAME_CHARS = 200


def _how_to_name_base(served: list[str]) -> str:
    return ("pass the base model with the upload form's 'Base model' field (API: multipart field base_model) or "
            f"`tessera adapters upload --base-model NAME`; served: {', '.join(served)}; "
            f"or add an alias ({ALIASES_ENV})")


def resolve_base_model(name: object, served: list[str], aliases: dict[str, str] | None = None, *,
                       given: bool = False) -> str:
    """The served base model's name that `name` refers to (adapter_config.json's
    base_model_name_or_path, or the uploader's name for it when `given`): a served name or alias
    (`aliases`: alias or local path -> served name), or a local path whose final segment is one,
    case-insensitively (adapter_registry.base_models). Else AdapterRejected, saying which
    models are served and how to name the base model."""
    origin = "given at upload" if given else "adapter_config.json's base_model_name_or_path"
    if not name:
        raise AdapterRejected(f"adapter_config.json has no base_model_name_or_path; {_how_to_name_base(served)}")
    if not isinstance(name, str):
        raise AdapterRejected(f"{origin} is not a string; {_how_to_name_base(served)}")
    matches = match_base_model(name, served, aliases or {})
    quoted = repr(name if len(name) <= _QUOTED_NAME_CHARS else name[:_QUOTED_NAME_CHARS] + "...")
    if not matches:
        local = final_segment_matches(name, served, aliases or {})
        hint = (f" (a hub id must match in full; if this is a local copy of {local[0]}, name that)"
                if len(local) == 1 else "")
        raise AdapterRejected(f"base model {quoted} ({origin}) is not served by this platform{hint}; "
                              f"{_how_to_name_base(served)}")
    if len(matches) > 1:
        raise AdapterRejected(f"base model {quoted} ({origin}) is ambiguous: it could be {' or '.join(matches)}; "
                              f"{_how_to_name_base(served)}")
    return matches[0]


def base_of_upload(*, config_path: Path, base_model: str | None,
                   settings: "RegistrySettings") -> BaseModelShape | None:
    """The served base model (its description) an upload is for: `base_model` (the uploader's,
    when given) or the config's base_model_name_or_path, resolved by `resolve_base_model` among
    settings.served_base_models (its AdapterRejected when neither names a served model). None
    when the config cannot be read: the content validation rejects that with its own reason.
    Reads at most MAX_CONFIG_BYTES."""
    if base_model:
        name = resolve_base_model(base_model, settings.served_names, settings.aliases, given=True)
        return settings.served_model(name)
    try:
        raw = read_adapter_config(config_path)
    except AdapterRejected:
        return None
    name = resolve_base_model(raw.get("base_model_name_or_path"), settings.served_names, settings.aliases)
    return settings.served_model(name)


def check_fits_base(*, config_path: Path, weights_path: Path, base: BaseModelShape) -> None:
    """AdapterRejected naming the first thing in the adapter that is not `base`'s: a module its
    target_modules list that the base does not have (naming the base's modules), or a LoRA tensor
    (first by layer, then the base's module order) of a module or layer the base does not have,
    or whose base-side dimension (lora_A's in_features, lora_B's out_features) is not the
    module's. Cheap and bounded (a config of at most MAX_CONFIG_BYTES, a safetensors header of at
    most FIT_CHECK_HEADER_BYTES, no regex run, no tensor read), so it runs at upload, before
    anything is stored; whatever it cannot read is left to `validate_adapter_files`."""
    try:
        raw = read_adapter_config(config_path)
    except AdapterRejected:
        return
    misfit = listed_target_misfit(raw.get("target_modules"), base)
    if misfit is not None:
        raise AdapterRejected(str(misfit))
    try:
        header = read_safetensors_header(weights_path, max_header_bytes=FIT_CHECK_HEADER_BYTES)
    except AdapterRejected:
        return
    order = {name: i for i, name in enumerate(base.module_names)}
    lora = []
    for name, entry in header.items():
        try:
            layer, module, which = parse_tensor_name(name, base)
        except ModuleNotInBase as e:
            raise AdapterRejected(f"{e}; the adapter does not fit {base.label} ({base.dims_text()})") from None
        except UnsupportedAdapterError:
            continue  # not a LoRA weight at all: validation rejects it with its own reason
        lora.append((layer, order[module], which, name, module, entry["shape"]))
    for layer, _, which, name, module, shape in sorted(lora):
        m = base.module(module)
        if len(shape) != 2:
            raise AdapterRejected(f"tensor {name!r} has shape {_fmt(shape)}; LoRA weights are matrices")
        fits = (shape[1] == m.in_features) if which == "A" else (shape[0] == m.out_features)
        if layer >= base.num_layers:
            raise AdapterRejected(f"tensor {name!r} is for layer {layer}, but {base.label} has {base.num_layers} "
                                  f"layers (0..{base.num_layers - 1}); the adapter does not fit it")
        if not fits:
            want = [shape[0], m.in_features] if which == "A" else [m.out_features, shape[1]]
            raise AdapterRejected(
                f"tensor {name!r} has shape {_fmt(shape)}, expected {_fmt(want)}: {base.label}'s "
                f"{base.module_text(module)}; the adapter does not fit {base.label} ({base.dims_text()}) "
                "- was it trained for another base model?")


def read_adapter_config(path: Path) -> dict:
    """The JSON object in adapter_config.json at `path`; AdapterRejected (naming the problem) when
    it is larger than MAX_CONFIG_BYTES, not JSON, or not an object."""
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterRejected(f"adapter_config.json is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise AdapterRejected(f"adapter_config.json is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterRejected("adapter_config.json must hold a JSON object")
    return config


def read_safetensors_header(path: Path, *, max_header_bytes: int = MAX_HEADER_BYTES) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors file's header,
    without reading tensor data. Raises AdapterRejected if the file is not safetensors, or its
    header is longer than `max_header_bytes`."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise AdapterRejected("adapter_model.safetensors is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", prefix)
        if n > max_header_bytes or 8 + n > size:
            raise AdapterRejected("adapter_model.safetensors is not a safetensors file (bad header length)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterRejected("adapter_model.safetensors is not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterRejected("adapter_model.safetensors is not a safetensors file (header is not an object)")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list) and isinstance(entry.get("dtype"), str)):
            raise AdapterRejected(f"adapter_model.safetensors: malformed header entry for {name!r}")
    return header


@dataclass
class _TensorStats:
    max_abs: float  # largest |value|
    norm_inf: float  # largest sum of |values| over a row (the matrix's infinity norm)


def _as_float32(chunk: bytes, dtype: str) -> np.ndarray:
    if dtype == "F16":
        return np.frombuffer(chunk, dtype="<f2").astype(np.float32)
    if dtype == "BF16":  # bf16 is the top half of an fp32
        return (np.frombuffer(chunk, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(chunk, dtype="<f4")


def _scan_values(path: Path, header: dict[str, dict]) -> dict[str, _TensorStats]:
    """Per tensor, its largest |value| and row-sum norm, read in whole-row chunks (no tensor is
    held whole). Raises AdapterRejected if a tensor's byte range is inconsistent or holds a
    NaN/Inf."""
    stats: dict[str, _TensorStats] = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        data_start = 8 + n
        data_len = path.stat().st_size - data_start
        for name, entry in sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0]):
            size, view, mask = _EXPONENT[entry["dtype"]]
            offsets = entry.get("data_offsets")
            shape = entry["shape"]
            count = int(np.prod(shape, dtype=np.int64))
            if (not isinstance(offsets, list) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1] <= data_len
                    or offsets[1] - offsets[0] != count * size):
                raise AdapterRejected(f"adapter_model.safetensors is corrupt: bad data offsets for tensor {name!r}")
            cols = int(shape[-1]) if len(shape) >= 2 else max(count, 1)
            row_bytes = cols * size
            f.seek(data_start + offsets[0])
            remaining = offsets[1] - offsets[0]
            max_abs = norm_inf = 0.0
            while remaining:
                chunk = f.read(min(remaining, max(1, CHUNK_BYTES // row_bytes) * row_bytes))
                if not chunk or len(chunk) % row_bytes:
                    raise AdapterRejected(f"adapter_model.safetensors is truncated inside tensor {name!r}")
                remaining -= len(chunk)
                if ((np.frombuffer(chunk, dtype=view) & mask) == mask).any():
                    raise AdapterRejected(f"tensor {name!r} contains NaN or Inf values")
                values = np.abs(_as_float32(chunk, entry["dtype"])).reshape(-1, cols)
                max_abs = max(max_abs, float(values.max(initial=0.0)))
                norm_inf = max(norm_inf, float(values.sum(axis=1, dtype=np.float64).max(initial=0.0)))
            stats[name] = _TensorStats(max_abs, norm_inf)
    return stats


def _check_overflow(stats: dict[str, _TensorStats], base: BaseModelShape, config: PeftAdapterConfig,
                    activation_bound: float) -> None:
    """Refuse weights beyond fp16's range, and any module whose output could overflow fp16 for
    activations up to `activation_bound` (see the module docstring)."""
    name = max(stats, key=lambda n: stats[n].max_abs)
    if stats[name].max_abs > FP16_MAX:
        raise AdapterRejected(
            f"tensor {name!r} holds a weight of magnitude {stats[name].max_abs:.3g}, beyond the fp16 range "
            f"({FP16_MAX:g}) the engine may store adapters in; refused as an overflow risk"
        )
    limit = FP16_MAX / activation_bound
    worst = None
    for layer in range(base.num_layers):
        for module in config.target_modules:
            a, b = stats[base.tensor_name(layer, module, "A")], stats[base.tensor_name(layer, module, "B")]
            module_scale = abs(config.module_scale(layer, module))
            gain = module_scale * b.norm_inf * a.norm_inf
            if worst is None or gain > worst[0]:
                worst = (gain, layer, module, a.norm_inf, b.norm_inf, module_scale)
    scale = max((abs(config.module_scale(layer, m)) for layer in range(base.num_layers) for m in config.target_modules),
                default=abs(config.scale))
    if worst is not None and worst[0] > limit:
        gain, layer, module, norm_a, norm_b, module_scale = worst
        where = base.tensor_name(layer, module, "A").removesuffix(".lora_A.weight")
        raise AdapterRejected(
            f"LoRA module {where} could overflow: its gain |scale| x ||B||inf x ||A||inf = {module_scale:.3g} x "
            f"{norm_b:.3g} x {norm_a:.3g} = {gain:.3g} exceeds the bound {limit:.4g} that keeps its output within "
            f"fp16 range ({FP16_MAX:g}) for activations up to {activation_bound:g}"
        )
    if scale > FP16_MAX:
        raise AdapterRejected(
            f"the adapter's scale ({'lora_alpha/sqrt(r)' if config.use_rslora else 'lora_alpha/r'} = {scale:.3g}) "
            f"is beyond the fp16 range ({FP16_MAX:g}); refused as an overflow risk"
        )


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def validate_adapter_files(*, config_path: Path, weights_path: Path,
                           settings: "RegistrySettings | ValidationLimits",
                           base: BaseModelShape | None) -> ValidatedAdapter:
    """Validate the two files of a PEFT adapter for the served base model `base` (its
    description) in this process; return what was learnt, or raise AdapterRejected. The registry
    calls `validate_in_sandbox` instead (bounded, in a child). `base` None (the upload named no
    base it could read) rejects once the config is read. Reads the weights in chunks of whole
    rows, never a whole tensor at once.
    """
    raw = read_adapter_config(config_path)
    if base is None:
        raise AdapterRejected("the base model this adapter is for is not known; upload it again naming the base model")
    try:
        config = parse_adapter_config(raw, base)
    except UnsupportedAdapterError as e:
        raise AdapterRejected(str(e)) from None
    largest, layer, module = config.largest_rank(base.num_layers)
    if largest > settings.max_rank:
        where = f"module {config.module_key(layer, module)} has " if config.rank_pattern else ""
        raise AdapterRejected(f"{where}rank {largest} exceeds the maximum rank {settings.max_rank} accepted by this platform")

    header = read_safetensors_header(weights_path)
    if not header:
        raise AdapterRejected("adapter_model.safetensors holds no tensors")
    dtypes = sorted({e["dtype"] for e in header.values()})
    bad = [d for d in dtypes if d not in settings.allowed_dtypes]
    if bad:
        raise AdapterRejected(f"tensor dtype {', '.join(bad)} is not allowed (allowed: {', '.join(settings.allowed_dtypes)})")
    if len(dtypes) > 1:
        raise AdapterRejected(f"tensors mix dtypes {', '.join(dtypes)}; save the adapter in one dtype")

    expected = expected_tensor_shapes(base, config)
    for name in sorted(header):
        try:
            layer, module, _ = parse_tensor_name(name, base)
        except UnsupportedAdapterError as e:
            raise AdapterRejected(str(e)) from None
        if layer >= base.num_layers:
            raise AdapterRejected(f"tensor {name!r} is for layer {layer}, but {base.label} has {base.num_layers} layers")
        if module not in config.target_modules:
            raise AdapterRejected(f"tensor {name!r} is for module {module}, which target_modules does not list")
        shape = tuple(header[name]["shape"])
        if shape != expected[name]:
            rank = config.module_rank(layer, module)
            raise AdapterRejected(
                f"tensor {name!r} has shape {_fmt(shape)}, expected {_fmt(expected[name])} for rank {rank} on "
                f"{base.label}: {base.module_text(module)} ({base.dims_text()})"
            )
    missing = sorted(set(expected) - set(header))
    if missing:
        raise AdapterRejected(f"{len(missing)} LoRA tensors are missing, e.g. {missing[0]!r}")

    stats = _scan_values(weights_path, header)
    _check_overflow(stats, base, config, settings.validation_activation_bound)
    return ValidatedAdapter(config=config, base=base, dtype=dtypes[0])


def validate_request(request: dict[str, Any]) -> dict[str, Any]:
    """The sandboxed child's entry point: `validate_adapter_files` on plain data.

    request: {"config_path", "weights_path", "base": BaseModelShape.to_dict() or None,
    "limits": ValidationLimits fields}. Returns {"ok": True, "config": PeftAdapterConfig fields,
    "dtype"} or {"ok": False, "reason": the rejection message}."""
    try:
        base = BaseModelShape.from_dict(request["base"]) if request.get("base") is not None else None
        result = validate_adapter_files(config_path=Path(request["config_path"]),
                                        weights_path=Path(request["weights_path"]),
                                        settings=ValidationLimits(**request["limits"]), base=base)
    except AdapterRejected as e:
        return {"ok": False, "reason": str(e)}
    config = asdict(result.config)
    config["target_modules"] = list(config["target_modules"])
    return {"ok": True, "config": config, "dtype": result.dtype}


def validate_in_sandbox(*, config_path: Path, weights_path: Path, settings: "RegistrySettings",
                        base: BaseModelShape | None) -> ValidatedAdapter:
    """`validate_adapter_files` in a child process bounded by settings.validation_timeout_s (wall
    clock and CPU) and settings.validation_max_memory_bytes (address space), the caller's thread
    only waiting on it. A deadline, crash or limit hit is AdapterRejected with its reason, like
    any other rule; never an exception of another kind, never a hang."""
    request = {"config_path": str(config_path), "weights_path": str(weights_path),
               "base": base.to_dict() if base is not None else None, "limits": asdict(ValidationLimits.of(settings))}
    try:
        out = run_sandboxed("adapter_registry.validation:validate_request", [request],
                            timeout_s=settings.validation_timeout_s,
                            max_memory_bytes=settings.validation_max_memory_bytes,
                            max_concurrent=settings.validation_max_concurrent, what="validation")
    except SandboxFailure as e:
        raise AdapterRejected(str(e)) from None
    if not out["ok"]:
        raise AdapterRejected(out["reason"])
    c = out["config"]
    config = PeftAdapterConfig(**{**c, "target_modules": tuple(c["target_modules"])})
    return ValidatedAdapter(config=config, base=base, dtype=out["dtype"])
