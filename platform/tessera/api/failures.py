"""What a tenant is told when something other than its request fails: a 503 that says what failed
in general terms and the request id, or the engine's reason for failing the request with internal
locations scrubbed. Worker URLs, object keys, paths and bucket names go to the server log only."""
from __future__ import annotations

import logging

from engine.sampling_params import RequestOutput
from tessera.errors import ApiError, scrub

log = logging.getLogger(__name__)


def unavailable(request_id: str | None, what: str, detail: object, *, code: str = "service_unavailable") -> ApiError:
    """A 503 naming `what` failed and the request id; `detail` is logged, never shown."""
    log.warning("request %s: %s: %s", request_id or "-", what, detail)
    ref = f" (request id {request_id})" if request_id else ""
    return ApiError(503, f"{what}; try again{ref}", type="server_error", code=code)


def engine_error(*, request_id: str, model: str, out: RequestOutput) -> ApiError:
    """The engine failed this request (its adapter could not be loaded, a step fault traced to
    it): the reason without internal paths or addresses, and the request id; logged whole. An
    adapter that made the model's numbers non-finite is a 409 (its version is quarantined, every
    later request for it is a 409 too, and the platform itself is fine); anything else a 503."""
    log.warning("request %s: the engine failed it: %s", request_id, out.error)
    reason = scrub(out.error or "engine error")
    if out.adapter_fault:
        return ApiError(409, f"the adapter of model {model!r} failed this request and is quarantined: {reason} "
                             f"(request id {request_id})", param="model", code="adapter_quarantined")
    return ApiError(503, f"the engine could not complete the request: {reason} (request id {request_id})",
                    type="server_error", code="engine_error")
