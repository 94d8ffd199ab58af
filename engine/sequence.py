"""Request state inside the engine."""
from __future__ import annotations

import enum
import itertools
import random
import time
from array import array

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import Priority, SamplingParams

_seq_ids = itertools.count()
#: What stands in token_ids for a sampled token whose value is still on the device (an
#: overlapped step: engine.llm_engine). Never a token id, so a step that read it unpatched fails.
PENDING_TOKEN = -1
_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers whose every input bit flips about
    half the output bits."""
    z = x & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


#: splitmix64's increment (2**64 / the golden ratio, odd).
_GAMMA = 0x9E3779B97F4A7C15


def sampling_uniform(seed: int, step: int) -> float:
    """The uniform number in [0, 1 - 2**-52] that the `step`-th completion token (0-based) of a
    request seeded with `seed` is drawn with (engine.sampler): the `step`-th output of the
    splitmix64 generator started at `seed` (taken as unsigned 64 bits), its high 52 bits over
    2**52. A function of (seed, step) alone: the batch, preemption and the device never change it,
    and every bit of a signed 64-bit seed counts."""
    return (splitmix64(seed + (step + 1) * _GAMMA) >> 12) / (1 << 52)


class TokenCounts:
    """The distinct tokens a request's penalties look at and how often the completion holds each,
    kept as tokens are appended (O(1) each) in two flat arrays the sampler concatenates per step
    without touching their elements: `ids` (int64) and `counts` (float32, exact below 2**24).
    Seeded with the prompt's distinct tokens at count 0 when the repetition penalty covers them."""

    __slots__ = ("ids", "counts", "_index")

    def __init__(self, seen=()):
        self.ids = array("q")
        self.counts = array("f")
        self._index: dict[int, int] = {}
        for t in seen:
            if t not in self._index:
                self._index[t] = len(self.ids)
                self.ids.append(t)
                self.counts.append(0.0)

    def add(self, token_id: int) -> None:
        i = self._index.get(token_id)
        if i is None:
            self._index[token_id] = len(self.ids)
            self.ids.append(token_id)
            self.counts.append(1.0)
        else:
            self.counts[i] += 1.0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens, KV blocks and output state of one request.

    The KV of tokens [0, num_computed_tokens) is in the cache (block_table). A step computes the
    next tokens [num_computed_tokens, num_computed_tokens + n); when that reaches num_tokens the
    step's logits for the last token are sampled and the new token appended.

    A token can be sampled before its value is known on the host: the engine then appends a
    placeholder (`add_pending`, PENDING_TOKEN in token_ids, counted by `num_pending`), which the
    next step's input reads from the device, and `append_token` later puts the value in the
    oldest placeholder's place. Counts a step depends on (`num_output_tokens`: the seed's draw
    index, min_tokens) include the pending tokens; the output (output_token_ids, text) does not.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, *, tenant_id: str = "default",
                 priority: Priority = Priority.standard, adapter: str | None = None,
                 cache_salt: str | None = None, eos_token_ids=(), tenant_weight: float = 1.0):
        """`cache_salt`: the prefix-cache scope (engine.block_manager). `eos_token_ids`: the
        model's end-of-sequence ids, masked with stop_token_ids until min_tokens (unless
        ignore_eos). `tenant_weight`: the tenant's weight in the scheduler's fair shares (> 0)."""
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.tenant_id = tenant_id
        self.tenant_weight = tenant_weight
        self.priority = priority
        self.adapter = adapter
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)  # prompt + output, appended in place
        self.num_computed_tokens = 0
        #: Trailing entries of token_ids that are placeholders for sampled tokens still on the device.
        self.num_pending = 0
        self.block_table: list[int] = []
        self.cache_salt = cache_salt
        #: Chained content hashes of the full blocks of token_ids computed so far (the block
        #: manager extends it lazily), and how many leading blocks of block_table it has offered
        #: to the prefix cache.
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        #: Prompt tokens served from the prefix cache when first scheduled; None before that.
        self.num_cached_tokens: int | None = None
        self.status = SequenceStatus.WAITING
        self.arrival_time = time.monotonic()
        #: When the scheduler first gave it a seat (time.monotonic()); None while it never had one.
        self.first_scheduled_time: float | None = None
        #: The rest of its timeline (time.monotonic()), kept for traces (`timings`): its prefill
        #: chunks (step start, step end, tokens), its first token, its end, and whether its adapter
        #: had to be loaded when it arrived (LLMEngine sets these).
        self.prefill_chunks: list[tuple[float, float, int]] = []
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.adapter_cold = False
        self.detokenizer = detokenizer
        self.output_text = ""
        self.emitted_text_len = 0
        self.emitted_token_len = 0
        #: Where a stop string may end at the earliest: output_text's length once min_tokens
        #: tokens were generated (LLMEngine sets it then; 0 without min_tokens).
        self.stop_text_floor = 0
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        #: The seed of this request's draws (engine.sequence.sampling_uniform): its own, or 64
        #: random bits.
        self.sampling_seed = random.getrandbits(64) if params.seed is None else params.seed
        #: The ids masked while fewer than min_tokens tokens are generated (empty: no mask).
        self.min_tokens_mask_ids: list[int] = []
        if params.min_tokens:
            eos = () if params.ignore_eos else eos_token_ids
            self.min_tokens_mask_ids = sorted(set(params.stop_token_ids) | set(eos))
        #: With a penalty: the distinct tokens it covers and their completion counts.
        self.token_counts: TokenCounts | None = None
        if params.penalized:
            self.token_counts = TokenCounts(prompt_token_ids if params.repetition_penalty != 1.0 else ())
        #: Whether engine.sampler has logits controls to apply for this request at some step.
        self.has_logits_controls = bool(params.logit_bias or params.penalized or self.min_tokens_mask_ids)
        #: engine.sampler's host arrays of this request (logit_bias ids and values, the
        #: min_tokens mask), built at its first step.
        self.controls_cache: dict[str, array] = {}

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Completion tokens sampled so far, the pending ones included."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host has (num_tokens less the pending ones)."""
        return len(self.token_ids) - self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def add_pending(self) -> None:
        """A token was sampled whose value is still on the device: hold its place."""
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending += 1

    def append_token(self, token_id: int) -> None:
        """The next completion token: into the oldest placeholder's place if one is pending."""
        if not self.output_token_ids:
            self.first_token_time = time.monotonic()
        if self.num_pending:
            self.token_ids[len(self.token_ids) - self.num_pending] = token_id
            self.num_pending -= 1
        else:
            self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.token_counts is not None:
            self.token_counts.add(token_id)

    def timings(self, adapter_load: tuple[float, float] | None = None) -> dict:
        """Its timeline as Unix-epoch nanoseconds, for spans made after the fact
        (tessera.observability.tracing.engine_spans): "arrival", "first_scheduled", "first_token",
        "finished" (None where it never got there), "prefill_chunks" [[start, end, tokens], ...],
        "adapter_load" [start, end] (the load it waited for, or None), "preemptions"."""
        offset = time.time_ns() - time.monotonic_ns()

        def ns(t: float | None) -> int | None:
            return None if t is None else int(t * 1e9) + offset

        return {"arrival": ns(self.arrival_time), "first_scheduled": ns(self.first_scheduled_time),
                "first_token": ns(self.first_token_time), "finished": ns(self.finished_time),
                "prefill_chunks": [[ns(a), ns(b), n] for a, b, n in self.prefill_chunks],
                "adapter_load": None if adapter_load is None else [ns(adapter_load[0]), ns(adapter_load[1])],
                "preemptions": self.num_preemptions}

    def reset_for_recompute(self) -> None:
        """After preemption: the KV is gone; prompt + output so far will be prefilled again."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_committed_blocks = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
