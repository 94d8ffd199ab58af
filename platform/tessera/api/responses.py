"""OpenAI's Responses API, run as a chat completion:

  POST   /v1/responses          create (JSON, or SSE events with stream true)
  GET    /v1/responses/{id}     a stored response (the caller's tenant's only)
  DELETE /v1/responses/{id}     delete a stored response

A request is translated into a `ChatCompletionRequest` (`chat_request`): `instructions` becomes
a system message first, the conversation behind `previous_response_id` (its stored input and
output items, oldest first) comes next, then the new input items (messages; `function_call`
items as an assistant message's `tool_calls`; `function_call_output` items as `tool` messages);
`tools`, `tool_choice`, `text.format` and `max_output_tokens` become chat's `tools`,
`tool_choice`, `response_format` and `max_completion_tokens`; n is 1. It then runs through the
chat path (openai.start_generation, generation.collect_chat / stream_chat), so priority, quotas,
admission, model resolution, prompt limits, billing, metrics, the usage event (keyed by the
response id) and disconnect handling are exactly a chat request's. The chat answer becomes the
response object (`message` and `function_call` output items, usage in the Responses shape);
chat chunks become the Responses stream's events (`_Events`). A refusal names the Responses
field (`in_responses_terms`).

`store` (default true) keeps the response per tenant (tessera.responses_store): saved before
the answer or the stream's last event is sent, so a client can continue from it at once. If the
database cannot take it, the answer says `"store": false` (the tokens were generated and billed;
the answer is not withheld).
"""
from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from tessera import responses_store
from tessera.api import generation
from tessera.api import openai as chat_api
from tessera.api import response_models as out
from tessera.api.deps import run_db
from tessera.api.responses_schema import (
    ResponsesRequest,
    normalize_input,
    normalize_tool_choice,
    normalize_tools,
    refuse_unsupported,
)
from tessera.api.schemas import ChatCompletionRequest
from tessera.auth import CallerDep, GatewayDep
from tessera.errors import ApiError
from tessera.gateway import Gateway
from tessera.models import StoredResponse
from tessera.responses_store import ChainError, NewResponse, as_utc
from tessera.services import Caller
from tessera.streaming import ClientDisconnected, DisconnectAwareStream, Final, cancel_on_disconnect

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")

#: Chat's parameter names -> the Responses field a refusal names instead.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format"}
#: Fields passed on to the chat request where its schema has them, as they are.
_PASSED_ON = ("temperature", "top_p", "user", "priority", "parallel_tool_calls", "safety_identifier",
              "prompt_cache_key", "service_tier")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


# --- request: Responses -> chat ---------------------------------------------------------------

def chat_messages(items: list[dict]) -> list[dict]:
    """Canonical input/output items (responses_schema.normalize_input) as chat messages. Function
    calls join the assistant message just before them (a reply's text and its calls are one
    chat turn; consecutive calls are parallel calls)."""
    messages: list[dict] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": "".join(p["text"] for p in item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:  # function_call_output
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_request(body: ResponsesRequest, conversation: list[dict], tools: list[dict],
                 tool_choice: str | dict | None) -> ChatCompletionRequest:
    """The chat completion request that answers `body` (module docstring); `conversation`: the
    stored history then the new input items. 400 naming `input` when there is nothing to answer."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) \
        + chat_messages(conversation)
    if not messages:
        raise ApiError(400, "input: give at least one input item (or instructions)", param="input",
                       code="invalid_value")
    raw: dict = {"model": body.model, "messages": messages, "n": 1, "stream": body.stream}
    if body.stream:
        raw["stream_options"] = {"include_usage": True}
    if body.max_output_tokens is not None:
        raw["max_completion_tokens"] = body.max_output_tokens
    fields = ChatCompletionRequest.model_fields
    raw |= {name: getattr(body, name) for name in _PASSED_ON if getattr(body, name) is not None and name in fields}
    if tools:
        raw["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    if tool_choice is not None:
        raw["tool_choice"] = tool_choice if isinstance(tool_choice, str) else \
            {"type": "function", "function": {"name": tool_choice["name"]}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        raw["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        spec = {k: v for k, v in fmt.as_dict().items() if k != "type"}
        raw["response_format"] = {"type": "json_schema", "json_schema": spec}
    try:
        return ChatCompletionRequest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ())]
        param = _PARAMS.get(loc[0], loc[0]) if loc else None
        raise ApiError(400, f"{param or 'request'}: {first.get('msg', 'invalid value')}", param=param,
                       code="invalid_value") from None


def in_responses_terms(e: ApiError) -> ApiError:
    """A chat refusal renamed for the Responses request that caused it (max_output_tokens, not
    max_completion_tokens; text.format, not response_format; tools[i].parameters, not
    tools[i].function.parameters; input, not messages[j])."""
    if e.param:
        base = e.param.split(".")[0].split("[")[0]
        if base == "messages":
            e.param = "input"
        elif base == "response_format":
            e.param = "text.format" + e.param[len(base):].replace(".json_schema", "", 1)
        elif base in _PARAMS:
            e.param = _PARAMS[base] + e.param[len(base):]
        elif base == "tools":
            e.param = e.param.replace(".function.", ".", 1)
    for chat_name, ours in (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
                            ("response_format", "text.format")):
        e.message = re.sub(rf"\b{chat_name}\b", ours, e.message)
    return e


# --- response: chat -> Responses --------------------------------------------------------------

def _usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _message_item(text: str, status: str) -> dict:
    return {"id": _new_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": _new_id("fc"), "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def output_items(message: dict, incomplete: bool) -> list[dict]:
    """A chat message as output items: its text as a `message` item (also when there is neither
    text nor a call), then one `function_call` item per call."""
    status = "incomplete" if incomplete else "completed"
    calls = message.get("tool_calls") or []
    items = [_message_item(message.get("content") or "", status)] if message.get("content") or not calls else []
    items += [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed") for c in calls]
    return items


@dataclass
class Answer:
    """One Responses request from its translation to its stored row: what the response object
    echoes and what storing it needs."""

    id: str
    created_at: int
    body: ResponsesRequest
    caller: Caller
    input_items: list[dict]  # this request's own items (canonical), as stored
    params: dict  # the response object's echo fields (`_params`)

    def object(self, *, status: str, output: list[dict], usage: dict | None = None,
               error: dict | None = None) -> dict:
        """The `response` object with `status` (in_progress, completed, incomplete, failed)."""
        details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": details, "instructions": self.body.instructions, "model": self.body.model,
                "output": output, "previous_response_id": self.body.previous_response_id, "usage": usage,
                "metadata": self.body.metadata or {}, "store": self.body.stores, **self.params}

    def finished(self, *, output: list[dict], finish_reason: str | None, usage: dict | None) -> dict:
        """The final object from the chat answer's finish_reason ("length": incomplete) and usage."""
        return self.object(status="incomplete" if finish_reason == "length" else "completed", output=output,
                           usage=_usage(usage))


def _params(body: ResponsesRequest, tools: list[dict], tool_choice: str | dict | None) -> dict:
    """The response object's echo of the request (OpenAI's defaults where it gave none)."""
    fmt = body.text.format.as_dict() if body.text is not None and body.text.format is not None else {"type": "text"}
    return {"background": False, "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "prompt_cache_key": body.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None}, "safety_identifier": body.safety_identifier,
            "service_tier": "default", "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt, "verbosity": "medium"}, "tool_choice": tool_choice or "auto", "tools": tools,
            "top_logprobs": 0, "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
            "user": body.user}


async def _store(gw: Gateway, answer: Answer, response: dict) -> None:
    """Keep `response` when its request asked to (module docstring); on a database failure the
    response says it was not stored."""
    if not answer.body.stores:
        return
    row_fields = ("id", "object", "created_at", "status", "instructions", "model", "output", "usage", "metadata",
                  "previous_response_id", "store")
    row = NewResponse(id=answer.id, tenant_id=answer.caller.tenant_id, api_key_id=answer.caller.key_id,
                      model=response["model"], status=response["status"],
                      created_at=datetime.fromtimestamp(answer.created_at, timezone.utc),
                      previous_response_id=response["previous_response_id"], instructions=response["instructions"],
                      input_items=answer.input_items, output_items=response["output"], usage=response["usage"],
                      metadata=response["metadata"], params={k: v for k, v in response.items() if k not in row_fields})
    try:
        await run_db(gw, lambda s: responses_store.save(session=s, response=row,
                                                        retention_days=gw.settings.responses_retention_days),
                     changes=False)
    except ApiError:
        log.exception("response %s: could not be stored; answered with store false", answer.id)
        response["store"] = False


def stored_object(row: StoredResponse) -> dict:
    """A stored response as GET answers it: the object as it was answered."""
    return {**row.params, "id": row.id, "object": "response", "created_at": int(as_utc(row.created_at).timestamp()),
            "status": row.status, "instructions": row.instructions, "model": row.model, "output": row.output_items,
            "previous_response_id": row.previous_response_id, "usage": row.usage, "metadata": row.metadata_,
            "store": True}


# --- streaming --------------------------------------------------------------------------------

class _Events:
    """The Responses stream's events, built from chat chunks: each event is SSE bytes (`event:`
    and `data:` lines, as OpenAI sends them) with the next sequence_number. Output items open
    when their first delta comes (a message's text; a function call's name) and close when
    another item opens or the stream ends; `output` holds them as they stand."""

    def __init__(self):
        self.sequence = 0
        self.output: list[dict] = []
        self._message: dict | None = None  # the open message item
        self._calls: dict[int, dict] = {}  # chat tool-call index -> its function_call item
        self._open_calls: list[dict] = []

    def event(self, kind: str, **fields) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields}, separators=(",", ":"))
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": next(i for i, x in enumerate(self.output) if x is item)}

    def text(self, delta: str) -> bytes:
        out = b""
        if self._message is None:
            out += self._close_calls("completed")
            self._message = item = _message_item("", "in_progress")
            part = item["content"].pop()
            self.output.append(item)
            out += self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)
            out += self.event("response.content_part.added", **self._where(item), content_index=0, part=part)
            item["content"].append(part)
        part = self._message["content"][0]
        part["text"] += delta
        return out + self.event("response.output_text.delta", **self._where(self._message), content_index=0,
                                delta=delta, logprobs=[])

    def tool_call(self, call: dict) -> bytes:
        out = b""
        fn = call.get("function") or {}
        index = call.get("index", 0)
        if index not in self._calls:
            out += self._close_message("completed") + self._close_calls("completed")
            item = _call_item(call.get("id") or _new_id("call"), fn.get("name") or "", "", "in_progress")
            self._calls[index] = item
            self._open_calls.append(item)
            self.output.append(item)
            out += self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)
        item = self._calls[index]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            if item in self._open_calls:
                out += self.event("response.function_call_arguments.delta", **self._where(item),
                                  delta=fn["arguments"])
        return out

    def close(self, incomplete: bool) -> bytes:
        """Close every open item (a reply with no output at all gets its empty message)."""
        status = "incomplete" if incomplete else "completed"
        out = b""
        if not self.output:
            out += self.text("")
        return out + self._close_message(status) + self._close_calls(status)

    def _close_message(self, status: str) -> bytes:
        item, self._message = self._message, None
        if item is None:
            return b""
        part = item["content"][0]
        where = self._where(item)
        item["status"] = status
        return (self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
                + self.event("response.content_part.done", **where, content_index=0, part=part)
                + self.event("response.output_item.done", output_index=where["output_index"], item=item))

    def _close_calls(self, status: str) -> bytes:
        out = b""
        for item in self._open_calls:
            where = self._where(item)
            item["status"] = status
            out += self.event("response.function_call_arguments.done", **where, name=item["name"],
                              arguments=item["arguments"])
            out += self.event("response.output_item.done", output_index=where["output_index"], item=item)
        self._open_calls = []
        return out

    def unfinished(self) -> list[dict]:
        """The output so far with open items marked incomplete (a failed stream's)."""
        for item in self.output:
            if item["status"] == "in_progress":
                item["status"] = "incomplete"
        return self.output


async def _stream(gw: Gateway, gen: generation.Generation, answer: Answer) -> AsyncIterator[bytes]:
    """The SSE body: response.created and response.in_progress, the items' events as chat chunks
    come, then response.completed (or .incomplete at max_output_tokens) with the usage, after the
    usage event is durable and the response stored; a mid-stream engine failure ends with an
    `error` event and response.failed. Closed early (the client went away), the chat stream is
    closed: the engine requests are aborted and what was sent is billed, as for chat."""
    ev = _Events()
    chunks = generation.stream_chat(gen)
    try:
        snapshot = answer.object(status="in_progress", output=[])
        yield ev.event("response.created", response=snapshot) + ev.event("response.in_progress", response=snapshot)
        finish_reason, usage, error = None, None, None
        async for chunk in chunks:
            if "error" in chunk and "choices" not in chunk:
                error = chunk["error"]
                break
            if not chunk.get("choices"):
                usage = chunk.get("usage") or usage
                continue
            out = b""
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    out += ev.text(delta["content"])
                for call in delta.get("tool_calls") or []:
                    out += ev.tool_call(call)
                finish_reason = choice.get("finish_reason") or finish_reason
            if out:
                yield out
        if error is not None:
            # In the Responses request's terms (a grammar that failed names text.format or tools).
            said = in_responses_terms(ApiError(400, error.get("message") or "engine error", param=error.get("param")))
            failed = {"code": error.get("code") or "server_error", "message": said.message}
            response = answer.object(status="failed", output=ev.unfinished(), error=failed)
            await _store(gw, answer, response)
            yield Final(ev.event("error", code=failed["code"], message=failed["message"], param=said.param)
                        + ev.event("response.failed", response=response))
            return
        out = ev.close(incomplete=finish_reason == "length")
        response = answer.finished(output=ev.output, finish_reason=finish_reason, usage=usage)
        await _store(gw, answer, response)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield Final(out + ev.event(kind, response=response))
    finally:
        await chunks.aclose()


# --- routes -----------------------------------------------------------------------------------

async def _history(gw: Gateway, caller: Caller, response_id: str) -> list[dict]:
    try:
        return await run_db(gw, lambda s: responses_store.history(
            session=s, tenant_id=caller.tenant_id, response_id=response_id,
            retention_days=gw.settings.responses_retention_days), changes=False)
    except ChainError as e:
        raise ApiError(400, e.message, param="previous_response_id", code=e.code) from None


@router.post("/responses", response_model=out.Response, responses={200: {"content": out.SSE_CONTENT}})
async def create_response(body: ResponsesRequest, caller: CallerDep, gw: GatewayDep, request: Request):
    """OpenAI's Responses API (module docstring): a response object, or its SSE events."""
    refuse_unsupported(body)
    items = normalize_input(body.input)
    tools = normalize_tools(body.tools)
    tool_choice = normalize_tool_choice(body.tool_choice)
    history = await _history(gw, caller, body.previous_response_id) if body.previous_response_id else []
    chat = chat_request(body, history + items, tools, tool_choice)
    answer = Answer(id=_new_id("resp"), created_at=int(time.time()), body=body, caller=caller, input_items=items,
                    params=_params(body, tools, tool_choice))
    try:
        gen = await cancel_on_disconnect(request.receive, lambda: chat_api.start_generation(
            gw=gw, caller=caller, body=chat, kind="chat", request_id=answer.id))
    except ApiError as e:
        raise in_responses_terms(e) from None
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the usage event says "aborted"
    if body.stream:
        return DisconnectAwareStream(_stream(gw, gen, answer), media_type="text/event-stream",
                                     headers=gen.headers | {"cache-control": "no-cache", "x-accel-buffering": "no"})
    try:
        completion = await cancel_on_disconnect(request.receive, lambda: generation.collect_chat(gen))
    except ApiError as e:
        raise in_responses_terms(e) from None
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the usage event says "aborted"
    choice = completion["choices"][0]
    response = answer.finished(output=output_items(choice["message"], choice["finish_reason"] == "length"),
                               finish_reason=choice["finish_reason"], usage=completion.get("usage"))
    await _store(gw, answer, response)
    return JSONResponse(response, headers=gen.headers)


async def _stored(gw: Gateway, caller: Caller, response_id: str) -> StoredResponse:
    row = await run_db(gw, lambda s: responses_store.get(session=s, tenant_id=caller.tenant_id, response_id=response_id,
                                                         retention_days=gw.settings.responses_retention_days),
                       changes=False)
    if row is None:
        raise _not_found(response_id)
    return row


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"response with id {response_id[:80]!r} not found", param="response_id",
                    code="response_not_found")


@router.get("/responses/{response_id}", response_model=out.Response, response_model_exclude_unset=True)
async def get_response(response_id: str, caller: CallerDep, gw: GatewayDep, stream: bool = False):
    """A stored response of the caller's tenant, as it was answered; 404 for any other id."""
    if stream:
        raise ApiError(400, "stream: replaying a stored response as events is not supported (leave it out)",
                       param="stream", code="unsupported_parameter")
    return stored_object(await _stored(gw, caller, response_id))


@router.delete("/responses/{response_id}", response_model=out.ResponseDeleted)
async def delete_response(response_id: str, caller: CallerDep, gw: GatewayDep):
    """Delete a stored response of the caller's tenant; 404 for any other id."""
    removed = await run_db(gw, lambda s: responses_store.remove(
        session=s, tenant_id=caller.tenant_id, response_id=response_id,
        retention_days=gw.settings.responses_retention_days), changes=False)
    if not removed:
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
