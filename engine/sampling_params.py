"""Per-request sampling parameters and the request/response types of the engine API."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from engine import response_format as _response_format


#: The seeds SamplingParams accepts: the signed 64-bit range of the OpenAI API's `seed`.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
#: logit_bias bounds: at most this many token ids, each bias in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]
#: (OpenAI's range). The ids' upper bound is the model's vocabulary, checked by the engine
#: (engine.request_checks.check_logit_bias).
LOGIT_BIAS_MAX_ENTRIES, LOGIT_BIAS_MAX = 1024, 100.0


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI style)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class Priority(enum.IntEnum):
    """Priority classes; a lower value is served first. The one definition of the classes there
    are: metrics labels, plans, prices, the CLI and the admin UI (through the API) all read
    `PRIORITY_NAMES`."""

    realtime = 0
    standard = 1
    batch = 2

    @classmethod
    def parse(cls, value: "str | Priority") -> "Priority":
        if isinstance(value, Priority):
            return value
        try:
            return cls[value]
        except KeyError:
            raise InvalidRequestError(
                f"unknown priority class {value!r} (use {_NAMES_IN_WORDS})", "priority") from None


#: The priority classes' names, served first to last: the wire and database spelling of Priority.
PRIORITY_NAMES: tuple[str, ...] = tuple(p.name for p in Priority)
_NAMES_IN_WORDS = f"{', '.join(PRIORITY_NAMES[:-1])} or {PRIORITY_NAMES[-1]}"


class SamplingParams(BaseModel):
    """How to sample one request's completion. Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1, description="most completion tokens")
    #: Until this many completion tokens are generated, the end-of-sequence ids (unless
    #: ignore_eos) and stop_token_ids cannot be sampled, and stop strings do not apply (vLLM's
    #: min_tokens). At most max_tokens.
    min_tokens: int = Field(0, ge=0, description="fewest completion tokens before a stop can end it")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass in (0, 1]")
    top_k: int = Field(-1, description="-1 disables; otherwise >= 1")
    seed: int | None = Field(None, description="same seed, same output; a signed 64-bit integer")
    stop: list[str] = Field(default_factory=list, max_length=16, description="stop strings, matched on text")
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    # The logits controls, applied in this order (engine.sampler, as vLLM): logit_bias, the
    # min_tokens mask, repetition_penalty, then frequency/presence penalties; then temperature,
    # top_k, top_p, min_p. A response_format grammar's mask wins over all of them.
    #: OpenAI's: minus presence_penalty for every token the completion already holds (not the prompt).
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    #: OpenAI's: minus frequency_penalty times how often the completion already holds the token.
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    #: vLLM's / transformers': a token in the prompt or the completion so far has a positive
    #: logit divided by it, a negative one multiplied by it; 1 is off.
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    #: OpenAI's: token id -> a bias in [-100, 100] added to its logit; at most 1024 ids, each in
    #: [0, the model's vocabulary) (the engine checks the upper bound). JSON's string keys are
    #: accepted ("50256").
    logit_bias: dict[int, float] | None = None
    #: vLLM's: after temperature, drop the tokens whose probability is below min_p times the
    #: likeliest token's; 0 is off.
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    #: Per generated token, its log-probability and those of the `logprobs` likeliest tokens
    #: (0..20), from the model's raw distribution (before the logits controls, temperature and any
    #: mask: engine.logprobs); None: off.
    logprobs: int | None = Field(None, ge=0, le=20)
    #: OpenAI's response_format, normalized (engine.response_format.normalize): None (free text),
    #: {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}; the output is
    #: constrained to it (engine.structured_output).
    response_format: dict | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v: int, info: ValidationInfo) -> int:
        max_tokens = info.data.get("max_tokens")  # absent when it failed its own check
        if max_tokens is not None and v > max_tokens:
            raise ValueError(f"min_tokens ({v}) must not exceed max_tokens ({max_tokens})")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v):
        # Checked here as a whole, so every refusal names the field itself (not a key inside it).
        if v is None:
            return None
        if not isinstance(v, dict):
            raise ValueError("logit_bias must be an object mapping token ids to biases")
        if len(v) > LOGIT_BIAS_MAX_ENTRIES:
            raise ValueError(f"logit_bias has {len(v)} entries; at most {LOGIT_BIAS_MAX_ENTRIES} are allowed")
        out: dict[int, float] = {}
        for key, bias in v.items():
            tok = _token_id(key)
            if tok is None or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
            if (isinstance(bias, bool) or not isinstance(bias, (int, float))
                    or not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX):
                raise ValueError(f"logit_bias values must be numbers in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], "
                                 f"got {bias!r} for token {tok}")
            out[tok] = float(bias)
        return out

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        # The OpenAI API documents seed as a 64-bit integer; anything wider cannot seed a
        # generator the same way on every engine, so it is refused rather than folded.
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (a signed 64-bit integer)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, v):
        try:
            return _response_format.normalize(v)
        except ValueError as e:
            raise PydanticCustomError("response_format", str(e)) from None

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties is on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_dict(cls, data: dict) -> "SamplingParams":
        """Validate user input; raises InvalidRequestError naming the first bad field."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err.get("loc", ())) or None
            msg = err.get("msg", "invalid value")
            if err.get("type") == "extra_forbidden":
                msg = f"unknown field {param!r}"
            raise InvalidRequestError(f"{param}: {msg}" if param else msg, param) from None


def _token_id(key) -> int | None:
    """A logit_bias key as a token id: an int, or a string of ASCII decimal digits (JSON's object keys)."""
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    if isinstance(key, str) and key.isascii() and key.strip().lstrip("-").isdigit():
        return int(key)
    return None


@dataclass
class GenerationRequest:
    """One request to the engine. Give `prompt` (text) or `prompt_token_ids`."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    tenant_id: str = "default"
    priority: Priority = Priority.standard
    #: The tenant's weight in the scheduler's fair shares of KV blocks and prefill tokens inside
    #: a priority class (engine.scheduler; the gateway passes its plan's scheduling_weight).
    tenant_weight: float = 1.0
    #: Immutable adapter version id (the engine fetches it through its AdapterSource); None = base.
    adapter: str | None = None
    #: Prefix-cache scope: requests share cached KV blocks only with requests of the same salt
    #: (and adapter version). The gateway passes the tenant, so tenants never share KV.
    cache_salt: str | None = None
    #: The compiled grammar of params.response_format (engine.structured_output.Grammar), set by
    #: AsyncLLMEngine off the step thread; None: LLMEngine.add_request compiles it. Never sent
    #: over the worker protocol.
    grammar: object | None = field(default=None, repr=False, compare=False)


@dataclass
class RequestOutput:
    """A delta of one request's completion. The last one has `finished` set and the exact counts."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    #: With finish_reason "error": the adapter version the failure was traced to (it is
    #: quarantined: later requests naming it fail at once); None when no adapter was at fault.
    adapter_fault: str | None = None
    #: With finish_reason "error": the request field whose value the engine could not serve
    #: ("response_format", or "tools" for a forced tool call's grammar, which failed mid-generation:
    #: structured_output.GrammarRejected). The client's error, not an engine fault; None otherwise.
    invalid_param: str | None = None
    #: Prompt tokens whose KV came from the prefix cache when the request was first scheduled
    #: (0 until then, and with caching off): OpenAI's usage.prompt_tokens_details.cached_tokens.
    cached_tokens: int = 0
    #: Prompt tokens whose KV this request has (computed, or found in the prefix cache) when the
    #: delta is made: every prompt token once it has produced a token; on the final output of an
    #: abort, how far its prefill got (0 if it was never scheduled). What billing counts as the
    #: prompt of an aborted request.
    computed_prompt_tokens: int = 0
    #: With SamplingParams.logprobs: one entry per id of `token_ids`, in order, as JSON-ready
    #: dicts {"token_id", "logprob", "top_logprobs": [{"token_id", "logprob"}, ...]} (top ones
    #: likeliest first). None when the request did not ask.
    logprobs: list[dict] | None = None
    #: On the final output: the request's timeline in the engine (Sequence.timings: arrival, first
    #: seat, prefill chunks, first token, end, adapter load), from which traces are made after the
    #: fact; None on other deltas.
    timings: dict | None = None
