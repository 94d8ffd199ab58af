"""Weight loading: GGUF files and Hugging Face safetensors checkpoints, into one layout.

Both loaders return a triple `(ModelConfig, dict[str, torch.Tensor], metadata: dict)` with
tensors named and laid out as Hugging Face's LlamaForCausalLM
(`model.layers.{i}.self_attn.q_proj.weight` [out, in], ...), so the model code and LoRA adapters
(trained against HF names) see one layout. A layer matrix the checkpoint stores quantized (a GGUF
type, AWQ, GPTQ, compressed-tensors) is an engine.loader.quantized.QuantizedWeight (its codes and
scales as the file has them, never dequantized by the loader; rows permuted and split like a
dense weight's), every other tensor a torch.Tensor. The metadata is the GGUF file's key/value
header (the tokenizer is built from it); a safetensors checkpoint gives an empty dict.
"""
from engine.loader.gguf_loader import load_gguf, default_model_path
from engine.loader.safetensors_loader import load_safetensors_checkpoint


def load_checkpoint(path, name: str | None = None):
    """Load a `.gguf` file or a directory with config.json + *.safetensors, served as `name`
    (None: the checkpoint's own name, see read_model_config); returns the loaders'
    (ModelConfig, tensors, metadata) triple. FileNotFoundError for anything else."""
    from pathlib import Path

    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p, name)
    if p.is_dir() and (p / "config.json").is_file():
        return load_safetensors_checkpoint(p, name)
    raise FileNotFoundError(f"{path}: not a .gguf file or a directory with config.json")


def read_model_config(path, name: str | None = None):
    """(ModelConfig, bytes a weight takes once loaded) of a checkpoint, reading only its config
    or header (no tensor data): what engine.memory_plan checks before load_checkpoint, and how
    processes without an engine describe the served model. Named as load_checkpoint names it:
    `name`, else a directory's config.json hub id (`_name_or_path`) or its name, a GGUF file's
    stem (the embedded file: its model's name). The bytes are an average over the weights: a
    GGUF's layer matrices as stored (quantized ones stay so), its other tensors as fp32 (4
    bytes); a safetensors checkpoint's in its stored dtype, a quantized one's (config.json's
    `quantization_config`) as its files' size over the weights."""
    import json
    from pathlib import Path

    from engine.loader import gguf_loader
    from engine.loader.architectures import model_config_from_hf
    from engine.loader.safetensors_loader import served_name, shard_files
    from engine.memory_plan import parameter_counts

    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        reader = gguf_loader.open_reader(p, keep=True)  # load_checkpoint usually follows: parse once
        meta = gguf_loader.read_metadata(reader)
        cfg = gguf_loader.config_of_file(reader, meta, name or gguf_loader.served_name(p))
        return cfg, gguf_loader.loaded_bytes_per_weight(reader)
    if p.is_dir() and (p / "config.json").is_file():
        raw = json.loads((p / "config.json").read_text())
        cfg = model_config_from_hf(raw, name or served_name(raw, p))
        if raw.get("quantization_config"):
            try:
                return cfg, sum(f.stat().st_size for f in shard_files(p)) / max(1, sum(parameter_counts(cfg)))
            except FileNotFoundError:
                pass  # load_checkpoint says what is missing
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
        return cfg, (4.0 if "32" in dtype else 2.0)
    raise FileNotFoundError(f"{path}: not a .gguf file or a directory with config.json")


__all__ = ["load_gguf", "load_safetensors_checkpoint", "load_checkpoint", "read_model_config", "default_model_path"]
