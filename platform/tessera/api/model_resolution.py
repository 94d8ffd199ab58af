"""Which model a tenant's `model` names: the base model, or one of the caller's own adapters by
name (its current version) or name@version. Another tenant's adapter is the same 404 as an
unknown name, so names never leak across tenants."""
from __future__ import annotations

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

    def resolve() -> tuple[str, str, str | None]:
        with read_only_session(gw.session_factory) as session:
            tenant = session.get(Tenant, caller.tenant_id)
            v = registry.resolve_version(session=session, tenant=tenant, ref=model)
            return v.sha256, v.ref, v.base_model

    try:
        sha256, ref, base = await anyio.to_thread.run_sync(resolve)
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
