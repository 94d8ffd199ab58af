"""A step's sampling, from the forward's logits to the host: the result type the engine applies,
and the two pipelines a backend chooses between (`Backend.step_sampler`).

    result = backend.step_sampler().sample(logits, seqs, structured)   # a StepResult

- `HostSampling` (logits on the host: the CPU backend, Triton under the interpreter): one row
  sum finds rows that are not finite (checked exactly, then dropped), logprobs of the raw
  logits, the response_format mask, `engine.sampler.sample` (row by row where the batch raises).
- `DeviceSampling` (logits on an accelerator): rows that are not finite are zeroed before
  sampling (a NaN probability would stop the device, not just raise), the mask, the controls and
  the draw on the device (`sample_tokens`; its host-built parameters in one upload), then the
  tokens, the finite and sampled flags and the logprobs come back in ONE device-to-host copy.

Both also split in two (`launch` -> `SampledStep`, then its `result()`), for an engine that
overlaps steps: `launch` enqueues the sampling and starts the copy without waiting for it, and
its `tokens` (on the logits' device) are what the next step's decode rows read as their inputs
before the host has them; `result()` waits for the copy. `sample` is the two at once.

Neither fails a request itself: every row that cannot go on becomes a `RowFailure` (why, in the
order found), and the engine applies them all in one place (LLMEngine._apply_failure), so
fault isolation is the same whichever pipeline ran. Logprobs come from the RAW logits, before
any control or mask (engine.logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from engine import logprobs as engine_logprobs
from engine.sampler import SamplingError, sample, sample_tokens
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.scheduler import SchedulerOutput
    from engine.structured_output import StructuredOutput

Upload = Callable[[list[torch.Tensor]], list[torch.Tensor]]
ToHost = Callable[[torch.Tensor], list]
#: Starts one device-to-host copy of a small tensor and returns what waits for it (-> a list).
StartToHost = Callable[[torch.Tensor], Callable[[], list]]


@dataclass
class RowFailure:
    """A sequence that cannot go on after this step's forward or sampling, and why."""

    seq: Sequence
    #: "forward" (its part of the batched forward raised on its own), "non_finite" (its logits
    #: row was not finite), "sampling" (its sampling raised or had nothing to draw), "grammar"
    #: (its response_format grammar cannot go on: the client's error, not a fault).
    kind: str
    error: Exception | None = None
    #: "forward" only: every request of its adapter version failed while another group ran.
    adapter_at_fault: bool = False


@dataclass
class StepResult:
    """What one step's execution produced, for the engine to apply (LLMEngine._update)."""

    #: The scheduled work whose forward ran: the step's SchedulerOutput itself, or (after the
    #: forward was isolated) a new one without `forward_failures`' sequences.
    ran: SchedulerOutput | None = None
    #: Scheduled sequences whose forward raised on their own; nothing of theirs ran.
    forward_failures: list[RowFailure] = field(default_factory=list)
    #: The sequences that sampled, and each one's token (None: it failed, see `failures`).
    seqs: list[Sequence] = field(default_factory=list)
    tokens: list[int | None] = field(default_factory=list)
    #: Rows that failed in sampling (non-finite, sampling, grammar), in the order found.
    failures: list[RowFailure] = field(default_factory=list)
    #: Row index into `seqs` -> its RequestOutput.logprobs entry (rows that asked and got a token).
    logprobs: dict[int, dict] = field(default_factory=dict)


class SampledStep:
    """A step's sampling, enqueued: `tokens` int64 [len(seqs)] on the logits' device, row i the
    token drawn for seqs[i] (any value for a row that fails: the engine discards that row's next
    step); `result()` waits for the host's copy and gives the StepResult (once; memoized)."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, finish: Callable[[], StepResult]):
        self.seqs = seqs
        self.tokens = tokens
        self._finish: Callable[[], StepResult] | None = finish
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result


def _constrain(logits: torch.Tensor, seqs: list[Sequence], structured: StructuredOutput,
               failures: list[RowFailure]) -> torch.Tensor:
    """The logits to sample from: the rows of requests with a response_format masked to the
    tokens their grammar allows (a copy; `logits` stays raw), the others as they are. A row
    whose grammar cannot go on is a "grammar" failure (its row is sampled, then dropped)."""
    if not structured.active:
        return logits
    masked, refused = structured.constrain(logits, [q.request_id for q in seqs])
    failures.extend(RowFailure(seqs[i], "grammar", e) for i, e in refused.items())
    return masked


class HostSampling:
    """Sampling where the logits are host tensors (module docstring)."""

    def launch(self, logits: torch.Tensor, seqs: list[Sequence], structured: StructuredOutput) -> SampledStep:
        """`sample` now (the host has nothing to overlap with), as a SampledStep over every row
        of `seqs` (a failed row's token 0)."""
        result = self.sample(logits, seqs, structured)
        drawn = {id(q): t for q, t in zip(result.seqs, result.tokens)}
        tokens = torch.tensor([drawn.get(id(q)) or 0 for q in seqs], dtype=torch.int64)
        return SampledStep(seqs, tokens, lambda: result)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], structured: StructuredOutput) -> StepResult:
        result = StepResult()
        # A row's sum is finite exactly when every logit is (NaN and inf propagate; finite
        # logits never come near fp32's range), and one sum per row is far cheaper than an
        # elementwise isfinite over the whole vocabulary. Flagged rows are checked exactly.
        if seqs and not bool(torch.isfinite(logits.sum(dim=1)).all()):
            ok = torch.isfinite(logits).all(dim=1)
            keep = ok.tolist()
            result.failures.extend(RowFailure(q, "non_finite") for q, good in zip(seqs, keep) if not good)
            logits, seqs = logits[ok], [q for q, good in zip(seqs, keep) if good]
        result.seqs = seqs
        if not seqs:
            return result
        lp = engine_logprobs.compute(logits, seqs)  # raw logits, before sampling
        result.tokens = self._sample(_constrain(logits, seqs, structured, result.failures), seqs, result.failures)
        if lp is not None:
            sampled = torch.tensor([t or 0 for t in result.tokens], dtype=torch.int64)
            result.logprobs = engine_logprobs.entries(lp, result.tokens,
                                                      engine_logprobs.gather(lp, sampled).tolist())
        return result

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: list[Sequence], failures: list[RowFailure]) -> list[int | None]:
        """One token per sequence; a sequence whose sampling raises is a "sampling" failure (its
        token None). Should sample() raise as a whole, each sequence is sampled on its own."""
        errors: dict[int, Exception] = {}
        try:
            tokens = sample(logits, seqs, errors)
        except Exception:  # noqa: BLE001 - per sequence below
            errors.clear()
            tokens = []
            for i, seq in enumerate(seqs):
                try:
                    tokens.append(sample(logits[i:i + 1], [seq])[0])
                except Exception as e:  # noqa: BLE001 - fails only this request
                    errors[i] = e
                    tokens.append(None)
        failures.extend(RowFailure(seqs[i], "sampling", e) for i, e in errors.items())
        return tokens


class DeviceSampling:
    """Sampling where the logits live off the host (module docstring). `upload`: host tensors to
    the device in one transfer; `to_host`: one device-to-host copy (Backend.upload, to_host);
    `start_to_host`: the same copy started without waiting (Backend.start_to_host; None: the
    copy is made when the result is asked for)."""

    def __init__(self, upload: Upload, to_host: ToHost, start_to_host: StartToHost | None = None):
        self.upload = upload
        self.to_host = to_host
        self.start_to_host = start_to_host or (lambda t: lambda: to_host(t))

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], structured: StructuredOutput) -> StepResult:
        if not seqs:
            return StepResult()
        return self.launch(logits, seqs, structured).result()

    def launch(self, logits: torch.Tensor, seqs: list[Sequence], structured: StructuredOutput) -> SampledStep:
        """Everything on the device, the one copy to the host started; `result()` waits for it."""
        result = StepResult(seqs=seqs)
        # Logprobs from the raw logits, before the sampling path scales or masks them.
        lp = engine_logprobs.compute(logits, seqs)
        finite = torch.isfinite(logits.sum(dim=1))
        safe = torch.where(finite[:, None], logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
        safe = _constrain(safe, seqs, structured, result.failures)
        errors: dict[int, Exception] = {}
        try:
            tokens_dev, sampled = sample_tokens(safe, seqs, self.upload)
        except Exception:  # noqa: BLE001 - each row on its own below
            tokens_dev, sampled = self._sample_rows_alone(safe, seqs, errors)
        n = len(seqs)
        packed = torch.cat([tokens_dev, finite.to(torch.int64), sampled.to(torch.int64)])
        if lp is not None:  # float64 holds token ids exactly
            packed = torch.cat([packed.double(), engine_logprobs.gather(lp, tokens_dev)])
        wait = self.start_to_host(packed)

        def finish() -> StepResult:
            host = wait()
            tokens: list[int | None] = [int(t) for t in host[:n]]
            for i, (seq, ok, drawn) in enumerate(zip(seqs, host[n:2 * n], host[2 * n:3 * n])):
                if not ok:
                    result.failures.append(RowFailure(seq, "non_finite"))
                    tokens[i] = None
                elif not drawn:
                    result.failures.append(RowFailure(seq, "sampling", errors.get(i) or SamplingError(
                        "no token can be sampled: every token is masked")))
                    tokens[i] = None
            result.tokens = tokens
            if lp is not None:
                result.logprobs = engine_logprobs.entries(lp, tokens, host[3 * n:])
            return result

        return SampledStep(seqs, tokens_dev.to(torch.int64), finish)

    def _sample_rows_alone(self, logits: torch.Tensor, seqs: list[Sequence],
                           errors: dict[int, Exception]) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample_tokens` row by row, after it raised for the batch: a row that raises keeps its
        argmax, is flagged not sampled, and its exception goes to errors[i]."""
        tokens, sampled = [], []
        for i, seq in enumerate(seqs):
            try:
                t, ok = sample_tokens(logits[i:i + 1], [seq], self.upload)
            except Exception as e:  # noqa: BLE001 - fails only this request
                errors[i] = e
                t, ok = logits[i:i + 1].max(dim=-1).indices, torch.zeros(1, dtype=torch.bool, device=logits.device)
            tokens.append(t)
            sampled.append(ok)
        return torch.cat(tokens), torch.cat(sampled)
