"""One step's execution: SchedulerOutput -> StepResult (engine.backends.step_sampling).

    result = executor.execute(sched)
    # forward: lora = lora_manager.batch_for(sched); logits, seqs = runner.execute(sched, lora)
    # sample:  the backend's pipeline (Backend.step_sampler): tokens, logprobs, failed rows

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

import torch

from engine.backends.step_sampling import RowFailure, StepResult
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence

log = logging.getLogger(__name__)


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
        """The forward of `sched` (traced to its requests if it raises), then sampling. Raises
        only for a forward fault no group of the step escapes (module docstring)."""
        forward_failures: list[RowFailure] = []
        try:
            logits, seqs = self._forward(sched)
            ran = sched
        except Exception as e:  # noqa: BLE001 - traced to its requests, or re-raised
            logits, seqs, ran = self._forward_isolating(sched, e, forward_failures)
        result = self.sampler.sample(logits, seqs, self.structured) if seqs else StepResult()
        result.ran, result.forward_failures = ran, forward_failures
        return result

    def _forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        lora = self.lora_manager.batch_for(sched) if self.lora_manager is not None else None
        return self.runner.execute(sched, lora)

    def _forward_isolating(self, sched: SchedulerOutput, error: Exception, failures: list[RowFailure]
                           ) -> tuple[torch.Tensor, list[Sequence], SchedulerOutput]:
        """The batched forward of `sched` raised `error`: run its work again per adapter version,
        then each group that still raises per sequence. Sequences that still raise on their own
        go to `failures`. Returns the logits and sampled sequences of the groups that ran, and
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
                ran.append(self._forward(sub))
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
