"""A cache that forgets what was not used lately: for caches keyed by things that come and go (processes, pods),
where a size cap alone lets the dead entries pile up to the cap and a wholesale clear throws the live ones away.

Entries live in two generations. A lookup finds an entry in either and moves it to the current one; every
`period_s` the current generation becomes the old one and the old one goes. So an entry used at least once per
period stays, and one not used for two periods is gone: the cache holds what is in use, whatever the churn.
`max_items` still bounds it (past it, the next `rotate()` check rotates at once).

Safe for several threads under the GIL: each step is one dict operation or one attribute assignment; a rotation
racing a store can lose that one entry, which is then built again (a cache, not a record).

>>> t = [0.0]
>>> c = Recent(period_s=10, clock=lambda: t[0])
>>> c["a"] = 1
>>> c["b"] = 2
>>> t[0] = 11; _ = c.rotate(); c.get("a")  # still there after one rotation, and now current again
1
>>> t[0] = 22; _ = c.rotate(); sorted(c.keys())  # "b" was not used for two periods
['a']
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")
_MISS = object()


class Recent(Generic[K, V]):
    __slots__ = ("_cur", "_old", "_clock", "_period", "_max", "_rotated_at", "rotations")

    def __init__(self, period_s: float = 120.0, *, max_items: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not period_s > 0 or max_items < 1:
            raise ValueError("Recent needs a positive period_s and max_items.")
        self._cur: dict[K, V] = {}
        self._old: dict[K, V] = {}
        self._clock, self._period, self._max = clock, period_s, max_items
        self._rotated_at = clock()
        self.rotations = 0

    def get(self, key: K, default: V | None = None) -> V | None:
        v = self._cur.get(key, _MISS)  # type: ignore[arg-type]
        if v is _MISS:
            v = self._old.get(key, _MISS)  # type: ignore[arg-type]
            if v is _MISS:
                return default
            self._cur[key] = v  # type: ignore[assignment]
        return v  # type: ignore[return-value]

    def __setitem__(self, key: K, value: V) -> None:
        self._cur[key] = value

    def setdefault(self, key: K, value: V) -> V:
        got = self.get(key, _MISS)  # type: ignore[arg-type]
        if got is _MISS:
            self._cur[key] = value
            return value
        return got  # type: ignore[return-value]

    def __contains__(self, key: object) -> bool:
        return key in self._cur or key in self._old

    def __len__(self) -> int:
        return len(self._cur) + sum(1 for k in self._old if k not in self._cur)

    def keys(self) -> Iterator[K]:
        yield from self._cur
        yield from (k for k in self._old if k not in self._cur)

    def rotate(self) -> bool:
        """Age the generations if a period has passed (or the cache is over max_items). Cheap: call it on every
        use of the cache (once per render, say). True when it rotated."""
        now = self._clock()
        if now - self._rotated_at < self._period and len(self._cur) + len(self._old) <= self._max:
            return False
        self._old, self._cur = self._cur, {}
        self._rotated_at = now
        self.rotations += 1
        return True

    def clear(self) -> None:
        self._cur, self._old = {}, {}
