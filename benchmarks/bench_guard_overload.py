"""The guard at 3x overload of an upstream of fixed capacity: does the adaptive limit find the capacity?

The upstream (tests/capped_upstream.py) serves 8 requests at a time, 50 ms each (160 req/s), and queues
the rest inside itself, FIFO, where priority cannot act. `gpuscope loadtest` offers 3x that (480 req/s,
Poisson), 20 % of it `x-priority: high`, the rest `low`, through three arms in turn, same seeds:
- guard: `gpuscope guard proxy`, the default adaptive controller (classes high 0.8 / low 0.2);
- oracle: the same proxy with `controller.mode: fixed` at the upstream's true concurrency (8);
- haproxy: HAProxy `maxconn 8` on the server with its queue (`timeout queue` = the guard's queue timeout)
  and `http-request set-priority-class` from the same header, HAProxy's own priority queue.
Two scenarios per arm: `fresh` (the upstream idle at the start) and `backlog` (the upstream handed
`--backlog-s` seconds of foreign work just before the run, as left by an earlier run's clients).

Per arm: the unloaded p50 (closed loop, one high request at a time, through the arm), then per scenario:
per class the requests sent, answered 200, shed (429/503) and failed, p50/p99 of the successes from the
*intended* send time; the guard's limit sampled from /guard/metrics every 0.2 s (its settling time: from
the start, or from the end of the backlog, until it stays within [C/2, 2C]); the upstream's own queue
(longest wait inside it); whether the breaker opened. Exit 0 when every arm ran (whatever the figures),
1 when something failed, 2 for a bad flag.

    python benchmarks/bench_guard_overload.py                      # 20 s per run, all arms
    python benchmarks/bench_guard_overload.py --seconds 10 --arms guard --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from capped_upstream import CappedUpstream  # noqa: E402

ARMS = ("guard", "oracle", "haproxy")
SCENARIOS = ("fresh", "backlog")


class BenchError(Exception):
    """A step failed; one sentence for the user (exit 1)."""


def gpuscope_cmd() -> list[str]:
    exe = shutil.which("gpuscope")
    return [exe] if exe else [sys.executable, "-c", "import sys; from gpuscope.cli import main; sys.exit(main())"]


def http_get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode("utf-8", "replace")


def metric(text: str, name: str, label: str = "") -> float | None:
    for line in text.splitlines():
        if line.startswith(name + (label or " ")) or (not label and line.startswith(name + "{")):
            try:
                return float(line.rsplit(None, 1)[1])
            except (IndexError, ValueError):
                return None
    return None


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def guard_config(arm: str, args: argparse.Namespace) -> str:
    ctl = (f"{{mode: fixed, initial_limit: {args.concurrency}, min_limit: 1, max_limit: {args.concurrency}}}"
           if arm == "oracle" else "{mode: gradient}")
    deadline = f", deadline_s: {args.deadline_s:g}" if args.deadline_s > 0 else ""
    return (f"classes:\n"
            f"  - {{name: high, share: 0.8, queue_timeout_s: {args.queue_timeout_s:g}{deadline}}}\n"
            f"  - {{name: low, share: 0.2, queue_timeout_s: {args.queue_timeout_s:g}{deadline}}}\n"
            f"classify: {{header: x-priority, default: low}}\n"
            f"queue_max: 256\n"
            f"controller: {ctl}\n"
            f"breaker: {{timeout_s: 30}}\n")


def haproxy_config(port: int, upstream_port: int, args: argparse.Namespace) -> str:
    return f"""global
    maxconn 4000
    log stderr format raw local0 err
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout queue {int(args.queue_timeout_s * 1000)}ms
frontend fe
    bind 127.0.0.1:{port}
    http-request set-priority-class int(-1) if {{ req.hdr(x-priority) -m str high }}
    default_backend be
backend be
    server up 127.0.0.1:{upstream_port} maxconn {args.concurrency}
"""


def start_arm(arm: str, upstream: str, upstream_port: int, work: Path, args: argparse.Namespace
              ) -> tuple[subprocess.Popen, str]:
    if arm == "haproxy":
        exe = shutil.which("haproxy")
        if not exe:
            raise BenchError("HAProxy is not installed (Debian: apt-get install haproxy).")
        port = free_port()
        cfg = work / "haproxy.cfg"
        cfg.write_text(haproxy_config(port, upstream_port, args))
        proc = subprocess.Popen([exe, "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL,
                                stderr=open(work / "haproxy.log", "wb"))  # noqa: SIM115
        url = f"http://127.0.0.1:{port}"
        probe = url + "/ping"
    else:
        cfg = work / f"guard-{arm}.yaml"
        cfg.write_text(guard_config(arm, args))
        log = open(work / f"proxy-{arm}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen([*gpuscope_cmd(), "guard", "proxy", "--config", str(cfg), "--upstream", upstream,
                                 "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=log, text=True)
        first: list[str] = []
        t = threading.Thread(target=lambda: first.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
        t.start()
        t.join(30)
        line = first[0] if first else ""
        m = re.search(r"(http://127\.0\.0\.1:\d+)", line)
        if not m:
            stop(proc)
            raise BenchError(f"The guard proxy did not start: {line.strip()} "
                             f"{(work / f'proxy-{arm}.log').read_text()[-300:]}")
        url = m.group(1)
        probe = url + "/guard/metrics"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            http_get(probe, 2)
            return proc, url
        except (OSError, urllib.error.URLError):
            time.sleep(0.2)
    stop(proc)
    raise BenchError(f"The {arm} arm never answered on {url}.")


def loadtest(url: str, out: Path, load: list[str], timeout_s: float) -> dict[str, Any]:
    cmd = [*gpuscope_cmd(), "loadtest", url, "--out", str(out), "--json", "--no-html", "--no-gpu", "--quiet",
           "--workers", "1", "--timeout", "10s", *load]
    try:
        p = subprocess.run(cmd, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BenchError(f"gpuscope loadtest ran past {timeout_s:g} s.") from None
    if not (out / "records.jsonl").exists():
        raise BenchError(f"gpuscope loadtest wrote no records: {p.stderr.decode(errors='replace')[-300:]}")
    return {"rc": p.returncode}


def records(out: Path) -> list[dict[str, Any]]:
    with open(out / "records.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def summarize(recs: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for klass in ("high", "low"):
        rs = [r for r in recs if r.get("tag") == klass and not r.get("warmup")]
        ok = [r for r in rs if r.get("status") == 200 and r.get("t_end") is not None]
        lat = [r["t_end"] - r["t_intended"] for r in ok]
        first_ok = min((r["t_end"] for r in ok), default=None)
        out[klass] = {"sent": len(rs), "ok": len(ok), "shed": sum(1 for r in rs if r.get("status") in (429, 503)),
                      "failed": sum(1 for r in rs if r.get("status") not in (200, 429, 503)),
                      "success": len(ok) / len(rs) if rs else None,
                      "p50_ms": None if not lat else 1000 * pct(lat, 0.5),
                      "p99_ms": None if not lat else 1000 * pct(lat, 0.99),
                      "first_ok_s": None if first_ok is None else first_ok - t0}
    return out


class MetricsPoller(threading.Thread):
    """The guard's limit, in-flight and breaker state every 0.2 s."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url + "/guard/metrics"
        self.samples: list[dict[str, float]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.halt.wait(0.2):
            try:
                text = http_get(self.url, 2)
            except (OSError, urllib.error.URLError):
                continue
            inflight = sum(float(line.rsplit(None, 1)[1]) for line in text.splitlines()
                           if line.startswith("gpuscope_guard_inflight{"))
            self.samples.append({"t": time.monotonic() - t0, "limit": metric(text, "gpuscope_guard_concurrency_limit") or 0,
                                 "inflight": inflight,
                                 "open": metric(text, "gpuscope_guard_breaker_state", '{state="open"}') or 0})


def settled_at(samples: list[dict[str, float]], lo: float, hi: float, start: float = 0.0) -> float | None:
    """Seconds from `start` after which the limit stays within [lo, hi], but for dips below lo of at most two
    samples (0.4 s: the probes that re-measure the no-load latency lower it on purpose); None if it never does."""
    xs = [s for s in samples if s["t"] >= start]
    if not xs or not lo <= xs[-1]["limit"] <= hi:
        return None
    last_out = start
    for i, s in enumerate(xs):
        if s["limit"] > hi:
            last_out = s["t"]
        elif s["limit"] < lo:
            run = 0
            while i + run < len(xs) and xs[i + run]["limit"] < lo:
                run += 1
            j = i
            while j > 0 and xs[j - 1]["limit"] < lo:
                j -= 1
                run += 1
            if run > 2:
                last_out = s["t"]
    return last_out - start


def wait_upstream_idle(up: CappedUpstream, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = up.stats()
        if s["waiting"] == 0 and s["in_service"] == 0:
            return
        time.sleep(0.2)
    raise BenchError(f"The upstream was still busy {timeout_s:g} s after a run.")


def run_arm(arm: str, up: CappedUpstream, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The unloaded p50, then each scenario on a freshly started arm (no state carried between scenarios)."""
    result: dict[str, Any] = {}
    reqs = work / "requests.jsonl"
    reqs.write_text("".join(json.dumps({"method": "GET", "path": "/work", "headers": {"x-priority": k}, "tag": k})
                            + "\n" for k in ("high", "low", "low", "low", "low")))
    for scenario in ["unloaded", *args.scenarios]:
        wait_upstream_idle(up, 120)
        up.reset()
        proc, url = start_arm(arm, up.url(""), up.port, work, args)
        try:
            if scenario == "unloaded":  # one high request at a time
                out = work / f"{arm}-unloaded"
                loadtest(url + "/work", out, ["--closed-loop", "--concurrency", "1", "--duration",
                                              f"{args.unloaded_s:g}s", "-H", "x-priority: high"], args.unloaded_s + 60)
                lat = [r["t_end"] - r["t_sent"] for r in records(out) if r.get("status") == 200 and r.get("t_end")]
                result["unloaded_p50_ms"] = 1000 * (pct(lat, 0.5) or 0)
                result["unloaded_n"] = len(lat)
                continue
            result[scenario] = run_scenario(arm, scenario, url, up, reqs, args, work)
        finally:
            stop(proc)
    return result


def run_scenario(arm: str, scenario: str, url: str, up: CappedUpstream, reqs: Path, args: argparse.Namespace,
                 work: Path) -> dict[str, Any]:
    backlog_n = int(args.backlog_s * args.concurrency * 1000 / args.service_ms) if scenario == "backlog" else 0
    poller = MetricsPoller(url) if arm != "haproxy" else None
    if poller:
        poller.start()
    if backlog_n:
        up.backlog(backlog_n)
    out = work / f"{arm}-{scenario}"
    rc = loadtest(url + "/work", out, ["--rate", f"{args.rate:g}", "--duration", f"{args.seconds:g}s",
                                       "--arrival", "poisson", "--seed", str(args.seed),
                                       "--request-file", str(reqs)], args.seconds + 120)
    if poller:
        poller.halt.set()
        poller.join(5)
    recs = records(out)
    t0 = min((r["t_intended"] for r in recs), default=0.0)
    s = summarize(recs, t0)
    # after the backlog has drained and the queue it built is served (the steady state the goal is about)
    late = summarize([r for r in recs if r["t_intended"] - t0 >= args.backlog_s + 4.0], t0) if backlog_n else None
    if late:
        s["high_after_drain"] = late["high"]
    st = up.stats()
    s["upstream"] = {"max_in_service": st["max_in_service"], "max_waiting": st["max_waiting"],
                     "max_wait_ms": 1000 * max(st["queue_wait_s"] or [0]),
                     "p50_wait_ms": 1000 * (pct(st["queue_wait_s"], 0.5) or 0),
                     "by_priority": st["by_priority"]}
    s["loadtest_rc"] = rc["rc"]
    s["send_lag_p99_ms"] = 1000 * (pct([r["t_sent"] - r["t_intended"] for r in recs], 0.99) or 0)
    s["backlog_jobs"] = backlog_n
    if poller and poller.samples:
        lims = [p["limit"] for p in poller.samples]
        drained = backlog_n / (args.concurrency * 1000 / args.service_ms)  # seconds of foreign work
        s["limit"] = {"min": min(lims), "max": max(lims), "last": lims[-1],
                      "median_after_10s": pct([p["limit"] for p in poller.samples if p["t"] >= 10], 0.5),
                      "settled_s": settled_at(poller.samples, args.concurrency / 2, args.concurrency * 2, drained),
                      "max_inflight": max(p["inflight"] for p in poller.samples),
                      "breaker_opened": any(p["open"] for p in poller.samples),
                      "trajectory": [(round(p["t"], 2), round(p["limit"], 2)) for p in poller.samples]}
    return s


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"upstream: {args.concurrency} x {args.service_ms:g} ms = {args.concurrency * 1000 / args.service_ms:g} "
          f"req/s; offered {args.rate:g} req/s (20 % high) for {args.seconds:g} s; SLO high p99 <= {args.slo_ms:g} ms")
    print("| arm | scenario | unloaded p50 ms | high ok | high p50 ms | p50/unloaded | high p99 ms | low ok | "
          "low shed | limit settled s | limit median after 10 s | upstream p50 / max wait ms | breaker opened | "
          "send lag p99 ms |")
    print("|" + "---|" * 14)
    for arm, r in res.items():
        for sc in args.scenarios:
            s = r.get(sc)
            if not s:
                continue
            h, lo, lim = s["high"], s["low"], s.get("limit", {})

            def f(x: float | None, fmt: str = "{:.0f}") -> str:
                return "-" if x is None else fmt.format(x)
            print(f"| {arm} | {sc} | {r['unloaded_p50_ms']:.1f} | {f(h['success'], '{:.1%}')} | {f(h['p50_ms'])} | "
                  f"{ratio(h['p50_ms'], r['unloaded_p50_ms'])} | {f(h['p99_ms'])} | {f(lo['success'], '{:.1%}')} | "
                  f"{f(lo['shed'] / lo['sent'] if lo['sent'] else None, '{:.1%}')} | {f(lim.get('settled_s'), '{:.1f}')} | "
                  f"{f(lim.get('median_after_10s'), '{:.1f}')} | {s['upstream']['p50_wait_ms']:.0f} / "
                  f"{s['upstream']['max_wait_ms']:.0f} | {'yes' if lim.get('breaker_opened') else 'no' if lim else '-'} | "
                  f"{s['send_lag_p99_ms']:.1f} |")
            a = s.get("high_after_drain")
            if a:
                print(f"| {arm} | {sc}: high from {args.backlog_s + 4:g} s | | {f(a['success'], '{:.1%}')} | "
                      f"{f(a['p50_ms'])} | {ratio(a['p50_ms'], r['unloaded_p50_ms'])} | {f(a['p99_ms'])} |"
                      + " |" * 7)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each overload run (default 20)")
    ap.add_argument("--rate", type=float, default=480.0, help="offered req/s (default 480: 3x capacity)")
    ap.add_argument("--concurrency", type=int, default=8, help="the upstream's slots (default 8)")
    ap.add_argument("--service-ms", type=float, default=50.0, help="the upstream's time per request (default 50)")
    ap.add_argument("--queue-timeout-s", type=float, default=1.0, help="longest queue wait, every arm (default 1)")
    ap.add_argument("--deadline-s", type=float, default=2.0, help="the guard classes' deadline_s (0: none)")
    ap.add_argument("--backlog-s", type=float, default=3.0, help="seconds of foreign work in the backlog scenario")
    ap.add_argument("--unloaded-s", type=float, default=3.0)
    ap.add_argument("--slo-ms", type=float, default=250.0, help="high priority's p99 SLO (default 250 ms)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", type=Path, help="keep every output in this directory")
    ap.add_argument("--json", type=Path, dest="json_out", help="write all figures here")
    a = ap.parse_args(argv)
    a.arms = [x for x in a.arms.split(",") if x]
    a.scenarios = [x for x in a.scenarios.split(",") if x]
    for x in a.arms:
        if x not in ARMS:
            ap.error(f"--arms takes {', '.join(ARMS)}, not {x!r}")
    for x in a.scenarios:
        if x not in SCENARIOS:
            ap.error(f"--scenarios takes {', '.join(SCENARIOS)}, not {x!r}")
    if not (0 < a.seconds <= 300 and 0 < a.rate <= 5000 and a.concurrency >= 1 and a.service_ms > 0):
        ap.error("--seconds must be in (0, 300], --rate in (0, 5000], --concurrency >= 1, --service-ms > 0")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="gpuscope-overload-"))
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {}
    try:
        with CappedUpstream(args.concurrency, args.service_ms) as up:
            for arm in args.arms:
                res[arm] = run_arm(arm, up, args, work)
    except (BenchError, OSError, RuntimeError) as e:
        print(f"bench_guard_overload: {e}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report(res, args)
    if args.json_out:
        args.json_out.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                      for k, v in vars(args).items()}, "results": res}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
