"""The classes' guaranteed shares as whole slots of the concurrency limit in force.

The guard admits a request only while fewer than the limit are in flight, whatever its class; a share is the
class's first claim on the slots that free while the limit is full, up to its reserved slots. Those are
recomputed whenever the limit (times the rate factor) moves, so a limit that falls takes the reservations
down with it. The rounding, at a limit L with the classes in priority order:

1. each class gets floor(share x L); the sum is at most floor(sum of shares x L) <= floor(L), shares summing
   to at most 1;
2. the slots that rounding left of floor(sum of shares x L) go to the largest remainders (share x L less what
   the class got), the higher priority first on a tie;
3. a class with a non-zero share that still has none gets one, in priority order: from the slots of floor(L)
   nobody reserved, else from the class with the most (if it has two or more; the lowest priority first on a
   tie). When floor(L) is smaller than the number of classes with a share, floor(L) of them have one each:
   those the proportional steps chose (the larger shares), then the others in priority order.

So the reserved slots never add up to more than floor(L), and a class with a share has at least one whenever
floor(L) is at least the number of classes with a share.

    >>> reserved_slots([0.8, 0.2], 10), reserved_slots([0.8, 0.2], 3), reserved_slots([0.8, 0.2], 2)
    ([8, 2], [2, 1], [1, 1])
    >>> reserved_slots([0.5, 0.3, 0.2], 2.9), reserved_slots([0.9, 0.05, 0.05], 10)
    ([1, 1, 0], [8, 1, 1])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["reserved_slots"]

_EPS = 1e-9  # 0.7 x 10 is 6.999999999999999 in floating point: a whole slot, not six


def reserved_slots(shares: Sequence[float], limit: float) -> list[int]:
    """Slots reserved per class (in priority order) at `limit`; see the module's docstring for the rounding."""
    slots = math.floor(limit + _EPS) if limit > 0 else 0
    quotas = [s * limit for s in shares]
    out = [math.floor(q + _EPS) for q in quotas]
    target = min(slots, math.floor(sum(quotas) + _EPS))
    while sum(out) < target:
        i = max(range(len(out)), key=lambda k: (quotas[k] - out[k], -k))
        out[i] += 1
    for i, s in enumerate(shares):
        if s <= 0 or out[i]:
            continue
        if sum(out) < slots:
            out[i] = 1
            continue
        j = max(range(len(out)), key=lambda k: (out[k], k))
        if out[j] < 2:
            break
        out[j] -= 1
        out[i] = 1
    return out
