"""The terminal side: a live progress line (refreshed at most twice a second on a TTY, a plain line every
5 s otherwise) and the end-of-run table. Plain text, no terminal library."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO


class ProgressLine:
    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out, self.tty = out, tty
        self.last_print = 0.0
        self.last = (0.0, 0)
        self.every_s = 0.5 if tty else 5.0
        self.shown = False

    def update(self, counts: list[int], t_s: float) -> None:
        now = time.monotonic()
        if now - self.last_print < self.every_s or t_s < 0:
            return
        sent, done, errors = sum(counts[0::3]), sum(counts[1::3]), sum(counts[2::3])
        t_prev, done_prev = self.last
        rate = (done - done_prev) / (t_s - t_prev) if t_s > t_prev else 0.0
        self.last, self.last_print = (t_s, done), now
        line = (f"{t_s:7.1f} s  sent {sent}  done {done}  errors {errors}  in flight {sent - done}  "
                f"{rate:8.1f} req/s")
        if self.tty:
            self.out.write("\r" + line + "\x1b[K")
            self.shown = True
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def end(self) -> None:
        if self.tty and self.shown:
            self.out.write("\n")
            self.out.flush()
            self.shown = False
        self.last = (0.0, 0)


def _p(d: dict | None, key: str) -> str:
    return "-" if not d or d.get(key) is None else f"{d[key]:.1f}"


def offered_text(st: Mapping[str, Any], per_s: str, conc: str) -> str:
    """A stage's intended load as its table shows it: '10 req/s', '4 conc.', or 'A -> B' for a ramp."""
    rate, c0 = st.get("target_rate"), st.get("concurrency")
    if rate is not None:
        end = st.get("ramp_to")
        return f"{rate:g}{per_s}" if end is None or end == rate else f"{rate:g} -> {end:g}{per_s}"
    if c0 is not None:
        c1 = st.get("concurrency_end")
        return f"{c0}{conc}" if c1 is None or c1 == c0 else f"{c0} -> {c1}{conc}"
    return "–"


def print_summary(summary: dict[str, Any], out_dir: Path, out: TextIO) -> None:
    streaming = summary["protocol"] != "http"
    names = summary["names"]
    cols = ["stage", "target", "reqs", "ok", "err", "late", "req/s", "p50 ms", "p99 ms", "p99 sent ms"]
    if streaming:
        cols += ["TTFT p99", f"{names['tpot_ms']} p99", "tok/s"]
    if summary.get("slo"):
        cols += ["goodput", "SLO %"]
    rows = []
    at_capacity = summary.get("overall_stage") is not None  # a capacity search: "overall" is the chosen trial
    for st in summary["stages"] + [{"name": "at capacity" if at_capacity else "overall", "stats": summary["overall"],
                                    "target_rate": None, "concurrency": None}]:
        s = st["stats"]
        target = "" if st.get("target_rate") is None and st.get("concurrency") is None else \
            offered_text(st, "/s", "") if st.get("target_rate") is not None else f"c={offered_text(st, '', '')}"
        row = [st["name"], target, str(s["requests"]), str(s["completed"]), str(sum(s["errors"].values())),
               str(s["late"]), f"{s['request_throughput']:.1f}", _p(s["latency_ms"], "p50"),
               _p(s["latency_ms"], "p99"), _p(s["service_latency_ms"], "p99")]
        if streaming:
            row += [_p(s.get("ttft_ms"), "p99"), _p(s.get("tpot_ms"), "p99"), f"{s.get('output_throughput', 0):.0f}"]
        if summary.get("slo"):
            row += [f"{s.get('goodput', 0):.2f}", f"{100 * s.get('slo_attainment', 0):.1f}"]
        rows.append(row)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    out.write("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=False)) + "\n")
    for r in rows:
        out.write("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=False)) + "\n")
    errors = summary["overall"]["errors"]
    if errors:
        out.write(f"errors{' at capacity' if at_capacity else ''}: " + ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) + "\n")
    if summary["overall"].get("retried"):
        out.write(f"retried: {summary['overall']['retried']} requests sent again on a fresh connection (the server "
                  "closed a kept-alive connection under them before answering; not counted as errors)\n")
    c = summary["client"]
    out.write(f"client: {c['workers']} worker(s), busiest {c['cpu_percent']:.0f}% CPU, send lag p99 "
              f"{c['send_lag_ms']['p99']:.2f} ms, loop lag p99 {c['loop_lag_ms']['p99']:.2f} ms, {c['late']} late\n")
    cap = summary.get("capacity")
    if cap:
        out.write(f"capacity: {cap.get('capacity_rps', 0):.4g} req/s within the SLOs\n")
    out.write(f"{'valid' if summary['valid'] else 'INVALID'} run; wrote {out_dir}/summary.json, records.jsonl"
              f"{', report.html' if (out_dir / 'report.html').exists() else ''}\n")
