"""Request bodies of the OpenAI-compatible API. Unknown fields are refused (a 400 naming the
field: tessera.errors) so a typo never silently changes behaviour; fields OpenAI has but this
server does not implement are accepted only with their no-op values."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tessera.errors import OUT_OF_RANGE

#: OpenAI's `seed` is an int64.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
#: The most choices one request may ask for (`n`): its quota reservation covers all of them.
MAX_N = 16
#: The most entries one logit_bias may hold.
MAX_LOGIT_BIAS = 1024


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    #: The arguments as JSON text (OpenAI's shape); decoded for the chat template when they parse.
    arguments: str = ""


class ToolCall(BaseModel):
    """A call an assistant message made (OpenAI's `tool_calls` entries, as clients send them back)."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction
    index: int | None = None  # sent back by some clients that reassembled a stream; unused


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    #: An assistant message's calls; a tool message's `tool_call_id` names the call it answers.
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)
    #: Fields of OpenAI's assistant messages that clients echo back in a history: accepted, unused.
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: dict | None = None

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls is only for assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        """A content part of another type (image_url, input_audio, file, ...) is refused by name:
        the served models take text only."""
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise PydanticCustomError(
                        "unsupported_content",
                        "content part {index} has type {kind}: this model takes text only (parts of type 'text')",
                        {"index": i, "kind": repr(kind[:64])})
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    #: vLLM's: every chunk carries the usage so far (load tools such as guidellm read it).
    continuous_usage_stats: bool = False


class JsonSchemaSpec(BaseModel):
    """response_format.json_schema as OpenAI shapes it; the schema's size and depth are checked
    with the sampling parameters (engine.response_format), what it means by the engine."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON valid against a schema
    (`json_schema`, given exactly with that type)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _spec_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only with it")
        return self


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    #: The end user and OpenAI's safety identifier, for the tenant's own records (its usage events).
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    #: OpenAI's penalties over the tokens generated so far, and per-token logit biases (token id
    #: as a string -> bias; ids are checked against the vocabulary).
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    #: vLLM's sampling extensions: repetition penalty (over prompt and output), min-p, a floor
    #: on completion tokens before EOS or a stop token may end it, and ignoring EOS.
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    #: OpenAI's function tools (tessera.tool_calls checks and renders them).
    tools: list[dict] | None = Field(None, max_length=128)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    #: OpenAI fields accepted for compatibility: `store` (nothing is stored for chat completions
    #: here; see the README), `metadata` (at most 16 string pairs), `service_tier` (one tier
    #: here: answered as "default"), `prompt_cache_key` (the prefix cache is per tenant already).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = Field(None, max_length=256)
    #: Extension: priority class (realtime, standard, batch); default: the tenant's plan default.
    priority: str | None = None
    #: The output's format (engine.structured_output constrains it to the grammar).
    response_format: ResponseFormat | None = None

    @field_validator("seed")
    @classmethod
    def _seed_int64(cls, v: int | None) -> int | None:
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise PydanticCustomError(OUT_OF_RANGE, "must be an integer from -2**63 to 2**63-1 (int64)")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's bounds: at most 16 pairs, keys up to 64 characters, values up to 512."""
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("at most 16 pairs, keys of at most 64 characters and values of at most 512")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_values(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()) or len(key) > 9:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be from -100 to 100 (token {key}: {bias})")
        return v


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    #: Per generated token its logprob; with top_logprobs (0..20) that many likeliest alternatives.
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    #: OpenAI's deprecated function calling: accepted only with no-op values (use tools).
    functions: list[dict] | None = None
    function_call: str | dict | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    echo: bool = False
    #: Per generated token its logprob and the `logprobs` (0..5) likeliest alternatives.
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = None  # no-op values only: None or n (completions_request._refuse_unsupported)
    suffix: str | None = None
