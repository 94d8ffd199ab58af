"""Text in a JSON request body is valid Unicode: decided once, at the edge, for every route.

JSON can spell text that is not Unicode: an unpaired surrogate escape ("\\ud800"), or the same
code unit written as UTF-8-style bytes (ED A0 80). Python decodes both into a `str` that the
tokenizer, the database and the JSON encoder of any answer that quotes it refuse, deep inside a
request. `valid_unicode_body`, an app-wide dependency, answers such a body with a 400 in
OpenAI's shape naming the first field that holds one (`param`, e.g. "messages[0].content", or
the object whose key it is), before authentication, quota or any other work; text is never
silently replaced.

Cost: a body is parsed once (FastAPI's parse, cached on the request, is reused); the parsed
value is walked only when its bytes hold something that can decode to a surrogate (a \\uD800 to
\\uDFFF escape, the bytes ED A0..BF, or a body that is not UTF-8), so ordinary bodies pay one
scan of their bytes.
"""
from __future__ import annotations

import json
import re

from fastapi import Request

from tessera.errors import ApiError

#: What can decode to a lone surrogate in a UTF-8 JSON body: an escape, or the bytes. A paired
#: escape (an emoji) or an escaped backslash before "ud800" match too; the walk then finds
#: nothing wrong. Two patterns, each with a literal prefix, scan far faster than one alternation.
_SUSPECT = (re.compile(rb"\\u[dD][89a-fA-F]"), re.compile(rb"\xed[\xa0-\xbf]"))
_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_TYPES = re.compile(r"application/(?:[\w.+-]*\+)?json\b", re.IGNORECASE)
#: The longest object key quoted in `param`; a longer one is cut.
_MAX_KEY_CHARS = 64


def invalid_text_param(value: object) -> str | None:
    """Where the first string (or object key) holding an unpaired surrogate sits in a parsed
    JSON value, in OpenAI's `param` form ("messages[0].content"; "" for the value itself; a
    bad key is named by the object holding it), or None when all its text is valid Unicode.
    Iterative: any nesting depth the JSON parser accepted is walked without recursion."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return path
        elif isinstance(node, dict):
            items = []
            for key, child in node.items():
                if _SURROGATE.search(key):
                    return path
                name = key if len(key) <= _MAX_KEY_CHARS else key[:_MAX_KEY_CHARS] + "..."
                items.append((child, f"{path}.{name}" if path else name))
            stack.extend(reversed(items))  # document order: the first bad field is named
        elif isinstance(node, list):
            stack.extend((child, f"{path}[{i}]") for i, child in reversed(list(enumerate(node))))
    return None


async def valid_unicode_body(request: Request) -> None:
    """The app-wide dependency: a JSON body whose text is not valid Unicode is a 400
    `invalid_unicode` naming the field (module docstring). Other bodies (forms, uploads, none)
    and bodies that are not JSON at all are left to the route."""
    if request.method in ("GET", "HEAD", "DELETE", "OPTIONS"):
        return
    if not _JSON_TYPES.match(request.headers.get("content-type", "")):
        return
    body = await request.body()  # FastAPI read it already for a JSON route: cached, no second read
    if not body or (not any(p.search(body) for p in _SUSPECT) and json.detect_encoding(body) == "utf-8"):
        return
    try:
        value = await request.json()  # cached too when FastAPI parsed it
    except (ValueError, RecursionError):  # not JSON, not decodable, too deep: the route's own parse answers it
        return
    param = invalid_text_param(value)
    if param is None:
        return
    where = param or "the request body"
    raise ApiError(400, f"{where}: holds text that is not valid Unicode (an unpaired UTF-16 surrogate such as "
                        "\\ud800); send text as UTF-8, or escape characters beyond U+FFFF as surrogate pairs",
                   param=param or None, code="invalid_unicode")
