"""The checks a prompt passes before it is queued, in one place: LLMEngine.add_request runs them,
and the gateway (tessera.api) runs the same function before it reserves quota, so a request the
engine would refuse is refused there first, with the same message, at no cost.

Checks run in this order and the first failure is raised: token ids in the vocabulary (only for
a prompt given as ids: a tokenizer's own ids need no check), a non-empty prompt, a prompt that
leaves room for one generated token, prompt + max_tokens within the context. `check_logit_bias`
bounds a request's logit_bias ids by the vocabulary (SamplingParams checks everything else about
it, and that min_tokens <= max_tokens).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.sampling_params import InvalidRequestError


class ContextLengthExceeded(InvalidRequestError):
    """The prompt, or the prompt plus max_tokens, does not fit the model's context; `code` is
    OpenAI's error code for it."""

    code = "context_length_exceeded"


def check_prompt(ids: Sequence[int], *, max_model_len: int, max_tokens: int | None = None,
                 vocab_size: int | None = None, param: str = "prompt") -> None:
    """Raise InvalidRequestError (ContextLengthExceeded for the context checks) for the first
    check `ids` fails; return None when it passes them all.

    Args:
        ids: the prompt's token ids.
        max_model_len: the context, in tokens; the prompt must be shorter (one token is generated).
        max_tokens: the completion's bound; None skips the prompt + max_tokens check.
        vocab_size: checks every id is an int in [0, vocab_size); None when the ids come from the
            model's own tokenizer.
        param: the request field the prompt came from, named in the error ("prompt", "messages").
    """
    if vocab_size is not None and any(not isinstance(t, int) or t < 0 or t >= vocab_size for t in ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", param)
    n = len(ids)
    if not n:
        raise InvalidRequestError("the prompt is empty", param)
    if n >= max_model_len:
        raise ContextLengthExceeded(f"the prompt has {n} tokens; this model's context is {max_model_len} tokens",
                                    param)
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise ContextLengthExceeded(f"max_tokens is too large: the prompt ({n} tokens) + max_tokens ({max_tokens}) "
                                    f"exceeds the context of {max_model_len} tokens", "max_tokens")


def check_logit_bias(logit_bias: Mapping[int, float] | None, vocab_size: int) -> None:
    """Raise InvalidRequestError naming `logit_bias` and the first id (in ascending order) outside
    [0, vocab_size); return None when every id is inside, or there is no logit_bias."""
    bad = sorted(t for t in logit_bias or () if not 0 <= t < vocab_size)
    if bad:
        raise InvalidRequestError(f"logit_bias: token id {bad[0]} is not in this model's vocabulary "
                                  f"[0, {vocab_size})", "logit_bias")
