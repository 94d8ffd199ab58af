"""Incremental detokenization: text deltas per new token, never emitting broken UTF-8."""
from __future__ import annotations

from engine.tokenizer import TextTokenizer

# How many already-emitted tokens to re-decode as context: byte-level BPE and tokenizers that
# strip leading spaces need a little left context to decode the next token correctly.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Contract: the concatenation of every delta returned by `push` equals
    `tokenizer.decode(all_ids)` once the sequence ends on a complete character; a token that ends
    inside a multi-byte character yields "" until the character completes.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0    # ids before this are already emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            # An incomplete UTF-8 sequence (or a token that decodes to nothing, e.g. a special).
            return ""
        delta = full_text[len(prefix_text):]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
        return delta
