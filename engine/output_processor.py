"""A request's output as its tokens arrive: detokenizing, end conditions, stop strings, deltas.

    reason = output.append(seq, tok, grammar_complete)   # "stop" | "length" | None
    delta = output.delta(seq, final=reason is not None)  # RequestOutput: new text, tokens, logprobs

End conditions, in order: an end-of-sequence id (unless ignore_eos) or one of `stop_token_ids`
("stop"; not detokenized), a stop string in the decoded text once min_tokens tokens are kept
(the text is cut before it), a complete response_format grammar ("stop"), then max_tokens or the
context end ("length"). Text that may be the start of a stop string is held back from a delta
until it cannot be. Logprobs entries (engine.logprobs) are kept per request until the delta
that carries their tokens. Finishing a request (scheduler, blocks, adapters) is the engine's.
"""
from __future__ import annotations

from engine.sampling_params import RequestOutput
from engine.sequence import Sequence


class OutputProcessor:
    """One engine's output bookkeeping: `eos_token_ids` end a completion, `max_model_len`
    bounds a sequence's tokens."""

    def __init__(self, eos_token_ids: set[int], max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        #: Logprobs entries of the tokens a request has appended but not yet emitted in a delta
        #: (requests that asked for logprobs only; `delta` takes them).
        self.pending_logprobs: dict[str, list[dict]] = {}

    def keep_logprobs(self, seq: Sequence, entry: dict) -> None:
        """Keep `seq`'s entry for the token it is about to append, until its delta."""
        self.pending_logprobs.setdefault(seq.request_id, []).append(entry)

    def clear(self) -> None:
        self.pending_logprobs.clear()

    def append(self, seq: Sequence, tok: int, grammar_complete: bool = False) -> str | None:
        """Append `tok` to `seq` (its text too, unless it ends the completion): the finish reason
        it causes ("stop", "length"), or None."""
        seq.append_token(tok)
        p = seq.params
        reason = None
        if not p.ignore_eos and tok in self.eos_token_ids:
            reason = "stop"
        elif tok in p.stop_token_ids:
            reason = "stop"
        else:
            seq.output_text += seq.detokenizer.push(tok)
            if len(seq.output_token_ids) == p.min_tokens:
                seq.stop_text_floor = len(seq.output_text)  # a stop string must end after it
            # Stop strings apply once min_tokens tokens are kept (the sampler masks stop ids until then).
            if p.stop and len(seq.output_token_ids) > p.min_tokens and self._truncate_at_stop(seq):
                reason = "stop"
            elif grammar_complete:
                reason = "stop"  # the response_format grammar is complete: only EOS could follow
        if reason is None and (len(seq.output_token_ids) >= p.max_tokens or seq.num_known_tokens >= self.max_model_len):
            reason = "length"
        return reason

    @staticmethod
    def _truncate_at_stop(seq: Sequence) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        # A stop string can straddle tokens: search from where a new match could begin, and (with
        # min_tokens) only for matches that end after the min_tokens-th token's text.
        begin = max(0, seq.emitted_text_len - longest + 1)
        floor = seq.stop_text_floor
        hits = [i for i in (seq.output_text.find(s, max(begin, floor - len(s) + 1)) for s in seq.params.stop)
                if i != -1]
        if not hits:
            return False
        seq.output_text = seq.output_text[:min(hits)]
        return True

    def delta(self, seq: Sequence, final: bool = False) -> RequestOutput:
        """What `seq` produced since its last delta (all of it if `final`: no hold-back)."""
        end = len(seq.output_text)
        if not final and seq.params.stop:
            # Hold back text that may be the start of a stop string.
            end = max(seq.emitted_text_len, end - (max(len(s) for s in seq.params.stop) - 1))
        text = seq.output_text[seq.emitted_text_len:end]
        toks = seq.output_token_ids[seq.emitted_token_len:]
        seq.emitted_text_len = end
        seq.emitted_token_len = len(seq.output_token_ids)
        out = RequestOutput(seq.request_id, text, toks, prompt_tokens=seq.num_prompt_tokens,
                            cached_tokens=seq.num_cached_tokens or 0,
                            completion_tokens=len(seq.output_token_ids),
                            computed_prompt_tokens=computed_prompt_tokens(seq))
        if seq.params.logprobs is not None:
            # Every appended token's entry was kept when it was sampled: they match `toks`.
            out.logprobs = self.pending_logprobs.pop(seq.request_id, [])
        return out


def computed_prompt_tokens(seq: Sequence) -> int:
    """Prompt tokens whose KV `seq` has now: all of them once it has produced a token, else
    how far its (chunked) prefill got, prefix-cache hits included. A sequence preempted
    before its first token holds none until it is scheduled again (from its cache hits)."""
    if seq.output_token_ids:
        return seq.num_prompt_tokens
    return min(seq.num_computed_tokens, seq.num_prompt_tokens)
