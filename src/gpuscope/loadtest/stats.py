"""Per-stage statistics: HDR histograms of every latency, counters, goodput; mergeable across workers.

Histograms hold microseconds at 3 significant digits (1 µs .. 1 h), so a percentile is within 0.1 % of
the exact value; means and maxima are kept exactly beside them.

The LLM figures follow the tool named by `metrics_as` (see REFERENCE Part C (b)):
- TTFT = first chunk with choices − actual send; time to second token = second chunk − first chunk.
- chunk gaps: every gap between content chunks (chunk-weighted) — vLLM's "ITL", AIPerf's "ICL".
- TPOT per request = (E2E − TTFT) / (output tokens − 1), only when output tokens > 1 (request-weighted)
  — vLLM's "TPOT", AIPerf's "ITL".
- E2E: vllm = last content chunk − send; aiperf = last response byte − send.
- Duration for throughputs: vllm = the stage's wall time; aiperf = last response − first send.
"""

from __future__ import annotations

import base64
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hdrh.histogram import HdrHistogram  # type: ignore[import-untyped]

from .records import RequestRecord

_MAX_US = 3_600_000_000
PCT_KEYS = ("mean", "p50", "p90", "p95", "p99", "p999", "max")
_QUANTILES = (("p50", 50.0), ("p90", 90.0), ("p95", 95.0), ("p99", 99.0), ("p999", 99.9))
LATENCIES = ("latency", "service_latency")
STREAMING = ("ttft", "ttst", "tpot", "chunk_gap", "e2e")
NAMES = {"vllm": {"chunk_gap_ms": "ITL", "tpot_ms": "TPOT"}, "aiperf": {"chunk_gap_ms": "ICL", "tpot_ms": "ITL"}}


class Dist:
    """One latency distribution: an HDR histogram plus the exact count, sum and max (seconds in)."""

    __slots__ = ("hist", "n", "sum_s", "max_s")

    def __init__(self) -> None:
        self.hist = HdrHistogram(1, _MAX_US, 3)
        self.n = 0
        self.sum_s = 0.0
        self.max_s = 0.0

    def add(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.hist.record_value(min(max(int(seconds * 1e6 + 0.5), 1), _MAX_US))
        self.n += 1
        self.sum_s += seconds
        if seconds > self.max_s:
            self.max_s = seconds

    def merge(self, other: Dist) -> None:
        if other.n:
            self.hist.add(other.hist)
            self.n += other.n
            self.sum_s += other.sum_s
            self.max_s = max(self.max_s, other.max_s)

    def pct_ms(self) -> dict[str, float] | None:
        if not self.n:
            return None
        out = {"mean": self.sum_s / self.n * 1e3}
        for key, q in _QUANTILES:
            out[key] = self.hist.get_value_at_percentile(q) / 1e3
        out["max"] = self.max_s * 1e3
        return out

    def dump(self) -> dict[str, Any]:
        raw = self.hist.encode() if self.n else b""
        return {"h": base64.b64encode(zlib.compress(raw)).decode() if raw else "", "n": self.n, "sum": self.sum_s,
                "max": self.max_s}

    @classmethod
    def load(cls, d: dict[str, Any]) -> Dist:
        out = cls()
        if d["n"]:
            out.hist = HdrHistogram.decode(zlib.decompress(base64.b64decode(d["h"])))
        out.n, out.sum_s, out.max_s = d["n"], d["sum"], d["max"]
        return out


@dataclass
class Acc:
    """Everything a stage's STATS is made of; one per stage per worker, merged in the parent."""

    dists: dict[str, Dist] = field(default_factory=lambda: {k: Dist() for k in LATENCIES + STREAMING})
    requests: int = 0
    completed: int = 0
    errors: Counter = field(default_factory=Counter)
    late: int = 0
    retried: int = 0      # sent again on a fresh connection (a reused one failed under it before any answer)
    input_tokens: int = 0
    output_tokens: int = 0
    good: int = 0
    first_sent_s: float = float("inf")
    last_end_s: float = float("-inf")
    streaming: bool = False

    def add(self, rec: RequestRecord, *, metrics_as: str, late_s: float, slo: dict[str, float]) -> None:
        self.requests += 1
        if rec.t_sent < self.first_sent_s:
            self.first_sent_s = rec.t_sent
        if rec.late_s > late_s:
            self.late += 1
        if rec.t_retried is not None:
            self.retried += 1
        if rec.error is not None or rec.t_end is None:
            self.errors[rec.error or "client"] += 1
            return
        self.completed += 1
        if rec.t_end > self.last_end_s:
            self.last_end_s = rec.t_end
        d = self.dists
        d["latency"].add(rec.t_end - rec.t_intended)
        d["service_latency"].add(rec.t_end - rec.t_sent)
        if rec.chunk_times is None:
            if slo:
                e2e = rec.t_end - rec.t_sent
                self.good += all(v <= slo[k] for k, v in (("e2e", e2e), ("ttft", e2e)) if k in slo)
            return
        self.streaming = True
        m = request_metrics(rec, metrics_as)
        for k in ("ttft", "ttst", "tpot", "e2e"):
            v = m[k]
            if v is not None:
                d[k].add(v)
        chunks = rec.chunk_times
        gaps = d["chunk_gap"]
        for a, b in zip(chunks, chunks[1:], strict=False):
            gaps.add(b - a)
        self.input_tokens += rec.input_tokens or 0
        self.output_tokens += rec.output_tokens or 0
        if slo:
            self.good += is_good(m, slo)

    def merge(self, other: Acc) -> None:
        for k, v in other.dists.items():
            self.dists[k].merge(v)
        self.requests += other.requests
        self.completed += other.completed
        self.errors.update(other.errors)
        self.late += other.late
        self.retried += other.retried
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.good += other.good
        self.first_sent_s = min(self.first_sent_s, other.first_sent_s)
        self.last_end_s = max(self.last_end_s, other.last_end_s)
        self.streaming = self.streaming or other.streaming

    def dump(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("dists", "errors")}
        out["dists"] = {k: v.dump() for k, v in self.dists.items()}
        out["errors"] = dict(self.errors)
        return out

    @classmethod
    def load(cls, d: dict[str, Any]) -> Acc:
        d = dict(d)
        dists = {k: Dist.load(v) for k, v in d.pop("dists").items()}
        errors = Counter(d.pop("errors"))
        return cls(dists=dists, errors=errors, **d)

    def stats(self, *, metrics_as: str, wall_s: float, slo: dict[str, float]) -> dict[str, Any]:
        """The summary's STATS dict; `wall_s` is the stage's planned length (vLLM's duration)."""
        if metrics_as == "aiperf":
            dur = self.last_end_s - self.first_sent_s if self.completed else 0.0
        else:
            dur = wall_s
        per_s = (lambda n: n / dur) if dur > 0 else (lambda n: 0.0)
        out: dict[str, Any] = {
            "requests": self.requests, "completed": self.completed, "errors": dict(self.errors),
            "late": self.late, "retried": self.retried, "request_throughput": per_s(self.completed), "duration_s": dur,
            "latency_ms": self.dists["latency"].pct_ms(),
            "service_latency_ms": self.dists["service_latency"].pct_ms()}
        if self.streaming:
            for k in STREAMING:
                out[f"{k}_ms"] = self.dists[k].pct_ms()
            out["input_tokens"] = self.input_tokens
            out["output_tokens"] = self.output_tokens
            out["output_throughput"] = per_s(self.output_tokens)
            out["total_token_throughput"] = per_s(self.input_tokens + self.output_tokens)
        if slo:
            out["goodput"] = per_s(self.good)
            out["slo_attainment"] = self.good / self.requests if self.requests else 0.0
        return out


def request_metrics(rec: RequestRecord, metrics_as: str) -> dict[str, float | None]:
    """TTFT, TTST, TPOT and E2E of one streamed request, in seconds (None where undefined)."""
    chunks = rec.chunk_times or []
    if not chunks or rec.t_end is None:
        return {"ttft": None, "ttst": None, "tpot": None, "e2e": None}
    ttft = chunks[0] - rec.t_sent
    e2e = (rec.t_end if metrics_as == "aiperf" else chunks[-1]) - rec.t_sent
    n = rec.output_tokens if rec.output_tokens is not None else len(chunks)
    return {"ttft": ttft, "ttst": chunks[1] - chunks[0] if len(chunks) > 1 else None,
            "tpot": (e2e - ttft) / (n - 1) if n > 1 else None, "e2e": e2e}


def is_good(m: dict[str, float | None], slo: dict[str, float]) -> bool:
    """Every SLO given holds (a TPOT undefined for one-token answers counts as 0, as vLLM does)."""
    for key, limit in slo.items():
        v = m.get(key)
        if v is None:
            v = 0.0 if key == "tpot" else None
        if v is None or v > limit:
            return False
    return True
