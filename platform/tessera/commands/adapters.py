"""`tessera adapters upload|list|show|delete`: manage tenants' LoRA adapters from a shell.

Reads the same TESSERA_* settings as the server (database, object store). With the embedded
SQLite database the schema is migrated on first use; other databases must be migrated with
`alembic upgrade head` first. An upload is checked against the base model the deployment serves:
TESSERA_MODEL_PATH / TESSERA_MODEL_NAME (default: the embedded SmolLM2), described from the
model's config or header (tessera.served_model; no weights are read).
"""
from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("adapters", help="upload, list, show and delete tenants' LoRA adapters")
    cmds = p.add_subparsers(dest="adapters_command", required=True)

    up = cmds.add_parser("upload", help="upload a PEFT adapter (folder, .zip or .tar.gz) as a new version")
    up.add_argument("--tenant", required=True, help="tenant name")
    up.add_argument("name", help="adapter name within the tenant")
    up.add_argument("path", help="folder with adapter_config.json + adapter_model.safetensors, or a .zip/.tar.gz")
    up.add_argument("--base-model", default=None, metavar="NAME",
                    help="served base model (or an alias), when adapter_config.json's base_model_name_or_path "
                         "names neither (e.g. a local path the platform cannot tell)")
    up.add_argument("--create-tenant", action="store_true", help="create the tenant if it does not exist")
    up.set_defaults(func=_upload)

    ls = cmds.add_parser("list", help="list a tenant's adapters, or the versions of one adapter")
    ls.add_argument("--tenant", required=True, help="tenant name")
    ls.add_argument("name", nargs="?", default=None, help="adapter name: list its versions")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=_list)

    show = cmds.add_parser("show", help="show one version: name (current), name@N or name@<sha256>")
    show.add_argument("--tenant", required=True, help="tenant name")
    show.add_argument("ref", help="name, name@N or name@<sha256>")
    show.set_defaults(func=_show)

    rm = cmds.add_parser("delete", help="delete an adapter (name) or one version (name@N)")
    rm.add_argument("--tenant", required=True, help="tenant name")
    rm.add_argument("ref", help="name or name@N")
    rm.set_defaults(func=_delete)


def _context():
    from tessera.cli import CLIError

    from adapter_registry.migrate import upgrade
    from adapter_registry.settings import get_settings
    from pydantic import ValidationError
    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError
    from tessera_core.context import build_context

    try:
        settings = get_settings()
    except ValidationError as e:  # e.g. TESSERA_BASE_MODEL_ALIASES naming a model that is not served
        raise CLIError("settings: " + "; ".join(
            f"{'.'.join(map(str, err['loc'])) + ': ' if err['loc'] else ''}{err['msg'].removeprefix('Value error, ')}"
            for err in e.errors())) from None
    except ValueError as e:  # pydantic-settings: a TESSERA_* value that does not parse (JSON fields)
        raise CLIError(f"settings: {e}") from None
    try:
        if settings.database_url.startswith("sqlite"):
            upgrade(settings)  # embedded mode: create/migrate the local database
        ctx = build_context(settings)
        if "adapters" not in inspect(ctx.engine).get_table_names():
            raise CLIError(f"database {ctx.engine.url!r} has no registry tables; run `alembic upgrade head` first")
    except SQLAlchemyError as e:
        raise CLIError(f"database unavailable: {type(e).__name__}: {e.__cause__ or e}") from None
    return ctx


def _run(fn):
    """Run fn(ctx, session) turning registry errors into one-line CLI errors."""
    from tessera.cli import CLIError

    from tessera_core.errors import TesseraError

    ctx = _context()
    with ctx.session_factory() as session:
        try:
            return fn(ctx, session)
        except TesseraError as e:  # the registry's, the object store's
            raise CLIError(str(e)) from None


def _version_dict(v) -> dict:
    return {
        "ref": v.ref, "version": v.version, "status": v.status, "sha256": v.sha256,
        "rejection_reason": v.rejection_reason, "base_model": v.base_model, "rank": v.rank, "alpha": v.alpha,
        "use_rslora": v.use_rslora, "target_modules": v.target_modules, "dtype": v.dtype, "size_bytes": v.size_bytes,
        "current": v.adapter.current_version_id == v.id,
        "created_at": v.created_at.isoformat() if v.created_at else None,
    }


def _serving(settings):
    """`settings` serving the deployment's base model (TESSERA_MODEL_PATH / TESSERA_MODEL_NAME);
    CLIError with one line when the model cannot be read or an alias names another model."""
    from tessera.cli import CLIError
    from tessera.commands.serve import load_settings
    from tessera.served_model import describe_model_files

    platform = load_settings()
    try:
        _, base = describe_model_files(platform.model_path, platform.model_name)
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(f"the served base model (TESSERA_MODEL_PATH) cannot be read: {e}") from None
    try:
        return settings.serving([base])
    except ValueError as e:
        raise CLIError(f"settings: {e}") from None


def _upload(args: argparse.Namespace) -> int:
    from adapter_registry import services
    from adapter_registry.errors import InvalidName, NotFound
    from adapter_registry.names import check_identifier
    from tessera.cli import CLIError

    try:  # before anything is read or migrated: a bad name is one line and exit 2
        check_identifier(args.name, what="adapter name")
        if args.create_tenant:
            check_identifier(args.tenant, what="tenant name (--tenant)")
    except InvalidName as e:
        raise CLIError(str(e)) from None

    def go(ctx, session):
        settings = _serving(ctx.settings)
        try:
            tenant = services.get_tenant(session=session, name=args.tenant)
        except NotFound:
            if not args.create_tenant:
                raise NotFound(f"tenant {args.tenant!r} not found (pass --create-tenant to create it)") from None
            tenant = services.create_tenant(session=session, name=args.tenant)
        v = services.upload_adapter(session=session, store=ctx.store, settings=settings, tenant=tenant,
                                    name=args.name, source=args.path, base_model=args.base_model)
        if v.status == "rejected":
            print(f"{v.ref} rejected: {v.rejection_reason}", file=sys.stderr)
            return 1
        print(f"{v.ref} {v.status} sha256={v.sha256}")
        return 0

    return _run(go)


def _list(args: argparse.Namespace) -> int:
    from adapter_registry import services

    def go(ctx, session):
        tenant = services.get_tenant(session=session, name=args.tenant)
        if args.name is None:
            rows = []
            for a in services.list_adapters(session=session, tenant=tenant):
                cur = a.current_version
                rows.append({"name": a.name, "current": cur.ref if cur else None,
                             "versions": len(services.list_versions(session=session, tenant=tenant, name=a.name))})
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                for r in rows:
                    print(f"{r['name']:<32} current={r['current'] or '-':<40} versions={r['versions']}")
            return 0
        versions = [_version_dict(v) for v in services.list_versions(session=session, tenant=tenant, name=args.name)]
        if args.json:
            print(json.dumps(versions, indent=2))
        else:
            for v in versions:
                mark = "*" if v["current"] else " "
                print(f"{mark} {v['ref']:<36} {v['status']:<10} rank={v['rank'] or '-':<4} {v['sha256'][:16]}"
                      + (f"  {v['rejection_reason']}" if v["rejection_reason"] else ""))
        return 0

    return _run(go)


def _show(args: argparse.Namespace) -> int:
    from adapter_registry import services

    def go(ctx, session):
        tenant = services.get_tenant(session=session, name=args.tenant)
        v = services.resolve_version(session=session, tenant=tenant, ref=args.ref, require_ready=False)
        print(json.dumps(_version_dict(v), indent=2))
        return 0

    return _run(go)


def _delete(args: argparse.Namespace) -> int:
    from adapter_registry import services

    def go(ctx, session):
        tenant = services.get_tenant(session=session, name=args.tenant)
        services.delete_adapter(session=session, tenant=tenant, ref=args.ref)
        print(f"deleted {args.ref}")
        return 0

    return _run(go)
