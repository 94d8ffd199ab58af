"""Tool calling (OpenAI's `tools`): how a request's tools and its tool-call history reach the
model, how a forced call is constrained, and how the model's calls are read back out of its text.

A model writes tool calls in the format its chat template teaches it (`tool_format` reads it off
the template):

- "hermes": one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block per call
  (Qwen2.5, Qwen3, Hermes). Also Tessera's **default format**, for templates that know no tools
  (SmolLM2, Gemma, Phi-3): `render` then writes the tools into the system message itself
  (`DEFAULT_TOOLS_PROMPT`), an earlier call into the assistant's text as such a block, and a tool
  result into a user turn between `<tool_response>` and `</tool_response>`; the demo adapter
  `weather-tools` is trained on exactly this rendering.
- "llama3_json": the reply is the call's JSON, `{"name": ..., "parameters": {...}}` (Llama 3.1+;
  several calls separated by "; ").
- "mistral": `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`.

`tool_choice` "required" and a named function are enforced token by token: `constraint` builds
a Lark grammar (engine.response_format's "lark" type) whose JSON parts are the tools' own
parameter schemas, so the call always parses and its arguments validate. "auto" leaves the model
free, and `parse` / `StreamParser` read whatever calls it wrote; text that does not parse as a
call stays text (never an error). Tools' schemas are bounded like response_format's
(engine.response_format: size and depth per schema) before any grammar is built.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from engine.response_format import MAX_GRAMMAR_BYTES, check_schema_bounds
from engine.structured_output import COMPACT_JSON

#: The most tools one request may declare (OpenAI's limit).
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"

#: The system text the default format adds: the tools, one JSON object per line, and the shape
#: of a call. `{tools}` is replaced by those lines.
DEFAULT_TOOLS_PROMPT = (
    "You can call functions to help you answer. Each function is described by a JSON object "
    "on its own line between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call functions, reply with one block per call and nothing else:\n"
    "<tool_call>\n{{\"name\": \"<function name>\", \"arguments\": {{<arguments as a JSON object>}}}}\n</tool_call>\n"
    "A function's result comes back in a user turn between <tool_response> and </tool_response>.")


class ToolsError(ValueError):
    """A request's tools or tool_choice the server refuses; `param` names the field (a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ToolFormat:
    """How the served model writes calls: `name` (see the module docstring) and whether its chat
    template renders `tools`, assistant `tool_calls` and `tool` messages itself (`native`);
    `mistral_marker_id`: the token id of Mistral's `[TOOL_CALLS]` where it is a special token."""

    name: str
    native: bool
    mistral_marker_id: int | None = None


def tool_format(chat_template: str | None, token_to_id=None) -> ToolFormat:
    """The tool-call format a chat template teaches (the module docstring), read off its text:
    `<tool_call>` means hermes, `[TOOL_CALLS]` mistral, Llama 3.1's ipython environment
    llama3_json; any other template (or none) gets the default format, rendered by `render`.
    `token_to_id`: the tokenizer's lookup, for Mistral's special marker."""
    t = chat_template or ""
    if "<tool_call>" in t and "tools" in t:
        return ToolFormat("hermes", native=True)
    if "[TOOL_CALLS]" in t:
        marker = token_to_id("[TOOL_CALLS]") if token_to_id else None
        return ToolFormat("mistral", native=True, mistral_marker_id=marker)
    if "Environment: ipython" in t or "<|python_tag|>" in t:
        return ToolFormat("llama3_json", native=True)
    return ToolFormat("hermes", native=False)


# -- the request's tools ------------------------------------------------------------------------

@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict
    strict: bool | None = None

    def as_openai(self) -> dict:
        """The tool as OpenAI's `tools` entry (what chat templates iterate over)."""
        fn = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    """A request's checked tools and choice: `mode` "none" (no tools offered), "auto",
    "required" or "named" (`named`: the function); `parallel`: whether several calls may be made."""

    tools: tuple[Tool, ...]
    mode: str
    named: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> bool:
        """Whether the model is shown the tools and its reply is read for calls."""
        return bool(self.tools) and self.mode != "none"


def plan(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None) -> ToolPlan:
    """Check a request's `tools`, `tool_choice` and `parallel_tool_calls` (OpenAI's shapes).
    Raises ToolsError naming the field: a tool that is not a function with a valid name,
    duplicate names, more than MAX_TOOLS, a parameters schema over response_format's size or
    depth bounds, a tool_choice naming no declared tool, or one that needs tools without any."""
    checked: list[Tool] = []
    for i, t in enumerate(tools or ()):
        where = f"tools.{i}"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ToolsError(f"{where}: must be {{'type': 'function', 'function': {{...}}}} (only function tools "
                             "are supported)", "tools")
        fn = t["function"]
        extra = sorted(str(k) for k in fn if k not in ("name", "description", "parameters", "strict"))
        if extra:
            raise ToolsError(f"{where}.function: unknown field {extra[0]!r}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolsError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'", "tools")
        if any(c.name == name for c in checked):
            raise ToolsError(f"{where}.function.name: {name!r} is declared twice", "tools")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolsError(f"{where}.function.description must be a string", "tools")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolsError(f"{where}.function.parameters must be a JSON schema object", "tools")
        _check_schema(params, f"{where}.function.parameters")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolsError(f"{where}.function.strict must be a boolean", "tools")
        checked.append(Tool(name, desc, params, strict))
    if len(checked) > MAX_TOOLS:
        raise ToolsError(f"at most {MAX_TOOLS} tools are accepted ({len(checked)} given)", "tools")

    mode, named = _choice(tool_choice, checked)
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    return ToolPlan(tuple(checked), mode, named, parallel and mode != "named")


def _choice(tool_choice, tools: list[Tool]) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolsError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                             "'function': {'name': ...}}", "tool_choice")
        if tool_choice != "none" and not tools:
            raise ToolsError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolsError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                         "'function': {'name': ...}}", "tool_choice")
    if not any(t.name == name for t in tools):
        raise ToolsError(f"tool_choice names function {name[:64]!r}, which is not among the tools", "tool_choice")
    return "named", name


def _check_schema(schema: dict, where: str) -> None:
    try:
        check_schema_bounds(schema, where)
    except ValueError as e:
        raise ToolsError(str(e), "tools") from None


# -- rendering the conversation -----------------------------------------------------------------

def render(messages: list[dict], tool_plan: ToolPlan, fmt: ToolFormat) -> tuple[list[dict], list[dict] | None]:
    """The messages and `tools` to hand the chat template. `messages` are chat messages as dicts
    (role, content, and for assistants `tool_calls` in OpenAI's shape, for tools
    `tool_call_id`). A native template gets the tools and the calls as they are (each call's
    arguments decoded to an object, as templates write them with `tojson`); otherwise the
    default format writes them into the messages' text (module docstring)."""
    tools = [t.as_openai() for t in tool_plan.tools] if tool_plan.offered else None
    if fmt.native:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _decoded(
                    c["function"].get("arguments"))}} for c in m["tool_calls"]]}
            out.append(m)
        return out, tools

    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_block(c["function"]["name"], _decoded(c["function"].get("arguments")))
                              for c in m["tool_calls"])
            text = (m.get("content") or "").strip()
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if tools:
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = DEFAULT_TOOLS_PROMPT.format(tools=lines)
        if out and out[0]["role"] == "system":
            first = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{first}\n\n{prompt}" if first else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def call_block(name: str, arguments) -> str:
    """One call in the hermes/default format, as the model is taught to write it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def _decoded(arguments):
    """A call's arguments as an object where they are a JSON string of one (OpenAI sends a
    string), else as given."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value
    return arguments if arguments is not None else {}


# -- forcing a call -----------------------------------------------------------------------------

def constraint(tool_plan: ToolPlan, fmt: ToolFormat) -> dict | None:
    """The response_format (engine.response_format's "lark" type) that forces the plan's call(s),
    or None when the model chooses ("auto", "none"). Each call is the format's wrapper around a
    JSON object whose name is one of the allowed functions and whose arguments follow that
    function's parameters schema (compact JSON, as every grammar here)."""
    if tool_plan.mode not in ("required", "named"):
        return None
    tools = [t for t in tool_plan.tools if tool_plan.mode == "required" or t.name == tool_plan.named]
    args_key = "parameters" if fmt.name == "llama3_json" else "arguments"
    defs: dict = {}
    alternatives = []
    for i, t in enumerate(tools):
        params = _hoisted(_params_schema(t), f"t{i}_", defs)
        alternatives.append({"type": "object", "properties": {"name": {"const": t.name}, args_key: params},
                             "required": ["name", args_key], "additionalProperties": False})
    call = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    if defs:
        call = {**call, "$defs": defs}
    if fmt.name == "mistral":
        array = {"type": "array", "items": call, "minItems": 1}
        if not tool_plan.parallel:
            array["maxItems"] = 1
        marker = f"<[{fmt.mistral_marker_id}]>" if fmt.mistral_marker_id is not None else '"[TOOL_CALLS]"'
        lark = f"start: {marker} calls\ncalls: %json {_json(array)}\n"
    elif fmt.name == "llama3_json":
        more = ' ("; " call)*' if tool_plan.parallel else ""
        lark = f"start: call{more}\ncall: %json {_json(call)}\n"
    else:
        # Calls follow each other directly: after one, the model's usual newline is not
        # allowed, so it chooses between another call and the end (with a newline allowed, small
        # models repeat the call until max_tokens).
        more = "+" if tool_plan.parallel else ""
        lark = f'start: call{more}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {_json(call)}\n'
    if len(lark.encode()) > MAX_GRAMMAR_BYTES:
        raise ToolsError(f"the tools' schemas together are too large to force a call ({len(lark.encode())} bytes; "
                         f"at most {MAX_GRAMMAR_BYTES})", "tools")
    return {"type": "lark", "lark": lark}


def _params_schema(tool: Tool) -> dict:
    """The schema a forced call's arguments follow: the tool's parameters with every object that
    lists its properties closed to them (JSON Schema leaves them open unless a schema says
    `additionalProperties`, and pydantic's schemas do not: a small model then invents keys until
    max_tokens), as OpenAI's strict function calling has them."""
    schema = _closed(tool.parameters)
    schema.pop("x-guidance", None)
    return schema or {"type": "object"}


def _hoisted(schema: dict, prefix: str, defs: dict) -> dict:
    """`schema` made to work inside the call's schema, whose root is not its own: its `$defs`
    (or `definitions`) move to `defs` under `prefix`-ed names, and its references (to those, or
    to its own root) are rewritten to match."""
    local = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}

    def rewrite(node):
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str):
            if ref == "#":
                out["$ref"] = f"#/$defs/{prefix}root"
            elif ref.startswith(("#/$defs/", "#/definitions/")):
                out["$ref"] = f"#/$defs/{prefix}{ref.split('/', 2)[2]}"
        return out

    if not local and '"#' not in json.dumps(body):
        return body
    for name, sub in local.items():
        defs[f"{prefix}{name}"] = rewrite(sub)
    body = rewrite(body)
    defs[f"{prefix}root"] = body
    return body


#: Keywords whose subschemas are closed too; allOf's parts are left open, since closing each part
#: would refuse the properties the other parts add.
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_OPENNESS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")


def _closed(schema):
    """A copy of `schema` with the objects that list properties and say nothing of other keys
    closed (additionalProperties false); depth is bounded by `plan`'s check."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(v) for v in out[key]]
    if isinstance(out.get("items"), dict):
        out["items"] = _closed(out["items"])
    if "properties" in out and not any(k in out for k in _OPENNESS):
        out["additionalProperties"] = False
    return out


def _json(schema: dict) -> str:
    return json.dumps({**schema, "x-guidance": COMPACT_JSON}, ensure_ascii=False, separators=(",", ":"))


# -- reading calls back -------------------------------------------------------------------------

def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse(text: str, tool_plan: ToolPlan, fmt: ToolFormat) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished reply. With no tools offered, or text that does not parse
    as calls of declared functions, the whole text is the content and there are no calls."""
    if not tool_plan.offered:
        return text, []
    names = {t.name for t in tool_plan.tools}
    if fmt.name == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        values = _hermes_values(text[start:])
        calls = [_call_obj(v, names, "arguments") for v in values or ()]
        if not values or any(c is None for c in calls):
            return text, []
        content = text[:start].strip()
        return (content or None), calls
    if fmt.name == "llama3_json":
        calls = _json_sequence(text.strip().removeprefix("<|python_tag|>"), names, "parameters", sep=";")
        return (None, calls) if calls else (text, [])
    body = text.strip().removeprefix("[TOOL_CALLS]").strip()
    try:
        value, end = json.JSONDecoder().raw_decode(body) if body.startswith("[") else (None, 0)
    except ValueError:
        return text, []
    if not isinstance(value, list) or body[end:].strip() or not value:
        return text, []
    calls = [_call_obj(v, names, "arguments") for v in value]
    return (text, []) if any(c is None for c in calls) else (None, calls)


def _hermes_values(text: str) -> list | None:
    """The JSON values of a text made only of `<tool_call>` blocks (whitespace between), or None.
    Each block's JSON is decoded whole, so a string holding "</tool_call>" cannot end it."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return values
        if not text.startswith(_OPEN, i):
            return None
        i += len(_OPEN)
        while i < len(text) and text[i].isspace():
            i += 1
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        while i < len(text) and text[i].isspace():
            i += 1
        if not text.startswith(_CLOSE, i):
            return None
        i += len(_CLOSE)
        values.append(value)


def _call(body: str, names: set[str], args_key: str) -> ParsedCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _call_obj(value, names, args_key)


def _call_obj(value, names: set[str], args_key: str) -> ParsedCall | None:
    """A call from its JSON object: {"name": declared, args_key (or the other spelling): an object
    or a JSON string of one}; None otherwise."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get(args_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(value["name"], json.dumps(args, ensure_ascii=False))


def _json_sequence(text: str, names: set[str], args_key: str, sep: str) -> list[ParsedCall]:
    """Calls written as JSON objects separated by `sep`; [] unless the whole text is such calls."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return []
        call = _call_obj(value, names, args_key)
        if call is None:
            return []
        calls.append(call)
        while i < len(text) and (text[i].isspace() or text[i] == sep):
            i += 1
    return calls


# -- streaming ----------------------------------------------------------------------------------

@dataclass
class Delta:
    """What a stream sends next: content text, or a call's start (`index`, `id`, `name`, empty
    arguments) or a piece of its arguments (`index`, `arguments`)."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def as_openai(self) -> dict:
        """The chunk's `delta` in OpenAI's shape."""
        if self.index is None:
            return {"content": self.content}
        call: dict = {"index": self.index}
        if self.id is not None:
            call |= {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": ""}}
        else:
            call["function"] = {"arguments": self.arguments}
        return {"tool_calls": [call]}


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)')


class StreamParser:
    """Turns a reply's text deltas into `Delta`s as they arrive: content streams until a call
    may begin (a possible start of the marker is held back, never sent as content); a hermes
    call goes out as its start (id, name) then its arguments: forced by a grammar ("required",
    a named function), in pieces as the model writes them; chosen by the model ("auto"), once
    its block has closed and parsed (else it is text). The JSON formats (llama3_json, mistral), whose reply is either wholly calls or
    wholly text, hold a reply that starts like a call until it ends. Whatever turns out not to be
    a call is sent as content, by `finish` at the latest. `calls` counts the calls sent."""

    def __init__(self, tool_plan: ToolPlan, fmt: ToolFormat):
        self.plan, self.fmt = tool_plan, fmt
        self.names = {t.name for t in tool_plan.tools}
        self.calls = 0
        self._buf = ""  # text not yet sent
        self._state = "content" if tool_plan.offered else "plain"
        self._depth = 0  # inside a streaming call's arguments: brace depth
        self._in_string = self._escaped = False
        self._whole = ""  # the JSON formats: the held reply
        self._gap = ""  # the whitespace before a held call marker (sent if it was no call)
        # Arguments stream as written only where a grammar forces the call (it always parses);
        # a call the model chose is held until its block closes, so what does not parse is text.
        self._stream_arguments = tool_plan.mode in ("required", "named")

    def feed(self, text: str) -> list[Delta]:
        if self._state == "plain":
            return [Delta(content=text)] if text else []
        if self.fmt.name != "hermes":
            return self._feed_json(text)
        self._buf += text
        out: list[Delta] = []
        while True:
            before = (self._state, len(self._buf))
            out += self._step()
            if (self._state, len(self._buf)) == before:
                return out

    def finish(self) -> list[Delta]:
        """The rest at the end of the reply: held text that was no call, as content."""
        if self.fmt.name != "hermes" and self._state == "held":
            content, calls = parse(self._whole, self.plan, self.fmt)
            if calls:
                out = []
                for c in calls:
                    out += [Delta(index=self.calls, id=c.id, name=c.name), Delta(index=self.calls, arguments=c.arguments)]
                    self.calls += 1
                return out
            return [Delta(content=self._whole)] if self._whole else []
        rest, self._buf = self._buf, ""
        if self._state == "call_header":
            return [Delta(content=self._gap + _OPEN + rest)]
        if self._state == "content" and rest and not (self.calls and rest.isspace()):
            return [Delta(content=rest)]
        return []

    def _feed_json(self, text: str) -> list[Delta]:
        if self._state == "content":
            stripped = (self._whole + text).lstrip()
            if not stripped:
                self._whole += text
                return []
            opener = "{" if self.fmt.name == "llama3_json" else "["
            if stripped[0] == opener or stripped.startswith("[TOOL_CALLS]") or stripped.startswith("<|python_tag|>"):
                self._state = "held"
            else:
                self._state = "plain"
                text, self._whole = self._whole + text, ""
                return [Delta(content=text)]
        self._whole += text
        return []

    def _step(self) -> list[Delta]:
        if self._state == "content":
            # Whitespace before a call (or after one) is no content: the end of the text sent
            # is always its last non-whitespace character.
            at = self._buf.find(_OPEN)
            if at >= 0:
                content = self._buf[:at].rstrip()
                self._gap, self._buf = self._buf[len(content):at], self._buf[at + len(_OPEN):]
                self._state = "call_header"
                return [Delta(content=content)] if content else []
            keep = _partial_suffix(self._buf, _OPEN)
            content = self._buf[:len(self._buf) - keep].rstrip()
            self._buf = self._buf[len(content):]
            return [Delta(content=content)] if content else []
        if self._state == "call_header":
            m = _HEADER.match(self._buf) if self._stream_arguments else None
            if m and m.group(1) in self.names:
                call = Delta(index=self.calls, id=new_call_id(), name=m.group(1))
                self._buf = self._buf[m.end():]
                self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
                return [call]
            at = self._buf.find(_CLOSE)
            if at < 0:
                return []  # wait for the header or the block's end
            # A block this parser could not stream (another key order, say): whole, or as text.
            block, self._buf = self._buf[:at], self._buf[at + len(_CLOSE):].lstrip("\n")
            self._state = "content"
            parsed = _call(block, self.names, "arguments")
            if parsed is None:
                return [Delta(content=self._gap + _OPEN + block + _CLOSE)]
            index = self.calls
            self.calls += 1
            return [Delta(index=index, id=parsed.id, name=parsed.name), Delta(index=index, arguments=parsed.arguments)]
        if self._state == "arguments":
            end = self._scan_arguments()
            if end is None:
                piece, self._buf = self._buf, ""
                return [Delta(index=self.calls, arguments=piece)] if piece else []
            piece, self._buf = self._buf[:end], self._buf[end:]
            self._state = "call_tail"
            index = self.calls
            self.calls += 1
            return [Delta(index=index, arguments=piece)] if piece else []
        if self._state == "call_tail":
            at = self._buf.find(_CLOSE)
            if at >= 0:
                self._buf = self._buf[at + len(_CLOSE):].lstrip("\n")
                self._state = "content"
            return []
        return []

    def _scan_arguments(self) -> int | None:
        """Where the arguments object in the buffer ends (one past its closing brace), or None
        when it has not ended yet; advances the scan state over the whole buffer in that case."""
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch == "{":
                self._depth += 1
            elif ch == "}":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
