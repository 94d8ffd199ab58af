"""The CUDA-graph bookkeeping of decode steps (engine.backends.triton.cuda_graphs), with the
capture call stubbed at its boundary: the stand-in records the forward closure once per bucket
and replays it by calling it again, so every host-side decision and metadata object is frozen at
capture exactly as in a CUDA graph, and the only way a step's inputs reach a replay is through the
static buffers. Runs the whole engine on the Triton backend under the interpreter (tiny synthetic
model, the parity test's fixtures)."""
from __future__ import annotations

from engine.backends.triton.cuda_graphs import DecodeGraphs, buckets_for

from .test_backend_parity import _engine, _requests, _run, tiny  # noqa: F401 - the module fixture


#: Greedy tokens a request: enough decode steps that buckets are replayed for batches whose
#: adapters differ (requests join and finish at different steps).
GRAPH_TOKENS = 8


class RecordingCapture:
    """Stands in for CudaGraphCapture: capture keeps the closure; a replay calls it again. Logs
    the static LoRA token slots each replay of each bucket read."""

    def __init__(self):
        self.graphs: DecodeGraphs | None = None
        self.captured: list[int] = []
        self.replayed_slots: dict[int, list[tuple[int, ...]]] = {}

    def __call__(self, forward):
        g = self.graphs
        b = g.capturing
        self.captured.append(b)

        def replay():
            self.replayed_slots.setdefault(b, []).append(tuple(g.token_slots[:b].tolist()))
            forward()
        return replay


def _with_graphs(engine, capture) -> DecodeGraphs:
    runner = engine.runner
    graphs = DecodeGraphs(runner, max_batch=engine.config.max_num_seqs,
                          block_width=-(-engine.max_model_len // engine.config.block_size),
                          sink_block=engine.block_manager.num_blocks, lora_slots=engine.lora_manager.slots,
                          capture=capture)
    capture.graphs = graphs
    runner.graphs = graphs
    return graphs


def test_buckets_pad_a_batch_to_the_next_captured_size():
    assert buckets_for(8) == (1, 2, 4, 8)
    assert buckets_for(20) == (1, 2, 4, 8, 12, 16, 20)
    assert buckets_for(300)[-1] == 300 and 256 in buckets_for(300)


def test_decode_graphs_give_the_cpu_backends_tokens_and_replays_read_fresh_lora_metadata(tiny):  # noqa: F811
    tokenizer = tiny[2]
    want, _ = _run(_engine(tiny, "cpu"), _requests(tokenizer, GRAPH_TOKENS))
    engine = _engine(tiny, "triton")
    capture = RecordingCapture()
    graphs = _with_graphs(engine, capture)
    got, _ = _run(engine, _requests(tokenizer, GRAPH_TOKENS))
    assert got == want
    # Each bucket was captured once and replayed for every decode step of its size.
    assert len(capture.captured) == len(set(capture.captured)) == graphs.stats["captures"] >= 2
    assert sum(len(v) for v in capture.replayed_slots.values()) == graphs.stats["replays"]
    # The KV cache has one block beyond the block manager's: the padded rows' sink.
    assert engine.kv.k[0].shape[0] == (engine.block_manager.num_blocks + 1) * engine.config.block_size
    # Some bucket was replayed for batches whose adapters differ (and padded rows carry no adapter).
    changed = [b for b, seen in capture.replayed_slots.items() if len(set(seen)) > 1]
    assert changed, capture.replayed_slots
    assert any(-1 in s and any(x >= 0 for x in s) for seen in capture.replayed_slots.values() for s in seen)


def test_a_replay_that_skipped_rewriting_the_lora_slots_would_be_caught(tiny, monkeypatch):  # noqa: F811
    """The negative control: if the static LoRA slots were not rewritten before a replay (the stale
    metadata bug), the tokens would differ from the CPU backend's; this is what the test above
    would then see."""
    tokenizer = tiny[2]
    want, _ = _run(_engine(tiny, "cpu"), _requests(tokenizer, GRAPH_TOKENS))
    engine = _engine(tiny, "triton")
    graphs = _with_graphs(engine, RecordingCapture())
    write = DecodeGraphs._write

    def stale_write(self, host, b):
        host = list(host)
        if self.stats["replays"]:  # after the first replay: keep whatever slots the buffer holds
            host[5] = self.token_slots[:b].cpu()
        write(self, host, b)

    monkeypatch.setattr(DecodeGraphs, "_write", stale_write)
    got, _ = _run(engine, _requests(tokenizer, GRAPH_TOKENS))
    assert graphs.stats["replays"] > 1
    assert got != want


def test_steps_the_graphs_do_not_take_run_eagerly(tiny):  # noqa: F811
    engine = _engine(tiny, "triton")
    graphs = _with_graphs(engine, RecordingCapture())

    class S:  # a scheduled sequence's shape, as DecodeGraphs.takes reads it
        def __init__(self, blocks):
            self.seq = type("Seq", (), {"block_table": list(range(blocks))})()

    sched = type("Sched", (), {})()
    sched.prefills, sched.decodes = [], [S(1)] * 3
    assert graphs.takes(sched)
    sched.prefills = [S(1)]
    assert not graphs.takes(sched)  # a prefill in the step
    sched.prefills, sched.decodes = [], [S(graphs.block_width + 1)]
    assert not graphs.takes(sched)  # wider than the static block tables
    sched.decodes = [S(1)] * (graphs.buckets[-1] + 1)
    assert not graphs.takes(sched)  # more rows than the largest bucket


def test_overlapped_decode_graphs_read_the_last_steps_tokens_on_the_device(tiny):  # noqa: F811
    """With overlapped steps, a replay's decode rows take their input tokens from the step
    before's sampled tokens on the device (written into the static input ids after the upload),
    sampled by DeviceSampling: the tokens are still the CPU backend's."""
    from engine.backends.step_sampling import DeviceSampling

    tokenizer = tiny[2]
    want, _ = _run(_engine(tiny, "cpu"), _requests(tokenizer, GRAPH_TOKENS))
    engine = _engine(tiny, "triton", overlap_steps=True)
    graphs = _with_graphs(engine, RecordingCapture())
    engine.executor.sampler = DeviceSampling(engine.backend.upload, engine.backend.to_host)
    got: dict[str, list[int]] = {}
    for r in _requests(tokenizer, GRAPH_TOKENS):
        engine.add_request(r)
        got[r.request_id] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id] += out.token_ids
    assert got == want
    assert graphs.stats["replays"] > 0 and engine.stats["overlapped_steps"] > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
