"""Turns last-token logits into next tokens: greedy, temperature, top-k, top-p, per-request seed."""
from __future__ import annotations

import torch

from engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [N, V] fp32, row i for seqs[i] -> one token id per row.

    Greedy rows take argmax. Other rows are sampled from their own torch.Generator (seeded from
    the request's seed), so a request's tokens do not depend on what else is in the batch.
    """
    # max(dim).indices is argmax (first index of the maximum) at ~1/3 of torch.argmax's CPU time
    # over a 49k vocabulary (22 vs 66 us a row, 0.4 vs 1.0 ms for 32 rows).
    tokens = logits.max(dim=-1).indices.tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = (cum - sorted_probs) >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_probs)
        tokens[i] = int(torch.multinomial(probs, 1, generator=seq.generator).item())
    return tokens
