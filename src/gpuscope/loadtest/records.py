"""The shapes every part of the load tester shares: one request's record, one GPU reading, the error classes.

A run writes one `RequestRecord` per request as a JSON line (`records.jsonl`), a summary (`summary.json`)
and, when GPU data was read, one `GpuReading` per GPU and reading (`gpu.jsonl`). All times are seconds
since the run's start on the monotonic clock (`time.perf_counter()`, which on Linux is CLOCK_MONOTONIC and
so the same clock in every worker process); the summary's `clock` holds the pair
`{"wall_s": time.time(), "mono_s": time.perf_counter()}` taken at that start, which converts them to wall
time (GPU readings from the agent come in wall time and are converted the other way).

Latency is measured from the *intended* send time (`t_intended`, from the schedule) so that a server
that slows down cannot hide its tail by slowing the sender (coordinated omission); the latency from the
actual send (`t_sent`) is kept beside it. A request sent late is still sent and counted (`late_s`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

# Why a request did not succeed; `None` when it did. One class per request, the first that applied.
ERROR_CLASSES: dict[str, str] = {
    "connect": "the connection could not be opened (refused, unreachable, DNS)",
    "tls": "the TLS handshake failed (certificate, protocol)",
    "timeout": "no complete answer within the request timeout (none at all, or one that stalled mid-way)",
    "http_4xx": "the server answered 4xx (429 is counted apart as http_429)",
    "http_429": "the server refused for load (429)",
    "http_5xx": "the server answered 5xx",
    "malformed": "the response could not be read: bad HTTP (a status line that is not HTTP's, a status outside "
                 "100-599, a 101 not asked for, headers over 64 KiB, a body longer than its Content-Length), bad "
                 "SSE or bad JSON",
    "disconnect": "the server closed or reset the connection before the answer was complete (a body shorter than "
                  "its Content-Length; no answer on a fresh connection, or on a reused one for a request not safe "
                  "to send twice)",
    "client": "the client failed (a bug or resource limit of the generator, not the server)",
}


@dataclass(slots=True)
class RequestRecord:
    """One request, as written to records.jsonl (one JSON object per line, keys as here)."""

    i: int                         # sequence number in the run, from 0
    stage: int                     # index of the stage it was scheduled in
    worker: int                    # worker process that sent it
    t_intended: float              # when the schedule said to send it
    t_sent: float                  # when its first byte was written
    t_end: float | None = None     # when its last byte arrived (None when it never completed)
    t_first_byte: float | None = None   # first response byte (status line)
    status: int = 0                # HTTP status; 0 when none arrived
    error: str | None = None       # a key of ERROR_CLASSES, or None
    error_detail: str | None = None  # one short sentence, for the report's error table
    warmup: bool = False           # sent during warm-up: recorded, excluded from the statistics
    bytes_out: int = 0
    bytes_in: int = 0
    # Streaming (OpenAI-compatible SSE) only:
    t_first_token: float | None = None   # first data chunk carrying choices (vLLM's TTFT point)
    chunk_times: list[float] | None = None  # arrival of every content chunk, first included
    input_tokens: int | None = None
    output_tokens: int | None = None
    tokens_from: str | None = None       # "usage" (server's usage field) or "estimate" (see openai.py)
    tag: str | None = None               # the request's class/label (replay path, template name, priority)
    t_failed: float | None = None        # when the client saw it fail; a timeout's t_failed - t_intended is
                                         # the timeout (deadlines count from the intended send)
    t_retried: float | None = None       # when it was sent again on a fresh connection: its first send, on a
                                         # reused keep-alive connection, failed before any byte of answer
                                         # (see client.py); t_sent stays the first send

    @property
    def latency(self) -> float | None:
        """Seconds from the intended send to the last byte: the latency a user saw."""
        return None if self.t_end is None else self.t_end - self.t_intended

    @property
    def service_latency(self) -> float | None:
        """Seconds from the actual send to the last byte (what closed-loop tools report)."""
        return None if self.t_end is None else self.t_end - self.t_sent

    @property
    def late_s(self) -> float:
        return self.t_sent - self.t_intended

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RequestRecord:
        return cls(**{k: obj[k] for k in cls.__dataclass_fields__ if k in obj})


def read_records(path: str | Path) -> Iterator[RequestRecord]:
    """The records of a JSON Lines file (records.jsonl or a worker's shard), one at a time, in file order.
    Raises OSError, orjson.JSONDecodeError (a line that is not JSON) or TypeError (another shape)."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield RequestRecord.from_json(orjson.loads(line))


@dataclass(slots=True)
class GpuReading:
    """One GPU at one moment during a run, as written to gpu.jsonl. Missing metrics are None."""

    t: float                       # seconds since the run's start (monotonic clock, see module doc)
    gpu: str                       # "0", "1", ... or "host/0" when read from a fleet
    sm_active: float | None = None         # 0..1, the true SM activity (GPM/DCGM), not NVML util
    nvml_util: float | None = None         # 0..1, "any kernel running"
    mem_used_frac: float | None = None     # 0..1 of framebuffer memory in use
    power_w: float | None = None
    energy_j: float | None = None          # cumulative energy counter, joules
    throttle: str | None = None            # the active throttle reason that matters ("power", "thermal", ...)
    source: str = ""                       # "agent http://..", "nvml", "simulated"
    extra: dict[str, float] = field(default_factory=dict)
