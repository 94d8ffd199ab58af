"""The shape and bounds of a request's `response_format` (OpenAI's), checked before any grammar is
compiled: SamplingParams validates it with `normalize`, so the gateway, the engine worker's
protocol and the engine all refuse the same inputs with the same message."""
from __future__ import annotations

import json
import re

#: The largest JSON schema accepted, in bytes of its compact JSON: compile time and the grammar's
#: memory grow with it, and a real schema is far smaller.
MAX_SCHEMA_BYTES = 32 * 1024
#: The largest Lark grammar accepted (tool calls: every tool's schema, each within the bounds
#: above, plus the call syntax around them).
MAX_GRAMMAR_BYTES = 4 * MAX_SCHEMA_BYTES
#: The deepest nesting of objects and arrays accepted in a schema.
MAX_SCHEMA_DEPTH = 32
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TYPES = ("text", "json_object", "json_schema")


def normalize(value) -> dict | None:
    """A response_format as OpenAI shapes it -> None (no constraint: absent or type "text"),
    {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name", "schema"?,
    "strict"?, "description"?}} with only the keys given. Raises ValueError saying which part
    is wrong (unknown keys included); nothing is compiled here.

    Also {"type": "lark", "lark": text}: a Lark grammar (llguidance's dialect, `%json {...}` for
    embedded schemas) that the gateway builds for forced tool calls (tessera.tool_calls) from
    schemas it has bounded like json_schema's. It is not an OpenAI type: the tenant-facing API
    never accepts it (tessera.api.schemas.ResponseFormat), and its size is bounded here."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object with a 'type'")
    kind = value.get("type")
    if kind == "lark":
        text = value.get("lark")
        if set(value) != {"type", "lark"} or not isinstance(text, str) or not text:
            raise ValueError("a lark response_format is {'type': 'lark', 'lark': <grammar text>}")
        if len(text.encode()) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"the grammar is {len(text.encode())} bytes; at most {MAX_GRAMMAR_BYTES} are accepted")
        return {"type": "lark", "lark": text}
    if kind not in _TYPES:
        raise ValueError(f"type must be one of {', '.join(repr(t) for t in _TYPES)} (got {_brief(kind)})")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = sorted(str(k) for k in value if k not in allowed)
    if extra:
        raise ValueError(f"unknown field {extra[0]!r} for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("json_schema must be an object with a 'name' and a 'schema'")
    extra = sorted(str(k) for k in spec if k not in ("name", "schema", "strict", "description"))
    if extra:
        raise ValueError(f"json_schema: unknown field {extra[0]!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError("json_schema.name must be 1 to 64 letters, digits, '_' or '-'")
    out: dict = {"name": name}
    if spec.get("description") is not None:
        if not isinstance(spec["description"], str):
            raise ValueError("json_schema.description must be a string")
        out["description"] = spec["description"]
    if spec.get("strict") is not None:
        if not isinstance(spec["strict"], bool):
            raise ValueError("json_schema.strict must be a boolean")
        out["strict"] = spec["strict"]
    schema = spec.get("schema")
    if schema is not None:
        if not isinstance(schema, dict):
            raise ValueError("json_schema.schema must be a JSON schema object")
        check_schema_bounds(schema, "json_schema.schema")
        out["schema"] = schema
    return {"type": "json_schema", "json_schema": out}


def check_schema_bounds(schema: dict, where: str) -> None:
    """ValueError naming `where` when the schema's compact JSON exceeds MAX_SCHEMA_BYTES or its
    objects and arrays nest deeper than MAX_SCHEMA_DEPTH (checked without recursion, so a hostile
    nesting cannot exhaust the stack). Tools' parameters (tessera.tool_calls) have the same bounds."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    size = len(json.dumps(schema, separators=(",", ":")).encode())
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"{where} is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are accepted")


def _brief(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."
