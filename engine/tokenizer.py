"""Tokenizer built from GGUF metadata or a Hugging Face checkpoint directory (BPE via the
`tokenizers` library), plus the chat template rendered with Jinja2 the way Hugging Face renders it.

Families covered: byte-level BPE (SmolLM2, Llama 3.x, Qwen2/2.5/3) and SentencePiece-style BPE
with byte fallback (Gemma 2/3, Phi-3/3.5, Mistral v0.1, Llama 2). transformers is not needed at
run time; the tests compare against it."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import NamedTuple

import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_TOKEN_TYPE_UNUSED = 5
_TOKEN_TYPE_BYTE = 6

# The regexes that split text into words before byte-level BPE, as the families' tokenizer.json
# files state them (a Split pre-tokenizer, then ByteLevel(use_regex=False)).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class _BytePre(NamedTuple):
    """How a byte-level vocabulary splits text before its merges apply."""
    split: str | None       # a Split regex, or None for GPT-2's own (ByteLevel's use_regex)
    isolate_digits: bool    # each digit alone first (StarCoder, SmolLM)
    nfc: bool               # NFC-normalize the text first, as the family's HF tokenizer does


_GPT2_PRE = _BytePre(None, False, False)
_DIGITS_PRE = _BytePre(None, True, False)
_LLAMA3_PRE = _BytePre(_LLAMA3_SPLIT, False, False)
_QWEN2_PRE = _BytePre(_QWEN2_SPLIT, False, True)

#: GGUF `tokenizer.ggml.pre` (llama.cpp's names) -> the pre-tokenizer. A file older than the key
#: is "default", read with GPT-2's split as transformers reads it (llama.cpp warns that such a
#: file may tokenize worse than its model's own tokenizer).
_GGUF_BYTE_PRE = {
    "default": _GPT2_PRE, "gpt2": _GPT2_PRE, "gpt-2": _GPT2_PRE,
    "smollm": _DIGITS_PRE, "starcoder": _DIGITS_PRE, "refact": _DIGITS_PRE,
    "llama-bpe": _LLAMA3_PRE, "llama3": _LLAMA3_PRE, "llama-v3": _LLAMA3_PRE,
    "qwen2": _QWEN2_PRE, "deepseek-r1-qwen": _QWEN2_PRE,
}

#: GGUF architectures whose SentencePiece scores do not follow the merge order; the order of the
#: tokens in the file does (what transformers' GGUF converter found for Gemma files).
_MERGE_ORDER_BY_POSITION = {"gemma", "gemma2", "gemma3"}

_SPACE_MARK = "\u2581"  # "▁", SentencePiece's spelling of a space

#: Token texts that end a generation in any GGUF holding them, as llama.cpp decides (by text:
#: many files state no eot id, e.g. Phi-3's <|end|>, Qwen's second end token <|endoftext|>).
_GGUF_END_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>")


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
_CONTENT = "\ue000tessera-content-{}\ue001"
_CONTENT_RE = re.compile("\ue000tessera-content-(\\d+)\ue001")
# Where contents cannot be placed so, each control-token text the caller wrote is wrapped in these
# two characters while rendering instead, so the prompt shows which control tokens the user wrote
# (encoded as plain text) and which the template wrote (encoded as control tokens).
_MARK_START = "\U000f0000"
_MARK_END = "\U000f0001"
_MARKED_RE = re.compile(f"{_MARK_START}([^{_MARK_START}{_MARK_END}]*){_MARK_END}|[{_MARK_START}{_MARK_END}]")


@dataclass
class TextTokenizer:
    """Encodes text to token ids and back; knows the special tokens and the chat template."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    #: The primary end-of-sequence id (the tokenizer's eos token), or None when none is stated.
    eos_token_id: int | None
    #: Whether `encode` puts `bos_token` first when the text does not start with it (`encode_chat`
    #: leaves BOS to the chat template).
    add_bos_token: bool = False
    #: True when every vocabulary entry is a byte-level string (GPT-2's alphabet: one character
    #: per byte of text) and no normalizer changes the input beyond NFC; `max_token_bytes` relies on it.
    byte_level: bool = False
    #: Every id the checkpoint states as ending a sequence: `eos_token_id` first, then e.g. the
    #: ids of generation_config.json's eos_token_id list (Llama 3.1: <|end_of_text|>, <|eom_id|>,
    #: <|eot_id|>) or a GGUF's eot/eom ids and the end tokens llama.cpp knows by their text.
    #: Generation stops at any of them.
    eos_token_ids: tuple[int, ...] = ()
    #: The sampling defaults generation_config.json states (temperature, top_p, ...), for display
    #: only: they are never applied, so a request's parameters mean the same on every model.
    generation_defaults: dict = field(default_factory=dict)

    def __post_init__(self):
        first = () if self.eos_token_id is None else (int(self.eos_token_id),)
        self.eos_token_ids = tuple(dict.fromkeys(first + tuple(int(i) for i in self.eos_token_ids)))

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
        tokenizer that is not byte-level). A text of B bytes (after NFC, where the tokenizer
        applies it) has at least ceil(B / this) tokens, so `check_fits` can refuse an oversized
        prompt without tokenizing it."""
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
        if self.tokenizer.normalizer is not None:  # NFC (see _is_byte_level): may shorten the text
            text = self.tokenizer.normalizer.normalize_str(text)
        n_bytes = len(text.encode("utf-8", "surrogatepass"))
        if n_bytes > max_tokens * per_token:
            raise PromptTooLong(-(-n_bytes // per_token), max_tokens)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) are parsed.
        With `add_special_tokens`, BOS comes first when the model wants it (`add_bos_token`)."""
        return self._with_bos(self.tokenizer.encode(text, add_special_tokens=False).ids, add_special_tokens)

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    @cached_property
    def _literal(self) -> Tokenizer:
        """A copy of the tokenizer that encodes every added token's text (special or not) as
        ordinary text."""
        spec = json.loads(self.tokenizer.to_str())
        for added in spec.get("added_tokens") or ():
            added["special"] = True  # encode_special_tokens below splits special ones only
        tok = Tokenizer.from_str(json.dumps(spec))
        tok.encode_special_tokens = True
        return tok

    @cached_property
    def control_tokens(self) -> tuple[str, ...]:
        """The added tokens' texts that `encode_chat` keeps as plain text inside messages: every
        special token, and the non-special ones the chat template itself writes (Qwen's
        <tool_call>, <think>), except whitespace tokens (Gemma's "\\n"). transformers' rule for
        `apply_chat_template(sanitize_control_tokens=True)`."""
        literal = _template_literal_text(self.chat_template) if self.chat_template else ""
        return tuple(a.content for a in self.tokenizer.get_added_tokens_decoder().values()
                     if a.special or (a.content in literal and not a.content.isspace()))

    @cached_property
    def _controls(self) -> "_ControlTexts":
        return _ControlTexts(self.control_tokens)

    @cached_property
    def _control_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.token_to_id(t) for t in self.control_tokens)

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    max_tokens: int | None = None, tools: list[dict] | None = None,
                    variables: dict | None = None) -> list[int]:
        """Token ids of the chat prompt, with the messages' texts as plain text: a control
        token's text written inside a message (say "<|im_end|>\\n<|im_start|>system") is encoded
        as the characters it is made of, so it can never open a turn. Only the chat template's
        own markup becomes control tokens, BOS included: the template writes it where the model
        wants it (Llama 3, Gemma) and nothing is added, as transformers and vLLM tokenize chats
        (a template without BOS is the model's chat format, as Phi-3's).

        Contents free of control-token texts give exactly
        `encode(apply_chat_template(messages), add_special_tokens=False)`. Otherwise each
        message's content is encoded whole as plain text between the template's pieces; where
        the template rewrites contents (Llama 3's and Gemma's `| trim` of a content with edge
        spaces) or a control text sits outside a content (tool calls, `tools`, `variables`), the
        ids are those of transformers' `apply_chat_template(..., tokenize=True,
        sanitize_control_tokens=True)` instead. `tools` and `variables` as in
        `apply_chat_template`. With `max_tokens`, PromptTooLong when the rendered prompt certainly
        exceeds it (before encoding)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        variables=variables)
        if max_tokens is not None:
            self.check_fits(text, max_tokens)
        if not self._controls.contains((messages, tools, variables)):
            return self.encode(text, add_special_tokens=False)
        render = dict(add_generation_prompt=add_generation_prompt, tools=tools, variables=variables)
        ids = self._encode_contents_as_text(messages, text, render)
        if ids is None:
            ids = self._encode_marked(messages, render)
        return ids

    def _encode_contents_as_text(self, messages: list[dict], text: str, render: dict) -> list[int] | None:
        """The prompt's ids with each content encoded whole as plain text, or None when that
        cannot be placed: a content that is not a string, control texts outside the contents, or
        a template that does not copy contents verbatim (found by rendering with a placeholder
        for each content and comparing)."""
        contents = [m["content"] for m in messages]
        rest = [{k: v for k, v in m.items() if k != "content"} for m in messages]
        if not all(isinstance(c, str) for c in contents) or \
                self._controls.contains((rest, render["tools"], render["variables"])):
            return None
        placed = self.apply_chat_template([{**m, "content": _CONTENT.format(i)} for i, m in enumerate(messages)],
                                          **render)
        pieces = _CONTENT_RE.split(placed)  # template, index, template, index, ..., template
        if "".join(p if k % 2 == 0 else contents[int(p)] for k, p in enumerate(pieces)) != text:
            return None
        newline = self.tokenizer.encode("\n", add_special_tokens=False).ids
        ids = self.tokenizer.encode(pieces[0], add_special_tokens=False).ids
        for k, piece in enumerate(pieces[1:], start=1):
            piece = piece if k % 2 == 0 else contents[int(piece)]
            if piece:
                ids += self._encode_piece(piece, k % 2 == 1, newline)
        return ids

    def _encode_marked(self, messages: list[dict], render: dict) -> list[int]:
        """The prompt's ids with each control-token text the caller wrote (anywhere: contents,
        tool calls, tools, variables) wrapped in markers while rendering, then encoded as plain
        text, the rest as usual: transformers' sanitize_control_tokens."""
        mark = self._controls.mark
        marked = self.apply_chat_template(mark(messages), add_generation_prompt=render["add_generation_prompt"],
                                          tools=mark(render["tools"]), variables=mark(render["variables"]))
        # Split into [text, marked text, text, ..., text]; a marker the template separated
        # from its token (by slicing, say) is dropped but still separates the texts around it.
        pieces = _MARKED_RE.split(marked)
        newline = self.tokenizer.encode("\n", add_special_tokens=False).ids
        ids = self.tokenizer.encode(pieces[0], add_special_tokens=False).ids
        for k, piece in enumerate(pieces[1:], start=1):
            if piece:
                ids += self._encode_piece(piece, k % 2 == 1, newline)
        return ids

    def _encode_piece(self, piece: str, as_text: bool, newline: list[int]) -> list[int]:
        """Ids of a piece from the middle of a chat; with `as_text`, every added token's text in
        it is plain text. It is encoded after a newline whose ids are then dropped, so a
        SentencePiece tokenizer does not add the space it adds at the start of a text
        (transformers' way, kept for identical ids). ChatTemplateError when plain text still
        gives a control token (merges that rebuild one)."""
        tok = self._literal if as_text else self.tokenizer
        ids = tok.encode("\n" + piece, add_special_tokens=False).ids
        ids = ids[len(newline):] if ids[:len(newline)] == newline else tok.encode(piece, add_special_tokens=False).ids
        rebuilt = self._control_ids & set(ids) if as_text else ()
        if rebuilt:
            raise ChatTemplateError(f"a message contains the text of {self.tokenizer.id_to_token(min(rebuilt))!r}, "
                                    "which this model's tokenizer cannot keep as plain text; remove it")
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """Render `messages` ([{"role", "content", ...}]) to the prompt text, as transformers'
        `apply_chat_template(..., tokenize=False)` does: the same Jinja environment (sandbox,
        loop controls, `raise_exception`, `strftime_now`, `namespace`, `tojson`), keys whose value
        is None dropped from messages, `reasoning_content` filled from `thinking`/`reasoning`.
        `tools`: JSON schemas the template may list; `variables`: more template variables, as
        transformers' keyword arguments (e.g. {"enable_thinking": False}, {"date_string": ...})."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **(variables or {}),
                   "messages": [_template_message(m) for m in messages], "tools": tools, "documents": None,
                   "add_generation_prompt": add_generation_prompt}
        template = _compile_template(self.chat_template)
        try:
            return template.render(**context)
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
            # Raised by the template's own checks (raise_exception) or by its logic on these
            # messages: the request's fault, not the server's.
            raise ChatTemplateError(f"chat template failed: {e}") from None

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "TextTokenizer":
        """Build the tokenizer from a GGUF file's `tokenizer.*` fields, as llama.cpp reads them.

        `tokenizer.ggml.model`: "gpt2" (byte-level BPE; `tokenizer.ggml.pre` names the split:
        see _GGUF_BYTE_PRE) or "llama" (SentencePiece BPE with byte fallback: Gemma, Phi-3,
        Mistral, Llama 2; `add_space_prefix` as the file states, default on). The eos, eot and
        eom ids and the tokens llama.cpp ends generation at by their text (_GGUF_END_TEXTS) all
        end a sequence. ValueError names any model or pre-tokenizer not supported."""
        kind = meta.get("tokenizer.ggml.model")
        if kind == "gpt2":
            tok = _gguf_byte_level(meta)
        elif kind == "llama":
            tok = _gguf_sentencepiece(meta)
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, "
                             "'llama' SentencePiece BPE)")
        tokens = meta["tokenizer.ggml.tokens"]

        def id_at(key):
            i = meta.get(f"tokenizer.ggml.{key}")
            return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

        eos_id, bos_id = id_at("eos_token_id"), id_at("bos_token_id")
        ends = tuple(i for i in (id_at("eot_token_id"), id_at("eom_token_id")) if i is not None)
        ends += tuple(i for i, t in enumerate(tokens) if t in _GGUF_END_TEXTS)
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        return cls(
            tokenizer=tok,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token=tokens[bos_id] if bos_id is not None else None,
            eos_token=tokens[eos_id] if eos_id is not None else None,
            eos_token_id=eos_id,
            add_bos_token=bool(add_bos),
            byte_level=kind == "gpt2",
            eos_token_ids=ends,
        )

    @classmethod
    def from_hf_directory(cls, path: str | Path) -> "TextTokenizer":
        """Load a Hugging Face checkpoint's tokenizer from what its directory states:

        - tokenizer.json: the whole pipeline; whether BOS comes first is what its post-processor
          does (Llama 3 adds <|begin_of_text|> there and states no add_bos_token), as
          transformers 5 reads it; tokenizer_config.json's add_bos_token only counts for a
          tokenizer.json without a post-processor. add_eos_token is not applied: a prompt ending
          in EOS would end the generation before it starts.
        - tokenizer_config.json (else special_tokens_map.json): bos_token and eos_token, as
          strings or AddedToken objects; chat_template, a string or a list of {name, template}
          whose "default" is taken.
        - chat_template.jinja, else chat_template.json: the chat template, taking precedence over
          tokenizer_config.json's (newer transformers save it there).
        - generation_config.json: eos_token_id (an int or a list) joins `eos_token_ids`; its
          sampling defaults go to `generation_defaults`, for display only.

        ValueError (one line, naming the file) for a missing tokenizer.json, invalid JSON or
        contradicting statements."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{path} has no tokenizer.json (a SentencePiece tokenizer.model alone is not supported)")
        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust parser's own exception type
            raise ValueError(f"{tok_file}: not a valid tokenizers file ({e})") from None
        conf = _read_json(path / "tokenizer_config.json")
        specials = _read_json(path / "special_tokens_map.json")
        gen = _read_json(path / "generation_config.json")

        def named(key):
            value = conf.get(key, specials.get(key))
            return value.get("content") if isinstance(value, dict) else value

        bos, eos = named("bos_token"), named("eos_token")
        first = _post_processor_prefix(tok)
        if tok.post_processor is None:
            add_bos = bool(conf.get("add_bos_token", False))
        elif first is None:
            add_bos = False
        elif bos is None or bos == first:
            bos, add_bos = first, True
        else:
            raise ValueError(f"{tok_file} puts {first!r} before every text but tokenizer_config.json names "
                             f"{bos!r} as bos_token; make them agree")
        eos_id = tok.token_to_id(eos) if eos else None
        gen_eos = gen.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else gen_eos
        if gen_eos is not None and not (isinstance(gen_eos, list) and all(type(i) is int for i in gen_eos)):
            raise ValueError(f"{path / 'generation_config.json'}: eos_token_id must be an integer or a list of "
                             f"integers, not {gen.get('eos_token_id')!r}")
        gen_eos = [i for i in gen_eos or () if 0 <= i < tok.get_vocab_size(with_added_tokens=True)]
        if eos_id is None and gen_eos:
            eos_id = gen_eos[0]
        return cls(
            tokenizer=tok,
            chat_template=_hf_chat_template(path, conf),
            bos_token=bos,
            eos_token=eos,
            eos_token_id=eos_id,
            add_bos_token=add_bos,
            byte_level=_is_byte_level(tok),
            eos_token_ids=tuple(gen_eos),
            generation_defaults={k: v for k, v in gen.items() if not k.startswith("_") and not k.endswith("_token_id")
                                 and k != "transformers_version"},
        )


# -- Hugging Face directory -------------------------------------------------------------------


def _read_json(file: Path) -> dict:
    """The JSON object in `file`, {} when there is no such file."""
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return value


def _hf_chat_template(path: Path, conf: dict) -> str | None:
    """The default chat template: chat_template.jinja, else chat_template.json's, else
    tokenizer_config.json's (transformers' precedence)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    for file, source in ((path / "chat_template.json", None), (path / "tokenizer_config.json", conf)):
        source = _read_json(file) if source is None else source
        template = source.get("chat_template")
        if template is None:
            continue
        if isinstance(template, str):
            return template
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)} \
            if isinstance(template, list) else {}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{file}: chat_template must be a string or a list of {{name, template}} with a "
                         f"'default' (found {sorted(map(str, named)) or type(template).__name__})")
    return None


def _post_processor_prefix(tok: Tokenizer) -> str | None:
    """The token the post-processor puts before every text (Llama 3's <|begin_of_text|>, Gemma's
    <bos>), or None. Read from what it does to a probe text, so every post-processor kind counts."""
    if tok.post_processor is None:
        return None
    enc = tok.encode("a", add_special_tokens=True)
    prefix = []
    for i, special in zip(enc.ids, enc.special_tokens_mask):
        if not special:
            break
        prefix.append(i)
    if len(prefix) == len(enc.ids):  # the probe encoded to nothing: no way to tell prefix from suffix
        return None
    if len(prefix) > 1:
        raise ValueError(f"tokenizer.json puts {len(prefix)} tokens before every text; only a single BOS is supported")
    return tok.id_to_token(prefix[0]) if prefix else None


def _is_byte_level(tok: Tokenizer) -> bool:
    """Whether every vocabulary entry spells bytes in GPT-2's byte-level alphabet and the input
    reaches the model unnormalized or only NFC-normalized (Qwen2), the condition of
    `max_token_bytes` (`check_fits` applies the NFC itself)."""
    if tok.normalizer is not None and not isinstance(tok.normalizer, normalizers.NFC):
        return False
    if not isinstance(tok.decoder, decoders.ByteLevel):
        return False
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    added = {a.content for a in tok.get_added_tokens_decoder().values()}
    return all(c in alphabet for t in tok.get_vocab(with_added_tokens=True) if t not in added for c in t)


# -- GGUF -------------------------------------------------------------------------------------


def _gguf_byte_level(meta: dict) -> Tokenizer:
    """Byte-level BPE from a GGUF's tokens and merges, split as `tokenizer.ggml.pre` names."""
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    pre = _GGUF_BYTE_PRE.get(pre_name)
    if pre is None:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre_name!r} "
                         f"(supported: {', '.join(sorted(_GGUF_BYTE_PRE))})")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [_TOKEN_TYPE_NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if pre.split is None:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        steps = [byte_level]
    else:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
        steps = [pre_tokenizers.Split(Regex(pre.split), behavior="isolated"), byte_level]
    if pre.isolate_digits:
        steps.insert(0, pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    _add_gguf_tokens(tok, tokens, types, special_types={_TOKEN_TYPE_CONTROL})
    return tok


def _gguf_sentencepiece(meta: dict) -> Tokenizer:
    """SentencePiece BPE with byte fallback from a GGUF's tokens, scores and token types, the
    pipeline the family's tokenizer.json states: spaces spelled "▁", a "▁" first when
    `add_space_prefix` (also after each control token, as llama.cpp and the legacy
    SentencePiece converters do), unknown bytes as <0xNN> tokens. The file has no merges: they
    are derived from the scores (transformers' and llama.cpp's reading)."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    n = len(tokens)
    types = list(meta.get("tokenizer.ggml.token_type") or [_TOKEN_TYPE_NORMAL] * n)
    known = set(tokens)
    # A token of whitespace with spaces is stored with real spaces in some files (Gemma), but
    # the text reaches the merges with spaces as "▁".
    tokens = [t.replace(" ", _SPACE_MARK) if " " in t and not t.strip() and t.replace(" ", _SPACE_MARK) not in known
              else t for t in tokens]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        if meta.get("general.architecture") in _MERGE_ORDER_BY_POSITION or "tokenizer.ggml.scores" not in meta:
            scores = [-float(i) for i in range(n)]
        else:
            scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
        # Never a merge into or out of a control, unknown, unused or byte token: text must not
        # turn into them (a control token's text stays text when encoded literally).
        skip = {t for t, ty in zip(tokens, types) if ty in (_TOKEN_TYPE_UNKNOWN, _TOKEN_TYPE_CONTROL,
                                                            _TOKEN_TYPE_UNUSED, _TOKEN_TYPE_BYTE)}
        merges = _merges_from_scores(vocab, scores, skip)
    unk = next((t for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    replace = normalizers.Replace(" ", _SPACE_MARK)
    steps = [decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE_MARK), replace])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tok.normalizer = replace
    tok.decoder = decoders.Sequence(steps)
    _add_gguf_tokens(tok, tokens, types, special_types={_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_UNKNOWN})
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: list[float], skip: set[str]) -> list[tuple[str, str]]:
    """BPE merges that rebuild a SentencePiece vocabulary: every split of a token into two
    tokens, ranked by the whole token's score (best first), then the longer left and right part
    first. The ranking transformers' SentencePiece and GGUF converters use (generate_merges)."""
    ranked = []
    for t, i in vocab.items():
        if t in skip:
            continue
        pairs = [(t[:k], t[k:]) for k in range(1, len(t))
                 if t[:k] in vocab and t[k:] in vocab and t[:k] not in skip and t[k:] not in skip]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked += [(scores[i], left, right) for left, right in pairs]
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable: ties keep their order
    return [(left, right) for _, left, right in ranked]


def _add_gguf_tokens(tok: Tokenizer, tokens: list[str], types: list[int], special_types: set[int]) -> None:
    """Control tokens (and the others of `special_types`) become special added tokens, which
    `encode` parses as single ids and decode can skip; user-defined ones (<think>) become
    ordinary added tokens, always matched whole, as llama.cpp matches them."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in special_types])
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
            if ty == _TOKEN_TYPE_USER_DEFINED]
    if user:
        tok.add_tokens(user)


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


# -- chat template ----------------------------------------------------------------------------


def _template_message(message: dict) -> dict:
    """A message as transformers hands it to the template: keys whose value is None dropped (an
    OpenAI assistant turn with tool_calls and content None), the reasoning under both names
    templates read."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class _ControlTexts:
    """Finds control tokens' texts in strings, fast whatever their number (Gemma 3 has thousands
    of added tokens): only where a string has a character one of them starts with, then one set
    lookup per distinct length, longest first (so a token wins over the tokens it contains)."""

    def __init__(self, texts: tuple[str, ...]):
        self.texts = frozenset(texts)
        lengths: dict[str, set[int]] = {}
        for t in self.texts:
            lengths.setdefault(t[0], set()).add(len(t))
        self._lengths = {c: sorted(ls, reverse=True) for c, ls in lengths.items()}
        self._starts = re.compile("[" + "".join(map(re.escape, lengths)) + "]") if lengths else None

    def spans(self, s: str):
        """(start, end) of each control text in `s`, leftmost first, not overlapping."""
        if self._starts is None:
            return
        end = 0
        for m in self._starts.finditer(s):
            i = m.start()
            if i < end:
                continue
            for n in self._lengths[s[i]]:
                if s[i:i + n] in self.texts:
                    yield i, i + n
                    end = i + n
                    break

    def contains(self, value) -> bool:
        """Whether a string anywhere in `value` (nested lists, tuples and dict values) holds one."""
        if isinstance(value, str):
            return next(self.spans(value), None) is not None
        if isinstance(value, dict):
            return any(self.contains(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(self.contains(v) for v in value)
        return False

    def mark(self, value):
        """`value` with each control text in its strings wrapped in the markers (markers already
        in the strings are dropped first, so none can be forged)."""
        if isinstance(value, str):
            value = value.replace(_MARK_START, "").replace(_MARK_END, "")
            out, last = [], 0
            for i, j in self.spans(value):
                out += [value[last:i], _MARK_START, value[i:j], _MARK_END]
                last = j
            return "".join(out) + value[last:]
        if isinstance(value, dict):
            return {k: self.mark(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark(v) for v in value]
        return value


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without the type's attributes (sandbox escapes)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace() refusing underscore names, which could reach CPython internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]  # Jinja's signature trick: namespace(self=...) still works
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})")


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: transformers marks the assistant's part of a
    training chat with it; rendering a prompt only needs the text inside."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=1)
def _template_environment() -> ImmutableSandboxedEnvironment:
    # transformers' chat-template renderer (utils/chat_template_utils.py): sandboxed, trim_blocks
    # and lstrip_blocks, loop controls ({% break %}), the same globals and tojson.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    try:
        return _template_environment().from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None


@lru_cache(maxsize=16)
def _template_literal_text(source: str) -> str:
    """The template's literal strings (its raw text and string constants), joined by NUL so a
    search cannot match across two of them."""
    try:
        ast = _template_environment().parse(source)
    except TemplateError:
        return ""  # rendering reports the error
    literals = {node.data for node in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {node.value for node in ast.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(literals)
