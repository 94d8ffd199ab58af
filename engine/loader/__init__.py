"""Weight loading: GGUF files and Hugging Face safetensors checkpoints, into one layout.

Both loaders return `(ModelConfig, dict[str, torch.Tensor])` with tensors named and laid out as
Hugging Face's LlamaForCausalLM (`model.layers.{i}.self_attn.q_proj.weight` [out, in], ...), so
the model code and LoRA adapters (trained against HF names) see one layout.
"""
from engine.loader.gguf_loader import load_gguf, default_model_path
from engine.loader.safetensors_loader import load_safetensors_checkpoint


def load_checkpoint(path):
    """Load a `.gguf` file or a directory with config.json + *.safetensors."""
    from pathlib import Path

    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p)
    if p.is_dir() and (p / "config.json").is_file():
        return load_safetensors_checkpoint(p)
    raise FileNotFoundError(f"{path}: not a .gguf file or a directory with config.json")


__all__ = ["load_gguf", "load_safetensors_checkpoint", "load_checkpoint", "default_model_path"]
