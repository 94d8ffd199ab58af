"""Errors a registry caller can get. Each carries the HTTP status the platform maps it to, and a
message meant for the person who caused it. The object store's errors (ObjectStoreError, a 503,
and ObjectNotFound) are tessera_core.errors'; a caller that must see them too catches
TesseraError or Unavailable, of which these are kinds."""
from __future__ import annotations

from tessera_core.errors import TesseraError, Unavailable


class RegistryError(TesseraError):
    """Base of the registry's user-facing errors. A subclass names its HTTP status in its class
    line (`class NotFound(RegistryError, http_status=404)`), else inherits its parent's."""


class NotFound(RegistryError, http_status=404):
    """No such tenant/adapter/version visible to this tenant (another tenant's is 'not found' too)."""


class UploadRejected(RegistryError, http_status=422):
    """The upload is refused before anything is stored (unsafe archive, pickle file, missing file...)."""


class BaseModelRefused(UploadRejected):
    """The upload names no served base model, or an ambiguous one; the message says how to name it
    (the upload's `base_model` field, `--base-model`, an alias)."""

    param = "base_model"


class AdapterDoesNotFitBase(UploadRejected):
    """The upload's modules or tensor shapes are not the served base model's (an adapter trained
    for another base); the message names the first module or tensor that does not fit and the
    base's dimensions."""

    param = "files"


class InvalidName(UploadRejected):
    """A tenant, adapter or key name that breaks the naming rule (adapter_registry.names); `param`
    is the field that carried it."""

    def __init__(self, message: str, *, param: str = "name"):
        super().__init__(message)
        self.param = param


class QuotaExceeded(RegistryError, http_status=413):
    """The upload would exceed the tenant's limits (adapter size, number of adapters)."""


class Conflict(RegistryError, http_status=409):
    """The request conflicts with current state (e.g. making a rejected version current)."""


class NameTaken(Conflict):
    """A live tenant or adapter already has this name, ignoring case; `param` is the field."""

    def __init__(self, message: str, *, param: str = "name"):
        super().__init__(message)
        self.param = param


class RegistryUnavailable(RegistryError, Unavailable, http_status=503):
    """Something the registry relies on failed (the database, the validation queue, a validation
    child, stored files that no longer match their digest); nothing was half-made, the caller may
    retry. (The object store's own failure is tessera_core's ObjectStoreError, an Unavailable too.)"""
