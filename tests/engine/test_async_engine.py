"""The async API: streaming deltas, cancellation, and an event loop that never blocks."""
import asyncio
import threading

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.lora.source import LocalDirectoryAdapterSource
from engine.sampling_params import GenerationRequest, InvalidRequestError, SamplingParams

from .conftest import chat
from .helpers import greedy
from .lora_fixtures import write_random_adapter


@pytest.fixture
def aengine(engine):
    a = AsyncLLMEngine(engine)
    yield a
    a.shutdown()


def test_stream_and_cancel_without_blocking_the_loop(aengine, engine, tokenizer):
    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        t = asyncio.create_task(ticker())
        deltas = []
        async for out in aengine.generate(greedy("s", chat(tokenizer, "What is the capital of France?"), 32)):
            deltas.append(out)
        # Cancel a long generation after a few deltas by leaving the loop.
        got = 0
        async for out in aengine.generate(greedy("c", "Write a very long essay about the ocean.", 500, ignore_eos=True)):
            got += 1
            if got == 3:
                break
        # A bad request fails only itself.
        with pytest.raises(InvalidRequestError):
            async for _ in aengine.generate(greedy("bad", "", 5)):
                pass
        stop.set()
        await t
        return deltas, ticks

    deltas, ticks = asyncio.run(main())
    assert deltas[-1].finished and "Paris" in "".join(d.text for d in deltas)
    assert deltas[-1].completion_tokens == sum(len(d.token_ids) for d in deltas)
    assert ticks > 20  # the loop kept running while the model computed
    # The aborted request's blocks return once the engine thread processes the abort.
    import time
    for _ in range(100):
        if not engine.has_unfinished():
            break
        time.sleep(0.05)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.requests


def test_task_cancellation_aborts(aengine, engine):
    async def main():
        async def consume():
            async for _ in aengine.generate(greedy("tc", "Tell me everything about space.", 500, ignore_eos=True)):
                pass
        task = asyncio.create_task(consume())
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    import time
    for _ in range(100):
        if not engine.requests:
            break
        time.sleep(0.05)
    assert not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_step_loop_waits_instead_of_spinning_while_a_request_waits_for_its_adapter(make_engine, tmp_path):
    """While the only request waits for its adapter's load, the engine thread must not step in a
    busy loop: it would hold the GIL against the loader (a newcomer's first adapter request took
    seconds). It waits, is woken when the load ends, and the request is served."""
    write_random_adapter(tmp_path / "slow", 8, seed=3)
    released = threading.Event()

    class SlowSource(LocalDirectoryAdapterSource):
        def fetch(self, version):  # a download that takes a while
            released.wait(10)
            return super().fetch(version)

    engine = make_engine(SlowSource(tmp_path), max_loras=2, max_lora_rank=8)
    steps = 0
    step = engine.step

    def counted():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted
    a = AsyncLLMEngine(engine)
    try:
        async def main():
            outs = []

            async def consume():
                request = GenerationRequest("w", prompt="Hello", adapter="slow",
                                            params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
                async for out in a.generate(request):
                    outs.append(out)

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.5)  # the request waits for the fetch all this time
            waited_steps = steps
            released.set()
            await asyncio.wait_for(task, 60)
            return waited_steps, outs

        waited_steps, outs = asyncio.run(main())
    finally:
        a.shutdown()
    assert outs[-1].finished and outs[-1].completion_tokens == 4 and outs[-1].error is None
    # 0.5 s of waiting at the loop's stall wait is ~50 steps; a spinning loop makes thousands.
    assert waited_steps < 150, waited_steps
