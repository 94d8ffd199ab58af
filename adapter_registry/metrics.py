"""Registry metrics for Prometheus: adapter uploads by outcome and rejections by reason.

  tessera_registry_uploads_total{outcome}           ready | rejected | validating (queued for a
                                                    worker) | refused (before storing) | error
  tessera_registry_rejections_total{stage, reason}  stage: upload (refused before anything is
                                                    stored) | validation (stored, then rejected)
  tessera_registry_quarantined_total                ready versions the engine found faulty

Reasons are a fixed set (`reason_of`), derived from the user-facing message, so the label stays
bounded whatever a message says. Validation counts where it runs: in the gateway process in
embedded mode, in the Celery worker otherwise (which needs its own exporter, e.g. multiprocess
files scraped through a gateway, or prometheus_client.start_http_server).
"""
from __future__ import annotations

import functools

from prometheus_client import Counter

from adapter_registry.errors import Conflict, QuotaExceeded, UploadRejected
from tessera_core.errors import TesseraError, Unavailable

UPLOADS = Counter("tessera_registry_uploads_total", "Adapter uploads by outcome.", ["outcome"])
REJECTIONS = Counter("tessera_registry_rejections_total", "Adapter uploads refused or rejected, by reason.",
                     ["stage", "reason"])
QUARANTINED = Counter("tessera_registry_quarantined_total", "Ready adapter versions quarantined after an engine fault.")

# (substring of the message, reason), first match wins; validation.py and archive.py word them.
_VALIDATION_REASONS = (
    ("deadline", "sandbox_limit"), ("memory limit", "sandbox_limit"), ("CPU time limit", "sandbox_limit"),
    ("was killed", "sandbox_limit"), ("crashed", "sandbox_crash"), ("failed unexpectedly", "sandbox_crash"),
    ("NaN or Inf", "non_finite"), ("overflow", "overflow"), ("RE2", "regex"), ("regex", "regex"),
    ("dtype", "dtype"), ("shape", "shape"), ("missing", "missing_tensors"),
    ("maximum rank", "rank"), ("base model", "base_model"), ("safetensors", "safetensors"),
    ("adapter_config.json", "config"), ("tensor", "tensors"),
)
_UPLOAD_REASONS = (
    ("base model", "base_model"), ("pickle", "pickle"), ("zip bomb", "archive_limits"), ("entries", "archive_limits"),
    ("unsafe path", "unsafe_archive"), ("link", "unsafe_archive"), ("encrypted", "unsafe_archive"),
    ("regular file", "unsafe_archive"), ("sparse", "unsafe_archive"), ("header record", "archive_limits"),
    ("not a readable", "corrupt_archive"), ("corrupt", "corrupt_archive"),
    ("invalid", "invalid_name"), ("holds no", "layout"), ("more than one", "layout"), ("nested", "layout"),
)
VALIDATION_REASONS = tuple(r for _, r in _VALIDATION_REASONS) + ("unsupported_config",)
UPLOAD_REASONS = tuple(dict.fromkeys(r for _, r in _UPLOAD_REASONS)) + ("quota", "conflict", "other")


def reason_of(message: str, *, stage: str) -> str:
    """The bounded reason label of a refusal/rejection message."""
    table, fallback = (_VALIDATION_REASONS, "unsupported_config") if stage == "validation" else (_UPLOAD_REASONS, "other")
    for needle, reason in table:
        if needle in message:
            return reason
    return fallback


def validated(version) -> None:
    """Count a version that validation just decided (ready, or rejected with its reason)."""
    if version.status == "rejected":
        REJECTIONS.labels("validation", reason_of(version.rejection_reason or "", stage="validation")).inc()


def quarantined(n: int) -> None:
    """Count `n` versions just quarantined."""
    QUARANTINED.inc(n)


def count_uploads(fn):
    """Decorator of `upload_adapter`: counts its outcome, and refusals by reason."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            version = fn(*args, **kwargs)
        except Unavailable:  # database, queue or object store
            UPLOADS.labels("error").inc()
            raise
        except TesseraError as e:
            reason = ("quota" if isinstance(e, QuotaExceeded) else "conflict" if isinstance(e, Conflict)
                      else reason_of(str(e), stage="upload") if isinstance(e, UploadRejected) else "other")
            UPLOADS.labels("refused").inc()
            REJECTIONS.labels("upload", reason).inc()
            raise
        UPLOADS.labels(version.status).inc()
        return version

    return wrapper
