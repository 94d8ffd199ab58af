"""Turns last-token logits into next tokens: greedy, temperature, top-k, top-p, per-request seed.

Numerically safe for every value SamplingParams accepts, given finite logits (the engine fails
rows that are not finite before sampling): each row is shifted so its maximum is 0 before it is
divided by the temperature, so every scaled logit is <= 0 whatever the temperature in (0, 2] (a
subnormal one sends all but the maximum to -inf, never to inf - inf = NaN), and the maximum keeps
probability exp(0) = 1 before normalization, so the distribution never sums to 0.
"""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence],
                  errors: dict[int, Exception] | None = None) -> torch.Tensor:
    """logits: [N, V] fp32, finite, row i for seqs[i] -> the next token of every row, an int64
    tensor [N] on the logits' device (the caller copies it to the host once).

    Greedy rows take argmax. Other rows are sampled from their own torch.Generator (seeded from
    the request's seed, on the logits' device), so a request's random draws do not depend on
    what else is in the batch. With `errors`, a row whose sampling raises keeps its argmax, its exception
    goes to errors[i], and the other rows are sampled as usual; without it the exception
    propagates.
    """
    # max(dim).indices is argmax (first index of the maximum) and cheaper than torch.argmax on
    # CPU over a large vocabulary (bench/RESULTS.md).
    tokens = logits.max(dim=-1).indices
    for i, seq in enumerate(seqs):
        if not seq.params.greedy:
            try:
                tokens[i] = sample_row(logits[i], seq.params, seq.generator)
            except Exception as e:  # noqa: BLE001 - reported per row when the caller asks
                if errors is None:
                    raise
                errors[i] = e
    return tokens


def sample(logits: torch.Tensor, seqs: list[Sequence],
           errors: dict[int, Exception] | None = None) -> list[int | None]:
    """`sample_tokens` as a host list; with `errors`, a row whose sampling raised is None."""
    tokens: list[int | None] = sample_tokens(logits, seqs, errors).tolist()
    for i in errors or ():
        tokens[i] = None
    return tokens


def sample_row(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token (a 0-d tensor on row's device) from finite logits `row` [V] under non-greedy
    params `p` (see the module doc)."""
    if p.temperature < torch.finfo(row.dtype).tiny:
        # Below the smallest normal fp32 the temperature would round to 0 in row's dtype (0 / 0
        # is NaN at the maximum); float64 holds every accepted value, subnormals included.
        row = row.double()
    row = (row - row.max()) / p.temperature
    if 0 < p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p, always at least the first token (a
        # top_p below fp32's range compares as 0 against the fp32 masses).
        drop = (cum - sorted_probs) >= p.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[0]
