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


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

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
    #: The end user, for the tenant's own records (passed on to the request's Job).
    user: str | None = Field(None, max_length=256)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: OpenAI fields not implemented here, accepted only with their no-op values (None, empty,
    #: "none"); completions_request.sampling_params answers another value 400 naming the field.
    logit_bias: dict[str, float] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
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


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    #: Per generated token its logprob; with top_logprobs (0..20) that many likeliest alternatives.
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    functions: list[dict] | None = None  # no-op values only (see _Common.logit_bias)
    function_call: str | dict | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    echo: bool = False
    #: Per generated token its logprob and the `logprobs` (0..5) likeliest alternatives.
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = None  # no-op values only: None or n (see _Common.logit_bias)
    suffix: str | None = None
