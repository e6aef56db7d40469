"""Tiers (raw and the 1 s / 1 min / 1 h rollups) and how long each is kept.

Every tier is written in blocks that never straddle a multiple of the tier's block length, so a
block can be rolled into the next tier as soon as the clock passes its end. The 1 s tier is written
with each 10-minute raw block and its pieces are merged into one chunk per hour (fewer, larger
chunks read faster). Each tier's block
length divides the next one's, and each tier keeps at least one block of the next tier before it
may be dropped (see Retention), so a rollup is always computed from complete data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._errors import StoreError

SECOND_NS = 1_000_000_000
MINUTE_NS = 60 * SECOND_NS
HOUR_NS = 60 * MINUTE_NS
DAY_NS = 24 * HOUR_NS


@dataclass(frozen=True)
class Tier:
    index: int
    name: str
    resolution_ns: int  # 0 for raw samples
    block_ns: int  # chunks of this tier never straddle a multiple of this


TIERS: tuple[Tier, ...] = (
    Tier(0, "raw", 0, 10 * MINUTE_NS),
    Tier(1, "1s", SECOND_NS, HOUR_NS),  # written per 10 minutes, compacted per hour
    Tier(2, "1m", MINUTE_NS, 6 * HOUR_NS),
    Tier(3, "1h", HOUR_NS, 7 * DAY_NS),
)
RAW, SEC, MIN, HOUR = TIERS
TIER_BY_NAME = {t.name: t for t in TIERS}

GIB = 1 << 30
_AGES = ("raw_s", "rollup_1s_s", "rollup_1m_s", "rollup_1h_s")
_CAPS = ("raw_max_bytes", "rollup_1s_max_bytes", "rollup_1m_max_bytes", "rollup_1h_max_bytes")


@dataclass(frozen=True)
class Retention:
    """How long each tier is kept, by age (measured from the newest sample stored, not the wall
    clock) and by size: `max_bytes` bounds all tiers together (over it, the oldest blocks go first,
    finest tier first: raw, then 1 s, then 1 min, so history survives in the coarser rollups), and
    each tier may have its own cap too. A tier always keeps what is not yet rolled up into the next
    one (at most one block of the next tier: 10 minutes of raw, 6 h of 1 s, 7 days of 1 min).

    >>> Retention(raw_s=6 * 3600, max_bytes=1 << 30).raw_s
    21600
    """

    raw_s: float = 86_400.0
    rollup_1s_s: float = 7 * 86_400.0
    rollup_1m_s: float = 90 * 86_400.0
    rollup_1h_s: float = 730 * 86_400.0
    max_bytes: int = 10 * GIB
    raw_max_bytes: int | None = None
    rollup_1s_max_bytes: int | None = None
    rollup_1m_max_bytes: int | None = None
    rollup_1h_max_bytes: int | None = None
    events_max_age_s: float = 90 * 86_400.0
    events_max_rows: int = 1_000_000

    def ages_s(self) -> tuple[float, ...]:
        return tuple(float(getattr(self, f)) for f in _AGES)

    def caps(self) -> tuple[int | None, ...]:
        return tuple(getattr(self, f) for f in _CAPS)

    def validate(self) -> None:
        for name in (*_AGES, "events_max_age_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise StoreError(f"Retention {name} must be a positive number of seconds, got {v!r}.")
        for name in ("max_bytes", *_CAPS, "events_max_rows"):
            v = getattr(self, name)
            if v is None and name in _CAPS:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise StoreError(f"Retention {name} must be a positive integer, got {v!r}.")
