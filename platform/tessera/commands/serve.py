"""`tessera serve`: the gateway with settings from TESSERA_* env vars / .env (the scale-out form:
Postgres, S3, Redis, engine workers), and `tessera engine-worker`: one engine process serving the
internal streaming API the gateway's HTTP engine client talks to. Both serve the base model
TESSERA_MODEL_PATH names (a .gguf file or a Hugging Face directory; default: the embedded
SmolLM2) under TESSERA_MODEL_NAME (default: the checkpoint's name); give every process of a
deployment the same two (the gateway refuses workers that serve another model)."""
from __future__ import annotations

import argparse
import socket


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the gateway (OpenAI-compatible + admin API) from TESSERA_* settings")
    p.add_argument("--host", default=None, help="listen address (default: TESSERA_HOST)")
    p.add_argument("--port", type=int, default=None, help="listen port (default: TESSERA_PORT)")
    p.add_argument("--workers", type=int, default=1,
                   help="gateway worker processes (>1 needs TESSERA_REDIS_URL, where they share quota counters "
                        "and the config epoch; metrics in prometheus-client multiprocess mode)")
    p.set_defaults(func=_serve)

    w = sub.add_parser("engine-worker", help="run one engine process with the internal streaming API "
                                             "(SIGTERM drains it: admits nothing new, finishes what runs, exits)")
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=8100)
    w.add_argument("--secret", default=None, help="shared secret (default: TESSERA_ENGINE_SECRET)")
    w.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: TESSERA_ENGINE_DEVICE, else cpu)")
    w.add_argument("--backend", default=None, choices=["cpu", "triton"],
                   help="the engine's kernels (default: TESSERA_ENGINE_BACKEND, else cpu on the CPU, triton on CUDA)")
    w.set_defaults(func=_worker)


def check_port_free(host: str, port: int) -> None:
    """CLIError with one line if host:port cannot be bound (instead of uvicorn's traceback)."""
    from tessera.cli import CLIError

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise CLIError(f"cannot listen on {host}:{port} ({e.strerror}); choose another with --port or TESSERA_PORT") from None


def load_settings(**overrides):
    """PlatformSettings from TESSERA_* / .env with `overrides` (None values ignored) on top. The
    overrides are constructor arguments, so they are validated and typed like the environment's
    (an admin token becomes a SecretStr) and win over it. CLIError with one line when invalid."""
    from pydantic import ValidationError

    from tessera.cli import CLIError
    from tessera.settings import PlatformSettings

    try:
        return PlatformSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        raise CLIError(f"invalid setting {'.'.join(map(str, err['loc'])) or ''}: {err['msg']}") from None


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tessera.cli import CLIError
    from tessera.http_server import server_options

    settings = load_settings(host=args.host, port=args.port)
    if args.workers < 1:
        raise CLIError(f"--workers must be at least 1 (got {args.workers})")
    if args.workers > 1 and not settings.redis_url:
        # Each process would keep its own quota counters, caller cache and config epoch: limits
        # multiplied by N, and a revoked key still accepted by the workers that did not see it.
        raise CLIError(f"--workers {args.workers} needs TESSERA_REDIS_URL: without Redis each worker keeps its own "
                       "quota counters and config epoch (limits would multiply, revocations reach one worker)")
    check_port_free(settings.host, settings.port)
    if settings.metrics_port is not None:
        check_port_free(settings.host, settings.metrics_port)
    if args.workers > 1:
        # Before anything imports the app: modules that create metrics at import time need the
        # multiprocess folder to exist by then.
        _multiprocess_metrics_dir()
    if settings.metrics_port is not None:
        # In this process: with --workers N it supervises them and reads every worker's values.
        from tessera.observability.exposure import start_listener

        start_listener(settings)
    if args.workers > 1:
        # Each worker builds its app from the same TESSERA_* environment (the factory reads it).
        uvicorn.run("tessera.app:create_app", factory=True, workers=args.workers, host=settings.host,
                    port=settings.port, log_level="info", **server_options(settings))
        return 0
    from tessera.app import create_app

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                **server_options(settings))
    return 0


def _multiprocess_metrics_dir() -> None:
    """Point prometheus-client's multiprocess mode at an empty folder, inherited by the workers:
    PROMETHEUS_MULTIPROC_DIR if set (emptied: values of a previous run must not count), else a
    fresh temporary one."""
    import os
    import tempfile
    from pathlib import Path

    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        for f in Path(path).glob("*.db"):
            f.unlink()
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="tessera-metrics-")


def _worker(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.async_engine import AsyncLLMEngine
    from tessera.cli import CLIError
    from tessera.engine_client.worker import create_worker_app
    from tessera.engine_config import engine_config_from_settings
    from tessera.http_server import server_options
    from tessera.served_model import load_engine

    settings = load_settings()
    secret = args.secret or (settings.engine_secret.get_secret_value() if settings.engine_secret else None)
    if not secret:
        raise CLIError("the engine worker needs a shared secret: --secret or TESSERA_ENGINE_SECRET")
    check_port_free(args.host, args.port)
    from adapter_registry.engine_source import RegistryAdapterSource
    from tessera_core.context import build_context

    ctx = build_context(settings)
    source = RegistryAdapterSource(session_factory=ctx.session_factory, store=ctx.store,
                                   cache_dir=settings.adapter_cache_dir)
    config = engine_config_from_settings(settings, device=args.device, backend=args.backend)
    from engine.backends import show_choices_on_stderr

    show_choices_on_stderr()  # what the backend chose at start (the CPU weight formats), one line
    try:
        engine = load_engine(settings.model_path, config, model_name=settings.model_name, adapter_source=source)
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(f"the base model (TESSERA_MODEL_PATH) cannot be served: {e}") from None
    aengine = AsyncLLMEngine(engine)
    app = create_worker_app(aengine, secret=secret, traced=settings.tracing)
    # Its clients are the gateways (a few addresses, many streams each): the total bound only.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            **server_options(settings, per_address=False))
    server = _draining_server_class()(config, app=app, drain_timeout_s=settings.engine_drain_timeout_s)
    try:
        server.run()
    finally:
        aengine.shutdown()
    return 0


def _draining_server_class():
    """uvicorn.Server whose first SIGTERM drains the engine worker before it exits; built in a
    function so that importing this module (every CLI command does) does not import uvicorn."""
    import logging
    import signal
    import threading
    import time

    import uvicorn

    from tessera.engine_client.worker import begin_drain, in_flight

    log = logging.getLogger("tessera.engine_worker")

    class _DrainingServer(uvicorn.Server):
        """On the first SIGTERM the worker drains: new requests get 503 and /ready says
        "draining" (the gateways route elsewhere), the requests in flight run to their end, then
        the server exits as on any signal; after `drain_timeout_s` it exits regardless (the
        streams still open end, and their gateways answer 503). SIGINT, or a second SIGTERM,
        exits at once."""

        def __init__(self, config, *, app, drain_timeout_s: float):
            super().__init__(config)
            self.app, self.drain_timeout_s = app, drain_timeout_s
            self._draining = False

        def handle_exit(self, sig, frame) -> None:
            if sig != signal.SIGTERM or self._draining:
                return super().handle_exit(sig, frame)
            self._draining = True
            begin_drain(self.app)
            log.warning("SIGTERM: draining %d request(s) in flight (at most %.0f s)",
                        in_flight(self.app), self.drain_timeout_s)
            threading.Thread(target=self._exit_when_drained, args=(sig, frame), name="drain", daemon=True).start()

        def _exit_when_drained(self, sig, frame) -> None:
            deadline = time.monotonic() + self.drain_timeout_s
            while in_flight(self.app) > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            super().handle_exit(sig, frame)

    return _DrainingServer
