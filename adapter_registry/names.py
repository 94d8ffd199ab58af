"""The rule for names people give things: tenants, adapters and API keys. One check, used by the
registry's services, the admin API and the CLI, so a name refused in one is refused in all.

Identifiers (tenant and adapter names) appear in URLs, model references (`adapter@3`), metric
labels and billing exports, so their profile is printable ASCII without separators:
  1 to 64 characters, ASCII letters, digits, '.', '_' or '-', the first a letter or a digit.
A trailing newline, surrounding whitespace, control characters and any non-ASCII character are
refused (not stripped: what was stored is what was sent). Identifiers are unique ignoring case
(`identifier_key`): "Acme" cannot be created beside "acme", so two tenants can never be told
apart by case alone in a log, a label or an invoice. Lookups stay exact.

Labels (API key names) are shown, never parsed: 1 to 64 characters of Unicode in NFC form,
printable (no control, format, surrogate, private-use or unassigned characters, no line or
paragraph separators), without leading or trailing whitespace. They need not be unique (a key is
known by its id; a rotated key keeps its label).

A name that breaks the rule raises InvalidName (422), whose `param` names the field.
"""
from __future__ import annotations

import re
import unicodedata

from adapter_registry.errors import InvalidName

MAX_LENGTH = 64
IDENTIFIER_PROFILE = "1-64 ASCII letters, digits, '.', '_' or '-', starting with a letter or digit"
LABEL_PROFILE = "1-64 printable characters (NFC), no control characters, no leading or trailing whitespace"

# \Z, not $: `$` also matches before a trailing newline.
_IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
# Unicode general categories a label may not contain: controls, format characters (bidi
# overrides, zero-width joiners), surrogates, private use, unassigned, line/paragraph separators.
_UNPRINTABLE = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}


def _shown(value: str) -> str:
    return repr(value if len(value) <= 80 else value[:80] + "...")


def check_identifier(value: object, *, what: str, param: str = "name") -> str:
    """`value` if it is a valid tenant/adapter name (see the module docstring), else InvalidName
    saying which `what` ("tenant name", "adapter name") and naming `param`."""
    if not isinstance(value, str):
        raise InvalidName(f"{what} must be a string", param=param)
    if not _IDENTIFIER.match(value):
        raise InvalidName(f"invalid {what} {_shown(value)}: use {IDENTIFIER_PROFILE}", param=param)
    return value


def identifier_key(value: str) -> str:
    """The form two identifiers are compared in for uniqueness (ASCII: lower case)."""
    return value.lower()


def check_label(value: object, *, what: str, param: str = "name") -> str:
    """`value` if it is a valid label (an API key's name; see the module docstring), else
    InvalidName naming `param`."""
    if not isinstance(value, str):
        raise InvalidName(f"{what} must be a string", param=param)
    if not 1 <= len(value) <= MAX_LENGTH:
        raise InvalidName(f"invalid {what}: {len(value)} characters; use {LABEL_PROFILE}", param=param)
    if unicodedata.normalize("NFC", value) != value:
        raise InvalidName(f"invalid {what} {_shown(value)}: not in Unicode NFC form; use {LABEL_PROFILE}", param=param)
    bad = next((c for c in value if unicodedata.category(c) in _UNPRINTABLE), None)
    if bad is not None:
        raise InvalidName(f"invalid {what} {_shown(value)}: character U+{ord(bad):04X} is not printable; "
                          f"use {LABEL_PROFILE}", param=param)
    if value != value.strip():
        raise InvalidName(f"invalid {what} {_shown(value)}: leading or trailing whitespace; use {LABEL_PROFILE}",
                          param=param)
    return value
