"""A completion request's checks, from its body to a `Job` the engine can run: the priority class,
the prompt (rendered, bounded by its UTF-8 size, tokenized), the sampling parameters and their
grammar (compiled and probed). The prompt checks the engine would make are
engine.request_checks.check_prompt, run here before any quota is reserved, with the engine's
messages. Every refusal is an ApiError (4xx).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import anyio

from engine.request_checks import ContextLengthExceeded, check_prompt
from engine.sampling_params import InvalidRequestError, Priority, SamplingParams
from engine.tokenizer import ChatTemplateError, PromptTooLong
from tessera.api.schemas import ChatCompletionRequest, CompletionRequest
from tessera.errors import ApiError
from tessera.gateway import Gateway
from tessera.services import Caller
from tessera.tool_calls import ToolFormat, ToolPlan, ToolsError, constraint, plan, render, tool_format

#: Prompts up to this many characters are tokenized on the event loop (tens of microseconds,
#: less than a hop to a worker thread); longer ones on a worker thread, so one tenant's large
#: prompt never stalls the other requests this process serves.
INLINE_TOKENIZE_CHARS = 2048

Body = ChatCompletionRequest | CompletionRequest


@dataclass
class Job:
    """Everything the engine call and the usage event need, fixed before admission."""

    kind: str  # "chat" | "text"
    request_id: str
    model: str
    adapter: str | None  # adapter version id (sha256); None for the base model
    priority: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool  # streaming: a last chunk with the usage
    n: int = 1  # choices: n engine requests with the same prompt (generation.py)
    user: str | None = None  # the body's `user`: the tenant's end user, for its own records
    safety_identifier: str | None = None  # the body's, for the tenant's own records
    #: The request's tools and how the served model writes calls (chat; None: no tools offered).
    tools: ToolPlan | None = None
    tool_format: ToolFormat | None = None
    continuous_usage: bool = False  # streaming: every chunk carries the usage so far
    started: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))


def invalid(e: InvalidRequestError) -> ApiError:
    """The 400 for a request the engine's checks refuse (context_length_exceeded where it is one)."""
    return ApiError(400, e.message, param=e.param, code=e.code if isinstance(e, ContextLengthExceeded) else None)


def requested_max_tokens(body: Body) -> int | None:
    """The completion bound the client asked for (chat's max_completion_tokens first), or None."""
    return getattr(body, "max_completion_tokens", None) or body.max_tokens


def priority_of(caller: Caller, requested: str | None) -> str:
    """The priority class: the requested one, else the plan's default. 400 invalid_priority for
    an unknown class, 403 priority_not_allowed for one the caller's plan does not allow."""
    name = requested or caller.policy.default_priority
    try:
        Priority.parse(name)
    except InvalidRequestError as e:
        raise ApiError(400, e.message, param="priority", code="invalid_priority") from None
    if name not in caller.policy.allowed_priorities:
        raise ApiError(403, f"priority class {name!r} is not allowed on plan {caller.policy.plan!r} "
                            f"(allowed: {', '.join(caller.policy.allowed_priorities)})",
                       param="priority", code="priority_not_allowed")
    return name


def tools_of(gw: Gateway, body: Body) -> tuple[ToolPlan | None, ToolFormat | None]:
    """The chat request's checked tools and the served model's tool-call format (None, None for
    a text completion, which takes no tools). 400 naming `tools` or `tool_choice` for what
    tessera.tool_calls.plan refuses."""
    if not isinstance(body, ChatCompletionRequest):
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(body, name) is not None:
                raise ApiError(400, f"{name} is for chat completions (/v1/chat/completions)", param=name)
        return None, None
    try:
        tool_plan = plan(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ToolsError as e:
        raise ApiError(400, e.message, param=e.param) from None
    tok = gw.engine.tokenizer
    return tool_plan, tool_format(tok.chat_template, tok.tokenizer.token_to_id)


async def prompt_ids(gw: Gateway, body: Body, tools: tuple[ToolPlan | None, ToolFormat | None] = (None, None)
                     ) -> list[int]:
    """The prompt's token ids (unchecked: `sampling_params` checks them), the chat's tools
    rendered as `tools_of` read them: on the event loop when short, else on a worker thread."""
    if _text_chars(body) <= INLINE_TOKENIZE_CHARS:
        return _tokenize(gw, body, tools)
    return await anyio.to_thread.run_sync(_tokenize, gw, body, tools)


def sampling_params(gw: Gateway, body: Body, ids: list[int], tool_plan: ToolPlan | None = None,
                    fmt: ToolFormat | None = None) -> SamplingParams:
    """Check the prompt `ids` (check_prompt: vocabulary, empty, context, prompt + max_tokens) and
    the body's sampling fields; max_tokens left to the server is the settings' default, capped by
    the room the context leaves. Raises ApiError 400 naming the first bad field."""
    ctx = gw.engine.max_model_len
    max_tokens = requested_max_tokens(body)
    if max_tokens is None:
        max_tokens = min(gw.settings.default_max_tokens, ctx - len(ids))
    try:
        check_prompt(ids, max_model_len=ctx, max_tokens=max_tokens, param=_prompt_param(body),
                     vocab_size=gw.engine.tokenizer.vocab_size if _given_as_ids(body) else None)
    except InvalidRequestError as e:
        raise invalid(e) from None
    _refuse_unsupported(body)
    raw = {"max_tokens": max_tokens}
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_p", "min_tokens", "ignore_eos"):
        if getattr(body, name) is not None:
            raw[name] = getattr(body, name)
    if body.logit_bias:
        raw["logit_bias"] = {int(k): v for k, v in body.logit_bias.items()}
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        if body.logprobs:
            raw["logprobs"] = body.top_logprobs or 0
    elif body.logprobs is not None:
        raw["logprobs"] = body.logprobs
    if body.stop is not None:
        raw["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.response_format is not None and body.response_format.type != "text":
        raw["response_format"] = body.response_format.model_dump(by_alias=True, exclude_none=True)
    forced = constraint(tool_plan, fmt) if tool_plan is not None else None
    if forced is not None:
        if "response_format" in raw:
            raise ApiError(400, "response_format cannot be combined with a tool_choice that forces a call "
                                "('required' or a named function)", param="response_format")
        raw["response_format"] = forced
    try:
        return SamplingParams.from_dict(raw)
    except InvalidRequestError as e:
        raise invalid(e) from None


async def check_grammar(gw: Gateway, params: SamplingParams) -> None:
    """Compile the request's response_format (or a forced tool call's grammar) and probe its
    first masks (engine.structured_output.StructuredOutput.compile: the library's per-request
    limits apply) before any quota is reserved, on the worker pool the engine compiles on, so
    the event loop never compiles. What cannot be served is a 400 naming `response_format` (or
    `tools`) with the library's reason: the same answer in-process and over HTTP, where the
    worker then compiles the same grammar from its own cache."""
    if params.response_format is None:
        return
    grammars = gw.grammars()
    try:
        await asyncio.get_running_loop().run_in_executor(None, grammars.compile, params.response_format)
    except InvalidRequestError as e:
        raise invalid(e) from None


#: OpenAI fields this server does not implement, with the values that mean "not used": any
#: other value is a 400 naming the field.
_NO_OP_VALUES = {"functions": (None, []), "function_call": (None, "none"), "echo": (False,), "suffix": (None, "")}


def _refuse_unsupported(body: Body) -> None:
    """Raise the 400 for the first field OpenAI has but this server does not implement that the
    body sets to something other than its no-op value."""
    for name, no_op in _NO_OP_VALUES.items():
        if name in body.model_fields_set and getattr(body, name) not in no_op:
            raise ApiError(400, f"{name} is not supported by this server (leave it out)", param=name,
                           code="unsupported_parameter")
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != body.n:
        raise ApiError(400, "best_of is not supported by this server (leave it out, or set it to n)",
                       param="best_of", code="unsupported_parameter")


def _prompt_param(body: Body) -> str:
    return "messages" if isinstance(body, ChatCompletionRequest) else "prompt"


def _given_as_ids(body: Body) -> bool:
    """The client sent token ids (checked against the vocabulary), not text."""
    return isinstance(body, CompletionRequest) and not isinstance(body.prompt, str) \
        and not any(isinstance(x, str) for x in body.prompt)


def _text_chars(body: Body) -> int:
    if isinstance(body, ChatCompletionRequest):
        if body.tools:  # rendering the tools' schemas costs more than their count says
            return INLINE_TOKENIZE_CHARS + 1
        calls = sum(len(c.function.arguments) for m in body.messages for c in m.tool_calls or ())
        return sum(len(m.text()) for m in body.messages) + calls
    if isinstance(body.prompt, str):
        return len(body.prompt)
    return sum(len(x) for x in body.prompt if isinstance(x, str))


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    """The body's messages as the chat template (and tool_calls.render) take them: developer
    messages as system ones, contents as text, calls and call ids where given."""
    out = []
    for m in body.messages:
        msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            msg["name"] = m.name
        out.append(msg)
    return out


def _tokenize(gw: Gateway, body: Body, tools: tuple[ToolPlan | None, ToolFormat | None] = (None, None)) -> list[int]:
    """Render (chat, with its tools) and encode the prompt. A prompt whose UTF-8 size alone
    shows it cannot fit the context is refused before encoding (400 context_length_exceeded).
    Messages' contents are text: special tokens written in them never become control tokens."""
    tok = gw.engine.tokenizer
    ctx = gw.engine.max_model_len
    most = ctx - 1  # the prompt must leave room for one generated token
    try:
        if isinstance(body, ChatCompletionRequest):
            messages, tool_list = chat_messages(body), None
            tool_plan, fmt = tools
            if tool_plan is not None:
                messages, tool_list = render(messages, tool_plan, fmt)
            return tok.encode_chat(messages, max_tokens=most, tools=tool_list)
        if _given_as_ids(body):
            return list(body.prompt)
        if not isinstance(body.prompt, str) and len(body.prompt) != 1:
            raise ApiError(400, "only one prompt per request is supported", param="prompt")
        text = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        tok.check_fits(text, most)
        return tok.encode(text) if text else []
    except ChatTemplateError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    except PromptTooLong as e:
        raise ApiError(400, f"the prompt has at least {e.min_tokens} tokens; this model's context is {ctx} tokens",
                       param=_prompt_param(body), code="context_length_exceeded") from None
