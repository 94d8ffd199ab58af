"""EngineClient over engine worker processes (worker.py's internal API).

The client keeps a view of every worker: it polls each one's GET /internal/state every
`poll_s` (load per priority class, free slots and KV blocks, adapters per tier, draining) and
counts the requests it sent since that answer, and `routing.route` picks the worker for each
request from that view (adapter affinity with bounded load; least load for base-model requests;
see routing.py). Polling rather than a Redis channel: the gateway already talks to every worker,
a poll that fails is itself the news that the worker is gone, and it needs no Redis in a
deployment that has none; G gateways x N workers x 2 polls a second stay small.

A worker that refuses a connection, answers 503 (draining, restarting) or breaks a stream is out
of the view at once (until a poll finds it serving again); a request that reached no worker, or
whose worker failed before anything was streamed back, is sent to the next one; once anything
was streamed, the caller gets EngineUnavailable (a 503), as when no worker can take it or one
goes silent for longer than the read timeout mid-request, never a hang.

Leaving a request's iteration early closes its connection, which aborts it in the worker, also
while the worker is still preparing the first delta (waiting for a seat, prefilling). `abort`
then asks the worker that had it for the abort's report (POST /internal/abort); the client
remembers each request's worker until it finishes (the latest `ABORTABLE_KEPT`).

`ready()` reads the same view (a fresh poll if the last one is older than `READY_CACHE_S`), so the
gateway's GET /ready is true when at least one worker serves and is not draining. Workers are
named worker-0, worker-1, ... in what it reports: their URLs stay internal.

Every worker must serve the deployment's model: the one the gateway's own settings name
(TESSERA_MODEL_PATH / TESSERA_MODEL_NAME, whose tokenizer and config it reads). A worker's GET
/internal/info (read when it is first seen serving, and again whenever it comes back) says which
model it serves and describes it (engine.lora.peft_format.BaseModelShape); a worker that serves
another model, or the same name with another shape than the deployment's files describe, is
refused: out of routing with the state "wrong_model", the refusal logged and given as /ready's
reason, both models named. The description a worker published, once accepted, is `base_model`:
what the registry checks uploads against.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import OrderedDict
from pathlib import Path
from typing import AsyncIterator

import httpx

from engine.lora.peft_format import BaseModelShape
from engine.sampling_params import GenerationRequest, InvalidRequestError, RequestOutput
from engine.tokenizer import TextTokenizer
from tessera.engine_client import ABORT_REPORT_TIMEOUT_S, EngineReadiness, EngineUnavailable
from tessera.engine_client.routing import DEFAULT_BALANCE, HashRing, ReplicaState, route
from tessera.observability import tracing

log = logging.getLogger(__name__)

#: Longest a view of the workers is used by `ready()` without polling again.
READY_CACHE_S = 2.0
#: Longest wait for one worker's state.
READY_TIMEOUT_S = 1.0
#: Requests whose worker is remembered for `abort` (those in flight, then those left unfinished).
ABORTABLE_KEPT = 65536


def load_served_model(model_path: Path | None,
                      model_name: str | None = None) -> tuple[TextTokenizer, str, int, BaseModelShape]:
    """The deployment's base model as its files say (no weights): its tokenizer, served name
    (`model_name`, else the checkpoint's: see tessera.served_model), context length and
    description."""
    from engine.loader.gguf_loader import default_model_path, open_reader, read_metadata
    from tessera.served_model import describe_model_files

    path = Path(model_path) if model_path else default_model_path()
    cfg, described = describe_model_files(path, model_name)
    tokenizer = (TextTokenizer.from_hf_directory(path) if path.is_dir()
                 else TextTokenizer.from_gguf_metadata(read_metadata(open_reader(path))))
    return tokenizer, cfg.name, cfg.max_position_embeddings, described


class _Replica:
    """The client's view of one worker: its last published state, plus the requests this client
    sent it that the state may not count yet (sent after the poll that produced it began, and
    not ended), as waiting in their priority class."""

    def __init__(self, name: str, url: str):
        self.name, self.url = name, url
        self.published = ReplicaState(name=name, up=False, state="unreachable")
        #: Why it is refused (it serves another model), None while it is not.
        self.refusal: str | None = None
        # Requests in flight that no published state counts yet, per poll generation (the poll
        # started after them is the first whose answer counts them): generation -> class -> n.
        self._generation = 0
        self._unseen: dict[int, dict[int, int]] = {}

    def view(self) -> ReplicaState:
        """The published state with this client's unseen requests counted as waiting."""
        p = self.published
        if not self._unseen:
            return p
        waiting = dict(p.waiting)
        for counts in self._unseen.values():
            for prio, n in counts.items():
                waiting[prio] = waiting.get(prio, 0) + n
        return ReplicaState(**{**vars(p), "waiting": waiting})

    def sent(self, prio: int) -> int:
        """Count a request sent now; returns the token `ended` takes."""
        counts = self._unseen.setdefault(self._generation, {})
        counts[prio] = counts.get(prio, 0) + 1
        return self._generation

    def ended(self, token: int, prio: int) -> None:
        """The request counted by `sent` (its `token`) ended: uncount it if no state counts it."""
        counts = self._unseen.get(token)
        if counts is not None and counts.get(prio, 0) > 0:
            counts[prio] -= 1
            if not any(counts.values()):
                del self._unseen[token]

    def poll_started(self) -> int:
        """A poll begins: requests sent from now on may be missing from its answer."""
        self._generation += 1
        return self._generation

    def polled(self, generation: int, state: ReplicaState) -> None:
        """The answer of the poll begun at `generation`: it counts every request sent before."""
        self.published = state
        for g in [g for g in self._unseen if g < generation]:
            del self._unseen[g]

    def take_out(self, why: str) -> None:
        """Out of routing at once (a failed connection, a 503, a broken stream) until a poll
        finds it serving again."""
        self.published = ReplicaState(**{**vars(self.published), "up": False, "state": why})


class HttpEngineClient:
    def __init__(self, urls: list[str], *, secret: str, model_path: Path | None = None, model_name: str | None = None,
                 connect_timeout_s: float = 2.0, read_timeout_s: float = 120.0,
                 poll_s: float = 0.5, balance: float = DEFAULT_BALANCE):
        """Workers at `urls` serving the model at `model_path` (None: the embedded SmolLM2) under
        `model_name` (None: its own name): the deployment's model, whose tokenizer this reads."""
        if not urls:
            raise ValueError("HttpEngineClient needs at least one engine worker URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.tokenizer, self.model_name, self.max_model_len, self._expected = load_served_model(model_path, model_name)
        #: The served model's description as a worker serving it published it (None until one did).
        self.base_model: BaseModelShape | None = None
        self._context_from_worker = False
        self._headers = {"authorization": f"Bearer {secret}"}
        self.replicas = [_Replica(f"worker-{i}", url) for i, url in enumerate(self.urls)]
        self.ring = HashRing([r.name for r in self.replicas])
        self.poll_s, self.balance = poll_s, balance
        self._rr = itertools.count()
        #: request id -> the worker it was sent to, until it finished (for `abort`), the latest
        #: ABORTABLE_KEPT
        self._sent_to: OrderedDict[str, _Replica] = OrderedDict()
        self._polled_at = float("-inf")
        self._poller: asyncio.Task | None = None
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=10.0, pool=connect_timeout_s),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))

    async def start(self) -> None:
        """Take a first view of every worker (checking the model each serves, and learning the
        model's description and context from the first that serves it; a worker not up yet is
        not fatal) and keep it fresh in the background."""
        await self.refresh()
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing: its end is not news
                pass
            self._poller = None
        await self.client.aclose()

    # -- the view of the workers ----------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a bug here must not stop routing updates for good
                log.exception("polling the engine workers failed")

    async def refresh(self) -> None:
        """Poll every worker's state concurrently and replace the view."""
        await asyncio.gather(*(self._poll(r) for r in self.replicas))
        self._polled_at = time.monotonic()

    async def _poll(self, replica: _Replica) -> None:
        generation = replica.poll_started()
        try:
            r = await self.client.get(f"{replica.url}/internal/state", headers=self._headers, timeout=READY_TIMEOUT_S)
            if r.status_code != 200:
                state = ReplicaState(name=replica.name, up=False, state=f"http_{r.status_code}")
            else:
                state = ReplicaState.from_dict(replica.name, r.json())
            if state.up:
                # The model it serves: by the name each state carries, and from its description
                # when it is first seen serving or comes back (it may have restarted on another).
                refusal = self._name_refusal(replica, state.model)
                if refusal is None and not replica.published.up:
                    refusal = await self._info_refusal(replica)
                self._note_refusal(replica, refusal)
                if refusal is not None:
                    state = ReplicaState(name=replica.name, up=False, state="wrong_model", model=state.model)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            state = ReplicaState(name=replica.name, up=False, state="unreachable")
        replica.polled(generation, state)

    def _name_refusal(self, replica: _Replica, model: str | None) -> str | None:
        """Why `replica` is refused when it says it serves `model` (None: it serves this
        deployment's, or did not say)."""
        if model is None or model == self.model_name:
            return None
        return f"{replica.name} serves {model!r}, not this deployment's {self.model_name!r}; refused"

    async def _info_refusal(self, replica: _Replica) -> str | None:
        """Read `replica`'s GET /internal/info: why it is refused (another model's name, or the
        same name with another description than the deployment's files give), or None; the first
        accepted description becomes `base_model` and its context `max_model_len`. httpx/
        ValueError/KeyError/TypeError when it does not answer as a worker does."""
        r = await self.client.get(f"{replica.url}/internal/info", headers=self._headers, timeout=READY_TIMEOUT_S)
        r.raise_for_status()
        info = r.json()
        refusal = self._name_refusal(replica, str(info["model"]))
        if refusal is not None or info.get("base_model") is None:  # a worker from before descriptions: by name
            return refusal
        try:
            described = BaseModelShape.from_dict(info["base_model"])
        except ValueError as e:
            return f"{replica.name} describes its model in a malformed way ({e}); refused"
        if described != self._expected:
            return (f"{replica.name} serves {described.label} ({described.dims_text()}), not this deployment's "
                    f"{self._expected.label} ({self._expected.dims_text()}); refused")
        if self.base_model is None:
            self.base_model = described
        if not self._context_from_worker:
            self.max_model_len, self._context_from_worker = int(info["max_model_len"]), True
        return None

    @staticmethod
    def _note_refusal(replica: _Replica, refusal: str | None) -> None:
        """Keep (and log once, when it changes) why `replica` is refused."""
        if refusal != replica.refusal and refusal is not None:
            log.error("engine worker %s: %s", replica.url, refusal)
        elif refusal != replica.refusal:
            log.warning("engine worker %s serves this deployment's model again", replica.url)
        replica.refusal = refusal

    def _order(self, request: GenerationRequest) -> list[_Replica]:
        views = [r.view() for r in self.replicas]
        order = route(views, adapter=request.adapter, priority=int(request.priority), ring=self.ring,
                      balance=self.balance, tiebreak=next(self._rr))
        return [self.replicas[i] for i in order]

    async def ready(self) -> EngineReadiness:
        """Ready when at least one worker serves and is not draining (see the module docstring);
        never raises."""
        if time.monotonic() - self._polled_at >= READY_CACHE_S:
            await self.refresh()
        engines = {r.name: r.published.state for r in self.replicas}
        serving = sum(r.published.accepting for r in self.replicas)
        refusals = [r.refusal for r in self.replicas if r.refusal and r.published.state == "wrong_model"]
        reason = None if serving else "no engine worker is ready (" + ", ".join(
            f"{name}: {state}" for name, state in engines.items()) + ")"
        if refusals:
            reason = "; ".join(([reason] if reason else []) + refusals)
        return EngineReadiness(
            ready=serving > 0, state="ready" if serving else "unavailable", reason=reason,
            restarts=sum(r.published.restarts for r in self.replicas), engines=engines)

    # -- requests ---------------------------------------------------------------------------------

    def _note_worker(self, request_id: str, replica: _Replica) -> None:
        self._sent_to[request_id] = replica
        self._sent_to.move_to_end(request_id)
        while len(self._sent_to) > ABORTABLE_KEPT:
            self._sent_to.popitem(last=False)

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Ask the worker the request was sent to for the abort's report (the module docstring);
        None when it was never sent, has finished, or the worker does not answer in time."""
        replica = self._sent_to.pop(request_id, None)
        if replica is None:
            return None
        try:
            r = await self.client.post(f"{replica.url}/internal/abort", json={"request_id": request_id},
                                       headers=self._headers, timeout=ABORT_REPORT_TIMEOUT_S + READY_TIMEOUT_S)
            r.raise_for_status()
            data = r.json()["output"]
            return None if data is None else RequestOutput(**data)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            log.warning("no abort report for request %s from %s (%s)", request_id, replica.name, type(e).__name__)
            return None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        body = {"request_id": request.request_id, "prompt_token_ids": request.prompt_token_ids,
                "params": request.params.model_dump(), "tenant_id": request.tenant_id,
                "tenant_weight": request.tenant_weight,
                "priority": request.priority.name, "adapter": request.adapter, "cache_salt": request.cache_salt}
        with tracing.span("engine.route") as span:
            order = self._order(request)
            if not order:
                # Nobody looks up: a worker back since the last poll would be missed until the next.
                await self.refresh()
                order = self._order(request)
            span.set_attribute("tessera.engine_worker", order[0].name if order else "")
        errors = []
        prio = int(request.priority)
        for replica in order:
            if not replica.published.accepting:
                continue  # taken out by a request that failed on it since this order was made
            url = replica.url
            streamed = False
            token = replica.sent(prio)
            self._note_worker(request.request_id, replica)
            tracing.annotate(engine_worker=replica.name)  # on the engine call's span (the last worker tried)
            try:
                async with self.client.stream("POST", f"{url}/internal/generate", json=body,
                                              headers=tracing.inject(self._headers)) as resp:
                    if resp.status_code == 400:
                        self._sent_to.pop(request.request_id, None)  # refused: nothing to abort
                        err = json.loads(await resp.aread())
                        raise InvalidRequestError(err.get("message", "invalid request"), err.get("param"))
                    if resp.status_code != 200:
                        errors.append(f"{replica.name}: HTTP {resp.status_code}")
                        if resp.status_code == 503:
                            replica.take_out("draining_or_restarting")
                        continue
                    async for line in resp.aiter_lines():
                        if not line:
                            continue
                        data = json.loads(line)
                        if "engine_dead" in data:
                            replica.take_out("engine_dead")
                            if not streamed:
                                errors.append(f"{replica.name}: engine died")
                                break
                            raise EngineUnavailable(f"engine {replica.name} died mid-request: {data['engine_dead']}")
                        out = RequestOutput(**data)
                        streamed = True
                        if out.finished:
                            self._sent_to.pop(request.request_id, None)  # nothing left to abort
                        yield out
                        if out.finished:
                            return
                    else:
                        replica.take_out("stream_closed")
                        if streamed:
                            raise EngineUnavailable(f"engine {replica.name} closed the stream early")
                        errors.append(f"{replica.name}: closed the stream before any output")
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:
                replica.take_out("unreachable")
                errors.append(f"{replica.name}: {type(e).__name__}")  # nothing was sent: try the next worker
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                if not isinstance(e, httpx.TimeoutException):
                    replica.take_out("stream_broken")
                if streamed or isinstance(e, httpx.TimeoutException):
                    raise EngineUnavailable(f"engine {replica.name} failed mid-request: {type(e).__name__}") from e
                errors.append(f"{replica.name}: {type(e).__name__} before any output")
            finally:
                replica.ended(token, prio)
        # The operator's log names every worker and its state (the tenant's message is scrubbed).
        states = ", ".join(f"{r.url} {r.published.state}" for r in self.replicas)
        why = "; ".join(errors) or f"none is ready: {states}"
        raise EngineUnavailable(f"no engine worker could take the request ({why})")
