"""What a tenant is told when something other than its request fails: a 503 that says what failed
in general terms and the request id, or the engine's reason for failing the request with internal
locations scrubbed. Worker URLs, object keys, paths and bucket names go to the server log only.
When the engine ended a request because of its own input (a grammar that could not go on), the
answer is a 400 naming the field and the usage status is "aborted", not a server error."""
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


def failure_status(out: RequestOutput) -> str:
    """The usage status of a request the engine finished with an error: "aborted" when the
    client's input was the cause (`invalid_param`: its grammar could not go on; billed as an
    aborted request, for what was sent), else "error" (a server error: it counts against the
    availability SLO)."""
    return "aborted" if out.invalid_param else "error"


def engine_error(*, request_id: str, model: str, out: RequestOutput) -> ApiError:
    """The engine failed this request (its adapter could not be loaded, a step fault traced to
    it): the reason without internal paths or addresses, and the request id; logged whole. An
    adapter that made the model's numbers non-finite is a 409 (its version is quarantined, every
    later request for it is a 409 too, and the platform itself is fine); anything else a 503.
    A request the engine ended for the client's input (`invalid_param`: its response_format or
    tools grammar could not go on mid-generation) is a 400 naming that field."""
    reason = scrub(out.error or "engine error")
    if out.invalid_param:
        log.info("request %s: the engine ended it for its %s: %s", request_id, out.invalid_param, out.error)
        return ApiError(400, f"{out.invalid_param}: {reason} (request id {request_id})", param=out.invalid_param,
                        code="grammar_failed")
    log.warning("request %s: the engine failed it: %s", request_id, out.error)
    if out.adapter_fault:
        return ApiError(409, f"the adapter of model {model!r} failed this request and is quarantined: {reason} "
                             f"(request id {request_id})", param="model", code="adapter_quarantined")
    return ApiError(503, f"the engine could not complete the request: {reason} (request id {request_id})",
                    type="server_error", code="engine_error")
