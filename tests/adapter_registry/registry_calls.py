"""The registry's service calls as the adapter_registry tests make them, each in a session of its
own on a registry context (build_context's, or the make_ctx fixture's)."""
from __future__ import annotations

from adapter_registry import services


def create_tenant(ctx, name: str = "acme", **kw):
    """A new tenant (kw: services.create_tenant's), its row as committed: pass it to upload."""
    with ctx.session_factory() as s:
        return services.create_tenant(session=s, name=name, **kw)


def upload(ctx, tenant, path, *, settings=None, **kw):
    """The adapter files at path uploaded as the tenant's adapter "bot" (kw: services.upload_adapter's),
    under ctx.settings unless settings are given."""
    with ctx.session_factory() as s:
        return services.upload_adapter(session=s, store=ctx.store, settings=settings or ctx.settings,
                                       tenant=tenant, name="bot", source=path, **kw)
