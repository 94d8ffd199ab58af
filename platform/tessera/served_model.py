"""The base model a deployment serves: TESSERA_MODEL_PATH (a .gguf file or a Hugging Face
checkpoint directory; unset: the embedded SmolLM2 GGUF) under TESSERA_MODEL_NAME (unset: the
checkpoint's own name, as the engine's loader gives it: config.json's hub id, the GGUF file's name).

Every process of a deployment reads the same two settings, so they agree on which model is
served: engines load it (`load_engine`), and the processes that have no engine describe it from
its files' config or header alone, without reading weights (`describe_model_files`): the CLI's
`tessera adapters upload`, `tessera demo` before its engine is up, and the gateway's HTTP engine
client, which refuses engine workers that report another model. The description for LoRA
(engine.lora.peft_format.BaseModelShape) is engine.lora.weights.base_shape_of of its ModelConfig,
whichever way it was read.
"""
from __future__ import annotations

from pathlib import Path


def describe_model_files(model_path: str | Path | None, model_name: str | None = None):
    """(ModelConfig, BaseModelShape) of the model at `model_path` (None: the embedded SmolLM2)
    served as `model_name` (None: its own name), read from its config.json or GGUF header only.
    FileNotFoundError / ValueError (the loader's, naming the problem) when it cannot be read."""
    from engine.loader import default_model_path, read_model_config
    from engine.lora.weights import base_shape_of

    path = Path(model_path) if model_path else default_model_path()
    cfg, _ = read_model_config(path, model_name)
    return cfg, base_shape_of(cfg)


def load_engine(model_path: str | Path | None, config, *, model_name: str | None = None, adapter_source=None):
    """An engine.llm_engine.LLMEngine over the model at `model_path` (None: the embedded SmolLM2),
    served as `model_name` when given (its ModelConfig.name: what /v1/models, the registry's
    served base model and usage events name)."""
    from engine.llm_engine import LLMEngine

    return LLMEngine(model_path, config, adapter_source=adapter_source, model_name=model_name)


def model_of(engine):
    """The BaseModelShape of a loaded engine's model (engine.lora.weights.base_shape_of)."""
    from engine.lora.weights import base_shape_of

    return base_shape_of(engine.model_config)
