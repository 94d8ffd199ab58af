import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import default_model_path, load_gguf
from engine.tokenizer import TextTokenizer


@pytest.fixture(scope="session")
def smollm_checkpoint():
    """(ModelConfig, fp32 tensors, metadata) of the embedded SmolLM2 GGUF, loaded once."""
    return load_gguf(default_model_path())


@pytest.fixture(scope="session")
def tokenizer(smollm_checkpoint) -> TextTokenizer:
    return TextTokenizer.from_gguf_metadata(smollm_checkpoint[2])


@pytest.fixture(scope="session")
def make_engine(smollm_checkpoint, tokenizer):
    def make(adapter_source=None, **overrides) -> LLMEngine:
        cfg = EngineConfig(**{"dtype": torch.float32, "weight_format": "fp32", "kv_cache_bytes": 96 << 20, **overrides})
        return LLMEngine(config=cfg, checkpoint=smollm_checkpoint, tokenizer=tokenizer,
                         adapter_source=adapter_source)
    return make


@pytest.fixture(scope="session")
def engine(make_engine) -> LLMEngine:
    """A shared fp32 engine; tests must leave it with no unfinished requests."""
    return make_engine()


@pytest.fixture(scope="session")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])
