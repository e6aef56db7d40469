"""gpuscope._recent.Recent: a cache that keeps what is in use and forgets the rest, whatever the churn."""

from __future__ import annotations

import pytest

from gpuscope._recent import Recent


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_churn_keeps_only_what_is_used():
    clock = Clock()
    c: Recent[int, str] = Recent(period_s=60, clock=clock)
    live = set(range(10))
    for k in live:
        c[k] = f"v{k}"
    # An hour of churn: every second one new key is used once and never again; the live ones every second.
    for second in range(3600):
        clock.t = float(second)
        c.rotate()
        for k in live:
            assert c.get(k) == f"v{k}"
        c[1000 + second] = "dead"
    assert c.rotations == 59  # at 60, 120, ..., 3540 s
    assert all(k in c for k in live)
    assert len(c) <= len(live) + 2 * 60  # at most two periods of dead keys
    assert 1000 not in c and 1000 + 3599 in c


def test_setdefault_and_max_items():
    clock = Clock()
    c: Recent[str, int] = Recent(period_s=1e9, max_items=5, clock=clock)
    assert c.setdefault("a", 1) == 1 and c.setdefault("a", 2) == 1
    for i in range(10):
        c[str(i)] = i
    assert c.rotate() is True  # over max_items: rotates without waiting for the period
    c.rotate()
    assert len(c) == 0
    c.clear()
    assert c.get("a") is None


@pytest.mark.parametrize("period, items", [(0, 10), (-1, 10), (10, 0)])
def test_bad_settings(period, items):
    with pytest.raises(ValueError):
        Recent(period_s=period, max_items=items)
