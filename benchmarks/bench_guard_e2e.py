"""The guard end to end: the example inference service under a spike, with and without `gpuscope guard proxy`.

1. Starts examples/inference_service/server.py (`--preset cpu --device cpu`; `--preset h200 --device cuda`
   on an H200) on a free port.
2. Calibrates (unless `--rate` is given): `gpuscope loadtest --openai completions` closed loop at
   concurrency = the service's max batch for `--calibrate-seconds` gives the sustainable request rate X
   and the TTFT/TPOT with a full batch and no queue. SLOs (unless given): TTFT <= max(3 x that p50,
   250 ms), TPOT <= 2 x that p50; the same for both classes.
3. Runs the same traffic twice, directly at the service and then through the guard proxy (classes
   `interactive` share 0.8 and `batch` 0.2 by the `x-priority` header, the default Gradient2 controller on
   TTFT, the service's `vllm:num_requests_waiting` as the queue signal, `--agent` for a GPU agent): two
   concurrent `gpuscope loadtest` processes, interactive Poisson at 0.5 X, batch at 0.3 X with a spike to
   3 X for the middle third (a stage file); the same seeds both times.
4. Reads every request back from records.jsonl and prints, per mode and class: sent, completed, shed
   (429/503), p99 TTFT and p99 E2E from the *intended* send time, SLO attainment (good / sent) and goodput
   (good requests per second, a good one meets every SLO); the guard / no-guard ratios; and whether the
   three claims held: interactive p99 TTFT within its SLO with the guard, total goodput higher with the
   guard, batch shed before interactive (batch's shed fraction above interactive's).

Exit status: 0 when both runs ran (whatever the claims), 1 when something failed, 2 for a bad flag.

    python benchmarks/bench_guard_e2e.py                                   # CPU, 60 s per run
    python benchmarks/bench_guard_e2e.py --preset h200 --device cuda --seconds 45 --json guard_e2e.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
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
SERVER = ROOT / "examples" / "inference_service" / "server.py"
CLASSES = ("interactive", "batch")
HEADER = "x-priority"
SHED_STATUSES = (429, 503)


class BenchError(Exception):
    """A step of the benchmark failed; one sentence for the user (exit 1)."""


def gpuscope_cmd() -> list[str]:
    exe = shutil.which("gpuscope")
    if exe:
        return [exe]
    return [sys.executable, "-c", "import sys; from gpuscope.cli import main; sys.exit(main())"]


def http_get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode("utf-8", "replace")


def metric_values(text: str, name: str) -> list[float]:
    """Every sample of one Prometheus metric in an exposition text (labels ignored)."""
    out = []
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            try:
                out.append(float(line.rsplit(None, 1)[1]))
            except (IndexError, ValueError):
                pass
    return out


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"{url} never answered: its process exited with status {proc.returncode}.")
        try:
            http_get(url, 2.0)
            return
        except (OSError, urllib.error.URLError):
            time.sleep(0.2)
    raise BenchError(f"{url} did not answer within {timeout_s:g} s.")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_service(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    """The example service on a free port; its URL from the first stdout line."""
    cmd = [sys.executable, str(args.server), "--port", "0", "--preset", args.preset, "--device", args.device,
           *args.server_arg]
    log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    first: list[str] = []
    reader = threading.Thread(target=lambda: first.append(proc.stdout.readline() if proc.stdout else ""),
                              daemon=True)
    reader.start()
    reader.join(args.start_timeout)
    line = first[0].strip() if first else ""
    if not line.startswith("listening on "):
        stop(proc)
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise BenchError(f"The example service did not start (within {args.start_timeout:g} s): "
                         + (" | ".join(tail) or "no output") + ".")
    url = line.split("listening on ", 1)[1].strip()
    wait_http(url + "/health", 30, proc)
    return proc, url


def wait_idle(service: str, timeout_s: float = 120.0) -> None:
    """Until the service has nothing running or waiting (the previous run's tail has drained)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = http_get(service + "/metrics")
        busy = sum(metric_values(text, "vllm:num_requests_running") + metric_values(text, "vllm:num_requests_waiting"))
        if busy == 0:
            return
        time.sleep(0.5)
    raise BenchError(f"The service was still busy {timeout_s:g} s after the run ended.")


def loadtest(url: str, out: Path, load: list[str], args: argparse.Namespace, extra: list[str]) -> subprocess.Popen:
    cmd = [*gpuscope_cmd(), "loadtest", url, "--openai", "completions", "--prompt-tokens", str(args.prompt_tokens),
           "--max-tokens", str(args.max_tokens), "--out", str(out), "--json", "--no-html", "--no-gpu", "--quiet",
           "--workers", str(args.workers), *load, *extra]
    return subprocess.Popen(cmd, stdout=open(out.with_suffix(".json"), "wb"),  # noqa: SIM115
                            stderr=open(out.with_suffix(".err"), "wb"))  # noqa: SIM115


def finish(proc: subprocess.Popen, out: Path, timeout_s: float) -> tuple[int, dict[str, Any], list[str]]:
    """Wait for a loadtest; its exit status and summary. 0 valid, 1 invalid (client-bound), else failed."""
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise BenchError(f"gpuscope loadtest ({out.name}) did not finish within {timeout_s:g} s.") from None
    if rc not in (0, 1):
        err = out.with_suffix(".err").read_text(errors="replace").strip().splitlines()[-3:]
        raise BenchError(f"gpuscope loadtest ({out.name}) failed with status {rc}: {' | '.join(err)}")
    try:
        summary = json.loads(out.with_suffix(".json").read_text())
    except (OSError, ValueError) as e:
        raise BenchError(f"gpuscope loadtest ({out.name}) printed no summary: {e}.") from None
    return rc, summary, list(summary.get("invalid_reasons") or [])


def calibrate(service: str, max_batch: int, args: argparse.Namespace, work: Path) -> dict[str, float]:
    out = work / "calibrate"
    p = loadtest(service, out, ["--closed-loop", "--concurrency", str(max_batch),
                                "--duration", f"{args.calibrate_seconds}s", "--warmup", "3s"], args, [])
    rc, s = finish(p, out, args.calibrate_seconds + 120)[:2]
    o = s["overall"]
    if not o.get("completed") or not o.get("ttft_ms") or not o.get("tpot_ms"):
        raise BenchError(f"Calibration completed no streamed request (errors: {o.get('errors')}).")
    return {"rate": o["request_throughput"], "ttft_p50_ms": o["ttft_ms"]["p50"], "tpot_p50_ms": o["tpot_ms"]["p50"],
            "concurrency": max_batch, "valid": rc == 0}


def guard_config(service: str, max_batch: int, slo: dict[str, float], args: argparse.Namespace) -> str:
    """The guard's YAML: two classes by header, Gradient2 on TTFT around the service's batch size, the
    service's queue as a signal. Queue timeouts are the TTFT SLO: a request that waits longer has missed
    its SLO anyway, and serving it late would only take a slot from one that can still make it."""
    ttft_s = slo["ttft_ms"] / 1000
    lines = [
        "classes:",
        "  - name: interactive",
        "    share: 0.8",
        f"    queue_timeout_s: {ttft_s:.3f}",
        "  - name: batch",
        "    share: 0.2",
        f"    queue_timeout_s: {ttft_s:.3f}",
        "classify:",
        f"  header: {HEADER}",
        "  default: batch",
        f"queue_max: {4 * max_batch}",
        "controller:",
        "  mode: gradient",
        "  signal: ttft",
        f"  initial_limit: {max_batch}",
        "  min_limit: 2",
        f"  max_limit: {max_batch}",
        "signals:",
        f"  service_metrics: {service}/metrics",
        "  queue_metric: vllm:num_requests_waiting",
        f"  queue_high: {max(2, max_batch // 8)}",
        f"  tpot_slo_s: {slo['tpot_ms'] / 1000:.4f}",
        "  interval_s: 0.5",
        "breaker:",
        "  enabled: false",
    ]
    if args.agent:
        lines.insert(lines.index("signals:") + 1, f"  agent: {args.agent}")
    return "\n".join(lines) + "\n"


def start_guard(service: str, config: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*gpuscope_cmd(), "guard", "proxy", "--config", str(config), "--upstream", service,
                             "--listen", f"127.0.0.1:{port}"],
                            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/guard/metrics", 30, proc)
    except BenchError:
        stop(proc)
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise BenchError(f"gpuscope guard proxy did not start: {' | '.join(tail)}") from None
    return proc, url


class GuardSampler(threading.Thread):
    """Reads the guard's concurrency limit and queue depth every half second while a run goes on."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url + "/guard/metrics"
        self.limits: list[float] = []
        self.queue_depths: list[float] = []
        self.tpots: list[float] = []  # the service's time per output token as the guard read it
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            try:
                text = http_get(self.url, 2.0)
            except (OSError, urllib.error.URLError):
                continue
            self.limits += metric_values(text, "gpuscope_guard_concurrency_limit")[:1]
            self.queue_depths += metric_values(text, "gpuscope_guard_queue_depth")[:1]
            self.tpots += metric_values(text, "gpuscope_guard_service_tpot_seconds")[:1]

    def figures(self) -> dict[str, Any]:
        self.done.set()
        self.join(5)
        lim = sorted(self.limits)
        return {"limit_min": lim[0] if lim else None, "limit_median": lim[len(lim) // 2] if lim else None,
                "limit_max": lim[-1] if lim else None,
                "queue_depth_max": max(self.queue_depths) if self.queue_depths else None,
                "service_tpot_ms_median": round(sorted(self.tpots)[len(self.tpots) // 2] * 1000, 2) if self.tpots else None,
                "service_tpot_ms_max": round(max(self.tpots) * 1000, 2) if self.tpots else None}


def p99(values: list[float]) -> float | None:
    """Nearest-rank 99th percentile."""
    if not values:
        return None
    v = sorted(values)
    return v[max(0, math.ceil(0.99 * len(v)) - 1)]


def class_figures(records: Path, seconds: float, slo: dict[str, float]) -> dict[str, Any]:
    """Per-class figures from one loadtest's records.jsonl; latencies from the intended send time."""
    sent = completed = shed = other = good = 0
    ttft: list[float] = []
    e2e: list[float] = []
    for line in records.read_text().splitlines():
        r = json.loads(line)
        if r.get("warmup"):
            continue
        sent += 1
        if r.get("status") in SHED_STATUSES:
            shed += 1
            continue
        chunks = r.get("chunk_times") or []
        if r.get("error") is not None or r.get("t_end") is None or not chunks:
            other += 1
            continue
        completed += 1
        t_ttft = chunks[0] - r["t_intended"]
        n = r.get("output_tokens") or len(chunks)
        tpot = (chunks[-1] - chunks[0]) / (n - 1) if n > 1 else 0.0
        ttft.append(t_ttft)
        e2e.append(r["t_end"] - r["t_intended"])
        good += t_ttft * 1000 <= slo["ttft_ms"] and tpot * 1000 <= slo["tpot_ms"]
    p99_ttft, p99_e2e = p99(ttft), p99(e2e)
    return {"sent": sent, "completed": completed, "shed": shed, "failed": other,
            "shed_fraction": shed / sent if sent else 0.0, "p99_ttft_ms": None if p99_ttft is None else p99_ttft * 1000,
            "p99_e2e_ms": None if p99_e2e is None else p99_e2e * 1000,
            "slo_attainment": good / sent if sent else 0.0, "good": good, "goodput_per_s": good / seconds}


def run_mode(name: str, url: str, rates: dict[str, float], args: argparse.Namespace, work: Path,
             slo: dict[str, float]) -> dict[str, Any]:
    third = args.seconds / 3
    stage_file = work / f"{name}-batch-stages.json"
    stage_file.write_text(json.dumps([
        {"duration": f"{third:.3f}s", "rate": rates["batch"], "name": "batch"},
        {"duration": f"{third:.3f}s", "rate": rates["spike"], "name": "spike"},
        {"duration": f"{args.seconds - 2 * third:.3f}s", "rate": rates["batch"], "name": "after"}]))
    outs = {c: work / f"{name}-{c}" for c in CLASSES}
    procs = {
        "interactive": loadtest(url, outs["interactive"], ["--rate", f"{rates['interactive']:.4f}",
                                                           "--duration", f"{args.seconds}s"], args,
                                ["-H", f"{HEADER}: interactive", "--seed", str(args.seed)]),
        "batch": loadtest(url, outs["batch"], ["--stage-file", str(stage_file)], args,
                          ["-H", f"{HEADER}: batch", "--seed", str(args.seed + 1)]),
    }
    result: dict[str, Any] = {"classes": {}}
    try:
        for c in CLASSES:
            _, _, invalid = finish(procs[c], outs[c], args.seconds + 180)
            fig = class_figures(outs[c] / "records.jsonl", args.seconds, slo)
            fig["loadtest_invalid_reasons"] = invalid
            result["classes"][c] = fig
    finally:
        for p in procs.values():
            stop(p)
    cl = result["classes"]
    result["total"] = {"sent": sum(f["sent"] for f in cl.values()), "good": sum(f["good"] for f in cl.values()),
                       "goodput_per_s": sum(f["goodput_per_s"] for f in cl.values())}
    return result


def fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def report(modes: dict[str, dict[str, Any]], slo: dict[str, float]) -> dict[str, Any]:
    print(f"\n{'mode':<9} {'class':<12} {'sent':>6} {'done':>6} {'shed':>6} {'fail':>5} {'p99 TTFT ms':>12} "
          f"{'p99 E2E ms':>11} {'SLO att.':>9} {'goodput/s':>10}")
    for mode, r in modes.items():
        for c, f in r["classes"].items():
            warn = f"  (loadtest: {'; '.join(f['loadtest_invalid_reasons'])})" if f["loadtest_invalid_reasons"] else ""
            print(f"{mode:<9} {c:<12} {f['sent']:>6} {f['completed']:>6} {f['shed']:>6} {f['failed']:>5} "
                  f"{fmt(f['p99_ttft_ms']):>12} {fmt(f['p99_e2e_ms']):>11} {f['slo_attainment']:>8.1%} "
                  f"{f['goodput_per_s']:>10.2f}{warn}")
        print(f"{mode:<9} {'total':<12} {r['total']['sent']:>6} {'':>6} {'':>6} {'':>5} {'':>12} {'':>11} "
              f"{r['total']['good'] / max(1, r['total']['sent']):>8.1%} {r['total']['goodput_per_s']:>10.2f}")
    g, n = modes["guard"], modes["direct"]
    gi, ni = g["classes"]["interactive"], n["classes"]["interactive"]
    gb = g["classes"]["batch"]
    ratio_goodput = g["total"]["goodput_per_s"] / n["total"]["goodput_per_s"] if n["total"]["goodput_per_s"] else None
    ratio_ttft = (gi["p99_ttft_ms"] / ni["p99_ttft_ms"]
                  if gi["p99_ttft_ms"] is not None and ni["p99_ttft_ms"] else None)
    print(f"\nguard / no guard: total goodput x{fmt(ratio_goodput, '.2f')}, "
          f"interactive p99 TTFT x{fmt(ratio_ttft, '.2f')}")
    claims = {
        "interactive_p99_ttft_within_slo": gi["p99_ttft_ms"] is not None and gi["p99_ttft_ms"] <= slo["ttft_ms"],
        "goodput_higher_with_guard": ratio_goodput is not None and ratio_goodput > 1,
        "batch_shed_first": gb["shed_fraction"] > gi["shed_fraction"],
    }
    print(f"  1. interactive p99 TTFT with the guard {fmt(gi['p99_ttft_ms'])} ms vs SLO {slo['ttft_ms']:.0f} ms: "
          + ("within it" if claims["interactive_p99_ttft_within_slo"] else "NOT within it")
          + f" (without the guard: {fmt(ni['p99_ttft_ms'])} ms)")
    print(f"  2. total goodput {g['total']['goodput_per_s']:.2f}/s with the guard vs {n['total']['goodput_per_s']:.2f}/s "
          "without: " + ("higher" if claims["goodput_higher_with_guard"] else "NOT higher"))
    print(f"  3. shed with the guard: batch {gb['shed_fraction']:.1%}, interactive {gi['shed_fraction']:.1%}: "
          + ("batch shed first" if claims["batch_shed_first"] else "batch NOT shed first"))
    return {"ratio_goodput": ratio_goodput, "ratio_interactive_p99_ttft": ratio_ttft, "claims": claims}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="length of each run (default 60)")
    ap.add_argument("--preset", choices=("cpu", "h200"), default="cpu")
    ap.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu")
    ap.add_argument("--server", type=Path, default=SERVER, help="the example service's server.py")
    ap.add_argument("--server-arg", action="append", default=[], help="extra server flag (repeatable), e.g. --threads=2")
    ap.add_argument("--rate", type=float, help="the sustainable rate X in req/s (skips calibration)")
    ap.add_argument("--calibrate-seconds", type=float, default=15.0)
    ap.add_argument("--slo-ttft-ms", type=float, help="default max(3 x calibrated p50 TTFT, 250 ms)")
    ap.add_argument("--slo-tpot-ms", type=float, help="default 2 x calibrated p50 TPOT")
    ap.add_argument("--interactive", type=float, default=0.5, help="interactive rate as a fraction of X")
    ap.add_argument("--batch", type=float, default=0.3, help="batch base rate as a fraction of X")
    ap.add_argument("--spike", type=float, default=3.0, help="batch rate in the middle third, as a multiple of X")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1, help="client processes per loadtest (default 1)")
    ap.add_argument("--agent", default="", help="a gpuscope agent URL for the guard's GPU signal")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds for the service to start")
    ap.add_argument("--keep", type=Path, help="keep every loadtest output and the guard config in this directory")
    ap.add_argument("--json", type=Path, dest="json_out", help="write all figures here")
    args = ap.parse_args(argv)
    positive = {"--seconds": args.seconds, "--calibrate-seconds": args.calibrate_seconds,
                "--interactive": args.interactive, "--batch": args.batch, "--spike": args.spike,
                "--prompt-tokens": args.prompt_tokens, "--max-tokens": args.max_tokens,
                "--start-timeout": args.start_timeout, "--workers": args.workers}
    for opt in ("rate", "slo_ttft_ms", "slo_tpot_ms"):
        if getattr(args, opt) is not None:
            positive["--" + opt.replace("_", "-")] = getattr(args, opt)
    for flag, v in positive.items():
        if not (v > 0 and math.isfinite(v)):
            ap.error(f"{flag} must be a number above 0 (got {v}).")
    if args.seconds < 6:
        ap.error("--seconds must be at least 6 (three stages of at least 2 s).")
    if not args.server.is_file():
        ap.error(f"--server {args.server} is not a file.")
    if args.agent and not args.agent.startswith(("http://", "https://")):
        ap.error(f"--agent {args.agent} is not an http(s) URL.")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench_guard_e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    service_proc = guard_proc = None
    try:
        t0 = time.monotonic()
        service_proc, service = start_service(args, work / "service.log")
        print(f"service: {service} ({args.preset} on {args.device}), started in {time.monotonic() - t0:.1f} s")
        max_batch = int((metric_values(http_get(service + "/metrics"), "example_max_batch") or [16])[0])
        if args.rate is None or args.slo_ttft_ms is None or args.slo_tpot_ms is None:
            cal = calibrate(service, max_batch, args, work)
            print(f"calibration: closed loop at concurrency {max_batch} for {args.calibrate_seconds:g} s: "
                  f"{cal['rate']:.2f} req/s, p50 TTFT {cal['ttft_p50_ms']:.0f} ms, p50 TPOT {cal['tpot_p50_ms']:.1f} ms")
            wait_idle(service)
        else:
            cal = {}
        x = args.rate if args.rate is not None else cal["rate"]
        slo = {"ttft_ms": args.slo_ttft_ms or max(3 * cal["ttft_p50_ms"], 250.0),
               "tpot_ms": args.slo_tpot_ms or 2 * cal["tpot_p50_ms"]}
        rates = {"interactive": args.interactive * x, "batch": args.batch * x, "spike": args.spike * x}
        print(f"X = {x:.2f} req/s; SLOs: TTFT <= {slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.1f} ms "
              f"(both classes); interactive {rates['interactive']:.2f}/s, batch {rates['batch']:.2f}/s with "
              f"{rates['spike']:.2f}/s for the middle third; {args.seconds:g} s per run; "
              f"{args.prompt_tokens} prompt / {args.max_tokens} max tokens")
        modes: dict[str, Any] = {}
        print("run 1: directly at the service ...", flush=True)
        modes["direct"] = run_mode("direct", service, rates, args, work, slo)
        wait_idle(service)
        config = work / "guard.yaml"
        config.write_text(guard_config(service, max_batch, slo, args))
        guard_proc, guard = start_guard(service, config, work / "guard.log")
        print(f"run 2: through gpuscope guard proxy at {guard} ...", flush=True)
        sampler = GuardSampler(guard)
        sampler.start()
        modes["guard"] = run_mode("guard", guard, rates, args, work, slo)
        modes["guard"]["guard_samples"] = gs = sampler.figures()
        gm = http_get(guard + "/guard/metrics")
        modes["guard"]["guard_metrics"] = [ln for ln in gm.splitlines() if ln.startswith("gpuscope_guard_shed_total")]
        summary = report(modes, slo)
        print(f"guard: concurrency limit min/median/max {fmt(gs['limit_min'], '.1f')}/"
              f"{fmt(gs['limit_median'], '.1f')}/{fmt(gs['limit_max'], '.1f')} (max batch {max_batch}), "
              f"queue depth max {fmt(gs['queue_depth_max'])}, service TPOT median/max "
              f"{fmt(gs['service_tpot_ms_median'])}/{fmt(gs['service_tpot_ms_max'])} ms (SLO {slo['tpot_ms']:.1f}); "
              + ", ".join(ln.replace("gpuscope_guard_shed_total", "shed") for ln in modes["guard"]["guard_metrics"]))
        if args.json_out:
            args.json_out.write_text(json.dumps({
                "bench": "guard_e2e", "preset": args.preset, "device": args.device, "seconds": args.seconds,
                "max_batch": max_batch, "calibration": cal, "rate_x": x, "rates": rates, "slo": slo,
                "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "seed": args.seed,
                "guard_config": config.read_text(), "modes": modes, **summary}, indent=1))
            print(f"figures written to {args.json_out}")
        return 0
    except BenchError as e:
        print(f"bench_guard_e2e: {e}", file=sys.stderr)
        return 1
    except (OSError, urllib.error.URLError) as e:
        print(f"bench_guard_e2e: {e}", file=sys.stderr)
        return 1
    finally:
        stop(guard_proc)
        stop(service_proc)
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"outputs kept in {work}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
