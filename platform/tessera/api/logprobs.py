"""Token logprobs in OpenAI's two shapes, from the engine's RequestOutput.logprobs entries.

Chat: choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}]}. Completions: choices[].logprobs = {tokens, token_logprobs, top_logprobs (one
{token: logprob} dict per token), text_offset}.

Alignment: the client gets the logprobs of the tokens whose text it gets. The engine emits token
ids as soon as they are sampled but holds text back (a possible stop string's start) and cuts
it at a stop string, so `ChoiceLogprobs` releases a token's entry only once the text sent covers
the token's first byte (its UTF-8 bytes counted from the completion's start; special tokens,
which decode to no text, take no bytes); a chunk's logprobs are those of the tokens its text
starts. The last delta's release (`final=True`) also releases what no text covers, the
end-of-sequence token and any tokens past a stop string's cut, at the completion's end (their
text offset): the logprobs hold one entry per completion token, as `completion_tokens` counts
them. As vLLM, such a token's entry names the token's own text (an end-of-sequence token's
content, e.g. "<|im_end|>", with its bytes), not the empty string.
"""
from __future__ import annotations

from collections import deque
from functools import lru_cache

from engine.tokenizer import TextTokenizer, byte_level_chars


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that spells each byte -> the byte."""
    return {c: b for b, c in enumerate(byte_level_chars())}


class TokenTexts:
    """Each token's UTF-8 bytes (byte-level BPE: the bytes the vocabulary entry spells; an added
    token: its text) and whether it is a special token (decoded as no text); cached per id."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        decoder = tokenizer.tokenizer.get_added_tokens_decoder()
        self._added = {i: a for i, a in decoder.items()}
        self._cache: dict[int, tuple[bytes, bool]] = {}

    def get(self, token_id: int) -> tuple[bytes, bool]:
        """(the token's bytes, whether it is special)."""
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[bytes, bool]:
        added = self._added.get(token_id)
        if added is not None:
            return added.content.encode(), bool(added.special)
        piece = self.tokenizer.tokenizer.id_to_token(token_id)
        table = _byte_of_char()
        if self.tokenizer.byte_level and piece is not None and all(c in table for c in piece):
            return bytes(table[c] for c in piece), False
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode(), False


_TEXTS: dict[int, TokenTexts] = {}


def token_texts(tokenizer: TextTokenizer) -> TokenTexts:
    """The (process-wide) TokenTexts of `tokenizer`."""
    t = _TEXTS.get(id(tokenizer))
    if t is None or t.tokenizer is not tokenizer:
        t = _TEXTS[id(tokenizer)] = TokenTexts(tokenizer)
    return t


def _text(b: bytes) -> str:
    # A token may be part of a multi-byte character: its bytes say exactly what it is.
    return b.decode("utf-8", "replace")


class ChoiceLogprobs:
    """One choice's logprobs as its client gets them (module docstring): `push` every delta's
    entries, then `release` the delta's text; each release returns the entries its text covers,
    in the API's shape for `kind` ("chat" or "text"), or None when it covers none."""

    def __init__(self, texts: TokenTexts, kind: str):
        self.texts = texts
        self.kind = kind
        self._waiting: deque[tuple[int, dict]] = deque()  # (first byte, engine entry), in order
        self._token_bytes = 0  # bytes of the tokens pushed so far (the next token's first byte)
        self._sent_bytes = 0  # bytes of the text released so far
        self._sent_chars = 0

    def push(self, entries: list[dict] | None) -> None:
        for e in entries or ():
            b, special = self.texts.get(e["token_id"])
            self._waiting.append((self._token_bytes, e))
            if not special:
                self._token_bytes += len(b)

    def release(self, text: str, *, final: bool = False) -> dict | None:
        """The entries whose first byte `text` (the next text sent to the client) covers; with
        `final` (the choice's last delta), every entry still waiting (module docstring)."""
        piece = text.encode()
        start_bytes, start_chars = self._sent_bytes, self._sent_chars
        self._sent_bytes += len(piece)
        self._sent_chars += len(text)
        out = []
        while self._waiting and (final or self._waiting[0][0] < self._sent_bytes):
            first, e = self._waiting.popleft()
            # The token's first character offset in the completion's text.
            offset = start_chars + len(piece[:max(0, first - start_bytes)].decode("utf-8", "ignore"))
            out.append((offset, e))
        return self._shape(out) if out else None

    def _shape(self, items: list[tuple[int, dict]]) -> dict:
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for _, e in items], "refusal": None}
        tokens, lps, tops = [], [], []
        for _, e in items:
            tokens.append(_text(self.texts.get(e["token_id"])[0]))
            lps.append(e["logprob"])
            tops.append({_text(self.texts.get(t["token_id"])[0]): t["logprob"] for t in e["top_logprobs"]})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": [offset for offset, _ in items]}

    def _chat_entry(self, e: dict) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            b = self.texts.get(token_id)[0]
            return {"token": _text(b), "logprob": logprob, "bytes": list(b)}

        return one(e["token_id"], e["logprob"]) | {
            "top_logprobs": [one(t["token_id"], t["logprob"]) for t in e["top_logprobs"]]}


def merge(kind: str, parts: list[dict]) -> dict:
    """The released parts of one choice as one logprobs object (a JSON answer's)."""
    if kind == "chat":
        return {"content": [c for p in parts for c in p["content"]], "refusal": None}
    return {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
