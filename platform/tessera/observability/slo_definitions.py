"""What the SLOs are, shared by the status code (slo.py) and the rule generator (rules.py): the
SLO names, the windows, the burn-rate alert pairs, a tenant's Objectives with the built-in
DEFAULTS and their checks, and the names of the Prometheus series the rules record and the
status reads. Both modules import it; it imports neither, so the two never import each other.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from tessera.observability.metrics import TPOT_BUCKETS_S, TTFT_BUCKETS_S

SLO_NAMES = ("availability", "ttft", "tpot")
WINDOW_DAYS = 30


@dataclass(frozen=True)
class BurnAlert:
    """One multi-window burn-rate condition: fires when both windows burn faster than `factor`."""

    severity: str  # "page" | "ticket"
    long_window: str
    short_window: str
    factor: float


BURN_ALERTS = (
    BurnAlert("page", "1h", "5m", 14.4),   # 2% of a 30-day budget in 1 hour
    BurnAlert("page", "6h", "30m", 6.0),   # 5% in 6 hours
    BurnAlert("ticket", "1d", "2h", 3.0),  # 10% in a day
    BurnAlert("ticket", "3d", "6h", 1.0),  # 10% in 3 days
)
# Every window a burn rate is computed over, shortest first.
WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
WINDOW_SECONDS = {"5m": 300, "30m": 1800, "1h": 3600, "2h": 7200, "6h": 21600, "1d": 86400, "3d": 259200,
                  "30d": WINDOW_DAYS * 86400}

TTFT_THRESHOLDS_MS = tuple(int(round(b * 1000)) for b in TTFT_BUCKETS_S)
TPOT_THRESHOLDS_MS = tuple(int(round(b * 1000)) for b in TPOT_BUCKETS_S)


@dataclass(frozen=True)
class Objectives:
    """A tenant's effective objectives."""

    availability_target: float
    ttft_threshold_ms: int
    ttft_target: float
    tpot_threshold_ms: int
    tpot_target: float

    def target(self, slo: str) -> float:
        return getattr(self, f"{slo}_target")

    def threshold_ms(self, slo: str) -> int | None:
        return getattr(self, f"{slo}_threshold_ms", None)

    def as_api(self) -> dict:
        """{"availability": {"target"}, "ttft": {"threshold_ms", "target"}, "tpot": {...}, "window_days"}"""
        return {"availability": {"target": self.availability_target},
                "ttft": {"threshold_ms": self.ttft_threshold_ms, "target": self.ttft_target},
                "tpot": {"threshold_ms": self.tpot_threshold_ms, "target": self.tpot_target},
                "window_days": WINDOW_DAYS}


DEFAULTS = Objectives(availability_target=0.995, ttft_threshold_ms=1000, ttft_target=0.95,
                      tpot_threshold_ms=100, tpot_target=0.95)
FIELDS = tuple(f.name for f in fields(Objectives))


def check_values(values: dict) -> None:
    """ValueError naming the field for an unknown field, a target outside (0, 1), or a threshold
    that is not a histogram bucket bound. None values (clear the override) are always fine."""
    for k, v in values.items():
        if k not in FIELDS:
            raise ValueError(f"unknown SLO field {k!r} (use {', '.join(FIELDS)})")
        if v is None:
            continue
        if k.endswith("_target") and not (isinstance(v, (int, float)) and 0 < v < 1):
            raise ValueError(f"{k} must be a share strictly between 0 and 1, e.g. 0.995 (got {v!r})")
        if k == "ttft_threshold_ms" and v not in TTFT_THRESHOLDS_MS:
            raise ValueError(f"ttft_threshold_ms must be one of the TTFT histogram bounds {list(TTFT_THRESHOLDS_MS)} (got {v!r})")
        if k == "tpot_threshold_ms" and v not in TPOT_THRESHOLDS_MS:
            raise ValueError(f"tpot_threshold_ms must be one of the TPOT histogram bounds {list(TPOT_THRESHOLDS_MS)} (got {v!r})")


ALERT_NAME = "TesseraErrorBudgetBurn"

# Series the recording rules write (rules.generate) and the Prometheus status reads
# (slo.status_from_prometheus); a window name follows ERROR_RATIO and BURN_RATE.
ERROR_RATIO = "tessera:slo_errors:ratio_rate"
BUDGET = "tessera:slo_error_budget:ratio"
BURN_RATE = "tessera:slo_burn_rate:rate"
BUDGET_REMAINING = "tessera:slo_error_budget_remaining:ratio"
