"""Which model a tenant's `model` names: the base model, or one of the caller's own adapters by
name (its current version) or name@version. Another tenant's adapter is the same 404 as an
unknown name, so names never leak across tenants.

Requests of one tenant naming the same model while its registry lookup is in flight share that
lookup (`Gateway.adapter_lookups`): a burst of requests for a few adapters costs a few lookups,
not one database session in a worker thread each. Those threads' Python work competes with the
in-process engine's step for the CPU and the interpreter, and slowed the step that ran while a
burst was admitted several times over (bench/RESULTS.md). Nothing is kept once a lookup ends, so
the answer is never older than a lookup that began before the request arrived.
"""
from __future__ import annotations

import asyncio
import functools

import anyio
from sqlalchemy.exc import SQLAlchemyError

from adapter_registry import services as registry
from adapter_registry.errors import NotFound
from adapter_registry.models import Tenant
from tessera.api.failures import unavailable
from tessera.errors import ApiError
from tessera.gateway import Gateway
from tessera.services import Caller
from tessera_core.db import read_only_session
from tessera_core.errors import TesseraError


def model_not_found(name: str) -> ApiError:
    return ApiError(404, f"The model '{name}' does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


async def resolve_adapter(*, gw: Gateway, caller: Caller, model: str, request_id: str | None = None) -> str | None:
    """The adapter version id (sha256) `model` names for this caller; None for the base model.
    Raises ApiError: 404 model_not_found, the registry's 4xx (e.g. no ready version), 409
    adapter_base_not_served for a version trained for another base model than the one served now
    (the deployment changed models since it was uploaded), or a 503 when the registry's database
    fails (`request_id` is named in it)."""
    if model == gw.engine.model_name:
        return None
    try:
        sha256, ref, base = await _shared_lookup(gw, caller.tenant_id, model)
    except NotFound:
        raise model_not_found(model) from None
    except TesseraError as e:  # the registry's, the object store's
        if e.http_status >= 500:
            raise unavailable(request_id, "the adapter registry is unavailable", e) from None
        raise ApiError(e.http_status, str(e), param="model") from None
    except SQLAlchemyError as e:
        raise unavailable(request_id, "the adapter registry is unavailable", type(e).__name__) from None
    if not gw.serves_base(base):
        raise ApiError(409, f"adapter version {ref} was trained for base model {base}, and this platform now serves "
                            f"{gw.engine.model_name}; upload a version trained for {gw.engine.model_name}",
                       param="model", code="adapter_base_not_served")
    return sha256


def _lookup(session_factory, tenant_id: int, model: str) -> tuple[str, str, str | None]:
    """(sha256, ref, base model) of the version `model` names for the tenant (a worker thread's
    database session); the registry's NotFound / Conflict / errors as they come."""
    with read_only_session(session_factory) as session:
        tenant = session.get(Tenant, tenant_id)
        v = registry.resolve_version(session=session, tenant=tenant, ref=model)
        return v.sha256, v.ref, v.base_model


async def _shared_lookup(gw: Gateway, tenant_id: int, model: str) -> tuple[str, str, str | None]:
    """`_lookup` in a worker thread, shared by every request of the tenant naming `model` while it
    runs (its result or its exception). A request that goes away (a client disconnect) leaves the
    lookup running for the others (shielded)."""
    key = (tenant_id, model)
    task = gw.adapter_lookups.get(key)
    if task is None:
        task = asyncio.ensure_future(anyio.to_thread.run_sync(_lookup, gw.session_factory, tenant_id, model))
        gw.adapter_lookups[key] = task
        task.add_done_callback(functools.partial(_lookup_done, gw.adapter_lookups, key))
    return await asyncio.shield(task)


def _lookup_done(lookups: dict, key: tuple[int, str], task: asyncio.Future) -> None:
    """Forget a finished lookup; its exception counts as retrieved (every request that awaited it
    may have gone)."""
    if lookups.get(key) is task:
        del lookups[key]
    if not task.cancelled():
        task.exception()


def model_card(id: str, owned_by: str, created: float | None = None) -> dict:
    """One entry of /v1/models in OpenAI's shape."""
    return {"id": id, "object": "model", "created": int(created or 0), "owned_by": owned_by}


def base_model_card(gw: Gateway) -> dict:
    """The served base model's entry of /v1/models: OpenAI's fields, plus its context length
    (`max_model_len`, the name vLLM uses) and architecture (its Hugging Face model_type, null
    before an engine described it); OpenAI clients keep fields they do not know."""
    base = getattr(gw.engine, "base_model", None)
    return {**model_card(gw.engine.model_name, "tessera"), "max_model_len": gw.engine.max_model_len,
            "architecture": base.architecture if base is not None else None}


async def models_of(*, gw: Gateway, caller: Caller) -> list[dict]:
    """The base model, then the caller's own adapters that have a ready version."""

    def adapters() -> list[dict]:
        with read_only_session(gw.session_factory) as session:
            tenant = session.get(Tenant, caller.tenant_id)
            return [model_card(a.name, caller.tenant_name, a.created_at.timestamp())
                    for a in registry.list_adapters(session=session, tenant=tenant) if a.current_version_id]

    return [base_model_card(gw)] + await anyio.to_thread.run_sync(adapters)
