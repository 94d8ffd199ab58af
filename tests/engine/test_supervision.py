"""When the step loop dies anyway (a fault no request can be blamed for), every request in flight
gets EngineDeadError at once, the engine is reset and the loop restarts: new requests are served
again in the same process. Resets that fail are retried; the state says what is going on."""
import asyncio
import time

import pytest
from prometheus_client import REGISTRY

import engine.async_engine as async_engine_module
from engine.async_engine import AsyncLLMEngine, EngineDeadError

from .faults import EngineFaults
from .helpers import greedy

PROMPT = "Once upon a time, in a land far away,"


def _restarts_metric() -> float:
    return REGISTRY.get_sample_value("tessera_engine_restarts_total") or 0.0


def _wait_state(aengine, state: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while aengine.state != state:
        assert time.monotonic() < deadline, f"engine state stayed {aengine.state!r}, not {state!r}"
        time.sleep(0.01)


async def _collect(aengine, req) -> list[int]:
    toks = []
    async for out in aengine.generate(req):
        toks += out.token_ids
    return toks


@pytest.fixture
def supervised(engine):
    a = AsyncLLMEngine(engine)
    yield a
    a.shutdown()
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_step_loop_death_fails_in_flight_requests_and_restarts(supervised, engine, monkeypatch):
    reference = asyncio.run(_collect(supervised, greedy("ref", PROMPT, 12)))
    before = _restarts_metric()
    faults = EngineFaults(engine, monkeypatch)

    async def main():
        got: dict[str, object] = {}
        fired = False

        async def consume(rid, prompt):
            nonlocal fired
            try:
                async for out in supervised.generate(greedy(rid, prompt, 400, ignore_eos=True)):
                    got.setdefault(rid, 0)
                    got[rid] += len(out.token_ids)
                    if rid == "long-1" and got[rid] >= 3 and not fired:
                        faults.step = fired = True  # the next step dies, both requests running
            except EngineDeadError as e:
                got[rid] = e

        await asyncio.gather(consume("long-1", PROMPT), consume("long-2", "The quick brown fox"))
        return got

    got = asyncio.run(main())
    assert isinstance(got["long-1"], EngineDeadError) and isinstance(got["long-2"], EngineDeadError)
    _wait_state(supervised, "ready")
    assert supervised.restarts == 1 and supervised.last_error == "RuntimeError"
    assert _restarts_metric() == before + 1
    # Served again, with the same output as before the restart.
    assert asyncio.run(_collect(supervised, greedy("after", PROMPT, 12))) == reference


def test_failing_reset_is_retried_and_reported(supervised, engine, monkeypatch):
    monkeypatch.setattr(async_engine_module, "RESET_BACKOFF_S", (0.005, 0.02))
    faults = EngineFaults(engine, monkeypatch, step=True, reset=True)

    async def doomed():
        with pytest.raises(EngineDeadError):
            await _collect(supervised, greedy("doomed", PROMPT, 50, ignore_eos=True))

    asyncio.run(doomed())
    _wait_state(supervised, "failed")  # after FAILED_AFTER_ATTEMPTS resets in a row

    async def refused():
        with pytest.raises(EngineDeadError, match="failed"):
            await _collect(supervised, greedy("refused", PROMPT, 5))

    asyncio.run(refused())
    faults.reset = False
    _wait_state(supervised, "ready")
    assert supervised.health() == {"state": "ready", "restarts": 1, "last_error": "RuntimeError"}
    assert len(asyncio.run(_collect(supervised, greedy("served", PROMPT, 5)))) == 5
