"""The request body of POST /v1/responses (OpenAI's Responses API) and its input items.

`ResponsesRequest` is the body as OpenAI shapes it. Unknown fields are refused (a 400 naming the
field, as every body of this API); fields OpenAI has that this server does not implement are
declared so that `unsupported` can refuse them by name unless they carry their no-op value.

`normalize_input` turns `input` (a string, or a list of items) into the canonical items this
server stores and translates: messages with a list of text parts, `function_call` and
`function_call_output` items. Anything else (images, files, built-in tool items, references to
items) is a 400 naming the item, never ignored.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tessera.errors import OUT_OF_RANGE, ApiError

#: The most input items one request may give (its body's size bounds them too).
MAX_INPUT_ITEMS = 1024
#: OpenAI's bounds on `metadata`: keys, a key's length, a value's length.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: The most function tools one request may declare (OpenAI's limit, and chat's).
MAX_TOOLS = 128
#: Bounds of the ids a client sends back: call ids (OpenAI's are ~30 characters) and item ids.
MAX_ID_CHARS = 128
_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

#: Content part types that carry text, by the role they belong to (both are accepted in either
#: role and stored as the role's own type).
_TEXT_PARTS = ("input_text", "output_text")


class TextFormat(BaseModel):
    """`text.format`: free text, any JSON object, or JSON valid against `schema` (json_schema)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=_NAME_PATTERN)
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "TextFormat":
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("type 'json_schema' needs a 'name' and a 'schema'")
        if self.type != "json_schema" and any(v is not None for v in (self.name, self.schema_, self.strict,
                                                                      self.description)):
            raise ValueError("name, schema, strict and description go only with type 'json_schema'")
        return self

    def as_dict(self) -> dict:
        """The format as the response echoes it (OpenAI's shape, only the fields given)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    #: Only OpenAI's default is served: another verbosity would change the answer.
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: OpenAI pads delta events against length side channels; this server does not (accepted).
    include_obfuscation: bool | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses. `store` defaults to true, as OpenAI's does."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200)
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    #: The end user, for the tenant's own records (passed on like chat's `user`).
    user: str | None = Field(None, max_length=256)
    store: bool | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=64)
    #: Extension (as on chat): priority class (realtime, standard, batch).
    priority: str | None = None
    #: Accepted and passed on where chat takes them; none changes the answer.
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    #: Counts calls to built-in tools only, and none are served: accepted, nothing to bound.
    max_tool_calls: int | None = Field(None, ge=1)
    #: OpenAI fields not implemented here, accepted only with their no-op values (`unsupported`).
    reasoning: Any = None
    background: bool | None = None
    include: list[Any] | None = None
    truncation: str | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > MAX_METADATA_KEYS:
            raise PydanticCustomError(OUT_OF_RANGE, "at most {n} keys are allowed (got {got})",
                                      {"n": MAX_METADATA_KEYS, "got": len(v)})
        for key, value in v.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise PydanticCustomError(OUT_OF_RANGE, "a key is at most {n} characters (got one of {got})",
                                          {"n": MAX_METADATA_KEY_CHARS, "got": len(key)})
            if len(value) > MAX_METADATA_VALUE_CHARS:
                raise PydanticCustomError(OUT_OF_RANGE, "a value is at most {n} characters (key {key} has {got})",
                                          {"n": MAX_METADATA_VALUE_CHARS, "key": repr(key[:64]), "got": len(value)})
        return v

    @property
    def stores(self) -> bool:
        """Whether the response is kept (absent or null means yes, as OpenAI)."""
        return self.store is not False


def _no_reasoning(v) -> bool:
    return v is None or (isinstance(v, dict) and all(x is None for x in v.values()))


#: OpenAI fields this server does not implement: (is the value a no-op?, why it is refused).
_UNSUPPORTED = {
    "reasoning": (_no_reasoning, "the served models do not reason (leave it out)"),
    "background": (lambda v: not v, "background responses are not supported (leave it out or false)"),
    "include": (lambda v: not v, "no extra output data can be included (leave it out)"),
    "truncation": (lambda v: v in (None, "disabled"),
                   "only 'disabled' is supported: an input that does not fit the context is a 400"),
    "conversation": (lambda v: v is None, "conversations are not supported: use previous_response_id"),
    "prompt": (lambda v: v is None, "prompt templates are not supported (send input and instructions)"),
    "top_logprobs": (lambda v: not v, "logprobs are not supported on /v1/responses (use /v1/chat/completions)"),
}


def refuse_unsupported(req: ResponsesRequest) -> None:
    """Raise the 400 for the first field OpenAI has but this server does not implement, set to
    something other than its no-op value."""
    for name, (no_op, why) in _UNSUPPORTED.items():
        if name in req.model_fields_set and not no_op(getattr(req, name)):
            raise ApiError(400, f"{name} is not supported by this server: {why}", param=name,
                           code="unsupported_parameter")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise ApiError(400, "text.verbosity: only 'medium' is supported (leave it out)", param="text.verbosity",
                       code="unsupported_parameter")


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def _text(value, param: str) -> str:
    if not isinstance(value, str):
        raise _bad(param, "must be a string")
    return value


def _text_parts(content, param: str, part_type: str) -> list[dict]:
    """A message's content (a string, or a list of text parts) as a list of `part_type` parts."""
    if isinstance(content, str):
        return [{"type": part_type, "text": content}]
    if not isinstance(content, list):
        raise _bad(param, "must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            if isinstance(kind, str):
                raise _bad(f"{where}.type", f"content parts of type {kind[:64]!r} are not supported: this model "
                                            "takes text only (input_text or output_text parts)", "unsupported_content")
            raise _bad(where, "must be a content part with a 'type' (input_text or output_text)")
        parts.append({"type": part_type, "text": _text(part.get("text"), f"{where}.text")})
    return parts


def _message(item: dict, param: str) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise _bad(f"{param}.role",
                   f"must be one of 'user', 'system', 'developer', 'assistant' (got {str(role)[:32]!r})")
    if "content" not in item:
        raise _bad(f"{param}.content", "field required")
    out = {"type": "message", "role": role,
           "content": _text_parts(item["content"], f"{param}.content",
                                  "output_text" if role == "assistant" else "input_text")}
    return _with_id(out, item, param)


def _call_id(item: dict, param: str) -> str:
    call_id = _text(item.get("call_id"), f"{param}.call_id")
    if not 1 <= len(call_id) <= MAX_ID_CHARS:
        raise _bad(f"{param}.call_id", f"must have 1 to {MAX_ID_CHARS} characters")
    return call_id


def _with_id(out: dict, item: dict, param: str) -> dict:
    """`out` with the item's own `id`, when the client gave one (an output item sent back)."""
    if item.get("id") is not None:
        item_id = _text(item["id"], f"{param}.id")
        if len(item_id) > MAX_ID_CHARS:
            raise _bad(f"{param}.id", f"must have at most {MAX_ID_CHARS} characters")
        out["id"] = item_id
    return out


def _function_call(item: dict, param: str) -> dict:
    name = _text(item.get("name"), f"{param}.name")
    if not re.fullmatch(_NAME_PATTERN, name):
        raise _bad(f"{param}.name", "must be 1 to 64 letters, digits, '_' or '-'")
    out = {"type": "function_call", "call_id": _call_id(item, param), "name": name,
           "arguments": _text(item.get("arguments"), f"{param}.arguments")}
    return _with_id(out, item, param)


def _function_call_output(item: dict, param: str) -> dict:
    output = item.get("output")
    if isinstance(output, list):
        output = "".join(p["text"] for p in _text_parts(output, f"{param}.output", "input_text"))
    out = {"type": "function_call_output", "call_id": _call_id(item, param),
           "output": _text(output, f"{param}.output")}
    return _with_id(out, item, param)


_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
              "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
              "function_call_output": {"type", "call_id", "output", "id", "status"}}


def normalize_input(value: str | list) -> list[dict]:
    """`input` as canonical items (module docstring): a string is one user message. Raises
    ApiError 400 naming the first item (and part) this server does not take."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if len(value) > MAX_INPUT_ITEMS:
        raise ApiError(400, f"input: at most {MAX_INPUT_ITEMS} items are accepted (got {len(value)})",
                       param="input", code="invalid_value")
    items = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(param, "must be an input item (an object)")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in _ITEM_KEYS:
            if isinstance(kind, str):
                raise _bad(f"{param}.type", f"input items of type {kind[:64]!r} are not supported (only message, "
                                            "function_call and function_call_output)", "unsupported_parameter")
            raise _bad(param, "must have a 'type' (message, function_call or function_call_output) or a 'role'")
        extra = sorted(str(k) for k in item if k not in _ITEM_KEYS[kind])
        if extra:
            raise _bad(f"{param}.{extra[0][:64]}", f"unknown field of a {kind} item (not supported by this API)")
        if kind == "message":
            items.append(_message(item, param))
        elif kind == "function_call":
            items.append(_function_call(item, param))
        else:
            items.append(_function_call_output(item, param))
    return items


def normalize_tools(tools: list | None) -> list[dict]:
    """`tools` as OpenAI's Responses function tools {"type", "name", "description"?,
    "parameters"?, "strict"?}. A built-in tool (web_search, file_search, ...) or any other type
    is a 400 naming it."""
    if not tools:
        return []
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools: at most {MAX_TOOLS} tools are accepted (got {len(tools)})", param="tools",
                       code="invalid_value")
    out = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            if isinstance(kind, str):
                raise _bad(f"{param}.type", f"tools of type {kind[:64]!r} are not supported (only 'function' "
                                            "tools: this server runs no built-in tools)", "unsupported_parameter")
            raise _bad(param, "must be a tool with a 'type' ('function')")
        extra = sorted(str(k) for k in tool if k not in ("type", "name", "description", "parameters", "strict"))
        if extra:
            raise _bad(f"{param}.{extra[0][:64]}", "unknown field of a function tool (not supported by this API)")
        fn = {"type": "function", "name": _text(tool.get("name"), f"{param}.name")}
        if not re.fullmatch(_NAME_PATTERN, fn["name"]):
            raise _bad(f"{param}.name", "must be 1 to 64 letters, digits, '_' or '-'")
        if tool.get("description") is not None:
            fn["description"] = _text(tool["description"], f"{param}.description")
        if tool.get("parameters") is not None:
            if not isinstance(tool["parameters"], dict):
                raise _bad(f"{param}.parameters", "must be a JSON schema object")
            fn["parameters"] = tool["parameters"]
        if tool.get("strict") is not None:
            if not isinstance(tool["strict"], bool):
                raise _bad(f"{param}.strict", "must be a boolean")
            fn["strict"] = tool["strict"]
        out.append(fn)
    return out


def normalize_tool_choice(choice: str | dict | None) -> str | dict | None:
    """`tool_choice`: "auto", "none", "required" or {"type": "function", "name": ...}; another
    choice (a built-in tool, allowed_tools, mcp, custom) is a 400 naming it."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if set(choice) != {"type", "name"} or not isinstance(choice["name"], str):
            raise _bad("tool_choice", "a function choice is {'type': 'function', 'name': <function name>}")
        return {"type": "function", "name": choice["name"]}
    if isinstance(choice, dict) and isinstance(choice.get("type"), str):
        raise _bad("tool_choice", f"a tool_choice of type {choice['type'][:64]!r} is not supported (use 'auto', "
                                  "'none', 'required' or a function)", "unsupported_parameter")
    raise _bad("tool_choice", "must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}")
