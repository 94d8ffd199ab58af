"""UTC calendar months, named 'YYYY-MM': billing periods, and the months of the quota's monthly
token budget (tessera.quota), so both agree on which month an instant belongs to and how it is
written. Dependency-free, so any layer may import it."""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date, datetime, timezone

_PERIOD = re.compile(r"^(\d{4})-(\d{2})$")


class PeriodError(ValueError):
    """A malformed period name."""


@dataclass(frozen=True, order=True)
class Period:
    """One UTC calendar month; hashable and ordered (a dict key, a set member)."""

    start: date  # first day of the month

    @property
    def end(self) -> date:
        """The first day of the next month (exclusive)."""
        y, m = self.start.year, self.start.month
        return date(y + (m == 12), m % 12 + 1, 1)

    @property
    def name(self) -> str:
        """'YYYY-MM': the one spelling of a month (API paths, file names, Redis budget keys)."""
        return f"{self.start.year:04d}-{self.start.month:02d}"

    def next(self) -> "Period":
        return Period(self.end)

    def end_datetime(self) -> datetime:
        return datetime(self.end.year, self.end.month, 1, tzinfo=timezone.utc)

    def start_datetime(self) -> datetime:
        return datetime(self.start.year, self.start.month, 1, tzinfo=timezone.utc)

    @classmethod
    def parse(cls, name: str) -> "Period":
        """'2026-11' -> Period; PeriodError names the expected form otherwise."""
        m = _PERIOD.match(name or "")
        if not m or not 1 <= int(m.group(2)) <= 12 or int(m.group(1)) < 1970:
            raise PeriodError(f"period {name!r} is not a month written YYYY-MM (e.g. 2026-11)")
        return cls(date(int(m.group(1)), int(m.group(2)), 1))

    @classmethod
    def at(cls, unix_seconds: float) -> "Period":
        """The month holding this instant (seconds since the epoch), in UTC."""
        return cls.of(datetime.fromtimestamp(unix_seconds, timezone.utc))

    def seconds_left(self, unix_seconds: float) -> float:
        """Seconds from this instant until the month ends."""
        return self.end_datetime().timestamp() - unix_seconds

    @classmethod
    def of(cls, day: date | datetime) -> "Period":
        if isinstance(day, datetime):
            day = day.astimezone(timezone.utc).date() if day.tzinfo else day.date()
        return cls(date(day.year, day.month, 1))

    def __str__(self) -> str:
        return self.name
