"""Times and durations as users write them: 'now', '-1h', 'now-15m', unix seconds, RFC 3339.

The one grammar for every verb, config and rule file (standard library only):

>>> parse_duration("250ms"), parse_duration("1d"), parse_duration("90"), parse_duration("1m30s")
(0.25, 86400.0, 90.0, 90.0)
>>> parse_time("-1h", now_s=7200.0)
3600000000000
"""

from __future__ import annotations

import math
import re
import time
from datetime import datetime, timezone

from .errors import UsageError

_REL = re.compile(r"^\s*(?:now)?\s*-\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h|d|w)\s*$")
_DUR = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h|d|w|y)?\s*$")
# Prometheus's compound form, as its API writes scrape intervals and users write ranges: 1m30s, 1h30m, 2d12h.
_PART = re.compile(r"([0-9]*\.?[0-9]+)(ms|s|m|h|d|w|y)")
_COMPOUND = re.compile(r"^\s*(?:[0-9]*\.?[0-9]+(?:ms|s|m|h|d|w|y)){2,}\s*$")
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "y": 31536000.0, None: 1.0}


class TimeError(UsageError, ValueError):
    """A time or duration that is not one: one sentence quoting what was typed."""


def parse_duration(text: str, what: str = "duration", *, allow_zero: bool = False) -> float:
    """Seconds from '250ms', '30s', '5m', '1h', '7d', '1w', a bare number of seconds, or Prometheus's
    compound form ('1m30s', '1h30m')."""
    m = _DUR.match(text or "")
    if m:
        v = float(m.group(1)) * _UNITS[m.group(2)]
    elif _COMPOUND.match(text or ""):
        v = sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))
    else:
        raise TimeError(f"{what} {text!r} is not a duration such as 1s, 30s, 5m or 1h.")
    if not math.isfinite(v):
        raise TimeError(f"{what} {text!r} is too long.")
    if v < 0 or (v == 0 and not allow_zero):
        raise TimeError(f"{what} must be {'non-negative' if allow_zero else 'positive'}, not {text!r}.")
    return v


_MAX_NS = 2**63 - 1


def parse_time(text: str, now_s: float | None = None, what: str = "time") -> int:
    """Nanoseconds since the epoch, between 1970 and 2262 (what an int64 of nanoseconds holds)."""
    ns = _parse_time(text, time.time() if now_s is None else now_s, what)
    if not 0 <= ns <= _MAX_NS:
        raise TimeError(f"{what} {text!r} is outside the years 1970-2262.")
    return ns


def _parse_time(text: str, now_s: float, what: str) -> int:
    t = (text or "").strip()
    if t in ("", "now"):
        return int(now_s * 1e9)
    m = _REL.match(t)
    if m:
        v = (now_s - float(m.group(1)) * _UNITS[m.group(2)]) * 1e9
        if not -1e19 < v < 1e19:
            raise TimeError(f"{what} {text!r} is outside the years 1970-2262.")
        return int(v)
    try:
        v = float(t)
    except ValueError:
        pass
    else:
        if not 0 <= v < 1e11:
            raise TimeError(f"{what} {text!r} is not a plausible unix time in seconds.")
        return int(v * 1e9)
    try:
        dt = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise TimeError(f"{what} {text!r} is not a time: use now, -1h, unix seconds or RFC 3339 "
                        "(2026-11-29T10:00:00Z).") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    try:
        return int(dt.timestamp() * 1e9)
    except (OverflowError, ValueError, OSError):
        raise TimeError(f"{what} {text!r} is outside the years 1970-2262.") from None
