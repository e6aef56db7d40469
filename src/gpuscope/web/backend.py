"""Where the dashboard's data comes from: the agent's own sampler and store, or a Prometheus server.

The page talks only to /ui/api/* (see gpuscope.web.api); those handlers parse and check the request
and then ask a Backend. A Backend answers in the shapes below and raises BackendError (status + one
sentence) for anything the user asked that cannot be answered; the handlers turn it into a 4xx/5xx.

Shapes (all JSON-able; times in ns since the epoch; GPU keys are 'host/gpu' as in gpuscope.viewmodel):

    overview()  -> gpuscope.viewmodel overview dict
    meta()      -> {"source", "simulated", "version", "gpus": [{"key","host","gpu","name"}],
                    "metrics": [metric names that can be charted], "resolution_s": float,
                    "oldest_ns": int | None}
    range(q)    -> {"metric", "start_ns", "end_ns", "step_s", "agg", "simulated",
                    "series": [{"gpu_key": str | None, "labels": {..}, "timestamps_ns": [int],
                                "values": [float | None]}]}
    timeline(start_ns, end_ns, gpus)
                -> {"spans": [{"gpu_key","kind","severity","start_ns","end_ns","summary"}],
                    "events": [{"time_ns","kind","gpu_key","message","count"}]}
                   kinds of events: xid, ecc, clock_events (throttle), gpu_lost, process_start, process_stop
    alerts()    -> {"firing": [..], "pending": [..], "resolved": [..]}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class BackendError(Exception):
    """A request the backend cannot answer: `status` (4xx for the user's mistake, 502/503 for an
    upstream that failed) and one sentence."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RangeQuery:
    metric: str
    start_ns: int
    end_ns: int
    step_s: float
    agg: str = "mean"                       # mean | max | min | last
    gpus: tuple[str, ...] = ()              # GPU keys; empty = all
    labels: dict[str, str] = field(default_factory=dict)  # other label filters, e.g. pid


class Backend(Protocol):
    source: str  # 'agent' or 'prometheus'

    async def overview(self) -> dict[str, Any]: ...

    async def meta(self) -> dict[str, Any]: ...

    async def range(self, q: RangeQuery) -> dict[str, Any]: ...

    async def timeline(self, start_ns: int, end_ns: int, gpus: tuple[str, ...] = ()) -> dict[str, Any]: ...

    async def alerts(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...
