"""The trace model: one process's (one rank's) trace as columns, whatever wrote it.

Kineto (the PyTorch profiler's Chrome-trace JSON, ours or anyone's) and, later, CUPTI records both
become a `Trace`: one row per complete event ("X"), numpy columns, strings interned in `names`.
Analyses, rules and exporters read only this, never the JSON.

Clock: int64 ns since the Unix epoch. Kineto writes `ts`/`dur` in float µs relative to the file's
`baseTimeNanoseconds` (0 when absent): t_ns = baseTimeNanoseconds + round(ts * 1000).

Columns of `Trace.events` (all the same length, sorted by `ts_ns` then `-dur_ns`):

    kind       int8   EventKind: CPU_OP, PYTHON, RUNTIME (cuda_runtime), DRIVER (cuda_driver), KERNEL,
                      MEMCPY, MEMSET, SYNC (cuda_sync), ANNOTATION (user_annotation), GPU_ANNOTATION,
                      OVERHEAD, OTHER
    name       int32  index into `names`
    ts_ns      int64  start, epoch ns
    dur_ns     int64  duration, ns (>= 0)
    pid        int64  OS pid for host events; device index for GPU events (Kineto's convention)
    tid        int64  OS tid for host events; stream id for GPU events
    device     int16  GPU index for GPU events, -1 for host events
    stream     int64  CUDA stream for GPU events, -1 for host events
    correlation int64 CUPTI correlation id (runtime/driver call <-> the GPU op it launched), -1 if none
    external   int64  Kineto "External id" (GPU op / runtime call <-> the cpu_op that caused it), -1 if none
    bytes      int64  memcpy/memset bytes, -1 otherwise
    parent     int64  PYTHON events: row of the enclosing python_function (from "Python parent id"), -1 root

Per-event extras that only some kinds have live in `Trace.args`: {row: dict} for kernels (grid, block,
registers per thread, shared memory, est. achieved occupancy %) and memcpy (copy kind from the name,
e.g. "Memcpy HtoD (Pageable -> Device)"). Metadata: `Trace.meta` (the JSON's top level minus
traceEvents: deviceProperties, distributedInfo (rank), versions, baseTimeNanoseconds), `Trace.source`
(the file), `Trace.rank` (from distributedInfo, else None).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import UsageError


class TraceError(UsageError):
    """A trace that cannot be read: one sentence naming the file and what is wrong with it."""


class EventKind(enum.IntEnum):
    CPU_OP = 0
    PYTHON = 1
    RUNTIME = 2
    DRIVER = 3
    KERNEL = 4
    MEMCPY = 5
    MEMSET = 6
    SYNC = 7
    ANNOTATION = 8
    GPU_ANNOTATION = 9
    OVERHEAD = 10
    OTHER = 11


GPU_KINDS = (EventKind.KERNEL, EventKind.MEMCPY, EventKind.MEMSET)

COLUMNS: dict[str, Any] = {
    "kind": np.int8, "name": np.int32, "ts_ns": np.int64, "dur_ns": np.int64, "pid": np.int64, "tid": np.int64,
    "device": np.int16, "stream": np.int64, "correlation": np.int64, "external": np.int64, "bytes": np.int64,
    "parent": np.int64,
}


@dataclass
class Trace:
    events: dict[str, np.ndarray]          # COLUMNS, equal lengths
    names: list[str]                       # interned event names
    args: dict[int, dict[str, Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    rank: int | None = None

    def __len__(self) -> int:
        return len(self.events["kind"])

    def name_of(self, row: int) -> str:
        return self.names[int(self.events["name"][row])]
