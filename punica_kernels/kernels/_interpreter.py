"""Triton's interpreter, patched triton.language once per launch instead of once per call.

The interpreter (TRITON_INTERPRET=1, how this project runs its GPU kernels on a CPU) replaces
triton.language's builtins with interpreted ones for the time of a launch (`_patch_lang`,
restored when the launch ends), and again at every call of one @triton.jit function from
another: a walk with `inspect.getmembers` over triton.language, its tensor and math modules
each time. Inside a launch those modules are already patched, so each repeat changes nothing,
and kernels that call small helpers in their loops pay it per call (bench/RESULTS.md, session
29).

`install()` makes each launch patch both triton.language and triton.language.core (the two
modules the interpreter patches; a kernel's helpers, and triton.language's own jit functions
such as `tl.sum`, may reach either) and skips the device-function calls' repeats while that
launch runs; the launch's end restores both, as before. Outside a launch a call patches as the
interpreter does. Nothing changes for compiled kernels, and nothing is installed where this
Triton's interpreter does not have the functions named here (another version: it then runs as
it is).
"""
from __future__ import annotations

import threading
import types

_state = threading.local()


class _AlreadyPatched:
    """The scope of a `_patch_lang` inside a launch (the launch's own and its device-function
    calls'): the launch restores the modules when it ends."""

    def restore(self) -> None:
        return None


_ALREADY_PATCHED = _AlreadyPatched()


def install() -> bool:
    """Install the once-per-launch patching; False (nothing installed) where this Triton's
    interpreter lacks `_patch_lang` or `GridExecutor`. Idempotent."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None:
        return False
    if getattr(patch_lang, "_tessera_once_per_launch", False):
        return True
    # _patch_lang patches the triton.language modules it finds in a function's globals.
    both = types.FunctionType((lambda: None).__code__, {"tl": tl, "core": tl.core})
    launch = executor.__call__

    def launch_patching_once(self, *args, **kwargs):
        outer = getattr(_state, "in_launch", False)
        scope = patch_lang(both)
        _state.in_launch = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            _state.in_launch = outer
            scope.restore()

    def patch_once_per_launch(fn):
        return _ALREADY_PATCHED if getattr(_state, "in_launch", False) else patch_lang(fn)

    patch_once_per_launch._tessera_once_per_launch = True
    interpreter._patch_lang = patch_once_per_launch
    executor.__call__ = launch_patching_once
    return True
