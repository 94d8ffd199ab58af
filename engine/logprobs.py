"""Token log-probabilities for the requests that ask (SamplingParams.logprobs).

They come from the log-softmax of the model's RAW logits: before logit_bias, the min_tokens mask,
the penalties, temperature, top-k/top-p/min-p and any response_format mask the sampling path
applies (engine.sampler), so they describe the model, not the sampler, and the same token gets
the same logprob whatever the request's sampling settings (as vLLM's default raw logprobs). Every
appended token has its entry, the end-of-sequence token that ends a completion included (it
counts in completion_tokens). The engine step computes
them right after the forward (`compute`), samples, then reads the sampled tokens' logprobs and
the top alternatives (`gather`) as one flat float64 tensor, so the device path copies them to
the host together with the tokens in its one device-to-host copy; `entries` turns that host list
into RequestOutput.logprobs entries. Rows that do not ask cost nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import Sequence

#: What a logprob below this (or not finite) is reported as: JSON has no -inf, and OpenAI reports
#: tokens the model all but rules out the same way.
FLOOR = -9999.0


@dataclass
class StepLogprobs:
    """The log-softmax rows of one step's sequences that asked, on the logits' device."""

    rows: list[int]  # indices into the step's sequences (and logits rows)
    ks: list[int]  # per asking row: how many top alternatives it wants (0..20)
    logprobs: torch.Tensor  # [R, V] fp32 log-softmax of the raw logits
    top_values: torch.Tensor  # [R, K] K = max(ks): each row's likeliest tokens' logprobs, descending
    top_ids: torch.Tensor  # [R, K] int64

    @property
    def width(self) -> int:
        """How many host values `gather` returns."""
        return len(self.rows) * (1 + 2 * self.top_ids.shape[1])


def compute(logits: torch.Tensor, seqs: list[Sequence]) -> StepLogprobs | None:
    """logits: [N, V] raw, row i for seqs[i] -> the log-softmax and top-k of the rows whose
    request asks for logprobs, or None when none does."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return None
    ks = [seqs[i].params.logprobs for i in rows]
    index = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    top = torch.topk(lp, min(max(ks), lp.shape[1]), dim=-1)
    return StepLogprobs(rows=rows, ks=ks, logprobs=lp, top_values=top.values, top_ids=top.indices)


def gather(state: StepLogprobs, tokens: torch.Tensor) -> torch.Tensor:
    """tokens: [N] int64, the step's sampled tokens on the logits' device -> one flat float64
    tensor [state.width]: the sampled tokens' logprobs [R], then the top logprobs [R*K], then
    the top ids [R*K] (exact in float64), logprobs floored at FLOOR."""
    index = torch.tensor(state.rows, device=tokens.device)
    sampled = state.logprobs.gather(1, tokens.index_select(0, index)[:, None].to(torch.int64))[:, 0]
    values = torch.cat([sampled, state.top_values.flatten()]).double()
    values = torch.nan_to_num(values, nan=FLOOR, neginf=FLOOR).clamp(min=FLOOR)
    return torch.cat([values, state.top_ids.flatten().double()])


def entries(state: StepLogprobs, tokens: list[int | None], host: list[float]) -> dict[int, dict]:
    """`gather`'s values on the host -> {row: RequestOutput.logprobs entry} for the asking rows
    whose token is not None (rows that failed in the step get none)."""
    r, k = len(state.rows), state.top_ids.shape[1]
    out = {}
    for j, (row, want) in enumerate(zip(state.rows, state.ks)):
        tok = tokens[row]
        if tok is None:
            continue
        top = [{"token_id": int(host[r + r * k + j * k + m]), "logprob": host[r + j * k + m]} for m in range(want)]
        out[row] = {"token_id": int(tok), "logprob": host[j], "top_logprobs": top}
    return out
