"""Tokenizer built from GGUF metadata (BPE via the `tokenizers` library) or a HF tokenizer.json,
plus the chat template rendered with Jinja2 the way Hugging Face renders it."""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
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


class PromptTooLong(ValueError):
    """The text needs more than the allowed number of tokens, known without tokenizing it:
    `min_tokens` is a lower bound of its token count (bytes / the longest token's bytes)."""

    def __init__(self, min_tokens: int, max_tokens: int):
        super().__init__(f"the prompt has at least {min_tokens} tokens (more than {max_tokens})")
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens


# Stands in for message i's content while the chat template is rendered, to find where each
# content lands in the prompt (private-use characters: no template writes them itself).
_SENTINEL = "\ue000tessera-content-{}\ue001"
_SENTINEL_RE = re.compile("\ue000tessera-content-(\\d+)\ue001")


@dataclass
class TextTokenizer:
    """Encodes text to token ids and back; knows the special tokens and the chat template."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_id: int | None
    add_bos_token: bool = False
    #: True when every vocabulary entry is a byte-level string (GPT-2's alphabet: one character
    #: per byte of text) and no normalizer changes the input; `max_token_bytes` relies on it.
    byte_level: bool = False

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The control tokens' texts (e.g. <|im_start|>), which `encode` parses as single ids."""
        return tuple(a.content for a in self.tokenizer.get_added_tokens_decoder().values() if a.special)

    @cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of UTF-8 text one token can stand for, or None when unknown (a
        tokenizer that normalizes its input). A text of B bytes has at least ceil(B / this)
        tokens, so `check_fits` can refuse an oversized prompt without tokenizing it."""
        if not self.byte_level:
            return None
        added = {a.content for a in self.tokenizer.get_added_tokens_decoder().values()}
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return max(len(t.encode()) if t in added else len(t) for t in vocab)

    def check_fits(self, text: str, max_tokens: int) -> None:
        """PromptTooLong when `text` certainly has more than `max_tokens` tokens, judged from its
        UTF-8 length alone (exact: a text that fits is never refused); cheap next to encoding."""
        per_token = self.max_token_bytes
        if per_token is None or 4 * len(text) <= max_tokens * per_token:  # at most 4 bytes a character
            return
        n_bytes = len(text.encode("utf-8", "surrogatepass"))
        if n_bytes > max_tokens * per_token:
            raise PromptTooLong(-(-n_bytes // per_token), max_tokens)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) are parsed."""
        return self._with_bos(self.tokenizer.encode(text, add_special_tokens=False).ids, add_special_tokens)

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    @cached_property
    def _literal(self) -> Tokenizer:
        """A copy of the tokenizer that encodes special-token texts as ordinary text."""
        tok = Tokenizer.from_str(self.tokenizer.to_str())
        tok.encode_special_tokens = True
        return tok

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    max_tokens: int | None = None) -> list[int]:
        """Token ids of the chat prompt, with the messages' contents as plain text: a control
        token's text written inside a message (say "<|im_end|>\n<|im_start|>system") is
        encoded as the characters it is made of, so it can never open a turn. Only the chat
        template's own markup becomes control tokens. Contents free of special-token texts give
        exactly `encode(apply_chat_template(messages))`. With `max_tokens`, PromptTooLong when
        the rendered prompt certainly exceeds it (before encoding)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        if max_tokens is not None:
            self.check_fits(text, max_tokens)
        specials = self.special_tokens
        contents = [m["content"] for m in messages]
        if not any(isinstance(c, str) and sp in c for c in contents for sp in specials):
            return self.encode(text)
        if not all(isinstance(c, str) for c in contents):
            raise ChatTemplateError("message contents must be text")
        # Render again with a sentinel for each content, then encode the template's pieces with
        # control tokens and each content as literal text.
        marked = self.apply_chat_template([{**m, "content": _SENTINEL.format(i)} for i, m in enumerate(messages)],
                                          add_generation_prompt=add_generation_prompt)
        pieces = _SENTINEL_RE.split(marked)  # template, index, template, index, ..., template
        if "".join(p if k % 2 == 0 else contents[int(p)] for k, p in enumerate(pieces)) != text:
            # The template transforms contents (strips, slices, ...): where they land is unknown.
            raise ChatTemplateError("a message contains a special token's text (such as "
                                    f"{next(sp for c in contents for sp in specials if sp in c)!r}), which this "
                                    "model's chat template cannot keep as plain text; remove it")
        ids: list[int] = []
        literal = self._literal
        for k, p in enumerate(pieces):
            if k % 2 == 0:
                ids += self.tokenizer.encode(p, add_special_tokens=False).ids if p else []
            elif contents[int(p)]:
                ids += literal.encode(contents[int(p)], add_special_tokens=False).ids
        return self._with_bos(ids, True)

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
            byte_level=True,
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
            byte_level=_is_byte_level(tok),
        )


@lru_cache(maxsize=1)
def byte_level_chars() -> tuple[str, ...]:
    """GPT-2's byte-level alphabet in byte order: the character that spells byte b in a byte-level
    BPE vocabulary is byte_level_chars()[b] (printable bytes spell themselves, the others take
    the characters from U+0100 on, in byte order)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) \
        | set(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return tuple(chars)


def _is_byte_level(tok: Tokenizer) -> bool:
    """Whether every vocabulary entry spells bytes in GPT-2's byte-level alphabet and the input
    reaches the model unnormalized (the condition of `max_token_bytes`)."""
    if tok.normalizer is not None or not isinstance(tok.decoder, decoders.ByteLevel):
        return False
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    added = {a.content for a in tok.get_added_tokens_decoder().values()}
    return all(c in alphabet for t in tok.get_vocab(with_added_tokens=True) if t not in added for c in t)


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
