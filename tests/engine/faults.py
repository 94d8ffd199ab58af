"""Faults injected into an LLMEngine's step and reset, for the tests of the supervision that
restarts a dead step loop (tests/engine/test_supervision.py, tests/platform/test_engine_resilience.py)."""
from __future__ import annotations


class EngineFaults:
    """Patches engine.step and engine.reset through monkeypatch. While `step` is set, the next step
    raises RuntimeError (once: it clears `step`); while `reset` is set, every reset raises
    MemoryError. Otherwise both call the engine's own."""

    def __init__(self, engine, monkeypatch, *, step: bool = False, reset: bool = False):
        self.step, self.reset = step, reset
        real_step, real_reset = engine.step, engine.reset

        def failing_step():
            if self.step:
                self.step = False
                raise RuntimeError("injected: an engine bug")
            return real_step()

        def failing_reset():
            if self.reset:
                raise MemoryError("injected: reset cannot allocate")
            return real_reset()

        monkeypatch.setattr(engine, "step", failing_step)
        monkeypatch.setattr(engine, "reset", failing_reset)
