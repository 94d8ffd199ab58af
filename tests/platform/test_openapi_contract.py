"""The OpenAPI document is the API's contract: every operation declares the schema of its success
body and OpenAI's error shape for 4xx and 5xx (api/response_models.py), so clients and the
Schemathesis run (test_openapi_fuzz.py) can check answers against it."""
from __future__ import annotations

import pytest

from tessera.app import create_app
from tessera.settings import PlatformSettings

from .conftest import ADMIN_TOKEN

DOCUMENT = create_app(PlatformSettings(_env_file=None, admin_token=ADMIN_TOKEN)).openapi()
OPERATIONS = [(method.upper(), path, op) for path, item in DOCUMENT["paths"].items()
              for method, op in item.items() if method in ("get", "put", "post", "patch", "delete")]
ERROR_REF = "#/components/schemas/ErrorResponse"
#: Answers with no body at all (sign-in and sign-out set or clear cookies).
NO_CONTENT = {("POST", "/admin/session"), ("DELETE", "/admin/session")}
def _described(schema: dict) -> bool:
    """A schema that says something: a reference to a model, or a type (a file's bytes, SSE text)."""
    return bool(schema.get("$ref") or schema.get("type") or schema.get("anyOf") or schema.get("oneOf"))


def test_the_document_lists_the_routes():
    paths = {path for _, path, _ in OPERATIONS}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/usage", "/v1/responses",
            "/admin/v1/tenants", "/admin/v1/tenants/{tenant}/adapters", "/admin/v1/slo",
            "/admin/v1/billing/prices", "/health"} <= paths
    assert len(OPERATIONS) >= 45


@pytest.mark.parametrize(("method", "path", "op"), [pytest.param(m, p, op, id=f"{m} {p}")
                                                   for m, p, op in OPERATIONS])
def test_every_operation_declares_its_success_body(method, path, op):
    success = {code: r for code, r in op["responses"].items() if code.startswith("2")}
    assert success, f"{method} {path} declares no 2xx answer"
    if (method, path) in NO_CONTENT:
        assert set(success) == {"204"} and not success["204"].get("content")
        return
    for code, response in success.items():
        content = response.get("content") or {}
        assert content, f"{method} {path} {code} declares no body"
        for media, body in content.items():
            assert _described(body.get("schema") or {}), f"{method} {path} {code} {media}: no schema"


@pytest.mark.parametrize(("method", "path", "op"), OPERATIONS, ids=[f"{m} {p}" for m, p, _ in OPERATIONS])
def test_every_operation_declares_openai_errors(method, path, op):
    for code in ("4XX", "5XX"):
        schema = op["responses"][code]["content"]["application/json"]["schema"]
        assert schema == {"$ref": ERROR_REF}, f"{method} {path} {code}"
    # FastAPI's own validation-error shape is not what the app answers (tessera.errors).
    assert "422" not in op["responses"]
    assert "HTTPValidationError" not in DOCUMENT["components"]["schemas"]


def test_streaming_operations_document_server_sent_events():
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        content = DOCUMENT["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}, path


def test_the_error_shape_is_openais():
    schemas = DOCUMENT["components"]["schemas"]
    assert schemas["ErrorResponse"]["required"] == ["error"]
    assert set(schemas["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}
