"""Per-process verdicts on a GPU that processes share: the rules over windows of real records, the simulated
shared_gpu node through the real agent's /api/v1/diagnose and its dashboard (headless Chromium), top's
process table, and `gpuscope run`'s report (JSON and HTML), replayed from its own recording."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from record_windows import COMPUTE, GIB, HEALTHY, proc, snapshots, window
from test_agent import AgentProc, http

from gpuscope import viewmodel
from gpuscope.diagnose import GpuWindow, ProcessView, diagnose
from gpuscope.diagnose.stacks import HostProfile
from gpuscope.top import model

MATMUL, SYNC = 4101, 4202


def shared(t: float) -> list:
    """The issue's pair: a bf16 matmul loop doing most of the SM work, and a small-op loop with .item() every
    step (a small SM share, its main thread busy spinning on the syncs)."""
    return [proc(MATMUL, "python", sm=0.90, cpu=1.0, threads=(1.0,)),
            proc(SYNC, "python3", sm=0.06, util=0.12, cpu=1.0, threads=(0.99,), memory=0.6 * GIB)]


def primary_of(verdicts: list) -> object:
    (v,) = [v for v in verdicts if v.primary and v.gpu == "0" and v.kind not in ("power_capped",)]
    return v


def own(v) -> dict[int, list[str]]:
    """pid -> the kinds of its verdicts, its primary first."""
    out: dict[int, list[str]] = {}
    for pv in sorted(v.processes, key=lambda x: not x.primary):
        out.setdefault(pv.pid, []).append(pv.kind)
    return out


def test_each_process_of_a_shared_gpu_gets_its_own_verdict_and_the_gpu_names_them():
    v = primary_of(diagnose([window(COMPUTE, shared)]))
    assert v.kind == "compute_bound"
    assert own(v) == {MATMUL: ["compute_bound"], SYNC: ["launch_or_sync_bound"]}
    # the GPU's own verdict says it is shared, by whom, and each one's share
    assert "Shared by 2 processes" in v.summary and f"{MATMUL} python" in v.summary and f"{SYNC} python3" in v.summary
    by = {r["pid"]: r for r in v.evidence["shared_by"]}
    assert by[MATMUL]["name"] == "python" and by[SYNC]["name"] == "python3"
    assert by[MATMUL]["sm_share"] == pytest.approx(0.90) and by[SYNC]["sm_share"] == pytest.approx(0.06)
    assert by[MATMUL]["share_of_gpu_work"] == pytest.approx(0.90 / 0.96, abs=1e-3)
    assert (by[MATMUL]["kind"], by[SYNC]["kind"]) == ("compute_bound", "launch_or_sync_bound")
    sync = next(pv for pv in v.processes if pv.pid == SYNC)
    assert sync.severity == "warning" and sync.gpu == "0" and sync.recommendations
    assert sync.evidence["process_cpu_cores"] == 1.0 and sync.evidence["share_of_gpu_work"] < 0.1
    assert f"{MATMUL}" in sync.summary  # whose work fills the GPU it waits on


def test_its_stacks_make_the_small_op_loop_sync_bound_and_only_it_is_sampled():
    calls = []

    def profiler(pid):
        calls.append(pid)
        shares = {"sync": 0.7, "launch": 0.2, "data": 0.0, "other": 0.1}
        return HostProfile(pid, 200, shares, {"sync": [("small_ops.py:14 step", 0.7)]}, 2.0), None

    v = primary_of(diagnose([window(COMPUTE, shared)], profiler=profiler))
    assert calls == [SYNC]  # the main user of busy SMs waits on nothing of its own
    assert own(v) == {MATMUL: ["compute_bound"], SYNC: ["sync_bound"]}
    sync = next(pv for pv in v.processes if pv.pid == SYNC)
    assert "small_ops.py:14" in sync.summary and sync.evidence["stack_samples"] == 200


def test_a_healthy_process_gets_nothing_but_healthy():
    def procs(t: float) -> list:
        return [proc(MATMUL, sm=0.86, cpu=1.0, threads=(1.0,)),
                proc(SYNC, sm=0.03, cpu=0.05, threads=(0.04,), memory=0.5 * GIB)]

    v = primary_of(diagnose([window(HEALTHY, procs)]))
    assert v.kind == "healthy"
    assert own(v) == {MATMUL: ["healthy"], SYNC: ["healthy"]}
    assert all(pv.severity == "info" for pv in v.processes)


def test_a_neighbour_holding_memory_idle_and_one_leaking_are_told_apart():
    def procs(t: float) -> list:
        return [proc(MATMUL, sm=0.95, cpu=1.0, threads=(1.0,), memory=(4 + 0.5 * t) * GIB),  # +0.5 GiB/s
                proc(SYNC, "jupyter", sm=0.0, util=0.0, cpu=0.0, threads=(0.0,), memory=20 * GIB)]

    v = primary_of(diagnose([window(COMPUTE, procs)]))
    kinds = own(v)
    assert kinds[MATMUL] == ["compute_bound", "memory_growth"]
    assert kinds[SYNC] == ["idle_allocated"]
    idle = next(pv for pv in v.processes if pv.pid == SYNC)
    assert "20.0 GiB" in idle.summary
    leak = next(pv for pv in v.processes if pv.kind == "memory_growth")
    assert leak.pid == MATMUL and not leak.primary and leak.evidence["bytes_per_s"] == pytest.approx(GIB / 2, rel=0.01)


def test_four_processes_two_trainers_and_two_small_op_loops():
    def procs(t: float) -> list:
        return [proc(1, sm=0.45, cpu=1.0, threads=(1.0,)), proc(2, sm=0.45, cpu=1.0, threads=(1.0,)),
                proc(3, sm=0.03, cpu=1.0, threads=(1.0,)), proc(4, sm=0.03, cpu=1.0, threads=(1.0,))]

    v = primary_of(diagnose([window(COMPUTE, procs)]))
    assert own(v) == {1: ["compute_bound"], 2: ["compute_bound"], 3: ["launch_or_sync_bound"],
                      4: ["launch_or_sync_bound"]}
    assert "Shared by 4 processes" in v.summary
    # half the work each: the GPU's pipe figures hold the other's kernels too, and it says so
    assert "neighbours" in next(pv for pv in v.processes if pv.pid == 1).summary


def test_a_gpu_with_one_process_gets_no_process_verdicts():
    verdicts = diagnose([window(COMPUTE, lambda t: [proc(MATMUL, sm=0.96, cpu=1.0, threads=(1.0,))])])
    v = primary_of(verdicts)
    assert v.kind == "compute_bound" and v.processes == [] and "Shared" not in v.summary
    assert all(x.pid is None and not x.processes for x in verdicts)


def test_a_lost_gpu_has_no_process_verdicts():
    w = window(COMPUTE, shared)
    w.healthy = False
    (v,) = diagnose([w])
    assert v.kind == "gpu_lost" and v.processes == []


def test_top_and_the_view_model_show_each_processs_verdict():
    w = window(COMPUTE, shared)
    verdicts = diagnose([w])
    snap = {"gpus": [{"identity": {"index": 0, "uuid": "GPU-test-0", "name": "NVIDIA H200"}, "values": {}}],
            "processes": [{"pid": MATMUL, "gpu": "0", "user": "a", "name": "python", "cmdline": "python mm.py"},
                          {"pid": SYNC, "gpu": "0", "user": "b", "name": "python3", "cmdline": "python small.py"}],
            "hostname": "node-a", "time_ns": 1}
    ov = viewmodel.from_snapshot(snap, verdicts, with_ppid=False)
    kinds = {p["pid"]: p["verdict"]["kind"] for p in ov["processes"]}
    assert kinds == {MATMUL: "compute_bound", SYNC: "launch_or_sync_bound"}
    # the same from the JSON an agent answers (dicts, as top's agent feed reads them)
    from dataclasses import asdict
    ov2 = viewmodel.from_snapshot(snap, [asdict(v) for v in verdicts], with_ppid=False)
    assert {p["pid"]: p["verdict"]["kind"] for p in ov2["processes"]} == kinds
    head = model.proc_head(160, model.SORT_KEYS[0], False)
    assert "VERDICT" in head and "RSS  ELAPSED CONTAINER/POD" in head
    rows = {p["pid"]: model.proc_line("", p, 160, 2.0) for p in ov["processes"]}
    assert "launch_or_sync_bound" in rows[SYNC] and "compute_bound" in rows[MATMUL]
    assert "VERDICT" not in model.proc_head(100, model.SORT_KEYS[0], False)  # narrow: the command keeps its room
    # a GPU a process has alone: its row shows the GPU's verdict
    alone = diagnose([window(COMPUTE, lambda t: [proc(MATMUL, sm=0.96, cpu=1.0, threads=(1.0,))])])
    one = viewmodel.from_snapshot({**snap, "processes": snap["processes"][:1]}, alone, with_ppid=False)
    assert one["processes"][0]["verdict"]["kind"] == "compute_bound"


def test_a_past_range_from_the_store_gives_process_verdicts_too(tmp_path):
    """`gpuscope diagnose --since` and /api/v1/diagnose?start=: the processes' series read back from a real store;
    a window holds only the processes seen in it."""
    from gpuscope.diagnose.history import diagnose_range
    from gpuscope.store import Store

    t0 = time.time() - 60
    late = 4303  # on the GPU only in the range's last 10 s, idle there with a little memory

    def procs(t: float) -> list:
        return shared(t) + ([proc(late, sm=0.0, util=0.0, cpu=0.0, threads=(0.0,), memory=0.3 * GIB)] if t >= 30 else [])

    with Store(tmp_path) as store:
        for snap in snapshots(COMPUTE, procs, seconds=40.0, t0=t0):
            store.append(snap)
        store.flush()
    with Store(tmp_path, readonly=True) as store:
        r = diagnose_range(store, int(t0 * 1e9), int((t0 + 40) * 1e9), min_window_s=10.0)
    overall = primary_of(r.overall)
    assert own(overall) == {MATMUL: ["compute_bound"], SYNC: ["launch_or_sync_bound"], late: ["idle"]}
    assert "Shared by 3 processes" in overall.summary


# -- the simulated node through the real agent, its dashboard, and `gpuscope run` --------------------------

@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = AgentProc(tmp_path_factory.mktemp("shared"), "--simulate", "shared_gpu")
    a.wait_ready()
    yield a
    a.stop()


def _diagnosis(agent, window: str = "8s", timeout: float = 60.0) -> dict:
    """/api/v1/diagnose once the agent holds a steady window (its history fills at its own pace)."""
    deadline = time.monotonic() + timeout
    while True:
        code, body = http(agent.port, f"/api/v1/diagnose?window={window}", agent.token())
        assert code == 200, body
        data = json.loads(body)
        if any(v["primary"] and v["processes"] for v in data["verdicts"]) or time.monotonic() > deadline:
            return data
        time.sleep(0.5)


def test_the_simulated_shared_gpu_through_the_agents_diagnose(agent):
    data = _diagnosis(agent)
    assert data["simulated"] == "shared_gpu"
    (gpu,) = [v for v in data["verdicts"] if v["primary"] and v["gpu"] == "0"]
    assert gpu["kind"] == "compute_bound" and gpu["pid"] is None
    procs = {p["pid"]: p for p in gpu["processes"] if p["primary"]}
    assert len(procs) == 2
    kinds = sorted(p["kind"] for p in procs.values())
    assert kinds == ["compute_bound", "launch_or_sync_bound"]
    heavy = next(p for p in procs.values() if p["kind"] == "compute_bound")
    light = next(p for p in procs.values() if p["kind"] == "launch_or_sync_bound")
    assert heavy["evidence"]["sm_share"] > 0.8 > 0.1 > light["evidence"]["sm_share"]
    assert all(str(pid) in gpu["summary"] for pid in procs)
    assert {r["pid"] for r in gpu["evidence"]["shared_by"]} == set(procs)
    assert "small_ops.py" not in json.dumps(gpu["evidence"])  # command lines stay out of the evidence


def test_the_dashboard_lists_each_processs_verdict(agent, chromium):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[test]' installs playwright")
    _diagnosis(agent)
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = b.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{agent.port}/ui/")
            cells = "Array.from(document.querySelectorAll('#procs tbody td.verdict-cell')).map(td => td.textContent)"
            deadline = time.monotonic() + 60
            got: list[str] = []
            while time.monotonic() < deadline:  # the live stream brings the rows, then the verdicts
                got = page.evaluate(cells)
                if sorted(got) == ["compute bound", "launch or sync bound"]:
                    break
                time.sleep(0.2)
            assert sorted(got) == ["compute bound", "launch or sync bound"], got
            head = page.evaluate("Array.from(document.querySelectorAll('#procs th')).map(th => th.textContent)")
            assert "Verdict" in head
            title = page.evaluate("document.querySelector('#procs tbody td.verdict-cell .sev-warning')"
                                  ".parentElement.title")
            assert "held up by its host side" in title
            assert errors == []
        finally:
            b.close()


@pytest.fixture(scope="module")
def run_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "run", "--simulate", "shared_gpu", "--json",
                        str(d / "r.json"), "--html", str(d / "r.html"), "--", sys.executable, "-c",
                        "import time; time.sleep(13)"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads((d / "r.json").read_text()), (d / "r.html").read_text(), p.stderr


def test_run_reports_each_processs_verdict(run_report):
    data, html, text = run_report
    rows = {r["pid"]: r for r in data["processes"] if r["gpu"] == "0"}
    assert len(rows) == 2
    verdicts = sorted(r["verdict"] for r in rows.values())
    assert verdicts == ["compute_bound", "launch_or_sync_bound"]
    light = next(r for r in rows.values() if r["verdict"] == "launch_or_sync_bound")
    assert light["verdict_share"] == {"launch_or_sync_bound": 1.0} and light["verdict_severity"] == "warning"
    assert light["threads_busy_max"] == 1 and light["busy_threads"][0]["name"] == "python"
    # what to change first is the run's own process that waits, though the GPU itself is well used
    assert [s["kind"] for s in data["spans"] if s["gpu"] == "0"] == ["compute_bound"]
    assert data["change_first"]["kind"] == "launch_or_sync_bound" and str(light["pid"]) in data["change_first"]["summary"]
    assert f"process {light['pid']} (python): launch_or_sync_bound 100 %" in text
    # the HTML's process table: a verdict column with each process's verdict
    table = html[html.index("<h2>Processes</h2>"):]
    assert "<th>verdict</th>" in table and "<th>busy threads max</th>" in table
    for r in rows.values():
        row = table[table.index(f"<td class=num>{r['pid']}</td>"):]
        row = row[:row.index("</tr>")]
        assert f"<b>{r['verdict']}</b>" in row, row


def test_runs_recording_replays_its_process_verdicts(run_report):
    """The JSON report is the recording: its GPU series and each process's series give the same verdicts."""
    data, _, _ = run_report
    s = data["series"]["0"]
    gpu = data["gpus"][0]
    seg = [x for x in data["timeline"] if x["primary"] and x["processes"]][-1]
    a, b = seg["end_s"] - 10.0, seg["end_s"]
    idx = [i for i, t in enumerate(s["t"]) if a <= t <= b]
    series = {k: [v["mean"][i] for i in idx] for k, v in s.items() if k.startswith("gpu_") and isinstance(v, dict)}
    w = GpuWindow("0", [s["t"][i] for i in idx], series, memory_total_bytes=gpu["memory_total_bytes"],
                  sm_clock_max_hertz=gpu["sm_clock_max_hertz"])
    for r in data["processes"]:
        if r["gpu"] != "0":
            continue
        ps = r["series"]
        keep = [i for i, t in enumerate(ps["t"]) if a <= t <= b]

        def mid(field: str, keep=keep, ps=ps) -> float | None:
            vals = sorted(ps[field][i] for i in keep if ps[field][i] is not None)
            return vals[len(vals) // 2] if vals else None

        w.processes.append(ProcessView(
            r["pid"], r["name"], cpu_cores=mid("cpu_cores"), thread_cpu_max_ratio=mid("thread_cpu_max_ratio"),
            gpu_memory_bytes=ps["gpu_memory_bytes"][keep[-1]], sm_ratio=mid("sm_ratio"),
            utilization_ratio=mid("utilization_ratio"), threads_busy=round(mid("threads_busy")),
            memory=[(ps["t"][i], ps["gpu_memory_bytes"][i]) for i in keep]))
    replayed = primary_of(diagnose([w]))
    assert replayed.kind == seg["kind"]
    assert {pv.pid: pv.kind for pv in replayed.processes if pv.primary} == {
        pv["pid"]: pv["kind"] for pv in seg["processes"] if pv["primary"]}
