"""`gpuscope trace fleet --job J (--agents URL... | --prometheus URL)`: one trace of a job across nodes.

    gpuscope trace fleet --job slurm/4242 --agents http://node1:9471 http://node2:9471 --duration 5s
    gpuscope trace fleet --job torchrun/run42 --prometheus http://prometheus:9090 --out job.pt.trace.json.gz

Every agent that holds processes of the job (the `workload` label: slurm/<id>, torchrun/<run id>,
k8s/<namespace>/<owner>) which opted in (`gpuscope trace --on-demand`, or the opt-in variable) is asked for
a window that starts at one moment on every node; the traces are pulled, put on this machine's clock, merged
into one Kineto trace (Perfetto UI, chrome://tracing) and the straggler and communication analyses run over
the ranks. With --prometheus the agents are the targets of that server whose series carry the job's
workload label.

Clock: each agent's offset is measured as NTP measures a server's (RFC 5905's on-wire exchange): a round
trip sent at t0 and back at t3 on this clock, received at t1 and answered at t2 on the agent's, gives
offset = ((t1 - t0) + (t2 - t3)) / 2 and delay = (t3 - t0) - (t2 - t1); of several round trips the one
with the least delay is kept, and its offset is off by at most half its delay. The start is asked in each
agent's own clock (start + offset), and each trace is moved back by its agent's offset before the merge.

What goes wrong is said in one sentence each, and the rest is merged: an agent that does not answer, one
with no process of the job, a process that exits before or during the window, a trace over the size cap, a
trace that is not one. Exit 0: every process asked for is merged; 3: some are, the missing are named;
1: none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from ..errors import Unavailable, UsageError

HELP = "trace every rank of one job across nodes at one moment, on one clock, merged and analysed"

EXIT_PARTIAL = 3
# Clock samples per agent before the request (the request's own is one more): enough to set the common start
# to a few ms; the offsets the merge uses come from these and from the samples taken during the window.
ROUND_TRIPS = 3
# Agents whose clocks are measured at once: every answer waits for this one loop, and what it waits is delay
# (and, unevenly spent, offset error); fewer at once keeps the loop free when each answer comes in.
CLOCK_CONCURRENCY = 16
# While the window runs the caller is idle: it goes on measuring each agent's clock, one round trip every
# this often, and keeps the least-delay one for the merge (clocks drift microseconds over those seconds, while
# a loaded machine stretches single round trips to milliseconds).
REFINE_EVERY_S = 0.25
REFINE_MAX = 40                    # ... at most this many per agent
MAX_TRACE_BYTES = 256 << 20        # a pulled trace, compressed (the agent serves at most as much)
MAX_TRACE_UNPACKED = 1 << 30       # ... and uncompressed: a gzip bomb stops here
POLL_S = 0.5
EXPORT_WAIT_S = 60.0               # after the window: how long a process may take to stop and write
MAX_AGENTS = 4096


class FleetError(Unavailable):
    """Nothing could be merged; one sentence."""


class AgentProblem(Exception):
    """One agent's failure, one sentence."""


@dataclass
class Clock:
    offset_ns: int   # the agent's clock minus this one's
    delay_ns: int    # the round trip it was measured on, less the agent's own time: the offset is +- delay / 2


@dataclass
class Agent:
    url: str
    shown: str
    clock: Clock | None = None
    asked_clock: Clock | None = None  # the estimate the window's start was asked with (later ones are better)
    host: str = ""
    request_id: str = ""
    processes: list[dict[str, Any]] = field(default_factory=list)
    problem: str = ""        # why nothing of this agent is merged ("" when something is)
    no_job: bool = False     # it answered, and holds no process of the job


@dataclass
class Rank:
    agent: Agent
    pid: int
    rank: int | None = None
    path: str = ""
    problem: str = ""        # why this process's trace is not merged
    note: str = ""           # merged, but said (a window cut short)
    start_error_ns: int | None = None  # its window's start on this clock minus the start asked for
    window_s: float | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", required=True, metavar="J",
                   help="the job: its workload label (slurm/<id>, torchrun/<run id>, k8s/<namespace>/<owner>)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--agents", nargs="+", metavar="URL", help="the agents to ask (http://node:9471 ...)")
    where.add_argument("--prometheus", metavar="URL",
                       help="find the agents that hold the job among this Prometheus-compatible server's targets")
    p.add_argument("--duration", default="5s", help="the window (default 5s; 1s to 30s)")
    p.add_argument("--start-in", default="3s", metavar="DURATION",
                   help="how far ahead the common start is set (default 3s: processes look for requests once a "
                        "second)")
    p.add_argument("--out", default="fleet.pt.trace.json.gz", metavar="FILE",
                   help="the merged trace (default fleet.pt.trace.json.gz)")
    p.add_argument("--keep", metavar="DIR", help="keep each rank's pulled trace in DIR")
    p.add_argument("--token", help="the agents' token (default $GPUSCOPE_TOKEN, else the local agent's token file)")
    p.add_argument("--timeout", default="10s", help="per HTTP request to an agent (default 10s)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON document")


def run(args: argparse.Namespace) -> int:
    from .._args import check_writable
    from ..http.auth import find_token
    from ..timeparse import parse_duration
    from .ondemand import MAX_DURATION_S, MAX_START_AHEAD_S, MIN_DURATION_S

    duration_s = parse_duration(args.duration, "--duration")
    if not MIN_DURATION_S <= duration_s <= MAX_DURATION_S:
        raise UsageError(f"--duration must be between {MIN_DURATION_S:g} s and {MAX_DURATION_S:g} s, not {duration_s:g} s.")
    start_in_s = parse_duration(args.start_in, "--start-in")
    if not 1.0 <= start_in_s <= MAX_START_AHEAD_S - 5:
        raise UsageError(f"--start-in must be between 1 s and {MAX_START_AHEAD_S - 5:g} s, not {start_in_s:g} s.")
    timeout_s = parse_duration(args.timeout, "--timeout")
    if not 0.1 <= timeout_s <= 300:
        raise UsageError(f"--timeout must be between 100ms and 300s, not {timeout_s:g} s.")
    job = args.job.strip()
    if not job or len(job) > 128 or not job.isprintable():
        raise UsageError("--job must be a workload such as slurm/4242 or torchrun/RUN_ID (at most 128 characters).")
    check_writable("--out", args.out)
    if args.keep and not os.path.isdir(args.keep):
        raise UsageError(f"--keep {args.keep} is not an existing directory.")
    token = find_token(args.token, None)
    if token is not None and not token.isprintable():
        raise UsageError("The token holds a line break or another character that cannot go in an HTTP header.")
    if args.prometheus and not args.prometheus.startswith(("http://", "https://")):
        raise UsageError(f"--prometheus must be the http:// or https:// URL of a Prometheus-compatible server, not "
                         f"{args.prometheus!r}.")
    urls = [agent_url(u) for u in args.agents] if args.agents else agents_from_prometheus(args.prometheus, job)
    with tempfile.TemporaryDirectory(prefix="gpuscope-fleet-") as tmp:
        result = trace_fleet(urls, job, duration_s, start_in_s, token, args.keep or tmp, timeout_s, args.out)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_summary(result)
    return int(result["exit_code"])


# -- where the agents are --------------------------------------------------------------------------
def agent_url(text: str) -> str:
    """An agent's base URL, checked: http(s)://host[:port], no path beyond '/'."""
    try:
        parts = urllib.parse.urlsplit(text.strip())
        _ = parts.port
    except ValueError as e:
        raise UsageError(f"{text!r} is not a usable agent URL: {e}.") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"An agent URL must be http://host:port or https://host:port, not {text!r}.")
    if parts.path.strip("/") or parts.query:
        raise UsageError(f"Give an agent's base URL (http://host:port), not {text!r}.")
    return f"{parts.scheme}://{parts.netloc}"


def agents_from_prometheus(url: str, job: str) -> list[str]:
    """The base URLs of the server's active targets whose series carry workload=`job` now (up or not: one
    that is down is named as not answering)."""
    from ..promql import Client, label_matcher

    client = Client(url, timeout=15.0)
    data = client.api("/api/v1/targets", [("state", "active")], post=False)
    targets = data.get("activeTargets") if isinstance(data, dict) else None
    if not isinstance(targets, list):
        raise FleetError(f"The server at {client.shown} listed no targets (/api/v1/targets).")
    scrape: dict[str, str] = {}
    for t in targets:
        labels = t.get("labels") if isinstance(t, dict) else None
        if isinstance(labels, dict) and isinstance(labels.get("instance"), str) and isinstance(t.get("scrapeUrl"), str):
            parts = urllib.parse.urlsplit(t["scrapeUrl"])
            if parts.scheme in ("http", "https") and parts.netloc:
                scrape[labels["instance"]] = f"{parts.scheme}://{parts.netloc}"
    rows = client.query("group by (instance) ({" + label_matcher("workload", job) + "})")
    instances = sorted({r["metric"].get("instance") for r in rows if isinstance(r.get("metric"), dict)} - {None})
    urls = sorted({scrape[i] for i in instances if i in scrape})
    if not urls:
        raise FleetError(f"No target of the server at {client.shown} has series of job {job!r} now "
                         f"({len(scrape)} active target(s)); check --job against the workload label.")
    return urls


# -- the fan-out -----------------------------------------------------------------------------------
def trace_fleet(urls: list[str], job: str, duration_s: float, start_in_s: float, token: str | None,
                work_dir: str, timeout_s: float, out: str) -> dict[str, Any]:
    """Everything: ask, wait, pull, merge, analyse; returns the summary (its exit_code says how it went)."""
    from .._redact import redact_url

    if not urls:
        raise UsageError("Name at least one agent.")
    if len(urls) > MAX_AGENTS:
        raise UsageError(f"{len(urls)} agents are more than the {MAX_AGENTS} one fleet trace asks.")
    agents = [Agent(u, redact_url(u)) for u in dict.fromkeys(urls)]
    phases: dict[str, float] = {}
    began = time.monotonic()
    ranks, start_ns = asyncio.run(_collect(agents, job, duration_s, start_in_s, token, work_dir, timeout_s, phases))
    collected_s = time.monotonic() - began
    done = _merge_and_analyse(agents, ranks, job, start_ns, duration_s, out, collected_s)
    phases["merge"] = time.monotonic() - began - collected_s
    done["phases_s"] = {k: round(v, 3) for k, v in phases.items()}
    return done


async def _collect(agents: list[Agent], job: str, duration_s: float, start_in_s: float, token: str | None,
                   work_dir: str, timeout_s: float, phases: dict[str, float]) -> tuple[list[Rank], int]:
    import aiohttp

    headers = {"User-Agent": "gpuscope trace fleet", **({"Authorization": f"Bearer {token}"} if token else {})}
    connector = aiohttp.TCPConnector(limit=256, limit_per_host=4)
    async with aiohttp.ClientSession(headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t = time.monotonic()
        gate = asyncio.Semaphore(CLOCK_CONCURRENCY)
        await asyncio.gather(*(_measure(session, a, gate) for a in agents))
        live = [a for a in agents if not a.problem]
        phases["clocks"] = time.monotonic() - t
        start_ns = time.time_ns() + int(start_in_s * 1e9)
        t = time.monotonic()
        await asyncio.gather(*(_ask(session, a, job, duration_s, start_ns) for a in live))
        phases["ask"] = time.monotonic() - t
        asked = [a for a in live if a.request_id]
        end_ns = start_ns + int(duration_s * 1e9)
        await asyncio.gather(*(_refine(session, a, end_ns) for a in asked))
        await asyncio.sleep(max(0.0, (end_ns - time.time_ns()) / 1e9))
        t = time.monotonic()
        deadline = t + EXPORT_WAIT_S
        got = await asyncio.gather(*(_pull(session, a, work_dir, deadline) for a in asked))
        phases["pull"] = time.monotonic() - t  # from the window's end: the processes' export, then the downloads
    return [r for rs in got for r in rs], start_ns


async def _call(session: Any, agent: Agent, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """(status, JSON document) of one call; an agent that cannot be reached or is no agent: AgentProblem."""
    import aiohttp

    try:
        async with session.request(method, agent.url + path, json=body) as r:
            raw = await r.content.read(1 << 20)
            status = r.status
    except asyncio.TimeoutError:
        raise AgentProblem(f"did not answer {path} in time") from None
    except aiohttp.ClientConnectorError as e:
        raise AgentProblem(f"cannot be reached ({e.os_error.strerror or e.os_error})") from None
    except (aiohttp.ClientError, OSError) as e:
        raise AgentProblem(f"broke off its answer to {path} ({type(e).__name__})") from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise AgentProblem(f"is not a gpuscope agent: {path} answered HTTP {status} without a JSON object")
    if status == 401:
        raise AgentProblem("refused the token (HTTP 401): give the agents' token with --token or $GPUSCOPE_TOKEN")
    return status, doc


async def _measure(session: Any, agent: Agent, gate: asyncio.Semaphore) -> None:
    """The agent's clock offset: the least-delay of ROUND_TRIPS round trips to /api/v1/clock."""
    async with gate:
        await _measure_one(session, agent)


async def _measure_one(session: Any, agent: Agent) -> None:
    try:
        for _ in range(ROUND_TRIPS):
            t0 = time.time_ns()
            status, doc = await _call(session, agent, "GET", "/api/v1/clock")
            t3 = time.time_ns()
            if status == 404:
                raise AgentProblem("has no /api/v1/clock: it is not a gpuscope agent, or one too old for fleet traces")
            if status != 200:
                raise AgentProblem(f"answered /api/v1/clock with HTTP {status}: {_said(doc)}")
            _sample(agent, t0, doc, t3)
            agent.host = str(doc.get("host") or "")[:200]
        if agent.clock is None:
            raise AgentProblem("answered /api/v1/clock without its clock readings")
    except AgentProblem as e:
        agent.problem = f"Agent {agent.shown} {str(e).rstrip('.')}."


async def _refine(session: Any, agent: Agent, until_ns: int) -> None:
    """More clock samples until `until_ns`, spread out; a failure here changes nothing (the offset stands)."""
    import random

    await asyncio.sleep(random.uniform(0, REFINE_EVERY_S))  # not every agent at the same instant
    for _ in range(REFINE_MAX):
        if time.time_ns() + REFINE_EVERY_S * 1e9 >= until_ns:
            return
        t0 = time.time_ns()
        try:
            status, doc = await _call(session, agent, "GET", "/api/v1/clock")
        except AgentProblem:
            return
        t3 = time.time_ns()
        if status == 200:
            _sample(agent, t0, doc, t3)
        await asyncio.sleep(REFINE_EVERY_S)


def _sample(agent: Agent, t0: int, doc: dict[str, Any], t3: int) -> None:
    t1, t2 = doc.get("received_unix_ns"), doc.get("answered_unix_ns")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (t1, t2)) or not t1 <= t2:
        return
    delay = (t3 - t0) - (t2 - t1)
    if agent.clock is None or delay < agent.clock.delay_ns:
        agent.clock = Clock(offset_ns=((t1 - t0) + (t2 - t3)) // 2, delay_ns=max(0, delay))


async def _ask(session: Any, agent: Agent, job: str, duration_s: float, start_ns: int) -> None:
    assert agent.clock is not None
    agent.asked_clock = agent.clock
    body = {"job": job, "duration": f"{duration_s:g}s", "start_unix": (start_ns + agent.clock.offset_ns) / 1e9}
    try:
        t0 = time.time_ns()
        status, doc = await _call(session, agent, "POST", "/api/v1/trace", body)
        t3 = time.time_ns()
        if status == 404:
            agent.no_job, agent.problem = True, f"Agent {agent.shown}: {_said(doc)}"
            return
        if status != 202 or not isinstance(doc.get("id"), str) or not isinstance(doc.get("processes"), list):
            raise AgentProblem(f"refused the window (HTTP {status}): {_said(doc)}")
        if isinstance(doc.get("clock"), dict):
            _sample(agent, t0, doc["clock"], t3)  # one more round trip; kept if its delay is the least
        agent.request_id = doc["id"]
        agent.processes = [p for p in doc["processes"] if isinstance(p, dict) and isinstance(p.get("pid"), int)]
    except AgentProblem as e:
        agent.problem = f"Agent {agent.shown} {str(e).rstrip('.')}."


async def _pull(session: Any, agent: Agent, work_dir: str, deadline: float) -> list[Rank]:
    """Wait for each asked process's answer, then download what they wrote."""
    ranks = {p["pid"]: Rank(agent, p["pid"], p.get("rank") if isinstance(p.get("rank"), int) else None)
             for p in agent.processes}
    answers: dict[int, dict[str, Any]] = {}
    try:
        while True:
            status, doc = await _call(session, agent, "GET", f"/api/v1/traces?id={agent.request_id}")
            if status != 200:
                raise AgentProblem(f"answered /api/v1/traces with HTTP {status}: {_said(doc)}")
            for t in doc.get("traces") or []:
                if isinstance(t, dict) and t.get("id") == agent.request_id and t.get("pid") in ranks:
                    answers[t["pid"]] = t
            alive = {p.get("pid") for p in doc.get("opted_in") or [] if isinstance(p, dict)}
            waiting = [pid for pid in ranks if pid not in answers and pid in alive]
            if not waiting or time.monotonic() > deadline:
                break
            await asyncio.sleep(POLL_S)
    except AgentProblem as e:
        for r in ranks.values():
            r.problem = f"Agent {agent.shown} {str(e).rstrip('.')}; the trace of process {r.pid} was not pulled."
        return list(ranks.values())
    for pid, r in ranks.items():
        t = answers.get(pid)
        if t is None:
            r.problem = (f"Process {pid} on {agent.shown} exited before it wrote its trace." if pid not in alive else
                         f"Process {pid} on {agent.shown} had not written its trace {EXPORT_WAIT_S:g} s after the window.")
        elif t.get("status") != "written":
            r.problem = f"Process {pid} on {agent.shown} wrote no trace: {str(t.get('reason') or t.get('status'))[:300]}."
        else:
            await _download(session, r, work_dir)
    return list(ranks.values())


async def _download(session: Any, r: Rank, work_dir: str) -> None:
    import aiohttp

    a = r.agent
    path = os.path.join(work_dir, f"{a.request_id}.{r.pid}.pt.trace.json.gz")  # request ids are random: unique
    url = f"{a.url}/api/v1/traces/{a.request_id}/file?pid={r.pid}"
    # A trace is up to MAX_TRACE_BYTES: the per-request timeout bounds a stall (no byte for that long), not the
    # whole body (on the H200 two real PyTorch ranks' 3 s windows were 1.3 M events, longer than 10 s to serve).
    stall_s = session.timeout.total or 10.0
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=stall_s, sock_read=stall_s)
    try:
        async with session.get(url, timeout=timeout) as resp:
            if resp.status != 200:
                raw = await resp.content.read(1 << 16)
                try:
                    said = _said(json.loads(raw))
                except (ValueError, RecursionError):
                    said = f"HTTP {resp.status}"
                r.problem = f"The trace of process {r.pid} on {a.shown} was not served: {said}"
                return
            if (resp.content_length or 0) > MAX_TRACE_BYTES:
                r.problem = (f"The trace of process {r.pid} on {a.shown} is {_size(resp.content_length or 0)}, over "
                             f"the {_size(MAX_TRACE_BYTES)} a fleet trace pulls.")
                return
            size = 0
            with open(path, "wb") as f:
                async for chunk in resp.content.iter_chunked(1 << 20):
                    size += len(chunk)
                    if size > MAX_TRACE_BYTES:
                        r.problem = (f"The trace of process {r.pid} on {a.shown} is over the "
                                     f"{_size(MAX_TRACE_BYTES)} a fleet trace pulls.")
                        break
                    f.write(chunk)
    except asyncio.TimeoutError:
        r.problem = f"The trace of process {r.pid} on {a.shown} stopped arriving (nothing for {stall_s:g} s)."
    except (aiohttp.ClientError, OSError) as e:
        r.problem = f"The trace of process {r.pid} on {a.shown} broke off ({type(e).__name__})."
    if r.problem:  # nothing half-written stays behind
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    r.path = path


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 1000:.0f} kB"


def _said(doc: Any) -> str:
    """An agent's one-sentence error, shortened, or what is known of its answer."""
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        text = " ".join(doc["error"].split())[:300]
        return text if text.endswith(".") else text + "."
    return "no reason given."


# -- merge and analyse -----------------------------------------------------------------------------
def _merge_and_analyse(agents: list[Agent], ranks: list[Rank], job: str, start_ns: int, duration_s: float,
                       out: str, collected_s: float) -> dict[str, Any]:
    """Each pulled trace read once: its events into the merge, its GPU ops kept for the analyses."""
    from .analyze import comm_overlap, stragglers
    from .collectives import arrivals
    from .merge import Merger
    from .model import TraceError

    summary: dict[str, Any] = {"job": job, "out": None, "start_unix_ns": start_ns, "duration_s": duration_s,
                               "collected_s": round(collected_s, 3)}
    kept: list[tuple[Rank, Any]] = []
    with Merger() as merger:
        for r in ranks:
            if not r.path:
                continue
            offset = r.agent.clock.offset_ns if r.agent.clock else 0
            try:
                header, t = merger.add(r.path, rank=r.rank, shift_ns=-offset, max_bytes=MAX_TRACE_UNPACKED,
                                       analyse=True)
            except TraceError as e:
                said = str(e).replace(r.path, "it")  # the pulled copy's temporary name says nothing
                r.problem = f"The trace of process {r.pid} on {r.agent.shown} is not usable: {said}"
                continue
            _window(r, header, offset, start_ns, duration_s)
            kept.append((r, t))
        _give_ranks(kept)
        if kept:
            try:
                merged = merger.write(out, [r.rank for r, _ in kept])  # type: ignore[misc]  # every rank is given now
            except OSError as e:
                raise UsageError(f"Cannot write {out}: {e.strerror or e}.") from None
            summary["out"] = merged["out"]
            summary["events"] = merged["events"]
    if kept:
        offsets = [r.agent.clock.offset_ns if r.agent.clock else 0 for r, _ in kept]
        only = [t for _, t in kept]
        summary["stragglers"] = [vars(s) for s in stragglers(only)]
        summary["communication"] = [vars(o) for o in (comm_overlap(t) for t in only) if o is not None]
        got = arrivals(only, [-o for o in offsets])
        summary["arrivals"] = got.to_dict() if got is not None else None
    summary["agents"] = [{"url": a.shown, "host": a.host, "offset_ns": a.clock.offset_ns if a.clock else None,
                          "offset_error_ns": a.clock.delay_ns // 2 if a.clock else None,
                          # the start was asked on the estimate of then: its window starts within its error
                          "start_offset_ns": a.asked_clock.offset_ns if a.asked_clock else None,
                          "start_offset_error_ns": a.asked_clock.delay_ns // 2 if a.asked_clock else None,
                          "request_id": a.request_id or None, "processes": len(a.processes),
                          "no_job": a.no_job, "problem": a.problem or None} for a in agents]
    summary["ranks"] = [{"rank": r.rank, "url": r.agent.shown, "pid": r.pid, "start_error_ns": r.start_error_ns,
                         "window_s": r.window_s, "note": r.note or None} for r, _ in kept]
    summary["missing"] = ([a.problem for a in agents if a.problem and not a.no_job]
                          + [r.problem for r in ranks if r.problem])
    summary["without_job"] = [a.problem for a in agents if a.no_job]
    if not kept:
        reasons = summary["missing"] or summary["without_job"]
        raise FleetError(f"No trace of job {job!r} was merged: {reasons[0] if reasons else 'no agent was asked.'}"
                         + (f" ({len(reasons) - 1} more problem(s))" if len(reasons) > 1 else ""))
    summary["exit_code"] = EXIT_PARTIAL if summary["missing"] else 0
    return summary


def _window(r: Rank, header: dict[str, Any], offset_ns: int, start_ns: int, duration_s: float) -> None:
    """What a trace's own facts say of its rank and its window (started how far from the start asked, how long)."""
    facts = header.get("gpuscope") if isinstance(header.get("gpuscope"), dict) else {}
    if r.rank is None and isinstance(facts.get("rank"), int):
        r.rank = facts["rank"]
    begin, stop = facts.get("profiler_start_unix_ns"), facts.get("profiler_stop_unix_ns")
    if isinstance(begin, int) and isinstance(stop, int):
        r.start_error_ns = begin - offset_ns - start_ns
        r.window_s = (stop - begin) / 1e9
        if r.window_s < duration_s * 0.9:
            r.note = (f"Process {r.pid} on {r.agent.shown} ended its window after {r.window_s:.2f} s of "
                      f"{duration_s:g} s (it exited meanwhile); what it recorded is merged.")


def _give_ranks(kept: list[tuple[Rank, Any]]) -> None:
    """The processes' own ranks where they are known and unique, else places after the known ones."""
    known = [r.rank for r, _ in kept]
    dupes = {x for x in known if x is not None and known.count(x) > 1}
    if dupes:
        for r, _ in kept:
            if r.rank in dupes:
                r.note = (r.note + " " if r.note else "") + (
                    f"Process {r.pid} on {r.agent.shown} claims rank {r.rank} as another does; it is given a rank of its own.")
                r.rank = None
    taken = {r.rank for r, _ in kept if r.rank is not None}
    free = (n for n in range(10**6) if n not in taken)
    for r, t in kept:
        if r.rank is None:
            r.rank = next(free)
        t.rank = r.rank


def print_summary(s: dict[str, Any]) -> None:
    ph = s.get("phases_s") or {}
    print(f"job {s['job']}: {len(s['ranks'])} rank(s) merged into {s['out']} ({s['events']} events); clocks "
          f"{ph.get('clocks', 0):.2f} s, request {ph.get('ask', 0):.2f} s, the window, pull {ph.get('pull', 0):.2f} s, "
          f"merge {ph.get('merge', 0):.2f} s")
    for a in s["agents"]:
        if a["offset_ns"] is not None and not a["problem"]:
            print(f"  {a['url']} ({a['host']}): clock {a['offset_ns'] / 1e6:+.3f} ms "
                  f"(+-{a['offset_error_ns'] / 1e6:.3f} ms), {a['processes']} process(es)")
    for r in s["ranks"]:
        late = "" if r["start_error_ns"] is None else f", started {r['start_error_ns'] / 1e6:+.3f} ms from the start asked"
        print(f"  rank {r['rank']}: pid {r['pid']} on {r['url']}{late}")
    arr = s.get("arrivals")
    if arr:
        who = f"rank {arr['slowest_rank']} is last at most of them" if arr["slowest_rank"] is not None else \
            "no rank is last at most of them"
        print(f"collectives: {arr['collectives']} matched across ranks, arrival spread p50 "
              f"{arr['spread_p50_ns'] / 1e6:.3f} ms, max {arr['spread_max_ns'] / 1e6:.3f} ms; {who}")
    for o in s.get("communication") or []:
        print(f"  rank {o['rank']}: communication {o['comm_ns'] / 1e6:.3f} ms, {o['overlap_ratio']:.0%} overlapped "
              "with compute")
    print("stragglers (GPU busy time > 10 % above the median rank): "
          + (", ".join(f"rank {x['rank']} (+{x['excess_ratio']:.0%})" for x in s["stragglers"]) or "none"))
    for line in s["without_job"]:
        print(f"no process of the job: {line}")
    for r in s["ranks"]:
        if r["note"]:
            print(f"note: {r['note']}")
    for line in s["missing"]:
        print(f"missing: {line}")
