"""The synchronous engine: add requests, step, abort. One step reads:

    sched = scheduler.schedule()                  # what runs (never modified after)
    step = executor.launch(sched, pending)        # forward + the backend's sampling, enqueued
                                                  # (apart when the sampling needs `pending` applied)
    self._advance(step)                           # computed counts; a placeholder per sampled token
    outputs = self._update(pending or step)       # wait for its tokens: commit, fail, append, deltas

Overlapped steps (EngineConfig.overlap_steps, on by default where the device runs the steps
asynchronously: CUDA): the step launched last is resolved one call later, after the next one is
launched, so the host's work of a step (applying the results, scheduling, building and
uploading the inputs) runs while the device computes the one before. Step N+1 is scheduled
before step N's tokens reach the host: each sequence that sampled in N holds a placeholder
(Sequence.num_pending), its decode row in N+1 reads the token from N's tokens on the device
(engine.model_runner.PendingTokens), and counts that a step depends on include the pending
tokens (the seed's draw index, min_tokens; max_tokens: a sequence whose last token is pending
is not scheduled). A sequence that ends at N (end of sequence, a stop, a fault, an abort) has
had one more token computed in N+1; that row is dropped when N+1 is applied (its KV blocks were
freed when it finished: every later use of them is ordered after N+1 on the device). A step
whose sequences need their tokens on the host before they can sample again (a response_format
grammar, penalties over the completion so far) is applied after the next one's forward is
launched and before its sampling is, so the device computes that forward meanwhile. Off
(the CPU backend: its steps run while they are called, nothing would overlap), each step is
launched and resolved in the same call, through the same code.

The device-dependent part of a step (input form, upload, graphs, host or device sampling) is the
backend's (engine.backends.base.Backend, engine.step_executor); this module has no device branch.
Construction (loading the model, sizing the KV cache, capturing decode graphs, the start-up
warm-up that compiles every kernel variant) is engine.engine_builder's: the engine keeps the
parts it returns and holds the per-request state, none of which the warm-up touched.

Failure model of a step: what can be traced to one request or one adapter version fails only
those requests (finish_reason "error", a message, KV blocks zeroed and freed), and a version at
fault is quarantined (LoRAManager.mark_failed). Faults are found where they happen and reported
as the StepResult's RowFailures; `_apply_failure` is the one place they fail requests:
- logits rows that are not finite (one vectorized check per step) fail their sequences;
- an exception in sampling a row fails that sequence (engine.backends.step_sampling);
- an exception in per-sequence output work (detokenizing, stop checks) fails that sequence;
- an exception in the batched forward (or in giving adapters their slots) is traced by running
  the step's work again in smaller groups, per adapter version, then per sequence
  (engine.step_executor): only the groups that still raise fail; if none of them succeeds the
  fault is not attributable and the exception propagates (AsyncLLMEngine then resets the
  engine, `reset`).
A row of a sequence that had already finished (an overlapped step's extra row) fails nothing.
The happy path pays one try block and one row-sum over the logits.

The async API (engine.async_engine) drives `step()` from a background thread.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from engine import metrics as engine_metrics
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.durations import Durations
from engine.engine_builder import build_engine_parts
from engine.backends.step_sampling import RowFailure
from engine.output_processor import OutputProcessor
from engine.request_checks import check_logit_bias, check_prompt
from engine.sampling_params import GenerationRequest, InvalidRequestError, Priority, RequestOutput
from engine.scheduler import Scheduler, SchedulerOutput, check_tenant_weight
from engine.step_executor import LaunchedStep, StepExecutor
from engine.sequence import Sequence, SequenceStatus
from engine.structured_output import GrammarRejected, StructuredOutput
from engine.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

NON_FINITE_MESSAGE = "the model produced non-finite values for this request"
#: How long a step loop waits after a stalled step (`LLMEngine.stalled`) before stepping again,
#: unless woken sooner (a new command, an adapter load ending).
STALL_WAIT_S = 0.01


class LLMEngine:
    def __init__(self, model_path: str | Path | None = None, config: EngineConfig | None = None, *,
                 checkpoint=None, tokenizer: TextTokenizer | None = None, adapter_source=None,
                 model_name: str | None = None):
        """Load a GGUF file or HF safetensors directory (default: the embedded SmolLM2 GGUF),
        served as `model_name` (None: the checkpoint's own name, engine.loader.read_model_config).

        `checkpoint` may pass an already loaded (ModelConfig, tensors, metadata) triple.
        `adapter_source` (an engine.lora.source.AdapterSource) enables LoRA adapters: requests
        then name an adapter version id in GenerationRequest.adapter.
        Loading, the KV cache's size and the decode graphs are engine.engine_builder's; the engine
        builds its per-request state over the parts it returns.
        """
        self.config = config or EngineConfig()
        ec = self.config
        parts = build_engine_parts(ec, model_path=model_path, checkpoint=checkpoint, tokenizer=tokenizer,
                                   adapter_source=adapter_source, model_name=model_name)
        #: What the engine runs on, built once (engine.engine_builder); `reset()` keeps them.
        self.model_config: ModelConfig = parts.model_config
        self.tokenizer = parts.tokenizer
        self.backend = parts.backend
        self.device = self.backend.device
        self.weight_format = self.backend.weight_format()
        self.model = parts.model
        #: What the backend measured or chose at start (CPU: the weight formats' crossovers).
        self.format_timings: dict = parts.format_timings
        self.startup_warmup: dict | None = parts.warmup  # engine_builder.warm_up's figures, if it ran
        self.lora_manager = parts.lora_manager
        self.kv = parts.kv
        self.runner = parts.runner
        #: The longest sequence served: the config's, the model's and the KV cache's bound.
        self.max_model_len = parts.max_model_len
        # -- the per-request state over them --
        self.block_manager = BlockManager(parts.num_kv_blocks, ec.block_size,
                                          enable_prefix_caching=ec.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_batched_tokens=ec.max_num_batched_tokens,
                                   max_num_seqs=ec.max_num_seqs, aging_seconds=ec.aging_seconds,
                                   max_loras=ec.max_loras, adapter_ready=self._adapter_ready,
                                   big_request_fraction=ec.big_request_kv_fraction)
        # Every end-of-turn id the checkpoint states: config.json / GGUF, the tokenizer's eos and
        # generation_config.json's list (Llama 3.1: <|end_of_text|>, <|eom_id|>, <|eot_id|>).
        model_cfg, tokenizer = parts.model_config, parts.tokenizer
        self.eos_token_ids = set(model_cfg.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()))
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        #: response_format grammars: the compile cache and the constrained requests' matchers.
        self.structured = StructuredOutput(tokenizer, model_cfg.vocab_size, self.eos_token_ids)
        #: SchedulerOutput -> StepResult: the forward (fault-traced) and the backend's sampling.
        self.executor = StepExecutor(self.runner, self.lora_manager, self.backend.step_sampler(), self.structured)
        self.requests: dict[str, Sequence] = {}
        #: Detokenizing, end conditions, stop strings and deltas (with their logprobs).
        self.output = OutputProcessor(self.eos_token_ids, self.max_model_len)
        #: Whether a step is resolved one call after it was launched (module docstring).
        self.overlap_steps: bool = ec.overlap_steps if ec.overlap_steps is not None else self.device.type == "cuda"
        #: The step launched and not yet applied (overlapped steps only), and when it started.
        self._inflight: tuple[LaunchedStep, float] | None = None
        #: Whether the last step ran nothing and produced nothing (see `step`).
        self.stalled = False
        self.stats = {"steps": 0, "preemptions": 0, "last_step_s": 0.0, "last_batch_tokens": 0,
                      "overlapped_steps": 0}
        #: How long finished requests held a seat (first scheduled to finished, however they
        #: ended): an engine worker publishes the recent mean for routing.
        self.seat_times = Durations(alpha=0.02)  # seat times vary widely: a mean over ~50 requests
        engine_metrics.track(self)  # queue, KV cache and adapter state, read at scrape time

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request: GenerationRequest) -> Sequence:
        """Validate and queue a request; raises InvalidRequestError (nothing is queued then)."""
        if not request.request_id:
            raise InvalidRequestError("request_id is required", "request_id")
        if request.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request_id {request.request_id!r}", "request_id")
        if request.prompt_token_ids is not None:
            ids, vocab = list(request.prompt_token_ids), self.model_config.vocab_size
        elif request.prompt is not None:
            if not isinstance(request.prompt, str):
                raise InvalidRequestError("prompt must be a string", "prompt")
            ids, vocab = self.tokenizer.encode(request.prompt), None
        else:
            raise InvalidRequestError("prompt is required", "prompt")
        params = request.params
        # AsyncLLMEngine compiles off the step thread and passes the grammar; a direct caller of
        # this synchronous API compiles here (InvalidRequestError when it cannot be compiled).
        grammar = None if params.response_format is None else (
            request.grammar or self.structured.compile(params.response_format))
        check_prompt(ids, max_model_len=self.max_model_len, max_tokens=params.max_tokens, vocab_size=vocab)
        check_logit_bias(params.logit_bias, self.model_config.vocab_size)
        priority = Priority.parse(request.priority)
        if request.adapter is not None and self.lora_manager is None:
            raise InvalidRequestError("this engine serves no adapters", "model")
        seq = Sequence(request.request_id, ids, params, IncrementalDetokenizer(self.tokenizer),
                       tenant_id=request.tenant_id, priority=priority, adapter=request.adapter,
                       cache_salt=request.cache_salt, eos_token_ids=self.eos_token_ids,
                       tenant_weight=check_tenant_weight(request.tenant_weight))
        if request.adapter is not None:
            seq.adapter_cold = self.lora_manager.request_adapter(seq.adapter)  # prefetch while it waits
        self.requests[seq.request_id] = seq
        if grammar is not None:
            self.structured.start(seq.request_id, grammar)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now: its KV blocks and its seat (running or waiting) are freed before
        the next step. Returns its final output (finish_reason "abort"; `computed_prompt_tokens`
        says how far its prefill got, 0 if it was never scheduled), None if it is unknown or
        already finished."""
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return None
        return self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def reset(self) -> list[str]:
        """Drop every request and return their ids: the scheduler's queues, every KV block (the
        cache is zeroed: a dead step may have left non-finite values in it), the LoRA manager's
        request references and slot assignments. The model weights, the KV tensors, the CPU
        adapter tier and the quarantines stay. Called by AsyncLLMEngine after its step loop died,
        on the loop's thread; the engine then serves new requests as if just started."""
        dropped = list(self.requests)
        self._inflight = None  # its rows are the dropped requests'; later work is ordered after it
        for seq in self.requests.values():
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        self.requests.clear()
        self.output.clear()
        self.structured.clear()
        self.scheduler.reset()
        if self.lora_manager is not None:
            self.lora_manager.reset()
        self.runner.clear_cache()
        return dropped

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step: schedule -> launch -> apply (the step launched before, when
        steps overlap; else this one). Returns the deltas it produced (finished ones included).
        Raises only for a fault no request or adapter could be blamed for (module docstring)."""
        t0 = time.perf_counter()
        outputs = self._fail_broken_adapters()
        inflight, self._inflight = self._inflight, None
        overlapped = inflight is not None
        sched = self._schedule()
        if not sched.is_empty:
            fwd = self.executor.forward(sched, inflight[0] if inflight is not None else None)
            if inflight is not None and self._needs_tokens(fwd.seqs):
                outputs += self._update(*inflight)  # while the device runs this step's forward
                inflight = None
            launched = self.executor.sample(fwd)
            self._advance(launched)
            if self.overlap_steps:
                self._inflight = (launched, t0)
                self.stats["overlapped_steps"] += overlapped
            else:
                outputs += self._update(launched, t0)
        if inflight is not None:
            outputs += self._update(*inflight)
        # Nothing ran and nothing came out: every unfinished request waits (for its adapter's load,
        # for room in the cache); a loop stepping again at once would only spin.
        self.stalled = sched.is_empty and not overlapped and not outputs
        return outputs

    def _needs_tokens(self, seqs: list[Sequence]) -> bool:
        """Whether one of `seqs`, about to sample, needs its pending token on the host first: a
        response_format grammar advances with it, penalties count it."""
        return any(q.num_pending and (q.token_counts is not None or self.structured.constrains(q.request_id))
                   for q in seqs)

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        self.stats["preemptions"] += len(sched.preempted)
        if sched.preempted:
            engine_metrics.PREEMPTIONS.inc(len(sched.preempted))
        return sched

    @staticmethod
    def _advance(step: LaunchedStep) -> None:
        """What `step` computes counts as computed from its launch on (the next step is scheduled
        after it), and each token it samples holds a placeholder until `_update` has it."""
        for s in step.ran.scheduled:
            s.seq.num_computed_tokens += s.num_tokens
        for q in step.seqs:
            q.add_pending()

    def _update(self, step: LaunchedStep, t0: float) -> list[RequestOutput]:
        """Apply a launched step's result (waiting for it): fail the sequences whose forward
        raised on its own, commit the computed blocks, fail the rows that could not be sampled,
        append the tokens (deltas, stop checks, finishes), and record the step. Rows of sequences
        finished since the launch are dropped. The SchedulerOutput is only read."""
        result = step.result()
        live = [f for f in result.forward_failures if not f.seq.is_finished]
        outputs = [self._apply_failure(f) for f in live]
        ran = result.ran
        for s in ran.scheduled:
            if not s.seq.is_finished:
                self.block_manager.commit(s.seq)  # its full blocks become prefix-cache hits
        if ran.prefills:  # each request's prefill chunks, for its trace (Sequence.timings)
            end = time.monotonic()
            start = end - (time.perf_counter() - t0)
            for s in ran.prefills:
                s.seq.prefill_chunks.append((start, end, s.num_tokens))
        outputs.extend(self._apply_failure(f) for f in result.failures if not f.seq.is_finished)
        for row, entry in result.logprobs.items():  # kept until the delta with their tokens
            if not result.seqs[row].is_finished:
                self.output.keep_logprobs(result.seqs[row], entry)
        outputs.extend(self._postprocess(result.seqs, result.tokens))
        self.stats["steps"] += 1
        self.stats["last_step_s"] = time.perf_counter() - t0
        self.stats["last_batch_tokens"] = ran.num_tokens
        engine_metrics.observe_step(self.stats["last_step_s"], ran)
        return outputs

    def _apply_failure(self, f: RowFailure) -> RequestOutput:
        """Finish the sequence of a failed row as its kind says (the one place a step's faults
        fail requests; per-sequence output work fails in `_postprocess`)."""
        if f.kind == "grammar":
            return self._refuse_grammar(f.seq, f.error)
        if f.kind == "non_finite":
            return self._fail_non_finite_seq(f.seq)
        if f.kind == "sampling":
            return self._fail_sampling(f.seq, f.error)
        name = type(f.error).__name__
        cause = f"the engine failed on a request using it ({name})" if f.adapter_at_fault else None
        return self._fail(f.seq, f"the engine failed on this request ({name})", "exception", adapter_cause=cause)

    def _fail_non_finite_seq(self, seq: Sequence) -> RequestOutput:
        """Fail `seq` whose logits were not finite; its adapter version is quarantined."""
        return self._fail(seq, NON_FINITE_MESSAGE, "non_finite",
                          adapter_cause="the model produced non-finite values with it")

    def _fail_sampling(self, seq: Sequence, error: Exception) -> RequestOutput:
        """Fail `seq` whose sampling raised `error`."""
        log.warning("sampling failed for request %s", seq.request_id, exc_info=error)
        return self._fail(seq, f"sampling failed for this request ({type(error).__name__})", "exception")

    def _fail(self, seq: Sequence, reason: str, kind: str, *, adapter_cause: str | None = None) -> RequestOutput:
        """Finish `seq` with finish_reason "error" and `reason` after a fault in a step (`kind`
        labels the metric): the KV blocks it alone holds are zeroed (they may hold non-finite
        values) and dropped from the prefix cache, and every block it holds is released.
        With `adapter_cause` and an adapter, the version is quarantined for that cause (the
        requests naming it fail at the next step's start) and the output names it."""
        engine_metrics.REQUEST_FAULTS.labels(kind).inc()
        self.runner.clear_blocks(self.block_manager.discard(seq))
        version = seq.adapter if adapter_cause is not None and self.lora_manager is not None else None
        if version is not None:
            reason = f"{reason}; adapter version {version} is quarantined"
            self.lora_manager.mark_failed(version, f"adapter version {version} is quarantined: {adapter_cause}")
        log.warning("request %s failed: %s", seq.request_id, reason)
        out = self._finish(seq, "error", error=reason)
        out.adapter_fault = version
        return out

    def _refuse_grammar(self, seq: Sequence, error: GrammarRejected) -> RequestOutput:
        """Finish `seq`, whose response_format (or tools') grammar cannot go on, with finish_reason
        "error" and `invalid_param` naming the field: the client's input, so no fault is counted
        and its KV blocks are freed as they are (they hold valid values)."""
        engine_metrics.GRAMMAR_REFUSALS.inc()
        log.info("request %s: %s", seq.request_id, error)
        out = self._finish(seq, "error", error=str(error))
        out.invalid_param = error.param
        return out

    def _fail_broken_adapters(self) -> list[RequestOutput]:
        """Fail the requests naming a version that failed to load (waiting ones) or was
        quarantined (waiting or running)."""
        if self.lora_manager is None:
            return []
        outs = []
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            if seq.adapter is not None:
                if seq.status == SequenceStatus.RUNNING and not self.lora_manager.is_quarantined(seq.adapter):
                    continue
                err = self.lora_manager.load_error(seq.adapter)
                if err is not None:
                    self.runner.clear_blocks(self.block_manager.discard(seq))
                    out = self._finish(seq, "error", error=err)
                    if self.lora_manager.is_quarantined(seq.adapter):
                        out.adapter_fault = seq.adapter
                    outs.append(out)
        return outs

    def _postprocess(self, seqs: list[Sequence], tokens: list[int | None]) -> list[RequestOutput]:
        outputs = []
        for seq, tok in zip(seqs, tokens):
            if tok is None or seq.is_finished:
                continue  # failed in this step
            try:
                out = self._postprocess_one(seq, tok)
            except Exception as e:  # noqa: BLE001 - fails only this request
                log.warning("postprocessing failed for request %s", seq.request_id, exc_info=True)
                out = self._fail(seq, f"the engine failed on this request's output ({type(e).__name__})", "exception")
            if out is not None:
                outputs.append(out)
        return outputs

    def _postprocess_one(self, seq: Sequence, tok: int) -> RequestOutput | None:
        """Append `tok` to `seq`: its delta, its final output if it finished, or None."""
        try:
            complete = self.structured.accept(seq.request_id, tok)
        except GrammarRejected as e:
            return self._refuse_grammar(seq, e)
        reason = self.output.append(seq, tok, complete)
        if reason is not None:
            return self._finish(seq, reason)
        out = self.output.delta(seq)
        return out if out.text or out.token_ids else None

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        was_finished = seq.is_finished  # a failure while finishing finishes it again, as an error
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if self.lora_manager is not None and seq.adapter is not None and not was_finished:
            self.lora_manager.release(seq.adapter)
        if not was_finished:
            seq.finished_time = time.monotonic()
            if seq.first_scheduled_time is not None:
                self.seat_times.record(seq.finished_time - seq.first_scheduled_time)
        out = self.output.delta(seq, final=True)
        out.timings = seq.timings(self._adapter_load_of(seq))
        out.finished = True
        out.finish_reason = reason
        out.error = error
        self.requests.pop(seq.request_id, None)
        self.structured.release(seq.request_id)
        return out

    def _adapter_load_of(self, seq: Sequence) -> tuple[float, float] | None:
        """The adapter load `seq` waited for (monotonic start, end), if it arrived before its
        adapter was in the CPU tier and that load has finished since."""
        if not seq.adapter_cold or self.lora_manager is None:
            return None
        span = self.lora_manager.load_spans.get(seq.adapter)
        return span if span is not None and span[1] >= seq.arrival_time else None

    def _adapter_ready(self, adapter: str) -> bool:
        return self.lora_manager is not None and self.lora_manager.is_ready(adapter)

    # -- convenience --------------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> dict[str, RequestOutput]:
        """Run requests to completion (blocking); returns one aggregated output per request."""
        agg: dict[str, RequestOutput] = {}
        for r in requests:
            self.add_request(r)
            agg[r.request_id] = RequestOutput(r.request_id, "", [])
        while self.has_unfinished():
            outs = self.step()
            if self.stalled:
                time.sleep(STALL_WAIT_S)  # the GIL to the adapter loaders, not to a spinning loop
            for out in outs:
                a = agg[out.request_id]
                a.text += out.text
                a.token_ids += out.token_ids
                if out.finished:
                    a.finished, a.finish_reason, a.error = True, out.finish_reason, out.error
                    a.adapter_fault, a.invalid_param = out.adapter_fault, out.invalid_param
                    a.prompt_tokens, a.completion_tokens = out.prompt_tokens, out.completion_tokens
                    a.cached_tokens = out.cached_tokens
                if out.logprobs is not None:
                    a.logprobs = (a.logprobs or []) + out.logprobs
        return agg
