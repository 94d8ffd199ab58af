"""One step's execution: SchedulerOutput -> StepResult (engine.backends.step_sampling).

    fwd = executor.forward(sched, pending)   # the forward enqueued: a Forward (logits, what ran)
    step = executor.sample(fwd)              # sampling enqueued: a LaunchedStep
    result = step.result()                   # waits for its one copy to the host: a StepResult
    # forward: lora = lora_manager.batch_for(sched); logits, seqs = runner.execute(sched, lora, pending)
    # sample:  the backend's pipeline (Backend.step_sampler): tokens, logprobs, failed rows

`pending` is the step launched before, whose results the host does not have yet (an overlapped
engine, engine.llm_engine): its sampled tokens on the device are the inputs of this step's decode
rows that sampled there (engine.model_runner.PendingTokens). The two halves are apart so that
the engine can apply that step between them when this one's sampling reads what it changes (a
response_format grammar, penalty counts): the forward does not. `launch` is forward + sample,
`execute(sched)` launch + result.

Fault tracing of the forward lives here: when the batched forward (or giving adapters their
slots) raises, the step's work runs again in smaller groups, per adapter version (the base model
is one group), then each group that still raises per sequence. Re-running writes the same K/V to
the same slots (each token's slot is fixed by its sequence's block table and position, and
attention writes a layer's K/V before it reads them), so it is idempotent. Sequences that still
raise on their own become "forward" failures (a version all of whose sequences failed while
another group ran is marked at fault); if no group ran the first exception propagates.
Nothing here fails a request or touches the scheduler's output: the engine applies the result
(LLMEngine._update), failures included.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.backends.step_sampling import RowFailure, SampledStep, StepResult
from engine.model_runner import PendingTokens
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class Forward:
    """A step's forward, run or enqueued: the logits [N, V] of `seqs` (the sequences that
    sample, in row order; None when none does), `ran` (the SchedulerOutput of what ran) and the
    sequences whose forward raised on their own."""

    logits: torch.Tensor | None
    seqs: list[Sequence]
    ran: SchedulerOutput
    forward_failures: list[RowFailure]


class LaunchedStep:
    """A step whose forward ran (or was enqueued) and whose sampling is enqueued: `ran` (the
    SchedulerOutput of what ran), `forward_failures`, `seqs` (the sequences that sample, in
    their tokens' row order); `result()` the StepResult (waits for the host copy, once)."""

    def __init__(self, ran: SchedulerOutput, forward_failures: list[RowFailure], sampled: SampledStep | None):
        self.ran = ran
        self.forward_failures = forward_failures
        self.sampled = sampled
        self.seqs: list[Sequence] = sampled.seqs if sampled is not None else []

    def pending_tokens(self) -> PendingTokens | None:
        """Its sampled tokens as the next step's inputs (None: nothing sampled)."""
        if self.sampled is None:
            return None
        return PendingTokens(self.sampled.tokens, {q.seq_id: i for i, q in enumerate(self.seqs)})

    def result(self) -> StepResult:
        result = self.sampled.result() if self.sampled is not None else StepResult()
        result.ran, result.forward_failures = self.ran, self.forward_failures
        return result


class StepExecutor:
    """Runs steps through `runner` (engine.model_runner.ModelRunner) with `lora_manager`'s
    batches (None: no adapters) and samples with `sampler` (the backend's step_sampler());
    `structured`: the engine's StructuredOutput (response_format masks)."""

    def __init__(self, runner, lora_manager, sampler, structured):
        self.runner = runner
        self.lora_manager = lora_manager
        self.sampler = sampler
        self.structured = structured

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """`launch(sched)`, then its result."""
        return self.launch(sched).result()

    def launch(self, sched: SchedulerOutput, pending: LaunchedStep | None = None) -> LaunchedStep:
        """`forward`, then `sample`."""
        return self.sample(self.forward(sched, pending))

    def forward(self, sched: SchedulerOutput, pending: LaunchedStep | None = None) -> Forward:
        """The forward of `sched` (traced to its requests if it raises), enqueued. `pending`: the
        step launched before whose tokens are still on the device (module docstring). Raises
        only for a forward fault no group of the step escapes."""
        forward_failures: list[RowFailure] = []
        tokens = pending.pending_tokens() if pending is not None else None
        try:
            logits, seqs = self._forward(sched, tokens)
            ran = sched
        except Exception as e:  # noqa: BLE001 - traced to its requests, or re-raised
            logits, seqs, ran = self._forward_isolating(sched, e, forward_failures, tokens)
        return Forward(logits, seqs, ran, forward_failures)

    def sample(self, fwd: Forward) -> LaunchedStep:
        """The backend's sampling of a forward's logits, enqueued."""
        sampled = self.sampler.launch(fwd.logits, fwd.seqs, self.structured) if fwd.seqs else None
        return LaunchedStep(fwd.ran, fwd.forward_failures, sampled)

    def _forward(self, sched: SchedulerOutput, pending: PendingTokens | None) -> tuple[torch.Tensor, list[Sequence]]:
        lora = self.lora_manager.batch_for(sched) if self.lora_manager is not None else None
        if pending is None:
            return self.runner.execute(sched, lora)
        return self.runner.execute(sched, lora, pending)

    def _forward_isolating(self, sched: SchedulerOutput, error: Exception, failures: list[RowFailure],
                           tokens: PendingTokens | None) -> tuple[torch.Tensor, list[Sequence], SchedulerOutput]:
        """The batched forward of `sched` raised `error`: run its work again per adapter version,
        then each group that still raises per sequence (`tokens`: the step before's, as for the
        batch). Sequences that still raise on their own go to `failures`. Returns the logits and sampled sequences of the groups that ran, and
        a new SchedulerOutput of what ran; re-raises `error` if nothing did."""
        order = sched.decodes + sched.prefills
        groups: dict[str | None, list[ScheduledSequence]] = {}
        for s in order:
            groups.setdefault(s.seq.adapter, []).append(s)
        pending = list(groups.values()) if len(groups) > 1 else [[s] for s in order]
        ran: list[tuple[torch.Tensor, list[Sequence]]] = []
        failed: list[tuple[ScheduledSequence, Exception]] = []
        while pending:
            group = pending.pop(0)
            ids = {id(s) for s in group}
            sub = SchedulerOutput(decodes=[s for s in sched.decodes if id(s) in ids],
                                  prefills=[s for s in sched.prefills if id(s) in ids])
            try:
                ran.append(self._forward(sub, tokens))
            except Exception as e:  # noqa: BLE001 - narrowed down below, or reported
                if len(group) > 1:
                    pending.extend([s] for s in group)
                else:
                    failed.append((group[0], e))
        if not ran:
            raise error
        log.warning("a step's forward raised %s: %d of %d sequences failed on their own",
                    f"{type(error).__name__}: {error}", len(failed), len(order), exc_info=error)
        faulty = {v for v, members in groups.items() if v is not None
                  and all(any(m is f for f, _ in failed) for m in members)}
        failures.extend(RowFailure(s.seq, "forward", e, adapter_at_fault=s.seq.adapter in faulty) for s, e in failed)
        gone = {id(s) for s, _ in failed}
        what_ran = SchedulerOutput(decodes=[s for s in sched.decodes if id(s) not in gone],
                                   prefills=[s for s in sched.prefills if id(s) not in gone],
                                   preempted=list(sched.preempted))
        seqs = [q for _, sq in ran for q in sq]
        logits = torch.cat([lg for lg, _ in ran]) if seqs else None
        return logits, seqs, what_ran
