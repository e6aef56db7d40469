"""`gpuscope fleet report` against known answers: three simulated agents (node-a idle on Kubernetes, node-b
thermally throttled, node-c compute-bound), scraped every second by a real Prometheus (with the recording
rules of `gpuscope fleet rules` loaded) and by a real VictoriaMetrics, for about 75 s; node-a's agent is
stopped (SIGSTOP) for 12 s in the middle, so its scrapes fail.

Ground truth is each simulation's own: the agent's /api/v1/query_range of its 100 ms samples, integrated,
and its counters read at the range's edges. The report's GPU-hours, idle hours and energy must equal it
within 1 %. Where the agent was stopped, each edge of the gap can cost or add one scrape (the server knows
the GPU only at its scrape step): that node's tolerance adds one scrape step per gap edge per GPU, and the
gap must show as unobserved time, never as idle.

One module-scoped fleet feeds every test (the servers run once); the queries are the real CLI's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grpc")
from kubelet_server import Kubelet  # noqa: E402
from servers import PrometheusServer, VictoriaMetricsServer, free_port, need_binary  # noqa: E402

from gpuscope.diagnose.rules import ADVICE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
UUID0 = "GPU-5171a7ed-0000-4000-8000-000000000000"
RANGE_S = 66.0
STOP_AT_S, STOP_FOR_S = 24.0, 12.0
STEP_S = 0.1  # the agents' sampling interval: their own samples are the truth
PRICE = 2.0  # the default price of a GPU-hour
NODES = {"node-a": "idle_allocated", "node-b": "throttled", "node-c": "compute_bound"}
GPUS = {"node-a": 2, "node-b": 2, "node-c": 3}
JOB = "torchrun/run-7"  # node-b's and node-c's processes are one torchrun run: node-b's two GPUs are its stragglers


class ScrapingVictoriaMetrics(VictoriaMetricsServer):
    """VictoriaMetrics scraping `targets` itself every second (-promscrape.config)."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        self.targets = targets
        super().__init__(workdir)

    def _command(self) -> list[str]:
        cfg = self.workdir / "scrape.yml"
        cfg.write_text(json.dumps({"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": [
            {"job_name": "gpuscope", "static_configs": [{"targets": self.targets}]}]}))
        return [*super()._command(), f"-promscrape.config={cfg}"]


@dataclass
class Agent:
    name: str
    scenario: str
    port: int
    proc: subprocess.Popen[bytes]

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return json.load(r)

    def series(self, metric: str, start: float, end: float, agg: str) -> list[dict[str, Any]]:
        return self.get(f"/api/v1/query_range?metric={metric}&start={start:.3f}&end={end:.3f}&step=100ms&agg={agg}")[
            "series"]


def start_agent(workdir: Path, name: str, extra: list[str], config: str = "") -> Agent:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    env.update(GPUSCOPE_NODE_NAME=name, PYTHONPATH=str(ROOT / "src"))
    cfg = workdir / f"{name}.toml"
    cfg.write_text(config or '[kubernetes]\npod_resources_socket = "off"\n')
    proc = subprocess.Popen([PY, "-m", "gpuscope", "agent", "--simulate", NODES[name], "--gpus", str(GPUS[name]), *extra,
                             "--port",
                             str(port), "--data-dir", str(workdir / name), "--config", str(cfg)],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(workdir / f"{name}.log", "wb"))  # noqa: SIM115
    return Agent(name, NODES[name], port, proc)


def wait(ok, what: str, timeout: float = 40.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = ok()
        except (OSError, urllib.error.URLError, AssertionError, KeyError, IndexError):
            v = None
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Fleet:
    agents: dict[str, Agent]
    prom: PrometheusServer
    vm: ScrapingVictoriaMetrics
    start: float
    end: float
    stopped: tuple[float, float]  # when node-a's agent was stopped and continued (wall clock)
    workdir: Path
    truth: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    late: dict[str, int] = field(default_factory=dict)  # per server: node-a's scrapes stamped while it was stopped
    # per agent: the sampler ticks it missed around the range (a loaded machine runs it late): each is a sample
    # of every GPU that its own truth lacks and that a scrape, every second whatever the sampler did, counts
    missed: dict[str, int] = field(default_factory=dict)
    reports: dict[tuple[str, ...], dict[str, Any]] = field(default_factory=dict)

    def report(self, server: str, by: str = "node", source: str = "auto", *, via_cli: bool = False) -> dict[str, Any]:
        """The report over the fleet's range, through the CLI (--json) or the library (the same code, in
        this process: each CLI run costs a Python start)."""
        key = (server, by, source, via_cli)
        if key not in self.reports:
            url = self.prom.url if server == "prometheus" else self.vm.url
            if via_cli:
                out = self.workdir / f"report-{len(self.reports)}.json"
                run = cli("fleet", "report", "--prometheus", url, "--since", f"{self.start:.3f}", "--until",
                          f"{self.end:.3f}", "--json", str(out), "--by", by, "--source", source)
                assert run.returncode == 0, run.stderr
                assert run.stderr == "", run.stderr  # no progress bar: stderr is no terminal here
                self.reports[key] = json.loads(out.read_text())
            else:
                from gpuscope.fleet import report

                self.reports[key] = report(url, self.start, self.end, by, source=source)
        return self.reports[key]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "gpuscope", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def truth_of(agent: Agent, start: float, end: float) -> dict[str, dict[str, float]]:
    """Per GPU, from the agent's own 100 ms samples: seconds observed, SM-seconds used, seconds idle
    (SM activity under 5 %), and the energy and throttle counters' increase between the edges."""
    # Each of the agent's samples stands for one sampling interval; a 100 ms bucket may hold two of them (the
    # sampler's ticks are not on the buckets' grid), so counts and sums are taken per bucket, not means.
    out: dict[str, dict[str, float]] = {}
    per = {agg: {s["labels"]["gpu"]: s["values"] for s in agent.series("gpu_sm_active_ratio", start, end, agg)}
           for agg in ("count", "sum", "max")}
    for gpu, counts in per["count"].items():
        sums, peaks = per["sum"][gpu], per["max"][gpu]
        assert len(sums) == len(peaks) == len(counts)
        out[gpu] = {"observed_s": sum(n or 0 for n in counts) * STEP_S,
                    "used_s": sum(v or 0 for v in sums) * STEP_S,
                    "idle_s": sum((n or 0) * STEP_S for n, top in zip(counts, peaks, strict=True)
                                  if top is not None and top < 0.05)}

    def at(metric: str, t: float) -> dict[tuple[str, str], float]:
        got = {}
        for s in agent.series(metric, t - 1.0, t, "last"):
            vals = [v for v in s["values"] if v is not None]
            got[(s["labels"]["gpu"], s["labels"].get("reason", ""))] = vals[-1]
        return got

    for metric, name in (("gpu_memory_used_bytes", "memory_used_max"), ("gpu_memory_total_bytes", "memory_total")):
        for s in agent.series(metric, start, end, "max"):
            out[s["labels"]["gpu"]][name] = max(v for v in s["values"] if v is not None)
    for metric, name in (("gpu_energy_joules_total", "energy_j"), ("gpu_throttle_seconds_total", "throttle")):
        a, b = at(metric, start), at(metric, end)
        for (gpu, reason), v in b.items():
            out[gpu][name if not reason else f"throttle_{reason}_s"] = v - a[(gpu, reason)]
    return out


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    need_binary("prometheus")
    need_binary("victoria-metrics")
    workdir = Path(tempfile.mkdtemp(prefix="fleet", dir="/tmp"))  # short: the kubelet's unix socket path
    kubelet = Kubelet(workdir / "kubelet.sock", [("nb", "jupyter-alice", [("notebook", "nvidia.com/gpu", [UUID0])])])
    kubelet.start()
    k8s = (f'[kubernetes]\npod_resources_socket = "{kubelet.path}"\npod_resources_interval = "1s"\n'
           'pod_resources_timeout = "1s"\n')
    run = ["--simulate-workload", JOB.split("/")[1]]
    agents = {"node-a": start_agent(workdir, "node-a", ["--processes", "1"], k8s),
              "node-b": start_agent(workdir, "node-b", run), "node-c": start_agent(workdir, "node-c", run)}
    prom = vm = None
    try:
        for a in agents.values():
            wait(lambda a=a: a.get("/api/v1/status"), f"agent {a.name}")
        rules = workdir / "rules.yml"
        assert cli("fleet", "rules", "-o", str(rules), "--scrape-interval", "1s").returncode == 0
        targets = [f"127.0.0.1:{a.port}" for a in agents.values()]
        prom = PrometheusServer(workdir, targets, rule_files=[rules])
        vm = ScrapingVictoriaMetrics(workdir, targets)
        for server in (prom, vm):
            server.wait_for("gpu_info", lambda r: len(r) == sum(GPUS.values()))
            server.wait_for('gpu_allocation_state{hostname="node-a",state="allocated_idle"} == 1', lambda r: len(r) == 1)
        prom.wait_for("gpuscope:gpu_observed:bool", lambda r: len(r) == sum(GPUS.values()))
        start = time.time() + 1.0
        missed0 = {name: missed_ticks(ag) for name, ag in agents.items()}
        time.sleep(max(0.0, start + STOP_AT_S - time.time()))
        a = agents["node-a"]
        a.proc.send_signal(signal.SIGSTOP)
        t_stop = time.time()
        time.sleep(STOP_FOR_S)
        a.proc.send_signal(signal.SIGCONT)
        t_cont = time.time()
        end = start + RANGE_S
        time.sleep(max(0.0, end + 3.0 - time.time()))  # the last scrapes of the range have landed
        vm.flush()
        f = Fleet(agents, prom, vm, start, end, (t_stop, t_cont), workdir)
        f.missed = {name: missed_ticks(ag) - missed0[name] for name, ag in agents.items()}
        f.truth = {name: truth_of(ag, start, end) for name, ag in agents.items()}
        for name, server in (("prometheus", prom), ("victoria-metrics", vm)):
            raw = server.query(f'gpu_info{{hostname="node-a",gpu="0"}}[{RANGE_S + 10:g}s]', end + 1)
            f.late[name] = sum(1 for t, _ in raw[0]["values"] if t_stop < float(t) < t_cont)
        yield f
    finally:
        for server in (prom, vm):
            if server is not None:
                server.stop()
        for ag in agents.values():
            ag.proc.send_signal(signal.SIGCONT)
            ag.proc.terminate()
        for ag in agents.values():
            try:
                ag.proc.wait(15)
            except subprocess.TimeoutExpired:
                ag.proc.kill()
        kubelet.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def groups(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["group"]: g for g in report["groups"]}


def near(got: float, want: float, rel: float = 0.01, slack: float = 0.0) -> bool:
    return abs(got - want) <= rel * abs(want) + slack + 1e-9


def node_truth(f: Fleet, node: str, key: str, gpus: tuple[str, ...] | None = None) -> float:
    return sum(f.truth[node][g].get(key, 0.0) for g in (gpus if gpus is not None else f.truth[node]))


def edge_slack(f: Fleet, report: dict[str, Any]) -> float:
    """Seconds one of node-a's GPUs may be seen for more or less than its agent sampled: a scrape step at
    each edge of the gap, and one for each scrape the server began while the agent was stopped and got
    answered when it continued (it stamps the sample with the scrape's start: the server's own record)."""
    server = "prometheus" if report["server"] == f.prom.url else "victoria-metrics"
    return (2 + f.late[server]) * report["scrape_step_s"]["node-a"]


def missed_ticks(agent: Agent) -> int:
    return int(agent.get("/api/v1/status")["sampler"]["missed_ticks"])


def gap_slack(f: Fleet, report: dict[str, Any], node: str) -> float:
    """Seconds a node's figures may differ by: edge_slack for each GPU of the gapped node; elsewhere the
    samples the agent's sampler missed in the range, on each GPU (none on a machine that kept up; node-a's
    count would hold the 12 s it was stopped, which its edges' slack covers)."""
    if node == "node-a":
        return GPUS[node] * edge_slack(f, report)
    return GPUS[node] * f.missed.get(node, 0) * STEP_S


# -- known answers ---------------------------------------------------------------------------------
KNOWN_ANSWER_RUNS = [("prometheus", "raw", True), ("prometheus", "recorded", False), ("victoria-metrics", "raw", False)]


def check_gpu_hours_idle_hours_and_energy_equal_the_simulations_truth(fleet, server, source, via_cli):
    r = fleet.report(server, "node", source, via_cli=via_cli)
    assert r["source"] == source and r["by"] == "node"
    assert r["scrape_step_s"] == {"node-a": 1.0, "node-b": 1.0, "node-c": 1.0}  # read from the data
    g = groups(r)
    assert set(g) == set(NODES)
    idle_gpus = {"node-a": ("0",), "node-b": (), "node-c": ()}  # node-a's GPU 1 is held by no one: not idle-allocated
    for node in NODES:
        slack = gap_slack(fleet, r, node)
        obs = node_truth(fleet, node, "observed_s")
        assert near(g[node]["observed_gpu_hours"] * 3600, obs, slack=slack), (node, g[node], obs)
        assert near(g[node]["used_gpu_hours"] * 3600, node_truth(fleet, node, "used_s"), slack=slack), node
        idle = node_truth(fleet, node, "idle_s", idle_gpus[node])
        assert near(g[node]["idle_gpu_hours"] * 3600, idle, slack=slack), (node, g[node]["idle_gpu_hours"] * 3600, idle)
        assert near(g[node]["energy_kwh"] * 3.6e6, node_truth(fleet, node, "energy_j")), node
    # The fleet's totals, gap and all, within 1 %.
    total = sum(node_truth(fleet, n, "observed_s") for n in NODES)
    assert near(r["fleet"]["observed_gpu_hours"] * 3600, total, slack=sum(gap_slack(fleet, r, n) for n in NODES))
    assert near(r["fleet"]["energy_kwh"] * 3.6e6, sum(node_truth(fleet, n, "energy_j") for n in NODES))
    assert near(r["fleet"]["idle_gpu_hours"] * 3600, node_truth(fleet, "node-a", "idle_s", ("0",)),
                slack=gap_slack(fleet, r, "node-a") / 2)  # the fleet's one idle GPU is node-a's GPU 0


def check_a_gap_in_scraping_is_unobserved_time_never_idle(fleet, server):
    r = fleet.report(server, "node")
    g = groups(r)
    a = g["node-a"]
    step = r["scrape_step_s"]["node-a"]
    # What the agent itself did not sample while it was stopped, on both GPUs.
    missing = GPUS["node-a"] * RANGE_S - node_truth(fleet, "node-a", "observed_s")
    assert missing > 2 * (STOP_FOR_S - 2 * step)
    assert fleet.late[server] <= 3, fleet.late  # a scrape answered late is the exception, not the gap
    assert near(a["unobserved_gpu_hours"] * 3600, missing, slack=gap_slack(fleet, r, "node-a")), (
        a["unobserved_gpu_hours"] * 3600, missing)
    # GPU 0 was idle the whole time it was seen: its idle hours stop at the gap (a carried-over last value,
    # or a zero, would have made the gap idle too).
    idle = node_truth(fleet, "node-a", "idle_s", ("0",))
    assert a["idle_gpu_hours"] * 3600 < RANGE_S - (STOP_FOR_S - 2 * step)
    assert near(a["idle_gpu_hours"] * 3600, idle, slack=edge_slack(fleet, r))
    for node in ("node-b", "node-c"):  # scraped throughout
        assert g[node]["unobserved_gpu_hours"] * 3600 <= 2 * step
    # The plots while node-a was stopped: 4 GPUs observed (not 6, not 0), and no GPU idle while allocated
    # (node-a's GPU 0 is the fleet's only one: its gap is a gap in the plot, not idle time).
    p = r["plots"]
    width = p["t_s"][1] - p["t_s"][0]
    inside = [i for i, t in enumerate(p["t_s"])
              if fleet.start + t - width >= fleet.stopped[0] + 2 * step and fleet.start + t <= fleet.stopped[1] - step]
    assert len(inside) >= STOP_FOR_S / width / 2, (inside, width)
    seen = [p["observed"][i] for i in inside]
    others = GPUS["node-b"] + GPUS["node-c"]
    assert all(v is not None and v < others + 1.5 for v in seen) and abs(sum(seen) / len(seen) - others) < 0.2, seen
    assert all(p["idle_allocated"][i] in (None, 0.0) for i in inside), [p["idle_allocated"][i] for i in inside]
    assert any(v and v > 0.9 for v in p["idle_allocated"])  # outside the gap it is there


def check_kubernetes_allocation_unallocated_gpus_and_the_money(fleet):
    r = fleet.report("prometheus", "node")
    a = groups(r)["node-a"]
    obs0, obs1 = (fleet.truth["node-a"][g]["observed_s"] for g in ("0", "1"))
    slack = gap_slack(fleet, r, "node-a")
    # GPU 0 is pod nb/jupyter-alice's (allocated_idle); GPU 1 runs nothing and no pod holds it.
    assert near(a["allocated_gpu_hours"] * 3600, obs0, slack=slack / 2)
    assert near(a["unallocated_gpu_hours"] * 3600, obs1, slack=slack / 2)
    assert a["outside_kubernetes_gpu_hours"] == 0.0
    # The money, as docs/FLEET.md defines it, at the default prices.
    assert a["gpu_cost"] == pytest.approx(a["observed_gpu_hours"] * PRICE)
    assert a["energy_cost"] == pytest.approx(a["energy_kwh"] * 0.12)
    assert a["wasted_money"] == pytest.approx((a["allocated_gpu_hours"] - a["used_gpu_hours"]) * PRICE)
    assert a["unallocated_money"] == pytest.approx(a["unallocated_gpu_hours"] * PRICE)
    assert a["co2e_kg"] == pytest.approx(a["energy_kwh"] * 0.4)
    fl = r["fleet"]
    x = fl["wasted_money"] + fl["unallocated_money"]
    assert fl["line"].startswith(f"${x:,.2f} of ${fl['cost']:,.2f}") and "idle or starved" in fl["line"]


def check_ranked_by_money_wasted_with_why_and_fix(fleet):
    r = fleet.report("prometheus", "node")
    ranked = [g["group"] for g in r["groups"]]
    assert ranked[0] == "node-a"
    wasted = [g["wasted_money"] for g in r["groups"]]
    assert wasted == sorted(wasted, reverse=True)
    a, b = groups(r)["node-a"], groups(r)["node-b"]
    assert a["why"].startswith("idle 100%") and a["fix"] == ADVICE["idle_allocated"][0]
    assert "throttled" in b["why"] and b["fix"] == ADVICE["throttled"][0]
    assert b["verdict_share"]["throttled"] > 0.9 and a["verdict_share"]["idle_allocated"] > 0.6
    # Throttled hours by reason: node-b's clocks are held by both thermal reasons the whole time it is seen.
    for reason in ("sw_thermal", "hw_thermal"):
        want = node_truth(fleet, "node-b", f"throttle_{reason}_s")
        assert near(b["throttled_hours_by_reason"][reason] * 3600, want), (reason, b["throttled_hours_by_reason"])
    used = max(t["memory_used_max"] / t["memory_total"] for t in fleet.truth["node-b"].values())
    assert b["memory_headroom_ratio"] == pytest.approx(1 - used, abs=0.002)


def check_by_namespace_pod_and_user(fleet):
    ns = groups(fleet.report("prometheus", "namespace"))
    obs0 = fleet.truth["node-a"]["0"]["observed_s"]
    slack = edge_slack(fleet, fleet.report("prometheus", "node"))
    assert set(ns) == {"nb", "(none)"}
    assert near(ns["nb"]["observed_gpu_hours"] * 3600, obs0, slack=slack) and ns["nb"]["gpus"] == 1
    assert ns["nb"]["idle_gpu_hours"] == pytest.approx(ns["nb"]["allocated_gpu_hours"], rel=0.02)
    assert ns["(none)"]["gpus"] == sum(GPUS.values()) - 1
    pods = groups(fleet.report("prometheus", "pod"))
    assert set(pods) == {"nb/jupyter-alice", "(none)"}
    # Users: every simulated process runs as 'sim'; node-a's GPU 1 runs none, so its time is no user's.
    users = groups(fleet.report("victoria-metrics", "user"))
    slack = edge_slack(fleet, fleet.report("victoria-metrics", "user"))
    assert set(users) == {"sim", "(none)"}
    obs1 = fleet.truth["node-a"]["1"]["observed_s"]
    assert near(users["(none)"]["observed_gpu_hours"] * 3600, obs1, slack=slack)
    held = sum(node_truth(fleet, n, "observed_s") for n in NODES) - obs1
    assert near(users["sim"]["observed_gpu_hours"] * 3600, held,  # node-a's GPU 0 is the gapped one
                slack=slack + gap_slack(fleet, {}, "node-b") + gap_slack(fleet, {}, "node-c"))
    assert near(users["sim"]["idle_gpu_hours"] * 3600, obs0, slack=slack)
    # The fleet's money does not depend on the grouping.
    assert fleet.report("victoria-metrics", "user")["fleet"]["line"] == fleet.report("victoria-metrics", "node")[
        "fleet"]["line"]
    models = groups(fleet.report("prometheus", "model"))
    assert set(models) == {"NVIDIA H200 (simulated)"}


def check_csv_and_html_outputs_and_the_text(fleet, chromium):
    html, csv_path = fleet.workdir / "fleet.html", fleet.workdir / "fleet.csv"
    run = cli("fleet", "report", "--prometheus", fleet.prom.url, "--since", f"{fleet.start:.3f}", "--until",
              f"{fleet.end:.3f}", "--by", "node", "--html", str(html), "--csv", str(csv_path))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "went to GPUs that were idle or starved" in lines[0] and "Unobserved:" in run.stdout
    assert lines.index(next(x for x in lines if x.startswith("node-a"))) < lines.index(
        next(x for x in lines if x.startswith("node-b")))
    rows = csv_path.read_text().splitlines()
    assert rows[0].startswith("group,gpus,observed_gpu_hours") and rows[1].startswith("node-a,2,")
    assert rows[-1].startswith(f"(fleet),{sum(GPUS.values())},") and len(rows) == 5
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1600})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
            page.goto(html.as_uri())
            got = page.evaluate("""() => ({
                figures: [...document.querySelectorAll('figure')].map(f => ({
                    id: f.id, lines: f.querySelectorAll('polyline.series').length,
                    points: [...f.querySelectorAll('polyline.series')].map(p => p.points.numberOfItems)})),
                rows: document.querySelectorAll('#groups tbody tr.group').length,
                stragglers: document.querySelectorAll('#stragglers tbody tr').length,
                headline: document.querySelector('#headline').textContent,
            })""")
        finally:
            browser.close()
    assert errors == []
    assert {f["id"] for f in got["figures"]} == {"plot-gpus", "plot-power"}
    for fig in got["figures"]:  # every plot has data: lines with points
        assert fig["lines"] >= 1 and all(n >= 2 for n in fig["points"]), fig
    assert got["rows"] == 3 and "idle or starved" in got["headline"] and got["stragglers"] == 2
    assert "Stragglers" in run.stdout and "node-b: throttled" in run.stdout


def check_by_job_and_the_stragglers_section(fleet):
    r = fleet.report("prometheus", "job")
    jobs = groups(r)
    assert set(jobs) == {JOB, "k8s/nb/jupyter-alice", "(none)"}, set(jobs)
    assert jobs[JOB]["gpus"] == GPUS["node-b"] + GPUS["node-c"]
    held = node_truth(fleet, "node-b", "observed_s") + node_truth(fleet, "node-c", "observed_s")
    assert near(jobs[JOB]["observed_gpu_hours"] * 3600, held,
                slack=gap_slack(fleet, r, "node-b") + gap_slack(fleet, r, "node-c"))
    # The job's straggler: node-b's GPUs, held down by heat, against node-c's three.
    st = r["stragglers"]
    assert st["jobs"] is True
    named = {(x["workload"], x["node"], x["gpu"], x["cause"]) for x in st["stragglers"]}
    assert named == {(JOB, "node-b", "0", "throttled"), (JOB, "node-b", "1", "throttled")}, st


def check_a_progress_bar_on_a_terminal_only(fleet):
    """stderr a terminal: the bar is drawn there while it queries, and erased; the JSON is the same report."""
    import pty

    out = fleet.workdir / "tty.json"
    main, side = pty.openpty()
    try:
        p = subprocess.run([PY, "-m", "gpuscope", "fleet", "report", "--prometheus", fleet.prom.url, "--since",
                            f"{fleet.start:.3f}", "--until", f"{fleet.end:.3f}", "--by", "node", "--json", str(out)],
                           stdout=subprocess.PIPE, stderr=side, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        os.close(side)
        side = -1
        drawn = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the terminal's other side is closed and drained
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(main)
        if side >= 0:
            os.close(side)
    assert p.returncode == 0
    text = drawn.decode()
    assert "querying [" in text and "\r\x1b[K" in text  # drawn, then erased
    r = json.loads(out.read_text())
    assert "querying" not in out.read_text() and r["groups"][0]["group"] == "node-a"


def test_the_fleet_report_over_real_servers(fleet, chromium):
    """Every check over the one fleet, in one test: under pytest-xdist each worker that runs a test of this module
    builds the module's fixture again (80 s of three agents, Prometheus and VictoriaMetrics), which made five
    fleets of one and the whole suite minutes longer."""
    for server, source, via_cli in KNOWN_ANSWER_RUNS:
        check_gpu_hours_idle_hours_and_energy_equal_the_simulations_truth(fleet, server, source, via_cli)
    for server in ("prometheus", "victoria-metrics"):
        check_a_gap_in_scraping_is_unobserved_time_never_idle(fleet, server)
    check_kubernetes_allocation_unallocated_gpus_and_the_money(fleet)
    check_ranked_by_money_wasted_with_why_and_fix(fleet)
    check_by_namespace_pod_and_user(fleet)
    check_csv_and_html_outputs_and_the_text(fleet, chromium)
    check_by_job_and_the_stragglers_section(fleet)
    check_a_progress_bar_on_a_terminal_only(fleet)
