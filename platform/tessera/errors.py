"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the right status.

Handlers raise ApiError (or a subclass); the exception handlers installed by `install_handlers`
turn it, FastAPI's validation errors, unknown routes and unexpected failures into that shape, so
an OpenAI client raises its matching exception class and the server keeps serving.
"""
from __future__ import annotations

import logging
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


# What must not reach a tenant in an error message: URLs (worker addresses, s3://bucket),
# absolute paths, quoted or multi-segment object keys, host:port pairs.
_INTERNAL = re.compile(r"""
    [a-z][a-z0-9+.-]*://[^\s'"]+
  | (?<![\w.~-])/[^\s'",;)]+
  | '[^'\s]*[/\\][^'\s]*'
  | \b[\w.-]+(?:/[\w.@=-]+){2,}
  | \b[\w.-]+:\d{2,5}\b
""", re.X | re.I)

#: Pydantic error types answered 400 (a value out of the range the API accepts) rather than 422.
OUT_OF_RANGE = "value_out_of_range"


def scrub(message: str) -> str:
    """`message` with internal locations (URLs, paths, object keys, host:port) replaced by
    "<internal>": for reasons that come from deep inside (the engine, the object store) and are
    shown to a tenant, who may read the reason but not where things live."""
    return _INTERNAL.sub("<internal>", message)


class ApiError(Exception):
    """A user-facing error: `status` HTTP code, a message for the caller, OpenAI's type/param/code."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") in ("json_invalid", "json_type"):
        return ApiError(400, "request body is not valid JSON: " + str(first.get("ctx", {}).get("error", first.get("msg"))),
                        code="invalid_json")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") in (OUT_OF_RANGE, "int_parsing_size"):
        return ApiError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")
    if first.get("type") == "extra_forbidden":
        msg = "unknown field (not supported by this API)"
    elif first.get("type") == "missing":
        msg = "field required"
    return ApiError(422, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    """Register the handlers that give every error response OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = _validation_error(exc)
        if request.url.path.startswith("/v1/"):
            # The OpenAI-compatible API answers every invalid body 400, as OpenAI does (its
            # clients raise BadRequestError naming `param`); the admin API keeps 422.
            err.status = 400
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return ApiError(404, "no such endpoint", code="unknown_url").response()
        if exc.status_code == 405:
            return ApiError(405, "method not allowed on this endpoint", type="invalid_request_error").response()
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # The details stay in the log, under a reference the caller can quote.
        ref = uuid.uuid4().hex[:16]
        log.exception("unhandled error (ref %s) on %s %s", ref, request.method, request.url.path)
        return ApiError(500, f"internal error; the request was not completed (ref {ref})",
                        type="server_error").response()
