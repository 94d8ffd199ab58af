"""Kernel variants: which compiled form of a Triton kernel a launch needs, and who records them.

Triton's JIT compiles one binary per kernel *variant*: the kernel, its constexpr values, each
other argument's type (tensor dtype, i32 / i64 integer, fp32 float) and Triton's own
specialization of it (a pointer whose address is a multiple of 16, an integer divisible by 16,
an integer equal to 1 — the latter becomes a constexpr), plus the launch options (num_warps,
num_stages, ...). `variant_key` computes that key for a launch with the same native routine the
JIT's binder calls (`native_specialize_impl`, with the base backend's rules, which the CUDA
backend does not override), so two launches share a binary exactly when their keys are equal.
A launch whose key was never seen before compiles (seconds on a GPU), which is what must not
happen while requests are being served (engine.engine_builder's start-up warm-up).

Recorders:
- `LaunchRecorder`: the keys of every launch made while it is active, under the interpreter
  (it wraps `InterpretedFunction.run`) or compiled (it wraps `JITFunction.run`); launches run,
  or with `launch=False` only compile (the interpreter then runs nothing: the keys a forward
  needs, for the price of its host code).
- `CompileRecorder`: every compile the JIT makes while it is active, through Triton's
  `knobs.runtime.jit_post_compile_hook` (Triton 3.6 and 3.9 both have it; `available` is False
  under the interpreter or on a Triton without it, and nothing is recorded then).

`compile_launch` compiles one launch for a chosen GPU target without a GPU (a stand-in driver
answers the target; nothing is launched): bench/sass.py reads the SASS of what it returns.
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Hashable
from typing import Any, NamedTuple, Self


class VariantKey(NamedTuple):
    """The compiled form one launch needs (see the module docstring)."""

    #: The kernel's Python function, "module.qualname".
    kernel: str
    #: One entry per parameter: ("constexpr", value) or (type, specialization) as Triton's
    #: binder gives them ("*bf16", "D": a 16-byte aligned pointer; "i32", "": an integer not
    #: divisible by 16).
    specialization: tuple
    #: The launch options passed by keyword (num_warps, num_stages, ...), sorted by name.
    options: tuple


def _python_fn(kernel) -> Any:
    """The Python function of a JITFunction or an InterpretedFunction."""
    return kernel.fn


def _kernel_name(kernel) -> str:
    fn = _python_fn(kernel)
    return f"{fn.__module__}.{fn.__qualname__}"


def _no_specialize(kernel, what: str) -> set:
    """The parameters (by name or index) the kernel's decorator excludes from `what`
    ("do_not_specialize" or "do_not_specialize_on_alignment")."""
    found = getattr(kernel, what, None)
    if found is None:
        found = getattr(kernel, "kwargs", {}).get(what)
    return set(found or ())


def _hashable(value) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


#: Each kernel's signature and Triton's view of its parameters, built at its first launch.
_PARAMS: dict[Any, tuple[inspect.Signature, list]] = {}


def variant_key(kernel, args: tuple, kwargs: dict) -> VariantKey:
    """The key Triton's JIT compiles `kernel[grid](*args, **kwargs)` for (the module docstring).
    `kernel`: a JITFunction or, under the interpreter, an InterpretedFunction."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import KernelParam

    fn = _python_fn(kernel)
    cached = _PARAMS.get(kernel)
    if cached is None:
        sig = inspect.signature(fn)
        no_value = _no_specialize(kernel, "do_not_specialize")
        no_align = _no_specialize(kernel, "do_not_specialize_on_alignment")
        cached = _PARAMS[kernel] = (sig, [
            KernelParam(i, param, i in no_value or name in no_value, i in no_align or name in no_align)
            for i, (name, param) in enumerate(sig.parameters.items())])
    sig, kparams = cached
    params = {k: v for k, v in kwargs.items() if k in sig.parameters}
    bound = sig.bind(*args, **params)
    bound.apply_defaults()
    spec = []
    for kp in kparams:
        arg = bound.arguments[kp.name]
        if kp.is_constexpr:
            spec.append(("constexpr", _hashable(arg)))
            continue
        specialize = not kp.do_not_specialize
        ann = kp.annotation_type
        if isinstance(ann, str) and ann and (ann == "u1" or ann[:2] in ("fp", "bf")):
            specialize = False  # the binder never specializes annotated floats and bools
        got = native_specialize_impl(BaseBackend, arg, kp.is_const, specialize, not kp.do_not_specialize_on_alignment)
        if ann:
            got = (ann,) + tuple(got[1:]) if specialize else (ann, None)
        spec.append(_hashable(tuple(got)))
    options = tuple(sorted((k, _hashable(v)) for k, v in kwargs.items() if k not in sig.parameters))
    return VariantKey(_kernel_name(kernel), tuple(spec), options)


def _launch_classes() -> list[type]:
    """The classes whose `run(*args, grid, warmup, **kwargs)` every `kernel[grid](...)` goes
    through: JITFunction (compiled) and InterpretedFunction (TRITON_INTERPRET=1)."""
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    return classes


class LaunchRecorder:
    """While active (`with LaunchRecorder() as rec:`), the VariantKey of every Triton launch in
    this process goes to `rec.keys` (in launch order, repeats included). Warm-up calls
    (`warmup=True`) are recorded too: they compile the same variant.

    launch: True, launches run as usual; False, each is only compiled (`warmup=True`: the JIT
    compiles the variant and launches nothing; the interpreter does nothing), so outputs are
    left unwritten: for callers that want the variants a forward needs, not its results."""

    def __init__(self, *, launch: bool = True):
        self.launch = launch
        self.keys: list[VariantKey] = []
        self._saved: list[tuple[type, Any]] = []

    @property
    def variants(self) -> set[VariantKey]:
        """The distinct keys recorded."""
        return set(self.keys)

    def __enter__(self) -> Self:
        for cls in _launch_classes():
            original = cls.__dict__["run"]

            def run(kernel, *args, grid, warmup, _original=original, **kwargs):
                self.keys.append(variant_key(kernel, args, kwargs))
                if not self.launch:
                    warmup = True
                return _original(kernel, *args, grid=grid, warmup=warmup, **kwargs)

            self._saved.append((cls, original))
            cls.run = run
        return self

    def __exit__(self, *exc) -> None:
        while self._saved:
            cls, original = self._saved.pop()
            cls.run = original


class CompileRecorder:
    """While active, every kernel the JIT compiles (or loads from Triton's disk cache into this
    process) is appended to `compiles` as (kernel "module.qualname", Triton's cache key), through
    `triton.knobs.runtime.jit_post_compile_hook` (a hook installed before is still called).
    `available`: whether this Triton has the hook and compiles (False under the interpreter,
    which compiles nothing: use LaunchRecorder's keys there)."""

    def __init__(self):
        self.compiles: list[tuple[str, str]] = []
        self._runtime = None
        self._previous = None
        self.available = False

    def __enter__(self) -> Self:
        try:
            from triton import knobs
        except ImportError:
            return self
        from punica_kernels.kernels._common import INTERPRETED

        runtime = getattr(knobs, "runtime", None)
        if INTERPRETED or runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return self
        self._runtime, self._previous, self.available = runtime, runtime.jit_post_compile_hook, True
        previous = self._previous

        def hook(*args, **kwargs):
            info = kwargs.get("fn")
            name = f"{info.module}.{info.name}" if info is not None else "?"
            self.compiles.append((name, str(kwargs.get("key"))))
            return previous(*args, **kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = hook
        return self

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_post_compile_hook = self._previous
            self._runtime = None


class TargetDriver:
    """The driver Triton's launcher asks for a device, a stream and a target: it answers `target`
    (a triton.backends.compiler.GPUTarget), so `JITFunction.run(..., warmup=True)` compiles a
    launch without a GPU (and launches nothing)."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def __getattr__(self, name):
        raise RuntimeError(f"the compile-only stand-in driver has no {name!r}: this Triton asked for more "
                           "than compiling needs")


@contextlib.contextmanager
def compiling_for(target):
    """Within: Triton's active driver is a TargetDriver for `target` (compile, never launch)."""
    from triton.runtime import driver

    previous = driver._active if hasattr(driver, "_active") else None
    driver.set_active(TargetDriver(target))
    try:
        yield
    finally:
        if previous is not None or hasattr(driver, "_active"):
            driver._active = previous


def compile_launch(kernel, args: tuple, kwargs: dict, grid: tuple):
    """Compile `kernel[grid](*args, **kwargs)` as Triton's launcher would (its own binder and
    cache, so the variant is the one `variant_key` names) for the active driver's target, without
    launching it; returns the CompiledKernel (`.hash`, `.asm`, `.metadata`). Call it inside
    `compiling_for(target)` to compile for a GPU this machine does not have."""
    from triton.runtime.jit import JITFunction

    return JITFunction.run(kernel, *args, grid=grid, warmup=True, **kwargs)
