"""From command-line flags to a checked run: the plan, the protocol, the pre-flight request, the outputs.

Every user mistake becomes a `SetupError` with one sentence (the CLI turns it into exit 2). The GPU watch,
HTML report and capacity search come from sibling modules that are imported only when used.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from .._files import MAX_LINE_BYTES, InputFileError, read_text
from ..errors import UsageError
from . import schedule as S
from .client import Client, Target, UrlError, classify_connect_error, shown_url
from .openai import load_prompts
from .progress import ProgressLine, print_summary
from .records import RequestRecord, read_records
from .requests import Protocol, ReplayError, RequestMaker, load_replay
from .runner import answer_reasons, collect_records, default_workers, summarize
from .runner import execute as execute_plan
from .templates import HEADER_VALUE, TOKEN, Template, TemplateError, load_request_file
from .worker import WorkerConfig, new_loop

DEFAULT_AGENT = "http://127.0.0.1:9471"


class SetupError(UsageError, ValueError):
    """A flag, file or URL that stops the run before it starts; one sentence."""


@dataclass
class Spec:
    cfg: WorkerConfig
    stage_names: list[str]
    workers: int
    protocol: str
    out_dir: Path
    arrival: str
    burstiness: float
    trial_s: float


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=200ms,tpot=50ms,e2e=2s' -> seconds per key."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "e2e"):
            raise SetupError(f"--slo takes ttft=, tpot= and e2e= limits, e.g. ttft=200ms,e2e=2s; not '{part}'.")
        out[key] = _duration(value, "--slo")
    return out


def _duration(text: str, flag: str) -> float:
    try:
        return S.parse_duration(text)
    except S.ScheduleError:
        raise SetupError(f"{flag} '{text}' is not a duration (examples: 30s, 2m, 500ms).") from None


def _stages(args: argparse.Namespace) -> tuple[list[S.Stage], bool]:
    """The stages the flags describe; True when they came from a replay file."""
    kw = {"arrival": args.arrival, "burstiness": args.burstiness}
    shapes = [f for f in ("stages", "ramp", "spike", "stage_file", "replay", "concurrency") if getattr(args, f)]
    if len(shapes) > 1 or (shapes and shapes[0] != "concurrency" and args.rate is not None):
        names = ", ".join("--" + f.replace("_", "-") for f in shapes + (["rate"] if args.rate is not None else []))
        raise SetupError(f"Choose one load shape, not {names}.")
    duration = _duration(args.duration, "--duration") if args.duration else None
    if args.requests is not None and args.requests < 1:
        raise SetupError("--requests must be at least 1.")
    if duration is None and args.requests is None:
        duration = 30.0
    try:
        if args.stage_file:
            return S.load_stage_file(args.stage_file, default_arrival=args.arrival, burstiness=args.burstiness), False
        if args.stages:
            try:
                values = [float(v) for v in args.stages.split(",") if v.strip()]
            except ValueError:
                raise SetupError(f"--stages takes comma-separated numbers, not '{args.stages}'.") from None
            if not values or min(values) <= 0:
                raise SetupError("--stages needs numbers above 0.")
            return S.ladder(values, _duration(args.stage_duration, "--stage-duration"), closed_loop=args.closed_loop,
                            **kw), False
        if args.ramp:
            m = re.fullmatch(r"(linear|exp):([0-9.]+):([0-9.]+)", args.ramp)
            if not m or duration is None:
                raise SetupError("--ramp takes linear:FROM:TO or exp:FROM:TO (rates) and needs --duration.")
            r0, r1 = float(m.group(2)), float(m.group(3))
            if args.closed_loop:   # the same ramp of requests in flight (as Locust ramps users)
                if not (r0.is_integer() and r1.is_integer() and min(r0, r1) >= 1):
                    raise SetupError("--ramp with --closed-loop takes whole concurrencies of at least 1, "
                                     "e.g. linear:1:32.")
                return [S.Stage(duration, concurrency=int(r0), ramp_to=r1, ramp=m.group(1), requests=args.requests,
                                name=f"ramp c={r0:g}->{r1:g}")], False
            return [S.Stage(duration, rate=r0, ramp_to=r1, ramp=m.group(1), name=f"ramp {r0:g}->{r1:g}/s", **kw)], False
        if args.spike:
            parts = args.spike.split(":")
            if len(parts) != 4 or duration is None:
                raise SetupError("--spike takes BASE:PEAK:AT:LENGTH (e.g. 20:200:60s:10s) and needs --duration.")
            try:
                base, peak = float(parts[0]), float(parts[1])
            except ValueError:
                raise SetupError("--spike's BASE and PEAK are rates in requests per second.") from None
            return S.spike(base, peak, _duration(parts[2], "--spike"), _duration(parts[3], "--spike"), duration, **kw), False
        if args.concurrency is not None:
            return [S.Stage(duration, concurrency=args.concurrency, requests=args.requests,
                            name=f"c={args.concurrency}")], False
        rate = args.rate if args.rate is not None else 10.0
        return [S.Stage(duration, rate=rate, requests=args.requests if duration is None else None,
                        name=f"{rate:g}/s", **kw)], False
    except S.ScheduleError as e:
        raise SetupError(str(e)) from None


def _protocol(args: argparse.Namespace) -> tuple[Protocol, str]:
    headers = {}
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise SetupError(f"-H takes 'Name: value', not '{h}'.")
        name, value = name.strip(), value.strip()
        # A header is one line of Latin-1 text: CR/LF would start a header of the user's making, and
        # characters outside Latin-1 cannot be written at all.
        if not TOKEN.fullmatch(name) or not HEADER_VALUE.fullmatch(value):
            raise SetupError(f"-H {h!r}: a header name is letters, digits and !#$%&'*+-.^_`|~, and its value "
                             "one line of Latin-1 text.")
        headers[name] = value
    body = args.body or ""
    if args.body_file:  # as large as one line of a --request-file may be
        body = read_text(args.body_file, f"--body-file {args.body_file}", max_bytes=MAX_LINE_BYTES, error=SetupError)
    try:
        Template(body)
        requests = load_request_file(args.request_file) if args.request_file else None
    except TemplateError as e:
        raise SetupError(str(e)) from None
    if args.openai:
        if body or requests:
            raise SetupError("--openai builds its own bodies; leave out --body, --body-file and --request-file.")
        if args.prompt_tokens < 1 or args.max_tokens < 1:
            raise SetupError("--prompt-tokens and --max-tokens must be at least 1.")
        # Each prompt is generated per request: a length no model accepts would only stall the sender.
        if max(args.prompt_tokens, args.max_tokens) > MAX_TOKENS:
            raise SetupError(f"--prompt-tokens and --max-tokens must be at most {MAX_TOKENS:,}.")
        prompts = None
        if args.prompt_file:
            try:
                prompts = load_prompts(args.prompt_file, f"--prompt-file {args.prompt_file}")
            except InputFileError as e:
                raise SetupError(str(e)) from None
        kind = f"openai-{args.openai}"
        return Protocol(kind=kind, headers=headers, model=args.model, prompt_tokens=args.prompt_tokens,
                        max_tokens=args.max_tokens, prompts=prompts), kind
    method = (args.method or ("POST" if body else "GET")).upper()
    if not TOKEN.fullmatch(method):
        raise SetupError(f"-X {args.method!r} is not an HTTP method (letters such as GET, POST, PUT).")
    return Protocol(kind="http", method=method, headers=headers, body=body, requests=requests), "http"


def _check_rate(stages: list[S.Stage], proto: Protocol, args: argparse.Namespace) -> int:
    """The number of workers, once sure they can send the stages' peak rate."""
    workers = args.workers if args.workers is not None else default_workers()
    if workers < 1:
        raise SetupError("--workers must be at least 1.")
    limit = args.max_rate_per_worker or (MAX_STREAM if proto.streaming else MAX_HTTP)
    if not limit > 0 or not math.isfinite(limit):
        raise SetupError("--max-rate-per-worker must be a number above 0.")
    peak = max((s.peak_rate() for s in stages if s.open_loop), default=0.0)
    if peak > limit * workers:
        raise SetupError(f"A rate of {peak:g} req/s is more than {workers} worker(s) can send (about {limit:g} "
                         f"req/s each); lower the rate or add --workers.")
    return workers


def build(args: argparse.Namespace) -> Spec:
    try:
        Target.parse(args.url)
    except UrlError as e:
        raise SetupError(str(e)) from None
    proto, protocol = _protocol(args)
    stages, _ = _stages(args)
    warmup_s = _duration(args.warmup, "--warmup") if args.warmup else 0.0
    if args.replay:
        if warmup_s:
            raise SetupError("--warmup does not apply to --replay (the capture is sent as it was).")
        if not args.speed > 0:
            raise SetupError("--speed must be above 0.")
        try:
            times, reqs = load_replay(args.replay, args.speed)
        except ReplayError as e:
            raise SetupError(str(e)) from None
        proto = replace(proto, replay=reqs)
        end = float(times[-1]) + 1e-3
        stage = S.Stage(end, rate=len(times) / end, arrival="constant", name=f"replay x{args.speed:g}")
        plan = S.Plan([stage], [0.0], [end], [times])
    else:
        if warmup_s:
            first = stages[0]
            stages = [replace(first, duration_s=warmup_s, requests=None, ramp_to=None, name="warmup", warmup=True),
                      *stages]
        try:
            for st in stages:
                S.validate(st)
        except S.ScheduleError as e:
            raise SetupError(str(e)) from None
        # Every send time is drawn before the start: a rate or a length past what can be sent is refused
        # before it is drawn, not after minutes of drawing (or an out-of-memory kill).
        _check_rate(stages, proto, args)
        planned = sum(s.peak_rate() * s.duration_s if s.duration_s is not None else (s.requests or 0)
                      for s in stages if s.open_loop)
        if args.requests is not None:
            planned = min(planned, args.requests)
        if planned > MAX_PLANNED_REQUESTS:
            raise SetupError(f"The load holds about {planned:.3g} requests, more than one run sends "
                             f"({MAX_PLANNED_REQUESTS:,}); shorten --duration or lower the rate.")
        try:
            plan = S.plan(stages, seed=args.seed, max_requests=None)
        except S.ScheduleError as e:
            raise SetupError(str(e)) from None
        if args.requests is not None and all(s.open_loop for s in stages):
            n_warm = 1 if warmup_s else 0
            plan = _cap_requests(plan, args.requests, n_warm)
    workers = _check_rate(plan.stages, proto, args)
    slo = parse_slo(args.slo)
    if args.find_capacity and not 0 < args.capacity_start < args.capacity_max:
        raise SetupError("--capacity-start must be above 0 and below --capacity-max.")
    if args.find_capacity and args.capacity_trials < 1:
        raise SetupError("--capacity-trials must be at least 1.")
    if args.max_connections < 0:
        raise SetupError("--max-connections must be 0 (as many as needed) or more.")
    cfg = WorkerConfig(url=args.url, proto=proto, plan=plan, seed=args.seed,
                       timeout_s=_duration(args.timeout, "--timeout"), verify_tls=not args.insecure,
                       max_connections=args.max_connections, metrics_as=args.metrics_as, slo=slo,
                       late_threshold_s=_duration(args.late_threshold, "--late-threshold"),
                       n_warmup_stages=1 if warmup_s else 0)
    if not cfg.timeout_s > 0:
        raise SetupError("--timeout must be above 0.")
    out = Path(args.out or f"gpuscope-loadtest-{time.strftime('%Y%m%d-%H%M%S')}")
    names = [s.name or f"stage {k}" for k, s in enumerate(plan.stages)]
    return Spec(cfg, names, workers, protocol, out, args.arrival, args.burstiness,
                _duration(args.stage_duration, "--stage-duration"))


# What one worker process can generate, with headroom, from benchmarks/bench_loadtest_rps.py (~40k req/s
# closed loop, 24k req/s open loop at 42 % CPU on nginx) and bench_loadtest_sse.py (~450k SSE chunks/s,
# i.e. ~3,500 streams/s of 128 chunks): asked for more, the run is refused before it starts.
MAX_HTTP = 20_000.0
MAX_STREAM = 1_500.0
# Send times are drawn up front (8 bytes each) and every request leaves a record: 50 M is 400 MB of times.
MAX_PLANNED_REQUESTS = 50_000_000
# Longer than any served model's context window (the largest are about 1 M tokens).
MAX_TOKENS = 2_000_000


def _cap_requests(plan: S.Plan, n: int, n_warm: int) -> S.Plan:
    """Keep the first `n` counted requests (warm-up requests do not count)."""
    times, ends = list(plan.times), list(plan.ends_s)
    left = n
    for k in range(n_warm, len(times)):
        if left <= 0:
            return S.Plan(plan.stages[:k], plan.starts_s[:k], ends[:k], times[:k])
        if len(times[k]) > left:
            times[k] = times[k][:left]
            ends[k] = float(times[k][-1]) + 1.0 / float(plan.stages[k].rate or 1.0)
        left -= len(times[k])
    return S.Plan(plan.stages, plan.starts_s, ends, times)


def _safe_to_send_twice(proto: Any) -> bool:
    """Whether the run's first request may also be sent once before the run: not a replayed capture (the
    server would get one request more than captured), not a request file or a method that may change
    state (POST, PUT, ...). An OpenAI request is sent first as vLLM's benchmark does: one generation."""
    if proto.replay is not None or proto.requests:
        return False
    return proto.kind != "http" or proto.method in ("GET", "HEAD", "OPTIONS")


def preflight(cfg: WorkerConfig) -> RequestRecord:
    """Before the run, send its first request (or, where sending it twice would change what the server gets,
    only open a connection, TLS included); a connection or TLS failure stops the run (one sentence)."""
    loop = new_loop()
    try:
        async def one() -> RequestRecord:
            client = Client(cfg.url, t0=time.perf_counter(), timeout_s=min(cfg.timeout_s, 15.0),
                            verify_tls=cfg.verify_tls)
            rec = RequestRecord(i=0, stage=-1, worker=0, t_intended=0.0, t_sent=0.0)
            if not _safe_to_send_twice(cfg.proto):
                t = client.target
                try:
                    transport, _ = await asyncio.wait_for(loop.create_connection(
                        asyncio.Protocol, t.host, t.port, ssl=client._ssl,
                        server_hostname=t.host if client._ssl else None), client.timeout_s)
                    transport.close()
                except Exception as e:
                    rec.error, rec.error_detail = classify_connect_error(e)
                return rec
            maker = RequestMaker(cfg.proto, client.target, cfg.seed, 0)
            payload, _, _, _ = maker.make(0)
            fut: asyncio.Future[RequestRecord] = loop.create_future()

            def done(r: RequestRecord) -> None:
                if not fut.done():
                    fut.set_result(r)
            client.send(rec, payload, done)
            try:
                return await fut
            finally:
                client.close()
        return loop.run_until_complete(one())
    finally:
        loop.close()


def _gpu_watch(args: argparse.Namespace) -> Any:
    if args.no_gpu:
        return None
    try:
        from .gpu import GpuWatch
    except ImportError:
        return None
    url = args.gpu or os.environ.get("GPUSCOPE_URL") or DEFAULT_AGENT
    watch = GpuWatch(agent_url=url, token=os.environ.get("GPUSCOPE_TOKEN"), hz=10.0,
                     clock=(time.time(), time.perf_counter()), gpus=getattr(args, "gpus", None))
    watch.start()
    return watch


def _shift(rec: RequestRecord, dt: float) -> None:
    rec.t_intended += dt
    rec.t_sent += dt
    for f in ("t_end", "t_first_byte", "t_first_token"):
        v = getattr(rec, f)
        if v is not None:
            setattr(rec, f, v + dt)
    if rec.chunk_times:
        rec.chunk_times = [t + dt for t in rec.chunk_times]


def execute(spec: Spec, args: argparse.Namespace) -> int:
    cfg = spec.cfg
    pre = preflight(cfg)
    if pre.error in ("connect", "tls", "timeout", "client"):
        raise SetupError(f"{shown_url(args.url)} did not answer before the start: {pre.error_detail}.")
    tty = sys.stderr.isatty()
    if pre.error is not None:
        print(f"note: the first request to {shown_url(args.url)} failed ({pre.error_detail}); going on.", file=sys.stderr)
    try:
        spec.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SetupError(f"Cannot create the output directory {spec.out_dir}: {e.strerror or e}.") from None
    watch = _gpu_watch(args)
    progress = None if args.quiet else ProgressLine(sys.stderr, tty=tty)
    cfg = replace(cfg, records_dir=str(spec.out_dir))
    try:
        if args.find_capacity:
            summary = _capacity(spec, cfg, args, progress)
        else:
            res = execute_plan(cfg, spec.workers, on_progress=progress.update if progress else None)
            if progress:
                progress.end()
            summary = summarize(replace(cfg, workers=spec.workers), res, url=shown_url(args.url), protocol=spec.protocol,
                                stage_names=spec.stage_names)
            collect_records(spec.out_dir, spec.workers)
    except RuntimeError as e:
        raise SetupError(f"The load test could not run: {e}.") from None
    readings = watch.stop() if watch is not None else []
    if watch is not None:
        dt = watch.clock[1] - summary["clock"]["mono_s"]
        for r in readings:
            r.t += dt
        summary["gpu_source"] = watch.source
        try:
            from .gpu import join_stages
            join_stages(summary, readings, watch.source)
        except ImportError:
            pass
        if summary.get("gpu_note"):
            print(f"note: {summary['gpu_note']}.", file=sys.stderr)
        if readings:
            (spec.out_dir / "gpu.jsonl").write_bytes(b"".join(orjson.dumps(_reading(r)) + b"\n" for r in readings))
    (spec.out_dir / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    if args.html:
        try:
            from .report import write_html
            write_html(str(spec.out_dir / "report.html"), summary, read_records(spec.out_dir / "records.jsonl"),
                       readings)
        except ImportError:
            pass
    if args.json:
        sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print_summary(summary, spec.out_dir, sys.stdout)
    if not summary["valid"]:
        print(f"INVALID RUN: {'; '.join(summary['invalid_reasons'])}.", file=sys.stderr)
    return 0 if summary["valid"] else 1


def _reading(r: Any) -> dict:
    from dataclasses import asdict
    return {k: v for k, v in asdict(r).items() if v is not None}


#: A capacity trial sends at least this many requests when it can (its p99 and SLO attainment need them):
#: a slow rate gets a longer trial, up to TRIAL_STRETCH_MAX times --stage-duration.
TRIAL_MIN_REQUESTS = 100
TRIAL_STRETCH_MAX = 4.0


def trial_seconds(stage_s: float, rate: float) -> float:
    """How long a capacity trial at `rate` runs: --stage-duration, stretched so it sends ~100 requests.

    >>> trial_seconds(6.0, 8.0), trial_seconds(6.0, 50.0), trial_seconds(6.0, 1.0)
    (12.5, 6.0, 24.0)
    """
    return max(stage_s, min(TRIAL_MIN_REQUESTS / rate, TRIAL_STRETCH_MAX * stage_s))


def _capacity(spec: Spec, cfg: WorkerConfig, args: argparse.Namespace, progress: Any) -> dict:
    """Trials of one constant-rate stage each; stages of the summary are the trials, on the first trial's clock.
    Each trial's records are appended to records.jsonl as it ends: trials follow one another in time, so the
    file stays in intended-time order."""
    from .capacity import find_capacity

    trials: list[tuple[float, Any, WorkerConfig, str]] = []
    first_mono: list[float] = []
    written = [0]
    out = open(spec.out_dir / "records.jsonl", "wb")  # noqa: SIM115 (closed below, whatever the search does)

    def measure(rate: float) -> dict:
        stage = S.Stage(trial_seconds(spec.trial_s, rate), rate=rate, arrival=spec.arrival, burstiness=spec.burstiness, name=f"{rate:.4g}/s")
        plan = S.plan([stage], seed=args.seed)
        tc = replace(cfg, plan=plan, n_warmup_stages=0, workers=spec.workers)
        res = execute_plan(tc, spec.workers, on_progress=progress.update if progress else None)
        if progress:
            progress.end()
        if not first_mono:
            first_mono.append(res.clock["mono_s"])
        dt = res.clock["mono_s"] - first_mono[0]
        k = len(trials)

        def adjust(r: RequestRecord) -> None:
            _shift(r, dt)
            r.stage = k
        written[0] += collect_records(spec.out_dir, spec.workers, into=out, first=written[0], adjust=adjust)
        s = summarize(tc, res, url=shown_url(args.url), protocol=spec.protocol, stage_names=[stage.name])
        trials.append((dt, res, tc, stage.name))
        return s["overall"]

    try:
        result = find_capacity(measure, cfg.slo or None, start_rate=args.capacity_start, max_rate=args.capacity_max,
                               max_trials=args.capacity_trials)
    finally:
        out.close()
    stages = []
    valid, reasons = True, []
    summaries = []
    judged = result.get("trials") or []
    for k, (dt, res, tc, name) in enumerate(trials):
        s = summarize(tc, res, url=shown_url(args.url), protocol=spec.protocol, stage_names=[name])
        summaries.append(s)
        st = s["stages"][0]
        st.update(index=k, start_s=st["start_s"] + dt, end_s=st["end_s"] + dt)
        stages.append(st)
        own = s["invalid_reasons"]
        if k < len(judged) and not judged[k]["passed"]:
            # A trial the search failed (it had more than 1 % errors, or missed the SLOs) is what the search
            # measures: the answers it lost are why it failed, not a flaw of the figures the search stands on.
            lost = set(answer_reasons(st["stats"]))
            own = [r for r in own if r not in lost]
        valid = valid and not own
        reasons += [f"trial at {name}: {r}" for r in own]
    if not summaries:
        raise RuntimeError("the capacity search ran no trial")
    # The overall figures are those of the trial at the capacity found (else the first trial's).
    at = [k for k, s in enumerate(summaries) if s["stages"][0]["target_rate"] == result.get("capacity_rps")]
    k = at[0] if at else 0
    summary = dict(summaries[0])
    summary.update(stages=stages, valid=valid, invalid_reasons=reasons, capacity=result,
                   duration_s=stages[-1]["end_s"] - stages[0]["start_s"], overall=summaries[k]["overall"])
    if at:  # join_stages then gives "overall" that trial's GPU figures, and the tables say "at capacity"
        summary["overall_stage"] = k
    return summary

