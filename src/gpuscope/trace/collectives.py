"""Collectives across ranks on one clock: who arrives last at each NCCL collective (the rank the others wait for).

    >>> from gpuscope.trace import load
    >>> from gpuscope.trace.collectives import arrivals
    >>> arrivals([load("tests/fixtures/traces/launch_bound.pt.trace.json.gz")]) is None  # one rank, no NCCL
    True

In a job whose ranks meet in collectives (data parallel: an all-reduce every step), every rank's NCCL kernel
starts when that rank gets there and then waits inside the kernel for the last one. So on one clock the k-th
collective of a name starts on every rank at nearly one moment, but for the last to arrive, and the spread
of the starts is the time the early ranks waited. The rank that is last most often is the one the job waits
for (its cause is in its own trace: compute, input, host); spreads near zero mean the ranks keep pace, and
then slow collectives are the network's. Only collectives every rank ran are compared (the k-th of each name
on each rank); `shifts_ns` puts each rank's stamps on the common clock (`gpuscope trace fleet` measures them).
Windows that start or end a little apart hold different first and last collectives, so each collective of
the first rank is matched, per name, with the nearest one in time on every other rank, within half the usual
gap between two of that name; a collective some rank has no match for is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .analyze import COMM_RE
from .model import EventKind, Trace


@dataclass
class Arrivals:
    ranks: list[int | None]          # in the order of the traces given
    collectives: int                 # collectives that every rank ran (matched by name and order)
    spread_p50_ns: float             # last start - first start, over those collectives
    spread_p99_ns: float
    spread_max_ns: int
    last_share: list[float]          # per rank: share of the collectives it started last
    wait_ns: list[int]               # per rank: its summed wait for the last one (its start to the last start)
    slowest_rank: int | None         # the rank most often last, when it is last at half of them or more

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def arrivals(traces: Sequence[Trace], shifts_ns: Sequence[int] | None = None) -> Arrivals | None:
    """The arrival spread of the collectives all `traces` (one per rank) ran; None for fewer than two
    ranks or when they share no collective."""
    if len(traces) < 2:
        return None
    shifts = list(shifts_ns) if shifts_ns is not None else [0] * len(traces)
    starts: list[dict[str, np.ndarray]] = []
    for t, shift in zip(traces, shifts, strict=True):
        ev = t.events
        rows = np.flatnonzero(ev["kind"] == EventKind.KERNEL)
        is_comm = np.array([bool(COMM_RE.match(n)) for n in t.names], dtype=bool)
        rows = rows[is_comm[ev["name"][rows]]] if len(t.names) else rows[:0]
        by_name: dict[str, np.ndarray] = {}
        for name_id in np.unique(ev["name"][rows]):
            mine = rows[ev["name"][rows] == name_id]
            # one collective may run on several streams of one rank: its first kernel is its start
            by_name[t.names[int(name_id)]] = np.sort(ev["ts_ns"][mine]) + np.int64(shift)
        starts.append(by_name)
    shared = set(starts[0]).intersection(*starts[1:])
    columns = [c for c in (_matched([s[name] for s in starts]) for name in sorted(shared)) if c.shape[1]]
    if not columns:
        return None
    grid = np.concatenate(columns, axis=1)
    last = grid.max(axis=0)
    spread = last - grid.min(axis=0)
    late = np.argmax(grid, axis=0)
    count = grid.shape[1]
    share = [float(np.count_nonzero(late == i)) / count for i in range(len(traces))]
    ranks = [t.rank for t in traces]
    top = int(np.argmax(share))
    return Arrivals(ranks=ranks, collectives=count, spread_p50_ns=float(np.percentile(spread, 50)),
                    spread_p99_ns=float(np.percentile(spread, 99)), spread_max_ns=int(spread.max()),
                    last_share=share, wait_ns=[int(v) for v in (last - grid).sum(axis=1)],
                    slowest_rank=ranks[top] if share[top] >= 0.5 else None)


def _matched(seqs: list[np.ndarray]) -> np.ndarray:
    """ranks x collectives: the first rank's starts, each with its nearest start on every other rank (within
    half the first rank's median gap), where every rank has one."""
    ref = seqs[0]
    gaps = np.diff(np.unique(ref))
    tolerance = float(np.median(gaps)) / 2 if len(gaps) else float("inf")
    rows, keep = [ref], np.ones(len(ref), dtype=bool)
    for seq in seqs[1:]:
        if len(seq) == 0:
            return np.empty((len(seqs), 0), dtype=np.int64)
        right = np.clip(np.searchsorted(seq, ref), 0, len(seq) - 1)
        left = np.clip(right - 1, 0, len(seq) - 1)
        nearest = np.where(np.abs(seq[left] - ref) <= np.abs(seq[right] - ref), left, right)
        keep &= np.abs(seq[nearest] - ref) <= tolerance
        rows.append(seq[nearest])
    return np.stack(rows)[:, keep]
