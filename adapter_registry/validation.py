"""Content validation of a PEFT adapter, run before a version may become ready.

`validate_adapter_files` checks, in order, and stops at the first failure with a message naming
the rule: config parses (JSON, a supported LoRA variant: engine.lora.peft_format), the base
model is one the platform serves, rank <= the configured maximum, the safetensors header is
sound, one allowed dtype, every tensor is a LoRA A/B of a targeted module with the shape the
base model's dimensions require and none is missing, and no value is NaN or Inf. Archive
safety, pickle refusal and size limits happen earlier, at upload (adapter_registry.archive).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from adapter_registry.settings import RegistrySettings
from engine.lora.peft_format import (
    KNOWN_BASE_MODELS,
    BaseModelShape,
    PeftAdapterConfig,
    UnsupportedAdapterError,
    expected_tensor_shapes,
    parse_adapter_config,
    parse_tensor_name,
)

MAX_CONFIG_BYTES = 1024 * 1024
# safetensors' own cap on the JSON header; a larger claimed header is a malformed file.
MAX_HEADER_BYTES = 100 * 1024 * 1024
CHUNK_BYTES = 8 * 1024 * 1024
# dtype -> (bytes per element, unsigned view, exponent mask). A float is NaN or Inf exactly when
# all its exponent bits are set, so one integer AND/compare per element finds both, vectorized,
# on raw bytes read in chunks (no tensor is materialized; fp16 isfinite in torch is far slower).
_EXPONENT = {"F16": (2, np.uint16, 0x7C00), "BF16": (2, np.uint16, 0x7F80), "F32": (4, np.uint32, 0x7F800000)}


class AdapterRejected(Exception):
    """The adapter fails a validation rule; str(e) is the reason kept on the rejected version."""


@dataclass(frozen=True)
class ValidatedAdapter:
    config: PeftAdapterConfig
    base: BaseModelShape
    dtype: str  # safetensors dtype name, e.g. "F16"


def resolve_base_model(name: str | None, served: list[str]) -> BaseModelShape:
    """The served base model `name` refers to: its exact name, or a path ending in the same final
    segment (PEFT records local paths such as /models/SmolLM2-135M-Instruct). Else AdapterRejected."""
    if not name:
        raise AdapterRejected(
            "adapter_config.json has no base_model_name_or_path; name the base model when uploading "
            f"(served: {', '.join(served)})"
        )
    for s in served:
        if name == s or PurePosixPath(name.rstrip("/")).name.lower() == PurePosixPath(s).name.lower():
            return KNOWN_BASE_MODELS[s]
    raise AdapterRejected(f"base model {name!r} is not served by this platform (served: {', '.join(served)})")


def _read_config(path: Path) -> dict:
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterRejected(f"adapter_config.json is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterRejected(f"adapter_config.json is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterRejected("adapter_config.json must hold a JSON object")
    return config


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors file's header,
    without reading tensor data. Raises AdapterRejected if the file is not safetensors."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise AdapterRejected("adapter_model.safetensors is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES or 8 + n > size:
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


def _check_finite(path: Path, header: dict[str, dict]) -> None:
    """Raise AdapterRejected if a tensor's byte range is inconsistent or holds a NaN/Inf."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        data_start = 8 + n
        data_len = path.stat().st_size - data_start
        for name, entry in sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0]):
            size, view, mask = _EXPONENT[entry["dtype"]]
            offsets = entry.get("data_offsets")
            count = int(np.prod(entry["shape"], dtype=np.int64))
            if (not isinstance(offsets, list) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1] <= data_len
                    or offsets[1] - offsets[0] != count * size):
                raise AdapterRejected(f"adapter_model.safetensors is corrupt: bad data offsets for tensor {name!r}")
            f.seek(data_start + offsets[0])
            remaining = offsets[1] - offsets[0]
            while remaining:
                chunk = f.read(min(remaining, CHUNK_BYTES - CHUNK_BYTES % size))
                if not chunk:
                    raise AdapterRejected(f"adapter_model.safetensors is truncated inside tensor {name!r}")
                remaining -= len(chunk)
                if ((np.frombuffer(chunk, dtype=view) & mask) == mask).any():
                    raise AdapterRejected(f"tensor {name!r} contains NaN or Inf values")


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def validate_adapter_files(*, config_path: Path, weights_path: Path, settings: RegistrySettings,
                           base_model: str | None = None) -> ValidatedAdapter:
    """Validate the two files of a PEFT adapter; return what was learnt, or raise AdapterRejected.

    `base_model` overrides the config's base_model_name_or_path (an operator naming the base).
    Reads the weights tensor by tensor (memory-mapped), never all at once.
    """
    raw = _read_config(config_path)
    base = resolve_base_model(base_model or raw.get("base_model_name_or_path"), settings.served_base_models)
    try:
        config = parse_adapter_config(raw, num_layers=base.num_layers)
    except UnsupportedAdapterError as e:
        raise AdapterRejected(str(e)) from None
    if config.rank > settings.max_rank:
        raise AdapterRejected(f"rank {config.rank} exceeds the maximum rank {settings.max_rank} accepted by this platform")

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
            layer, module, _ = parse_tensor_name(name)
        except UnsupportedAdapterError as e:
            raise AdapterRejected(str(e)) from None
        if layer >= base.num_layers:
            raise AdapterRejected(f"tensor {name!r} is for layer {layer}, but {base.name} has {base.num_layers} layers")
        if module not in config.target_modules:
            raise AdapterRejected(f"tensor {name!r} is for module {module}, which target_modules does not list")
        shape = tuple(header[name]["shape"])
        if shape != expected[name]:
            raise AdapterRejected(
                f"tensor {name!r} has shape {_fmt(shape)}, expected {_fmt(expected[name])} for rank {config.rank} "
                f"on {base.name} (hidden {base.hidden_size}, intermediate {base.intermediate_size})"
            )
    missing = sorted(set(expected) - set(header))
    if missing:
        raise AdapterRejected(f"{len(missing)} LoRA tensors are missing, e.g. {missing[0]!r}")

    _check_finite(weights_path, header)
    return ValidatedAdapter(config=config, base=base, dtype=dtypes[0])
