"""Turns last-token logits into next tokens, vectorized over the batch (no per-row Python loop
on the tensors): OpenAI's and vLLM's sampling controls, greedy, temperature, top-k, top-p,
min-p, and a per-request seed.

Semantics, per row, in vLLM's order (min_p last, as in vLLM's V0 sampler). x: the row's logits,
a response_format grammar's mask already in them as -inf (-inf stays -inf through every step,
so a bias never lifts a banned token); count[t]: how often the completion so far holds t; seen:
the prompt's and the completion's tokens.

    x[t] += logit_bias[t]                                   for t in logit_bias
    x[t] = -inf            while len(completion) < min_tokens, for t in stop_token_ids and
                           the model's end-of-sequence ids (unless ignore_eos)
    x[t] = x[t] / rep if x[t] > 0 else x[t] * rep           for t in seen
    x[t] -= frequency * count[t] + presence * (count[t] > 0)
    greedy (temperature 0 or top_k 1): argmax(x)
    else: z = (x - max(x)) / temperature; z[z < k-th largest z] = -inf (top_k); p = softmax(z);
          zero all but the likeliest tokens whose mass first reaches top_p (the first is always
          kept); zero p[t] < min_p * max(p); draw from what is left.

The first four run sparsely: only the (row, token) positions involved are read and written, in
place in the step's logits, and the saved originals are written back before sampling returns
(no pass over [N, V] is added; with no control in the step nothing at all is; the entry points
run in inference mode, where the engine's logits, inference tensors, may be written);
`process_logits` returns them as a tensor. The penalties' counts are kept incrementally per
sequence (engine.sequence.TokenCounts: distinct ids and counts in flat arrays, updated per
appended token) and joined per step without a per-token Python loop; bench/sampling.py
--compare-counts measured that against building them per step from the token lists (one
torch.unique) and against a dense scatter_add count tensor.

The draw is counter-based: a non-greedy row's token is the first, in vocabulary order, whose
cumulative (float64) weight exceeds u times the row's total, u = engine.sequence.sampling_uniform
(seed, number of completion tokens so far): a function of the request's seed and the token's
index alone, so the same seed gives the same tokens whatever else is in the batch, after a
preemption, and with no per-request generator (one uniform per row, not one per vocabulary
entry as the Gumbel-max trick would need). Zero-weight tokens are never drawn (u < 1 strictly,
see sampling_uniform). Every row op is row-local, so a row's result does not depend on the batch.

Numerically safe for every value SamplingParams accepts, given finite logits (the engine fails
rows that are not finite before sampling): a repetition penalty's quotient is clamped to fp32's
finite range (masked -inf stays), biases and counts are far below it; each row is shifted so its
maximum is 0 before it is divided by the temperature, so every scaled logit is <= 0 whatever the
temperature in (0, 2] (temperatures below fp32's smallest normal, where the division would reach
0 / 0 at the maximum, are computed in float64 in a group of their own), and the maximum keeps
weight exp(0) = 1, so no row's total is 0. A row whose maximum is not finite (NaN in, or every
token masked) is not sampled: `sample_tokens` flags it and keeps its argmax, `sample` reports it.

Host work (the per-step parameter and index tensors) is built first and reaches the device in
one upload (`upload`, e.g. Backend.upload); nothing in here copies device data back.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from engine.sequence import Sequence, sampling_uniform

Upload = Callable[[list[torch.Tensor]], list[torch.Tensor]]

_NEG_INF = float("-inf")


class SamplingError(RuntimeError):
    """A row that cannot be sampled: its logits are not finite, or every token is masked."""


# -- per-step host plan ---------------------------------------------------------------------------


@dataclass
class _Group:
    """Non-greedy rows sampled together in one dtype (float64 for subnormal temperatures)."""

    rows: torch.Tensor | None  # [R] int64 indices into the batch; None: every row, in order
    dtype: torch.dtype
    params: torch.Tensor  # [5, R] float64: temperature, top_k, top_p, min_p, u
    topk_rows: torch.Tensor | None  # [Rk] int64 indices into the group: rows with 0 < top_k < V
    topk_max: int
    topp_rows: torch.Tensor | None  # [Rp] int64 indices into the group: rows with top_p < 1
    min_p: bool  # whether some row has min_p > 0


@dataclass
class _Plan:
    """One step's host-built tensors: the controls' sparse positions and the draw's parameters."""

    bias_keys: torch.Tensor | None = None  # [B] int64 flat positions row * V + token
    bias_values: torch.Tensor | None = None  # [B] fp32
    mask_keys: torch.Tensor | None = None  # [M] int64 flat positions set to -inf (min_tokens)
    pen_keys: torch.Tensor | None = None  # [U] int64 distinct flat positions of seen tokens
    pen_params: torch.Tensor | None = None  # [4, U] fp32: repetition, frequency, presence, count
    groups: list[_Group] = field(default_factory=list)

    @property
    def has_controls(self) -> bool:
        return self.bias_keys is not None or self.mask_keys is not None or self.pen_keys is not None

    def upload(self, upload: Upload | None, device: torch.device) -> None:
        """Move every host tensor to `device` (with one `upload` call when given one)."""
        slots = [(self, name) for name in ("bias_keys", "bias_values", "mask_keys", "pen_keys", "pen_params")]
        slots += [(g, name) for g in self.groups for name in ("rows", "params", "topk_rows", "topp_rows")]
        slots = [(o, n) for o, n in slots if getattr(o, n) is not None]
        host = [getattr(o, n) for o, n in slots]
        if not host or all(t.device == device for t in host):
            return
        moved = upload(host) if upload is not None else [t.to(device, non_blocking=True) for t in host]
        for (o, n), t in zip(slots, moved):
            setattr(o, n, t)


class _Ragged:
    """Per-row runs of token ids (and values) joined into flat host arrays with C-level array
    operations only: no Python loop over tokens, and no small torch ops per row (on a loaded
    machine each can wait for a thread-pool wake-up, and these run every step)."""

    def __init__(self, *value_names: str):
        self.ids = array("q")
        self.offsets = array("q")  # row * vocab, per id
        self.values = {name: array("f") for name in value_names}

    def add(self, row: int, vocab: int, ids: array, **values) -> None:
        """ids: the row's token ids; values: per name, an array as long as ids or one number for all."""
        self.ids.extend(ids)
        self.offsets.extend(array("q", [row * vocab]) * len(ids))
        for name, v in values.items():
            self.values[name].extend(v if isinstance(v, array) else array("f", [v]) * len(ids))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(flat positions row * vocab + id, int64; then each value name's float32), owned by torch."""
        keys = torch.frombuffer(self.ids, dtype=torch.int64) + torch.frombuffer(self.offsets, dtype=torch.int64)
        return (keys, *(torch.frombuffer(v, dtype=torch.float32).clone() for v in self.values.values()))


def _cached_array(seq: Sequence, name: str, build: Callable[[], array]) -> array:
    a = seq.controls_cache.get(name)
    if a is None:
        a = seq.controls_cache[name] = build()
    return a


def _bias_ids(seq: Sequence, vocab: int) -> array:
    ids = array("q", seq.params.logit_bias)
    if max(ids) >= vocab:  # the engine refuses such requests (engine.request_checks.check_logit_bias)
        raise ValueError(f"logit_bias of request {seq.request_id!r} names a token id outside the vocabulary of {vocab}")
    return ids


def _plan_controls(plan: _Plan, seqs: list[Sequence], vocab: int) -> None:
    bias, mask, pen_rows = _Ragged("bias"), _Ragged(), []
    for i, s in enumerate(seqs):
        if not s.has_logits_controls:
            continue
        p = s.params
        if p.logit_bias:
            ids = _cached_array(s, "bias_ids", lambda: _bias_ids(s, vocab))
            bias.add(i, vocab, ids, bias=_cached_array(s, "bias_values", lambda: array("f", p.logit_bias.values())))
        if s.min_tokens_mask_ids and s.num_output_tokens < p.min_tokens:
            mask.add(i, vocab, _cached_array(s, "mask_ids", lambda: array(
                "q", [t for t in s.min_tokens_mask_ids if t < vocab])))
        if p.penalized:
            pen_rows.append(i)
    if bias.ids:
        plan.bias_keys, plan.bias_values = bias.tensors()
    if mask.ids:
        (plan.mask_keys,) = mask.tensors()
    if pen_rows:
        _plan_penalties(plan, seqs, pen_rows, vocab)


def _plan_penalties(plan: _Plan, seqs: list[Sequence], rows: list[int], vocab: int) -> None:
    """The distinct (row, token) positions the penalties touch, each with its row's penalties and
    the token's count in the row's completion (Sequence.token_counts: kept as tokens are
    appended; joined here without a Python loop over tokens)."""
    ragged = _Ragged("rep", "freq", "pres", "count")
    for i in rows:
        p, c = seqs[i].params, seqs[i].token_counts
        ragged.add(i, vocab, c.ids, rep=p.repetition_penalty, freq=p.frequency_penalty, pres=p.presence_penalty,
                   count=c.counts)
    if not ragged.ids:
        return  # no tokens yet, and no prompt to penalize
    keys, *params = ragged.tensors()
    plan.pen_keys, plan.pen_params = keys, torch.stack(params)


def _plan_draw(plan: _Plan, seqs: list[Sequence], vocab: int, dtype: torch.dtype) -> None:
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if not rows:
        return
    tiny = torch.finfo(dtype).tiny
    narrow = [i for i in rows if seqs[i].params.temperature >= tiny]
    wide = [i for i in rows if seqs[i].params.temperature < tiny]
    for members, group_dtype in ((narrow, dtype), (wide, torch.float64)):
        if not members:
            continue
        ps = [seqs[i].params for i in members]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in ps]
        params = torch.tensor([[p.temperature for p in ps], top_k, [p.top_p for p in ps], [p.min_p for p in ps],
                               [sampling_uniform(seqs[i].sampling_seed, seqs[i].num_output_tokens)
                                for i in members]], dtype=torch.float64)
        topk = [j for j, k in enumerate(top_k) if k]
        topp = [j for j, p in enumerate(ps) if p.top_p < 1.0]
        everyone = len(members) == len(seqs)
        plan.groups.append(_Group(
            rows=None if everyone else torch.tensor(members, dtype=torch.int64), dtype=group_dtype, params=params,
            topk_rows=torch.tensor(topk, dtype=torch.int64) if topk else None,
            topk_max=max(top_k), topp_rows=torch.tensor(topp, dtype=torch.int64) if topp else None,
            min_p=any(p.min_p > 0.0 for p in ps)))


def _plan(seqs: list[Sequence], logits: torch.Tensor, upload: Upload | None) -> _Plan:
    vocab = logits.shape[1]
    plan = _Plan()
    _plan_controls(plan, seqs, vocab)
    _plan_draw(plan, seqs, vocab, logits.dtype)
    plan.upload(upload, logits.device)
    return plan


# -- device work --------------------------------------------------------------------------------


@contextmanager
def _controlled(logits: torch.Tensor, plan: _Plan):
    """The logits with the plan's controls applied, written in place and restored on exit (the
    positions they touch are saved first: a few thousand values, where a copy of the logits would
    be a pass over [N, V] every step). A non-contiguous input is copied instead."""
    if not plan.has_controls:
        yield logits
        return
    x = logits if logits.is_contiguous() else logits.contiguous()
    flat = x.view(-1)
    touched = [k for k in (plan.bias_keys, plan.mask_keys, plan.pen_keys) if k is not None]
    touched = touched[0] if len(touched) == 1 else torch.cat(touched)
    saved = flat.index_select(0, touched)
    try:
        if plan.bias_keys is not None:
            flat.index_add_(0, plan.bias_keys, plan.bias_values.to(x.dtype))
        if plan.mask_keys is not None:
            flat.index_fill_(0, plan.mask_keys, _NEG_INF)
        if plan.pen_keys is not None:
            rep, freq, pres, count = plan.pen_params.to(x.dtype)
            v = flat.index_select(0, plan.pen_keys)
            big = torch.finfo(x.dtype).max
            # A tiny repetition penalty's quotient may overflow: clamp it, but keep masked -inf.
            penalized = torch.where(v > 0, v / rep, v * rep).clamp_(-big, big)
            penalized = torch.where(torch.isfinite(v), penalized, v)
            penalized -= freq * count + pres * (count > 0).to(x.dtype)
            flat.index_copy_(0, plan.pen_keys, penalized)
        yield x
    finally:
        # Duplicate positions (a token both biased and penalized) restore the same saved value.
        flat.index_copy_(0, touched, saved)


def _weights(x: torch.Tensor, best: torch.Tensor, g: _Group) -> torch.Tensor:
    """The group's rows' unnormalized probabilities [R, V] in g.dtype (the likeliest kept token
    weighs exactly 1), after temperature, top-k, top-p and min-p."""
    xs, ms = (x, best) if g.rows is None else (x.index_select(0, g.rows), best.index_select(0, g.rows))
    temperature, top_k, top_p, min_p = (g.params[:4]).to(g.dtype)
    # Rows whose maximum is not finite are flagged by the caller; a 0 shift keeps them harmless.
    ms = torch.where(torch.isfinite(ms), ms, torch.zeros((), dtype=ms.dtype, device=ms.device))
    z = (xs.to(g.dtype) - ms.to(g.dtype)[:, None]) / temperature[:, None]
    if g.topk_rows is not None:
        sub = z.index_select(0, g.topk_rows)
        k = top_k.index_select(0, g.topk_rows).long()
        kth = torch.topk(sub, g.topk_max, dim=-1).values.gather(1, (k - 1)[:, None])
        z.index_copy_(0, g.topk_rows, sub.masked_fill(sub < kth, _NEG_INF))
    e = z.exp_()
    if g.topp_rows is not None:
        sub = e.index_select(0, g.topp_rows)
        probs = sub / sub.sum(dim=-1, keepdim=True)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p, always at least the first token (a
        # top_p below fp32's range compares as 0 against the fp32 masses).
        drop = (cum - sorted_probs) >= top_p.index_select(0, g.topp_rows)[:, None]
        drop[:, 0] = False
        e.index_copy_(0, g.topp_rows, sub.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), 0.0))
    if g.min_p:
        # e is p / max(p) (the maximum weighs 1, and top-p always keeps it).
        e.masked_fill_(e < min_p[:, None], 0.0)
    return e


def _draw(e: torch.Tensor, g: _Group) -> torch.Tensor:
    """One token per row of weights `e` by inverse CDF with the group's uniforms (module doc)."""
    cum = torch.cumsum(e, dim=-1, dtype=torch.float64)
    target = g.params[4].to(cum.device) * cum[:, -1]
    return torch.searchsorted(cum, target[:, None], right=True)[:, 0].clamp_(max=e.shape[1] - 1)


# -- API ------------------------------------------------------------------------------------------


@torch.inference_mode()
def process_logits(logits: torch.Tensor, seqs: list[Sequence], upload: Upload | None = None) -> torch.Tensor:
    """logits: [N, V], row i for seqs[i] -> the logits after logit_bias, the min_tokens mask and
    the penalties (module doc): a new tensor when any row has one this step, else `logits`
    itself (the input is left as it was)."""
    plan = _Plan()
    _plan_controls(plan, seqs, logits.shape[1])
    plan.upload(upload, logits.device)
    if not plan.has_controls:
        return logits
    with _controlled(logits, plan) as x:
        return x.clone()


@torch.inference_mode()
def sample_tokens(logits: torch.Tensor, seqs: list[Sequence],
                  upload: Upload | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, V] fp32, row i for seqs[i] (a response_format mask already applied) -> (the
    next token of every row, int64 [N]; whether the row could be sampled, bool [N]), both on the
    logits' device (the caller copies them to the host once). A row that could not be sampled
    (its maximum is not finite after the controls) holds its argmax. `upload` moves the step's
    host-built tensors to the device in one transfer (default: one `.to` each). The controls are
    written into `logits` and undone before it returns (also when it raises), so the caller sees
    them unchanged. Raises only for a fault in building the step's parameters (a logit_bias id
    outside the vocabulary)."""
    plan = _plan(seqs, logits, upload)
    with _controlled(logits, plan) as x:
        # max(dim).indices is argmax (first index of the maximum) and cheaper than torch.argmax
        # on CPU over a large vocabulary (bench/RESULTS.md).
        best = x.max(dim=-1)
        tokens, ok = best.indices, torch.isfinite(best.values)
        for g in plan.groups:
            drawn = _draw(_weights(x, best.values, g), g)
            if g.rows is None:
                tokens = torch.where(ok, drawn, tokens)
            else:
                tokens = tokens.index_copy(0, g.rows, torch.where(ok.index_select(0, g.rows), drawn,
                                                                  tokens.index_select(0, g.rows)))
    return tokens, ok


def sample(logits: torch.Tensor, seqs: list[Sequence],
           errors: dict[int, Exception] | None = None) -> list[int | None]:
    """`sample_tokens` as a host list. A row that could not be sampled raises SamplingError; with
    `errors`, it is None instead, its exception goes to errors[i], and the other rows are
    sampled as usual."""
    tokens, ok = sample_tokens(logits, seqs)
    out: list[int | None] = tokens.tolist()
    for i, good in enumerate(ok.tolist()):
        if not good:
            e = SamplingError("no token can be sampled: the row's logits are not finite, or every token is masked")
            if errors is None:
                raise e
            errors[i] = e
            out[i] = None
    return out


@torch.inference_mode()
def probabilities(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The distribution each row's next token is drawn from, [N, V] float64: after the controls,
    temperature, top-k, top-p and min-p (a greedy row: all mass on its argmax). For tests and
    tools: the engine samples with `sample_tokens`, which computes the same weights."""
    plan = _plan(seqs, logits, None)
    with _controlled(logits, plan) as x:
        best = x.max(dim=-1)
        probs = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        probs.scatter_(1, best.indices[:, None], 1.0)
        for g in plan.groups:
            e = _weights(x, best.values, g).double()
            e = e / e.sum(dim=-1, keepdim=True)
            if g.rows is None:
                probs = e
            else:
                probs.index_copy_(0, g.rows, e)
    return probs
