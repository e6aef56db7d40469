"""One worker: runs its share of the plan on one event loop and returns mergeable results.

Open-loop stages: the worker sends every W-th scheduled request (W workers) at its intended time, never
waiting for answers; when it falls behind it sends at once (catch-up) and the lateness is recorded.
Closed-loop stages: the worker keeps its share of the concurrency in flight, each slot sending the next
request as soon as the previous one ends (intended time = that moment). The stage's slots 1, 2, ... are
dealt to workers in turn (slot k to worker (k - 1) mod W); a ramp opens each slot at its time and retires
it on the way down once its request in flight has ended (`Stage.slot_span`), never cancelling one.

Records leave the worker (its shard file, or the list kept for in-process runs) in the order the requests
were fired, which is the order of their intended send times: the parent then merges the shards as sorted
streams instead of loading and sorting every record. A record that ends before an older one waits for it.

The worker also watches itself: event-loop lag (a 10 ms timer's lateness), send lag (dispatch − intended
time) and its CPU time, so the parent can tell a slow server from a slow client.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .client import Client
from .openai import SseReader
from .records import RequestRecord
from .requests import Protocol, RequestMaker
from .schedule import Plan
from .stats import Acc, Dist

perf_counter = time.perf_counter


@dataclass
class WorkerConfig:
    url: str
    proto: Protocol
    plan: Plan
    workers: int = 1
    seed: int | None = None
    timeout_s: float = 30.0
    verify_tls: bool = True
    max_connections: int = 0
    metrics_as: str = "vllm"
    slo: dict[str, float] = field(default_factory=dict)
    late_threshold_s: float = 0.005
    n_warmup_stages: int = 0
    records_dir: str | None = None       # where workers write their shards of records; None: keep none
    keep_records: bool = False           # return the records (in-process runs and tests)


class Worker:
    def __init__(self, cfg: WorkerConfig, index: int, t0: float, counts: Any = None) -> None:
        self.cfg, self.index, self.t0 = cfg, index, t0
        self.client = Client(cfg.url, t0=t0, timeout_s=cfg.timeout_s, verify_tls=cfg.verify_tls,
                             max_connections=cfg.max_connections)
        self.maker = RequestMaker(cfg.proto, self.client.target, cfg.seed, index)
        self.accs = [Acc() for _ in cfg.plan.stages]
        self.loop_lag, self.send_lag = Dist(), Dist()
        self.counts = counts if counts is not None else [0] * (3 * (index + 1))
        self.base = index * 3
        self.in_flight = 0
        self.records: list[RequestRecord] = []
        self._buffer: list[bytes] = []
        self._file = open(shard_path(cfg.records_dir, index), "ab") if cfg.records_dir else None  # noqa: SIM115
        # Fired and not yet written, oldest first; ids of those of them that have ended. Only when kept.
        self._keeping = cfg.keep_records or self._file is not None
        self._fired: deque[RequestRecord] = deque()
        self._ended: set[int] = set()
        self._idle: asyncio.Event | None = None

    # sending
    def fire(self, seq: int, stage: int, t_intended: float) -> None:
        payload, tag, words, stream = self.maker.make(seq)
        warm = stage < self.cfg.n_warmup_stages
        rec = RequestRecord(i=seq, stage=stage - self.cfg.n_warmup_stages if not warm else -1, worker=self.index,
                            t_intended=t_intended, t_sent=0.0, warmup=warm, tag=tag)
        reader = SseReader(rec, words) if stream else None
        self.in_flight += 1
        self.counts[self.base] += 1
        if self._keeping:
            self._fired.append(rec)
        self.client.send(rec, payload, lambda r: self.done(r, stage, reader), reader)

    def done(self, rec: RequestRecord, stage: int, reader: SseReader | None) -> None:
        if reader is not None:
            err = reader.finish()
            if err is not None and rec.error is None:
                rec.error, rec.error_detail = err, "the stream was not well-formed server-sent events"
        self.in_flight -= 1
        self.counts[self.base + 1] += 1
        if rec.error is not None:
            self.counts[self.base + 2] += 1
        cfg = self.cfg
        if not rec.warmup:
            self.accs[stage].add(rec, metrics_as=cfg.metrics_as, late_s=cfg.late_threshold_s, slo=cfg.slo)
        if self._keeping:
            self._keep(rec)
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    def _keep(self, rec: RequestRecord) -> None:
        """Write out every ended record no older request is still holding back (fired order)."""
        fired, ended = self._fired, self._ended
        if fired[0] is not rec:
            ended.add(id(rec))
            return
        fired.popleft()
        out = [rec]
        while fired and id(fired[0]) in ended:
            ended.discard(id(fired[0]))
            out.append(fired.popleft())
        self._emit(out)
        if len(self._buffer) >= 4096:
            self._flush()

    def _emit(self, recs: list[RequestRecord]) -> None:
        if self.cfg.keep_records:
            self.records.extend(recs)
        if self._file is not None:
            self._buffer.extend(orjson.dumps(r.to_json()) for r in recs)

    def _flush(self) -> None:
        if self._file is not None and self._buffer:
            self._file.write(b"\n".join(self._buffer) + b"\n")
            self._buffer.clear()

    async def run_open(self, stage: int) -> None:
        plan, w, n_w = self.cfg.plan, self.index, self.cfg.workers
        times = plan.times[stage]
        base = sum(len(t) for t in plan.times[:stage])
        t0 = self.t0
        mine = range(w, len(times), n_w)
        j, n = 0, len(mine)
        send_lag = self.send_lag
        while j < n:
            now = perf_counter() - t0
            k = mine[j]
            due = float(times[k])
            if due > now:
                # Event-loop timers tick in whole milliseconds: a shorter sleep would spin the loop (a busy
                # core for nothing), so a send less than 1 ms away waits one tick and is up to 1 ms late.
                await asyncio.sleep(max(due - now, 0.001))
                continue
            while j < n and float(times[mine[j]]) <= now:
                k = mine[j]
                due = float(times[k])
                send_lag.add(now - due)
                self.fire(base + k, stage, due)
                j += 1
            await asyncio.sleep(0)   # let answers in between bursts of catch-up sends
        end = plan.ends_s[stage]
        if math.isfinite(end):
            now = perf_counter() - t0
            if end > now:
                await asyncio.sleep(end - now)

    async def run_closed(self, stage_index: int) -> None:
        st = self.cfg.plan.stages[stage_index]
        n_w, w = self.cfg.workers, self.index
        start = self.cfg.plan.starts_s[stage_index]
        end = self.cfg.plan.ends_s[stage_index]
        top = max(st.concurrency or 0, st.concurrency_end() or 0)
        spans = [st.slot_span(k) for k in range(w + 1, top + 1, n_w)]
        budget = None if st.requests is None else st.requests // n_w + (1 if w < st.requests % n_w else 0)
        counter = [0]
        loop = asyncio.get_running_loop()

        async def slot(opens_s: float, retires_s: float) -> None:
            until = min(end, start + retires_s)
            # A loop timer may fire a fraction of a millisecond early: a slot never opens before its time.
            while (now := perf_counter() - self.t0) < start + opens_s:
                await asyncio.sleep(start + opens_s - now)
            while True:
                now = perf_counter() - self.t0
                if now >= until or (budget is not None and counter[0] >= budget):
                    return
                seq = 1_000_000_000 + counter[0] * n_w + w
                counter[0] += 1
                fut = loop.create_future()
                payload, tag, words, stream = self.maker.make(seq)
                rec = RequestRecord(i=seq, stage=stage_index - self.cfg.n_warmup_stages, worker=w,
                                    t_intended=now, t_sent=0.0, tag=tag,
                                    warmup=stage_index < self.cfg.n_warmup_stages)
                if rec.warmup:
                    rec.stage = -1
                reader = SseReader(rec, words) if stream else None
                self.in_flight += 1
                self.counts[self.base] += 1
                if self._keeping:
                    self._fired.append(rec)

                def finished(r: RequestRecord, fut: asyncio.Future = fut, reader: SseReader | None = reader) -> None:
                    self.done(r, stage_index, reader)
                    if not fut.done():
                        fut.set_result(None)
                self.client.send(rec, payload, finished, reader)
                await fut
        await asyncio.gather(*(slot(a, b) for a, b in spans))
        self.cfg.plan.ends_s[stage_index] = min(end, perf_counter() - self.t0) if not math.isfinite(end) else end

    async def _watch_loop(self) -> None:
        period = 0.01
        while True:
            t = perf_counter()
            await asyncio.sleep(period)
            self.loop_lag.add(max(perf_counter() - t - period, 0.0))

    async def main(self) -> dict[str, Any]:
        now = perf_counter()
        if self.t0 > now:
            await asyncio.sleep(self.t0 - now)
        cpu0, wall0 = time.process_time(), perf_counter()
        watcher = asyncio.get_running_loop().create_task(self._watch_loop())
        for k, st in enumerate(self.cfg.plan.stages):
            if st.open_loop:
                await self.run_open(k)
            else:
                await self.run_closed(k)
        if self.in_flight:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), self.cfg.timeout_s + 1.0)
            except asyncio.TimeoutError:
                pass
        watcher.cancel()
        self.client.close()
        # Requests still unanswered after the wait leave no record; those that ended behind them do.
        rest = [r for r in self._fired if id(r) in self._ended]
        self._fired.clear()
        self._ended.clear()
        self._emit(rest)
        self._flush()
        if self._file is not None:
            self._file.close()
        wall = perf_counter() - wall0
        return {"worker": self.index, "accs": [a.dump() for a in self.accs], "loop_lag": self.loop_lag.dump(),
                "send_lag": self.send_lag.dump(), "cpu_s": time.process_time() - cpu0, "wall_s": wall,
                "end_s": perf_counter() - self.t0}


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (2-3x less time per request), else the standard loop."""
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def run_worker(cfg: WorkerConfig, index: int, t0: float, counts: Any = None) -> tuple[dict[str, Any], list]:
    loop = new_loop()
    try:
        w = Worker(cfg, index, t0, counts)
        result = loop.run_until_complete(w.main())
        return result, w.records
    finally:
        loop.close()


def shard_path(out_dir: str | Path, index: int) -> str:
    return str(Path(out_dir) / f".records.w{index}.jsonl")
