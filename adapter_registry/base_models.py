"""Which served base model a name from an adapter's config (or an uploader) refers to.

PEFT writes whatever its base was loaded from into base_model_name_or_path: a hub id
("HuggingFaceTB/SmolLM2-135M-Instruct"), or for a local checkout its path as given
("/models/SmolLM2-135M-Instruct", "~/ckpt/base", "./smol", "C:\\models\\smol"). `match_base_model`
maps such a name to the served models it can mean, matching case-insensitively:

- a served name (what the engine serves, ModelConfig.name: "SmolLM2-135M-Instruct",
  "Qwen/Qwen2.5-7B-Instruct"), or an alias: each served model's final segment
  ("Qwen2.5-7B-Instruct"), its built-in aliases (BUILTIN_BASE_MODEL_ALIASES: the embedded
  SmolLM2's hub id and GGUF file) and the configured ones (settings' base_model_aliases, whose
  keys may be local paths too);
- a local path whose final segment is one of the bare (slash-free) names above.

A hub id of another organization ("someone/SmolLM2-135M-Instruct") is not a local path and is not
matched by its final segment: it may well be different weights. Pure functions on plain data:
settings.py and the sandboxed validation child both import this module.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

# Other names of a served model, by the name the engine serves it under: names only, no shapes.
# The embedded SmolLM2 (engine.loader.gguf_loader's DEFAULT_MODEL_NAME and DEFAULT_GGUF_FILE, not
# imported: that module needs torch) is served as its final segment, and adapters trained on it
# name its hub id.
BUILTIN_BASE_MODEL_ALIASES: dict[str, tuple[str, ...]] = {
    "SmolLM2-135M-Instruct": ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
ALIASES_ENV = "TESSERA_BASE_MODEL_ALIASES"

_WINDOWS_PATH = re.compile(r"^[A-Za-z]:[\\/]")
_LOCAL_PREFIXES = ("/", "~", "./", "../", ".\\", "..\\", "\\")


def alias_key(name: str) -> str:
    """The form names are compared in: no surrounding blanks, '/' separators, no trailing one,
    lower case."""
    return name.strip().replace("\\", "/").rstrip("/").lower()


def is_local_path(name: str) -> bool:
    """Whether `name` is a filesystem path rather than a hub id (at most "org/name"): absolute,
    ~, ./ or ../, a Windows drive or UNC path, backslashes, or more than two segments."""
    raw = name.strip()
    return (raw.startswith(_LOCAL_PREFIXES) or bool(_WINDOWS_PATH.match(raw)) or "\\" in raw
            or raw.rstrip("/").count("/") >= 2)


def _final_segment(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _name_table(served: list[str], aliases: Mapping[str, str]) -> dict[str, set[str]]:
    """alias_key -> the served models that name means (two or more: ambiguous)."""
    table: dict[str, set[str]] = {}
    for s in served:
        table.setdefault(alias_key(s), set()).add(s)
        table.setdefault(_final_segment(alias_key(s)), set()).add(s)
    for alias, target in aliases.items():
        table.setdefault(alias_key(alias), set()).add(target)
    table.pop("", None)
    return table


def match_base_model(name: str, served: list[str], aliases: Mapping[str, str]) -> list[str]:
    """The served models `name` refers to (sorted): one when it resolves, none when it names
    nothing served, two or more when it is ambiguous (say, a path whose final segment is the
    final segment of two served models). `aliases`: alias or local path -> served name."""
    table = _name_table(served, aliases)
    key = alias_key(name)
    if key in table:
        return sorted(table[key])
    return final_segment_matches(name, served, aliases) if is_local_path(name) else []


def final_segment_matches(name: str, served: list[str], aliases: Mapping[str, str]) -> list[str]:
    """The served models whose name's final segment, or a bare alias, is `name`'s final segment
    (sorted): what `name` would mean if it were a local path."""
    return sorted(_name_table(served, aliases).get(_final_segment(alias_key(name)), ()))


def check_alias_names(configured: Mapping[str, str]) -> None:
    """ValueError naming TESSERA_BASE_MODEL_ALIASES when an alias is blank (what can be checked
    before the served models are known)."""
    for alias in configured:
        if not alias_key(alias):
            raise ValueError(f"{ALIASES_ENV}: alias {alias!r} is blank")


def aliases_in_effect(configured: Mapping[str, str], served: list[str]) -> dict[str, str]:
    """The aliases to resolve names with: each served model's built-in ones, then `configured`
    (alias or local path -> a served model, by its served name or any name that means exactly it:
    its final segment, a built-in alias; each mapped to the served name). ValueError naming
    TESSERA_BASE_MODEL_ALIASES when a target is not served, an alias is blank, or an alias would
    name a second model (it differs only in case from another alias, or is a served model's name
    or final segment)."""
    merged = {a: name for name in served for a in BUILTIN_BASE_MODEL_ALIASES.get(name, ())}
    builtin_names = _name_table(served, merged)
    for alias, target in configured.items():
        means = sorted(builtin_names.get(alias_key(target), ())) if isinstance(target, str) else []
        if len(means) != 1:
            raise ValueError(f"{ALIASES_ENV}: alias {alias!r} names {target!r}, which is not served "
                             f"(served: {', '.join(served) or 'nothing yet'})")
        if not alias_key(alias):
            raise ValueError(f"{ALIASES_ENV}: alias {alias!r} is blank")
        merged[alias] = means[0]
    table = _name_table(served, merged)
    for alias in merged:
        targets = table[alias_key(alias)]
        if len(targets) > 1:
            raise ValueError(f"{ALIASES_ENV}: alias {alias!r} would name {' and '.join(sorted(targets))} "
                             "(names match regardless of case); keep one")
    return merged
