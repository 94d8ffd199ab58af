"""Admin API for tenants' LoRA adapters (Bearer admin token, or the web UI's session).

  GET    /admin/v1/tenants/{tenant}/adapters                          adapters with their versions
  GET    /admin/v1/tenants/{tenant}/adapters/{name}                   one adapter (poll it while validating)
  POST   /admin/v1/tenants/{tenant}/adapters/{name}/versions          upload a new version (multipart)
  PUT    /admin/v1/tenants/{tenant}/adapters/{name}/current           {"version": N}: make N current
  DELETE /admin/v1/tenants/{tenant}/adapters/{name}                   delete the adapter, every version
  DELETE /admin/v1/tenants/{tenant}/adapters/{name}/versions/{N}      delete one version

Upload: multipart form with `files` = adapter_config.json + adapter_model.safetensors, or one
.zip / .tar.gz holding them; optional `base_model` when the config's base_model_name_or_path is
neither a served model nor an alias of one (a local path ending in one counts; the list answers
`served_base_models`, the names of what the engine serves, and `served_base_model_details`, each
one's architecture, layers and LoRA-able modules); without it such an upload is refused with 422
(param "base_model", code base_model_not_served), nothing stored. An adapter whose modules or
tensor shapes are not the served model's is refused with 422 (code adapter_does_not_fit_base)
naming the first that does not fit and the model's dimensions, nothing stored; before any engine
has described the model it serves, uploads are refused with 503. The answer (201) is the version: 'ready' or 'rejected' with its reason when
validation ran inline (embedded mode), else 'validating' until the Celery worker decides; poll GET .../{name}.
An unsafe or incomplete upload (pickle weights, missing file, bad archive) is refused with 422
and nothing stored. The body may be up to settings.max_upload_bytes (app.py lets this route
past the general body limit), and the registry's size and count limits apply.

Each version: version, ref, status ('validating' | 'ready' | 'rejected' | 'quarantined': the
engine found it faulty), rejection_reason (why rejected or quarantined), current, sha256,
size_bytes, base_model, rank, alpha, target_modules, dtype, created_at, validated_at.
Validation runs in a bounded child process that the upload's worker thread waits on (embedded
mode), so the event loop keeps serving; a deadline or limit hit is a rejection with its reason.
"""
from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path, PurePath

from fastapi import APIRouter, File, Form, UploadFile
from pydantic import BaseModel, ConfigDict, Field

from adapter_registry import services as registry
from adapter_registry.errors import AdapterDoesNotFitBase, BaseModelRefused
from tessera.api import response_models as out
from tessera.api.admin_views import iso
from tessera.api.deps import PathTenant, attach, run_db
from tessera.auth import AdminDep, GatewayDep
from tessera.errors import ApiError

router = APIRouter(prefix="/admin/v1")

#: The upload route, for app.py's body limit (it gets settings.max_upload_bytes, not max_body_bytes).
UPLOAD_PATH = re.compile(r"^/admin/v1/tenants/[^/]+/adapters/[^/]+/versions/?$")
_ARCHIVES = (".zip", ".tar.gz", ".tgz", ".tar")
_COPY_CHUNK = 1 << 20


class CurrentIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=1)


def version_dict(v, current_id: int | None) -> dict:
    return {"version": v.version, "ref": v.ref, "status": v.status, "rejection_reason": v.rejection_reason,
            "current": v.id == current_id, "sha256": v.sha256, "size_bytes": v.size_bytes,
            "base_model": v.base_model, "rank": v.rank, "alpha": v.alpha, "target_modules": v.target_modules,
            "dtype": v.dtype, "created_at": iso(v.created_at), "validated_at": iso(v.validated_at)}


def _adapter_dict(session, tenant, adapter) -> dict:
    versions = registry.list_versions(session=session, tenant=tenant, name=adapter.name)
    current = next((v.version for v in versions if v.id == adapter.current_version_id), None)
    return {"name": adapter.name, "current_version": current, "created_at": iso(adapter.created_at),
            "versions": [version_dict(v, adapter.current_version_id) for v in reversed(versions)]}


def served_base_models(gw) -> dict:
    """What the engine serves, for the upload form: the names adapters may give as their base
    (the served model's own; its name before any engine described it) and each described model's
    architecture, layers and LoRA-able modules."""
    described = gw.registry_settings().served_base_models
    return {"served_base_models": [m.name for m in described] or [gw.engine.model_name],
            "served_base_model_details": [{"name": m.name, "architecture": m.architecture, "num_layers": m.num_layers,
                                           "modules": list(m.module_names)} for m in described]}


@router.get("/tenants/{tenant}/adapters", response_model=out.AdapterList)
async def list_adapters(_: AdminDep, tenant: PathTenant, gw: GatewayDep):
    def run(session):
        t = attach(session, tenant)
        return {"tenant": t.name, **served_base_models(gw),
                "data": [_adapter_dict(session, t, a) for a in registry.list_adapters(session=session, tenant=t)]}

    return await run_db(gw, run, changes=False)


@router.get("/tenants/{tenant}/adapters/{name}", response_model=out.Adapter)
async def get_adapter(_: AdminDep, tenant: PathTenant, name: str, gw: GatewayDep):
    def run(session):
        t = attach(session, tenant)
        return _adapter_dict(session, t, registry.get_adapter(session=session, tenant=t, name=name))

    return await run_db(gw, run, changes=False)


def _save_upload(files: list[UploadFile], work: Path) -> Path:
    """Write the uploaded files under `work`; the path to hand the registry (folder or archive)."""
    names = [PurePath((f.filename or "").replace("\\", "/")).name for f in files]
    if not files or not all(names):
        raise ApiError(422, "choose the adapter's files: adapter_config.json and adapter_model.safetensors, "
                            "or one .zip or .tar.gz holding them", code="upload_missing_files")
    if len(set(names)) != len(names):
        raise ApiError(422, f"the same file name was sent twice ({', '.join(names)}); send each file once",
                       code="upload_duplicate_files")
    folder = work / "adapter"
    folder.mkdir()
    for f, name in zip(files, names):
        with open(folder / name, "wb") as out:
            shutil.copyfileobj(f.file, out, _COPY_CHUNK)
    if len(names) == 1 and names[0].lower().endswith(_ARCHIVES):
        return folder / names[0]
    return folder


@router.post("/tenants/{tenant}/adapters/{name}/versions", status_code=201, response_model=out.AdapterVersion)
async def upload_version(_: AdminDep, tenant: PathTenant, name: str, gw: GatewayDep,
                         files: list[UploadFile] = File(default_factory=list),
                         base_model: str | None = Form(None)):
    with tempfile.TemporaryDirectory(prefix="tessera-admin-upload-") as work:
        def run(session):
            t = attach(session, tenant)
            source = _save_upload(files, Path(work))
            try:
                v = registry.upload_adapter(session=session, store=gw.store, settings=gw.registry_settings(), tenant=t,
                                            name=name, source=source, base_model=base_model or None)
            except BaseModelRefused as e:
                raise ApiError(422, str(e), param=e.param, code="base_model_not_served") from None
            except AdapterDoesNotFitBase as e:
                raise ApiError(422, str(e), param=e.param, code="adapter_does_not_fit_base") from None
            return version_dict(v, v.adapter.current_version_id)

        return await run_db(gw, run, changes=False)


@router.put("/tenants/{tenant}/adapters/{name}/current", response_model=out.Adapter)
async def set_current(_: AdminDep, tenant: PathTenant, name: str, body: CurrentIn, gw: GatewayDep):
    return await _change_version(gw, tenant, name, body.version, registry.set_current_version)


@router.delete("/tenants/{tenant}/adapters/{name}", response_model=out.AdapterDeleted)
async def delete_adapter(_: AdminDep, tenant: PathTenant, name: str, gw: GatewayDep):
    if "@" in name:
        raise ApiError(400, "to delete one version use DELETE .../adapters/{name}/versions/{N}")

    def run(session):
        registry.delete_adapter(session=session, tenant=attach(session, tenant), ref=name)
        return {"name": name, "deleted": True}

    return await run_db(gw, run)


@router.delete("/tenants/{tenant}/adapters/{name}/versions/{version}", response_model=out.Adapter)
async def delete_version(_: AdminDep, tenant: PathTenant, name: str, version: int, gw: GatewayDep):
    return await _change_version(gw, tenant, name, version, registry.delete_adapter)


async def _change_version(gw, tenant, name: str, version: int, change) -> dict:
    """Apply `change(session=, tenant=, ref="name@version")` (a registry call) to the tenant's
    adapter `name`, then answer the adapter as it now is."""
    def run(session):
        t = attach(session, tenant)
        change(session=session, tenant=t, ref=f"{name}@{version}")
        return _adapter_dict(session, t, registry.get_adapter(session=session, tenant=t, name=name))

    return await run_db(gw, run)
