"""The backend seam holds: only engine/backends imports a backend's own modules (the engine,
the platform and the registry reach kernels through engine.backends.create_backend and the
Backend methods), `LLMEngine.step` has no device or backend branch, and a step leaves the
scheduler's output as the scheduler made it (the CPU LoRA path lays decodes out on its own copy).
bench/ and tests/ may import kernels directly and are not scanned."""
from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

from engine.llm_engine import LLMEngine
from engine.lora.source import LocalDirectoryAdapterSource
from engine.sampling_params import GenerationRequest, SamplingParams

from .lora_fixtures import write_random_adapter

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("engine", "platform", "adapter_registry")
BACKEND_MODULES = ("engine.backends.cpu", "engine.backends.triton")


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every import in `tree`: `import X` gives X, `from X import Y` gives X.Y."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def _is_backend_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in BACKEND_MODULES)


def test_no_backend_module_is_imported_outside_engine_backends():
    backends = ROOT / "engine" / "backends"
    files = [p for top in SCANNED for p in (ROOT / top).rglob("*.py") if backends not in p.parents]
    assert len(files) > 50  # the scan found the packages
    imports = [(str(p.relative_to(ROOT)), line, name)
               for p in files for line, name in _imported_modules(ast.parse(p.read_text(), str(p)))
               if _is_backend_module(name)]
    leaks = [f"{f}:{line} imports {name}" for f, line, name in imports]
    assert not leaks, "\n".join(leaks)


def test_the_scan_sees_a_backend_import():
    """The negative control: the scan flags the forms an import of a backend module can take."""
    for src in ("from engine.backends.triton.cuda_graphs import DecodeGraphs",
                "import engine.backends.cpu.linear", "from engine.backends import cpu",
                "def f():\n    from engine.backends.triton import TritonBackend"):
        assert any(_is_backend_module(name) for _, name in _imported_modules(ast.parse(src))), src


def _branches_on_device_or_backend(fn) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    tests = [n.test for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    tests += [v for n in ast.walk(tree) if isinstance(n, ast.BoolOp) for v in n.values]
    words = ("device", "backend")
    return [ast.unparse(t) for t in tests if any(w in ast.unparse(t) for w in words)]


def test_the_step_has_no_device_or_backend_branch():
    assert not _branches_on_device_or_backend(LLMEngine.step)
    assert not _branches_on_device_or_backend(LLMEngine._update)

    def branching(self):  # the negative control
        if self.device.type != "cpu":
            return 1
    assert _branches_on_device_or_backend(branching)


def test_a_step_leaves_the_scheduler_output_unchanged(make_engine, tmp_path):
    """With adapters on the CPU backend (whose LoRA path orders decode tokens by slot), the
    SchedulerOutput of every step still holds what the scheduler put there, in its order."""
    for i, name in enumerate(("a", "b")):
        write_random_adapter(tmp_path / name, 4, seed=i + 1, std=0.05)
    eng = make_engine(LocalDirectoryAdapterSource(tmp_path), max_loras=2, max_lora_rank=8)
    seen = []
    schedule = eng.scheduler.schedule

    def recording():
        sched = schedule()
        seen.append((sched, [(id(s), s.num_tokens) for s in sched.decodes],
                     [(id(s), s.num_tokens) for s in sched.prefills]))
        return sched

    eng.scheduler.schedule = recording
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # Adapters in an order the slot sort changes: b, base, a, b.
    reqs = [GenerationRequest(f"r{i}", prompt="Once upon a time", adapter=a, params=params)
            for i, a in enumerate(("b", None, "a", "b"))]
    for r in reqs:
        eng.add_request(r)
        if r.adapter is not None:
            eng.lora_manager.wait_loaded(r.adapter)
    while eng.has_unfinished():
        eng.step()
    decoding = [s for s, d, _ in seen if len({q.seq.adapter for q in s.decodes}) > 1]
    assert decoding, "no step decoded a mixed batch"
    for sched, decodes, prefills in seen:
        assert [(id(s), s.num_tokens) for s in sched.decodes] == decodes
        assert [(id(s), s.num_tokens) for s in sched.prefills] == prefills
    # Some mixed step was not already in slot order: the layout really differed from it.
    slots = {None: -1, **eng.lora_manager._slot_of}
    assert any([slots[q.seq.adapter] for q in s.decodes] != sorted(slots[q.seq.adapter] for q in s.decodes)
               for s in decoding)
