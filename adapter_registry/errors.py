"""Errors a registry caller can get. Each carries the HTTP status the platform maps it to, and a
message meant for the person who caused it."""
from __future__ import annotations


class RegistryError(Exception):
    """Base of the registry's user-facing errors."""

    http_status = 400


class NotFound(RegistryError):
    """No such tenant/adapter/version visible to this tenant (another tenant's is 'not found' too)."""

    http_status = 404


class UploadRejected(RegistryError):
    """The upload is refused before anything is stored (unsafe archive, pickle file, missing file...)."""

    http_status = 422


class QuotaExceeded(RegistryError):
    """The upload would exceed the tenant's limits (adapter size, number of adapters)."""

    http_status = 413


class Conflict(RegistryError):
    """The request conflicts with current state (e.g. making a rejected version current)."""

    http_status = 409


class RegistryUnavailable(RegistryError):
    """The database or object store failed; nothing was half-made, the caller may retry."""

    http_status = 503


class ObjectStoreError(RegistryUnavailable):
    """The object store could not be reached or refused an operation."""


class ObjectNotFound(RegistryError):
    """The object store has no object under this key."""

    http_status = 404
