"""Run one function in a child process bounded in wall-clock time, CPU time and memory.

`run_sandboxed("package.module:function", args, timeout_s=..., max_memory_bytes=...)` starts
`python -m adapter_registry.sandbox`, which sets its own resource limits (RLIMIT_AS = the memory
cap, RLIMIT_CPU = the deadline rounded up plus one second, no core files, no file writes), then
imports the module, calls `function(*args)` and writes its JSON result to stdout. The caller's
thread only waits on a pipe (it holds no GIL meanwhile, so an event loop in the same process
keeps running); past the deadline the child is killed. Every failure of the child (deadline,
CPU limit, memory limit, crash, an exception of the function) is a SandboxFailure whose message
says which, in words meant for the person whose input it was: no paths, no tracebacks (those go
to this module's log).

The child is a fresh interpreter (not a fork of the caller: nothing of the caller's state, threads
or locks is inherited) importing only the target's module, so starting one costs a Python start
plus those imports (~0.1-0.2 s for validation: numpy and the PEFT format module). The target is
always named by our code, never by a tenant; arguments and results are plain JSON.

`max_concurrent` bounds how many children this process runs at once (each may use up to its
memory cap); callers beyond it wait for a slot before their deadline starts.
"""
from __future__ import annotations

import importlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The directory holding the adapter_registry and engine packages, put on the child's PYTHONPATH
# so the child imports the same code as its parent wherever it was started from.
_CODE_ROOT = str(Path(__file__).resolve().parents[1])
# Numerical libraries would otherwise start a thread per core (and reserve address space for each).
_SINGLE_THREADED = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_STDERR_TAIL = 4000

_slots_guard = threading.Lock()
_slots: dict[int, threading.BoundedSemaphore] = {}


class SandboxFailure(Exception):
    """The sandboxed call did not return a result; str(e) says why (deadline, limit, crash)."""


def _slots_for(n: int) -> threading.BoundedSemaphore:
    with _slots_guard:
        return _slots.setdefault(n, threading.BoundedSemaphore(n))


def run_sandboxed(target: str, args: list, *, timeout_s: float, max_memory_bytes: int,
                  max_concurrent: int = 2, what: str = "the sandboxed call") -> Any:
    """`target(*args)` ("module:function") in a bounded child process; its JSON-able result.

    Raises SandboxFailure, worded "<what> exceeded its 30 s deadline" / "... its memory limit of
    N MiB" / "... its CPU time limit" / "<what> crashed (...)" / "<what> failed unexpectedly
    (ExceptionType)". A child that cannot be started at all raises OSError (the host is out of
    processes or memory: not the input's fault)."""
    request = json.dumps({"target": target, "args": args, "max_memory_bytes": int(max_memory_bytes),
                          "cpu_seconds": int(math.ceil(timeout_s)) + 1}).encode()
    env = {**os.environ, **_SINGLE_THREADED,
           "PYTHONPATH": os.pathsep.join(p for p in (_CODE_ROOT, os.environ.get("PYTHONPATH")) if p)}
    with _slots_for(max_concurrent):
        proc = subprocess.Popen([sys.executable, "-B", "-m", "adapter_registry.sandbox"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
        try:
            out, err = proc.communicate(request, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise SandboxFailure(f"{what} exceeded its {timeout_s:g} s deadline") from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return _result(proc.returncode, out, err, what=what, max_memory_bytes=max_memory_bytes, timeout_s=timeout_s)


def _result(returncode: int, out: bytes, err: bytes, *, what: str, max_memory_bytes: int, timeout_s: float) -> Any:
    tail = err[-_STDERR_TAIL:].decode(errors="replace")
    try:  # the reply is the last line (a library may have printed before it)
        reply = json.loads(out.rstrip(b"\n").rsplit(b"\n", 1)[-1]) if returncode == 0 else None
    except ValueError:
        reply = None
    if isinstance(reply, dict) and "result" in reply:
        return reply["result"]
    if isinstance(reply, dict) and reply.get("memory_error"):
        raise SandboxFailure(f"{what} exceeded its memory limit of {max_memory_bytes // (1 << 20)} MiB")
    if isinstance(reply, dict) and "error" in reply:
        log.warning("%s failed in its sandbox: %s\n%s", what, reply["error"], tail)
        raise SandboxFailure(f"{what} failed unexpectedly ({reply['error']})")
    log.warning("%s sandbox ended with status %s\n%s", what, returncode, tail)
    if returncode == -signal.SIGXCPU:
        raise SandboxFailure(f"{what} exceeded its CPU time limit of {math.ceil(timeout_s) + 1} s")
    if returncode == -signal.SIGKILL:  # the kernel's OOM killer, or an operator
        raise SandboxFailure(f"{what} was killed (SIGKILL), e.g. for using too much memory")
    if returncode < 0:
        raise SandboxFailure(f"{what} crashed ({signal.Signals(-returncode).name})")
    raise SandboxFailure(f"{what} crashed (exit status {returncode})")


def _apply_limits(max_memory_bytes: int, cpu_seconds: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, max_memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # it reads files; it never writes one


def _child_main() -> None:
    """The child's side: read the request from stdin, apply the limits, call, write the reply."""
    request = json.loads(sys.stdin.buffer.read())
    _apply_limits(request["max_memory_bytes"], request["cpu_seconds"])
    try:
        module, _, name = request["target"].partition(":")
        result = getattr(importlib.import_module(module), name)(*request["args"])
        reply = json.dumps({"result": result})
    except MemoryError:
        reply = json.dumps({"memory_error": True})
    except BaseException as e:  # reported to the parent, which turns it into a SandboxFailure
        import traceback

        traceback.print_exc()
        reply = json.dumps({"error": type(e).__name__})
    sys.stdout.write("\n" + reply + "\n")
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: the reply is out, nothing else matters


if __name__ == "__main__":
    _child_main()
