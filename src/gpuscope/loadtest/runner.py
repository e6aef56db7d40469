"""Runs a plan on N worker processes, merges their histograms and records, and builds summary.json.

Nothing here holds every record: the statistics are merged HDR histograms and counters (`stats.Acc`), and
the workers' record shards, each in intended-time order, are merged as streams into records.jsonl.

Workers are spawned (not forked: the parent may hold threads, e.g. the GPU watch), report ready, and are
then given one start instant `t0` on `time.perf_counter()` — CLOCK_MONOTONIC on Linux, the same clock in
every process — so every record and stage boundary is on one time axis. One worker runs in-process.
"""

from __future__ import annotations

import heapq
import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from .records import RequestRecord, read_records
from .stats import NAMES, Acc, Dist
from .worker import WorkerConfig, run_worker, shard_path

# A run is marked invalid (exit 1) when its figures are not the server's: the client was the bottleneck
# (send lag, late sends, a saturated worker), the client failed requests itself (class `client`), or more
# than MAX_UNANSWERED_RATIO of the requests got no complete answer (timeout, disconnect, malformed): the
# latency percentiles are taken over the answered requests, so past 1 % the p99 shown is not the server's.
# Answers with an error status (4xx, 5xx) and refused connections are the server's own figures, read right.
MAX_SEND_LAG_P99_S = 0.005
MAX_LATE_RATIO = 0.10
MAX_WORKER_CPU_PERCENT = 90.0
MAX_UNANSWERED_RATIO = 0.01
UNANSWERED = ("timeout", "disconnect", "malformed")
_START_MARGIN_S = 0.05


@dataclass
class RunResult:
    accs: list[Acc]
    loop_lag: Dist
    send_lag: Dist
    cpu_percent: list[float]
    end_s: float
    clock: dict[str, float]
    records: list[RequestRecord] = field(default_factory=list)


def _child(cfg: WorkerConfig, index: int, ready: Any, start: Any, results: Any, counts: Any) -> None:
    try:
        ready.put(index)
        t0 = start.recv()
        if t0 is None:
            return
        result, _ = run_worker(cfg, index, t0, counts)
        results.put(result)
    except BaseException as e:  # the parent reports it as one sentence; never a silent hang
        results.put({"worker": index, "failed": f"{type(e).__name__}: {e}"})


def execute(cfg: WorkerConfig, workers: int, *, on_progress: Callable[[list[int], float], None] | None = None,
            clock_cb: Callable[[dict[str, float]], None] | None = None) -> RunResult:
    """Run the plan; `on_progress(counts, t)` is called about twice a second from the parent."""
    cfg = replace(cfg, workers=workers)
    if workers == 1:
        t0 = time.perf_counter() + _START_MARGIN_S
        clock = {"wall_s": time.time() + _START_MARGIN_S, "mono_s": t0}
        if clock_cb:
            clock_cb(clock)
        counts = [0, 0, 0]
        result, records = _run_inline(cfg, t0, counts, on_progress)
        return _merge(cfg, [result], clock, records)
    ctx = mp.get_context("spawn")
    counts = ctx.Array("q", 3 * workers, lock=False)
    ready, results = ctx.Queue(), ctx.Queue()
    pipes, procs = [], []
    for w in range(workers):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_child, args=(replace(cfg, keep_records=False), w, ready, b, results, counts), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    try:
        for _ in range(workers):
            ready.get(timeout=60)
        t0 = time.perf_counter() + _START_MARGIN_S
        clock = {"wall_s": time.time() + _START_MARGIN_S, "mono_s": t0}
        if clock_cb:
            clock_cb(clock)
        for a in pipes:
            a.send(t0)
        got: list[dict] = []
        while len(got) < workers:
            try:
                got.append(results.get(timeout=0.5))
            except Exception:  # queue.Empty: time for a progress line; also notice a dead worker
                if all(not p.is_alive() for p in procs) and results.empty():
                    raise RuntimeError("a worker process died without a result") from None
            if on_progress:
                on_progress(list(counts), time.perf_counter() - t0)
        failed = [g["failed"] for g in got if "failed" in g]
        if failed:
            raise RuntimeError(f"a worker failed ({failed[0]})")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return _merge(cfg, got, clock, [])


def _run_inline(cfg: WorkerConfig, t0: float, counts: list[int],
                on_progress: Callable[[list[int], float], None] | None) -> tuple[dict, list]:
    import threading

    stop = threading.Event()
    if on_progress is not None:
        def tick() -> None:
            while not stop.wait(0.5):
                on_progress(list(counts), time.perf_counter() - t0)
        threading.Thread(target=tick, daemon=True).start()
    try:
        return run_worker(cfg, 0, t0, counts)
    finally:
        stop.set()


def _merge(cfg: WorkerConfig, results: list[dict], clock: dict[str, float], records: list) -> RunResult:
    accs = [Acc() for _ in cfg.plan.stages]
    loop_lag, send_lag = Dist(), Dist()
    cpu = []
    end_s = 0.0
    for r in sorted(results, key=lambda r: r["worker"]):
        for a, d in zip(accs, r["accs"], strict=False):
            a.merge(Acc.load(d))
        loop_lag.merge(Dist.load(r["loop_lag"]))
        send_lag.merge(Dist.load(r["send_lag"]))
        cpu.append(100.0 * r["cpu_s"] / r["wall_s"] if r["wall_s"] > 0 else 0.0)
        end_s = max(end_s, r["end_s"])
    return RunResult(accs, loop_lag, send_lag, cpu, end_s, clock, records)


def merge_key(rec: RequestRecord) -> tuple[float, int]:
    return rec.t_intended, rec.worker


def merged_records(streams: Iterable[Iterable[RequestRecord]]) -> Iterator[RequestRecord]:
    """One stream in (t_intended, worker) order from streams each already in intended-time order (a worker's
    shard); equal keys keep their stream's order. Holds one record per stream."""
    return heapq.merge(*streams, key=merge_key)


def collect_records(out_dir: str | Path, workers: int, records: Iterable[RequestRecord] | None = None, *,
                    into: BinaryIO | None = None, first: int = 0,
                    adjust: Callable[[RequestRecord], None] | None = None) -> int:
    """Merge the workers' shards (and in-process records) into records.jsonl (or the open file `into`),
    numbered by intended time from `first`, each passed to `adjust` first; the shards are removed.
    Returns how many records were written."""
    out_dir = Path(out_dir)
    shards = [p for p in (Path(shard_path(out_dir, w)) for w in range(workers)) if p.exists()]
    merged = merged_records([records or (), *(read_records(p) for p in shards)])
    n = first
    with open(out_dir / "records.jsonl", "wb") if into is None else nullcontext(into) as f:
        for r in merged:
            if adjust is not None:
                adjust(r)
            r.i = n
            n += 1
            f.write(orjson.dumps(r.to_json()) + b"\n")
    for p in shards:
        p.unlink()
    return n - first


def summarize(cfg: WorkerConfig, res: RunResult, *, url: str, protocol: str, stage_names: list[str]) -> dict[str, Any]:
    """summary.json: stages (warm-up left out), overall, the client's self-check and the verdict."""
    plan, n_warm = cfg.plan, cfg.n_warmup_stages
    stages: list[dict[str, Any]] = []
    overall = Acc()
    for k, acc in enumerate(res.accs):
        if k < n_warm:
            continue
        st = plan.stages[k]
        start = plan.starts_s[k]
        end = plan.ends_s[k] if math.isfinite(plan.ends_s[k]) else max(res.end_s, start)
        stages.append({"index": k - n_warm, "name": stage_names[k], "start_s": start, "end_s": end,
                       "target_rate": st.rate if st.open_loop else None,
                       "ramp_to": st.ramp_to if st.open_loop else None,
                       "ramp": st.ramp if st.ramp_to is not None else None,
                       "arrival": st.arrival if st.open_loop else None,
                       "concurrency": st.concurrency, "concurrency_end": st.concurrency_end(),
                       "stats": acc.stats(metrics_as=cfg.metrics_as, wall_s=end - start, slo=cfg.slo)})
        overall.merge(acc)
    measured_s = (stages[-1]["end_s"] - stages[0]["start_s"]) if stages else 0.0
    o = overall.stats(metrics_as=cfg.metrics_as, wall_s=measured_s, slo=cfg.slo)
    send = res.send_lag.pct_ms() or dict.fromkeys(("p50", "p99", "max"), 0.0)
    loop = res.loop_lag.pct_ms() or dict.fromkeys(("p50", "p99", "max"), 0.0)
    reasons = []
    if send["p99"] > MAX_SEND_LAG_P99_S * 1e3:
        reasons.append(f"the client sent late: p99 send lag {send['p99']:.1f} ms > {MAX_SEND_LAG_P99_S * 1e3:g} ms")
    if o["requests"] and o["late"] / o["requests"] > MAX_LATE_RATIO:
        reasons.append(f"{o['late'] / o['requests']:.0%} of requests were sent more than "
                       f"{cfg.late_threshold_s * 1e3:g} ms late (> {MAX_LATE_RATIO:.0%})")
    busiest = max(res.cpu_percent, default=0.0)
    if busiest > MAX_WORKER_CPU_PERCENT:
        reasons.append(f"a worker used {busiest:.0f}% of a core (> {MAX_WORKER_CPU_PERCENT:g}%): add --workers")
    if o["errors"].get("client"):
        reasons.append(f"{o['errors']['client']} requests failed inside the load generator (class client), not at "
                       "the server")
    for row in stages:   # per stage: a short stage whose answers were lost would hide in the run's total
        name = f"stage {row['index']} ({row['name']}): " if len(stages) > 1 else ""
        reasons += [name + r for r in answer_reasons(row["stats"])]
    return {
        "tool": "gpuscope loadtest", "version": 1, "url": url, "protocol": protocol, "metrics_as": cfg.metrics_as,
        "clock": res.clock, "duration_s": measured_s, "valid": not reasons, "invalid_reasons": reasons,
        "client": {"workers": cfg.workers, "cpu_percent": busiest, "cpu_percent_per_worker": res.cpu_percent,
                   "loop_lag_ms": {k: loop[k] for k in ("p50", "p99", "max")},
                   "send_lag_ms": {k: send[k] for k in ("p50", "p99", "max")},
                   "late": o["late"], "late_threshold_ms": cfg.late_threshold_s * 1e3},
        "slo": dict(cfg.slo), "names": NAMES[cfg.metrics_as], "stages": stages, "overall": o,
    }


def answer_reasons(stats: dict[str, Any]) -> list[str]:
    """Why a stage's (or the run's) latency figures are not the server's for want of answers: [] or one sentence.

    >>> answer_reasons({"requests": 200, "errors": {"disconnect": 30, "http_5xx": 9}})[0][:60]
    '15.0 % of requests got no complete answer (disconnect 30; at'
    """
    n = stats.get("requests") or 0
    errors = stats.get("errors") or {}
    missing = {k: errors[k] for k in UNANSWERED if errors.get(k)}
    if not n or sum(missing.values()) / n <= MAX_UNANSWERED_RATIO:
        return []
    return [f"{100 * sum(missing.values()) / n:.1f} % of requests got no complete answer "
            f"({', '.join(f'{k} {v}' for k, v in missing.items())}; at most {MAX_UNANSWERED_RATIO * 100:g} % may), so the "
            "latency percentiles, taken over the answered ones, are not the server's"]


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
