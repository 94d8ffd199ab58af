"""Errors of the services every part shares (database, object store), and the base of every
user-facing Tessera error. Each carries the HTTP status the platform maps it to, and a message
meant for the person who caused it."""
from __future__ import annotations


class TesseraError(Exception):
    """Base of Tessera's user-facing errors (the registry's RegistryError builds on it). A subclass
    names its HTTP status in its class line (`class NotFound(RegistryError, http_status=404)`),
    else inherits its parent's."""

    http_status = 400

    def __init_subclass__(cls, *, http_status: int | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if http_status is not None:
            cls.http_status = http_status


class Unavailable(TesseraError, http_status=503):
    """A backing service (database, object store, queue) failed; nothing was half-made, the caller
    may retry. The registry's RegistryUnavailable is one."""


class ObjectStoreError(Unavailable):
    """The object store could not be reached or refused an operation."""


class ObjectNotFound(TesseraError, http_status=404):
    """The object store has no object under this key."""
