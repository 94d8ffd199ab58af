"""Tokenizer built from GGUF metadata (BPE via the `tokenizers` library) or a HF tokenizer.json,
plus the chat template rendered with Jinja2 the way Hugging Face renders it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer regexes by GGUF `tokenizer.ggml.pre`. "smollm" splits digits one by one and then
# applies GPT-2's byte-level split; plain GPT-2 style vocabularies use only the latter.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "qwen2"}


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


@dataclass
class TextTokenizer:
    """Encodes text to token ids and back; knows the special tokens and the chat template."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_id: int | None
    add_bos_token: bool = False

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) are parsed."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role", "content"}]) to the prompt text, as HF's tokenizer does."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
        try:
            return _compile_template(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "TextTokenizer":
        """Build the tokenizer from a GGUF file's `tokenizer.ggml.*` fields (gpt2-style BPE)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2')")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        tok = Tokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        if meta.get("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level]
            )
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_USER_DEFINED]
        tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)

        def tok_at(key):
            i = meta.get(key)
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            tokenizer=tok,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token=tok_at("tokenizer.ggml.bos_token_id"),
            eos_token=tok_at("tokenizer.ggml.eos_token_id"),
            eos_token_id=int(eos_id) if eos_id is not None else None,
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_hf_directory(cls, path: str | Path) -> "TextTokenizer":
        """Load tokenizer.json (+ tokenizer_config.json for the chat template and specials)."""
        import json

        path = Path(path)
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        conf = {}
        if (path / "tokenizer_config.json").is_file():
            conf = json.loads((path / "tokenizer_config.json").read_text())

        def as_str(v):
            return v.get("content") if isinstance(v, dict) else v

        eos = as_str(conf.get("eos_token"))
        return cls(
            tokenizer=tok,
            chat_template=conf.get("chat_template"),
            bos_token=as_str(conf.get("bos_token")),
            eos_token=eos,
            eos_token_id=tok.token_to_id(eos) if eos else None,
            add_bos_token=bool(conf.get("add_bos_token", False)),
        )


def _raise_exception(message):
    raise TemplateError(message)


_TEMPLATE_CACHE: dict[str, object] = {}


def _compile_template(source: str):
    # Same environment options as transformers' chat-template renderer: sandboxed, trim_blocks
    # and lstrip_blocks, `raise_exception` and a `tojson` that keeps non-ASCII.
    template = _TEMPLATE_CACHE.get(source)
    if template is None:
        import json

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        template = env.from_string(source)
        _TEMPLATE_CACHE[source] = template
    return template
