"""Weight loading: GGUF files and Hugging Face safetensors checkpoints, into one layout.

Both loaders return a triple `(ModelConfig, dict[str, torch.Tensor], metadata: dict)` with
tensors named and laid out as Hugging Face's LlamaForCausalLM
(`model.layers.{i}.self_attn.q_proj.weight` [out, in], ...), so the model code and LoRA adapters
(trained against HF names) see one layout. The metadata is the GGUF file's key/value header
(the tokenizer is built from it); a safetensors checkpoint gives an empty dict. A GGUF's Q4_0 and
Q4_1 layer weights also come as their raw blocks under name + `gguf_loader.Q4_0_SUFFIX` /
`Q4_1_SUFFIX` (rows in the weight's order, split alike where a fused tensor is split).
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
    stem (the embedded file: its model's name). GGUF layers are dequantized to fp32 on load
    (4 bytes); safetensors keep their stored dtype."""
    import json
    from pathlib import Path

    from gguf import GGUFReader

    from engine.loader import gguf_loader
    from engine.loader.architectures import model_config_from_hf
    from engine.loader.safetensors_loader import served_name

    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        reader = GGUFReader(str(p))
        meta = gguf_loader.read_metadata(reader)
        return gguf_loader.config_of_file(reader, meta, name or gguf_loader.served_name(p)), 4.0
    if p.is_dir() and (p / "config.json").is_file():
        raw = json.loads((p / "config.json").read_text())
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
        return model_config_from_hf(raw, name or served_name(raw, p)), (4.0 if "32" in dtype else 2.0)
    raise FileNotFoundError(f"{path}: not a .gguf file or a directory with config.json")


__all__ = ["load_gguf", "load_safetensors_checkpoint", "load_checkpoint", "read_model_config", "default_model_path"]
