"""Traces on demand: the file protocol (trace/ondemand.py), and a real agent asking a real program that
runs under `gpuscope trace --on-demand` with a fake `torch` (as in test_trace_run.py), over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from test_agent import AgentProc, env, http
from test_trace_run import FAKE_TORCH, PROG
from test_web_chromium import Page, browser  # noqa: F401,F811 - a fixture

from gpuscope.agent.trace_api import NO_ONE, short_name, store_rows
from gpuscope.trace import ondemand as od

TEMPLATED = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int, float)"
# A second kernel, with a templated name and its own launch, beside the fake's "gemm".
SECOND_KERNEL = (
    '{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": pid, "ts": ts + 20, '
    '"dur": 2.0, "args": {"correlation": 8}},\n'
    '{"ph": "X", "cat": "kernel", "name": ' + json.dumps(TEMPLATED) + ', "pid": 0, "tid": 7, "ts": ts + 25, '
    '"dur": 4.0, "args": {"correlation": 8, "device": 0, "stream": 7}},\n'
    '{"ph": "M", "name": "process_name"')


# -- the protocol ----------------------------------------------------------------------------------
def test_requests_reach_the_pids_they_name_once(tmp_path):
    d = str(tmp_path)
    to_all = od.write_request(d, 2, "all", host="h")
    to_7 = od.write_request(d, 3, [7], host="h")
    od.write_request(d, 3, [8], host="h")
    od.write_request(d, 3, "all", host="other-host")
    assert [r["id"] for r in od.pending_for(d, 7, "h", since_unix=0)] == [to_all["id"], to_7["id"]]
    assert od.pending_for(d, 7, "h", since_unix=time.time() + 1) == []  # made before it opted in
    od.mark_done(d, to_all["id"], "h", 7, status="written", file="x.pt.trace.json.gz")
    assert [r["id"] for r in od.pending_for(d, 7, "h", since_unix=0)] == [to_7["id"]]
    assert [t["id"] for t in od.list_traces(d)] == [to_all["id"]]


def test_malformed_and_expired_requests_are_ignored(tmp_path):
    d = str(tmp_path)
    now = time.time()
    bad = [{"id": "../../etc/passwd", "duration_s": 1, "pids": "all", "host": "h", "created_unix": now},
           {"id": "0123456789abcdef", "duration_s": "1", "pids": "all", "host": "h", "created_unix": now},
           {"id": "0123456789abcdee", "duration_s": 1, "pids": [True], "host": "h", "created_unix": now},
           {"id": "0123456789abcded", "duration_s": 1, "pids": "all", "host": "h",
            "created_unix": now - od.REQUEST_TTL_S - 1}]
    for i, req in enumerate(bad):
        (tmp_path / f"req.{i}.json").write_text(json.dumps(req))
    (tmp_path / "req.junk.json").write_text("{not json")
    assert od.pending_for(d, 7, "h", since_unix=0) == []
    od.expire_requests(d)
    assert sorted(p.name for p in tmp_path.glob("req.*")) == ["req.0.json", "req.1.json", "req.2.json"]


def test_opted_in_lists_live_processes_and_forgets_dead_ones(tmp_path):
    d = str(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    od.register(d, {"host": "h", "pid": os.getpid()})
    od.register(d, {"host": "h", "pid": dead.pid})
    assert [p["pid"] for p in od.opted_in(d, host="h")] == [os.getpid()]
    assert not (tmp_path / f"proc.h.{dead.pid}.json").exists()
    od.unregister(d, "h", os.getpid())
    assert od.opted_in(d, host="h") == []


def test_planted_names_do_not_redirect_writes(tmp_path):
    """In a directory other users can write, a symlink planted at the name a writer will use must not
    make it write through the link (the old temporary name was predictable: <name>.<pid>.tmp)."""
    d = str(tmp_path)
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.write_text("precious")
    req_id = "0123456789abcdef"
    target = tmp_path / f"done.{req_id}.h.7.json"
    os.symlink(victim, f"{target}.{os.getpid()}.tmp")
    od.mark_done(d, req_id, "h", 7, status="refused", reason="test")
    assert victim.read_text() == "precious"
    assert json.loads(target.read_text())["status"] == "refused" and not target.is_symlink()


def test_hostile_protocol_files_are_skipped_not_fatal(tmp_path):
    """Files anyone with write access to the directory could plant: no exception, no hang, no
    unbounded read, and a symlink never counts as a request."""
    d = str(tmp_path)
    os.mkfifo(tmp_path / "done.fifo.json")  # opening it for reading would block forever
    os.symlink("/dev/zero", tmp_path / "done.zero.json")  # reading it would never end
    (tmp_path / "done.big.json").write_text(json.dumps({"id": "x", "pad": "x" * (od.MAX_FILE_BYTES + 1)}))
    (tmp_path / "done.a.json").write_text(json.dumps({"id": "a", "answered_unix": "yesterday"}))
    (tmp_path / "done.b.json").write_text(json.dumps({"id": "b", "answered_unix": 10**400}))
    (tmp_path / "req.c.json").write_text(json.dumps({"id": "c", "created_unix": "now"}))
    for i, pid in enumerate([10**30, -1, 0, True]):
        (tmp_path / f"proc.h.{i}.json").write_text(json.dumps({"host": "h", "pid": pid}))
    real = od.write_request(d, 2, "all", host="h")
    (tmp_path / "real.json").write_text(json.dumps(dict(real, id="0123456789abcdef")))
    os.symlink(tmp_path / "real.json", tmp_path / "req.0123456789abcdef.json")
    assert sorted(t["id"] for t in od.list_traces(d)) == ["a", "b"]
    od.expire_requests(d)
    assert not (tmp_path / "req.c.json").exists()
    assert od.opted_in(d, host="h") == []
    assert [r["id"] for r in od.pending_for(d, 7, "h", since_unix=0)] == [real["id"]]


def test_the_duty_budget_spaces_windows():
    b = od.Budget(0.01)
    assert b.refuse(5, now=100.0) == "" and b.next_allowed_unix(now=100.0) is None
    b.spend(100.0, 5)
    assert "duty budget of 1 %" in b.refuse(5, now=599.0) and "in 101 s" in b.refuse(5, now=599.0)
    # spaced 500 s after it, but two windows of 5 s would be 10 s of the 10 minutes [5, 605]
    assert "spent 5.0 s of the last 10 min" in b.refuse(5, now=600.0)
    assert b.refuse(5, now=700.0) == "" and b.refuse(1, now=600.0) == ""  # 5 + 1 s of any 10 min
    assert "outside 1..30 s" in b.refuse(31, now=10_000.0)
    assert od.Budget(7).max_duty == od.DEFAULT_MAX_DUTY  # a nonsense setting cannot lift the cap


def test_the_budget_charges_the_whole_measured_cost_not_the_duration():
    # A 1 s window whose start, stop and export took 2.5 s in all: the next waits 250 s at 1 %, not 100.
    b = od.Budget(0.01)
    b.spend(100.0, 2.5)
    assert "in 1 s" in b.refuse(1, now=349.0)
    assert b.refuse(1, now=350.0) == ""


def test_the_budget_holds_over_any_ten_minutes_whatever_the_spacing():
    """Windows of 1.5 s in all, each spaced by its cost: the spacing alone would let four into 600 s (6 s);
    the 10-minute rule counts every window that overlaps the span whole, so the sum over any 600 s of the
    windows it lets start stays <= 6 s, checked over every span that starts or ends at a window's edge."""
    b = od.Budget(0.01)
    t, starts = 0.0, []
    while t < 3600:
        t = b.allowed_at(1.0, t)
        starts.append(t)
        b.spend(t, 1.5, duration_s=1.0)
        t += 1.5
    edges = [s for s in starts] + [s + 1.5 for s in starts]
    for left in edges:
        inside = sum(1.5 for s in starts if s + 1.5 > left and s < left + 600)
        assert inside <= 6.0 + 1e-9, (left, inside)
    assert len(starts) >= 3600 / 600 * 4 - 1  # and it does not hold back more than that: 4 per 10 min
    assert "the next window of 30 s" in b.refuse(30, now=t)  # 30 s needs 3000 s with nothing else in them


def test_the_watcher_costs_one_stat_when_nothing_changed(tmp_path):
    w = od.Watcher(str(tmp_path))
    assert w.changed()
    old = time.time_ns() - 10 * 10**9
    os.utime(tmp_path, ns=(old, old))
    assert w.changed() and not w.changed()
    (tmp_path / "req.x.json").write_text("{}")
    assert w.changed()
    assert not od.Watcher(str(tmp_path / "absent")).changed()


def test_kernel_names_are_shortened_and_bounded():
    assert short_name(TEMPLATED) == "at::native::vectorized_elementwise_kernel"
    assert short_name("gemm") == "gemm" and short_name("sm90_xmma_gemm_f16(x)") == "sm90_xmma_gemm_f16"
    kernels = [{"gpu": "0", "short_name": f"k{i}", "total_s": float(i), "count": 1} for i in range(25)]
    series, values = store_rows(kernels + [{"gpu": "1", "short_name": "k0", "total_s": 2.0, "count": 3}])
    names = [lab["kernel"] for m, lab in series if m == "gpu_kernel_time_seconds" and lab["gpu"] == "0"]
    assert len(names) == 21 and names[0] == "k24" and names[-1] == "other"
    assert values[series.index(("gpu_kernel_time_seconds", {"kernel": "other", "gpu": "0"}))] == sum(range(5))
    assert values[series.index(("gpu_kernel_launches", {"kernel": "k0", "gpu": "1"}))] == 3


# -- a real agent and a real program ----------------------------------------------------------------
@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_ondemand")
    (root / "torch").mkdir()
    for name, text in FAKE_TORCH.items():
        if name == "profiler.py":
            assert '{"ph": "M", "name": "process_name"' in text
            text = text.replace('{"ph": "M", "name": "process_name"', SECOND_KERNEL)
        (root / "torch" / name).write_text(text)
    (root / "prog.py").write_text(PROG)
    return root


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = AgentProc(tmp_path_factory.mktemp("agent"), "--simulate", "healthy")
    a.wait_ready()
    yield a
    a.stop()


def call(agent: AgentProc, path: str, body: object = None, token: bool = True, raw: bytes | None = None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    code, out = http(agent.port, path, agent.token() if token else None, method="POST" if data is not None or
                     path == "/api/v1/trace" else "GET", data=data)
    return code, json.loads(out)


def wait_for(what, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_requests_are_checked(agent):
    code, out = call(agent, "/api/v1/trace", {"duration": "1s"}, token=False)
    assert code == 401, out
    for body, words in [(b"{nope", "must be JSON"), (b"[1]", "JSON object"),
                        (b'{"duration": "40s"}', "between 1 s and 30 s"), (b'{"duration": "0.5s"}', "between"),
                        (b'{"duration": "soon"}', "not a duration"), (b'{"pids": ["12"]}', "pids must be"),
                        (b'{"pids": []}', "pids must be"), (b'{"cmd": "rm -rf /"}', "Unknown field")]:
        code, out = call(agent, "/api/v1/trace", raw=body)
        assert code == 400 and words in out["error"], (body, out)
        assert out["error"].count(". ") == 0  # one sentence
    code, out = call(agent, "/api/v1/trace", {"duration": "1s"})
    assert code == 409 and out["error"] == NO_ONE


def test_a_program_traced_on_demand_through_the_agent(agent, fake):
    e = env()
    e["PYTHONPATH"] = f"{fake}{os.pathsep}{e['PYTHONPATH']}"
    e.update(PROG_SLEEP="60")
    prog = subprocess.Popen([sys.executable, "-m", "gpuscope.cli", "trace", "--on-demand", "--agent-dir",
                             str(agent.data), "--", sys.executable, str(fake / "prog.py"), "plain"],
                            env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        [me] = wait_for(lambda: call(agent, "/api/v1/traces")[1]["opted_in"])
        code, out = call(agent, "/api/v1/trace", {"duration": "1s", "pids": [me["pid"] + 1]})
        assert code == 409 and str(me["pid"]) in out["error"]

        code, out = call(agent, "/api/v1/trace", {"duration": "1s", "pids": [me["pid"]]})
        assert code == 202, out
        assert out["processes"][0]["pid"] == me["pid"] and out["processes"][0]["max_duty"] == 0.01
        first = out["id"]
        listed = wait_for(lambda: [t for t in call(agent, "/api/v1/traces")[1]["traces"]
                                   if t["id"] == first and t["kernel_names"]])
        assert listed[0]["status"] == "written" and listed[0]["duration_s"] == 1.0
        assert listed[0]["kernel_names"] == 2 and listed[0]["kernel_launches"] == 2
        assert (agent.data / "traces" / listed[0]["file"]).exists()

        code, out = call(agent, f"/api/v1/traces/{first}/kernels")
        assert code == 200
        kernels = out["traces"][0]["kernels"]
        assert {k["short_name"] for k in kernels} == {"gemm", "at::native::vectorized_elementwise_kernel"}
        gemm = next(k for k in kernels if k["name"] == "gemm")
        assert gemm["count"] == 1 and gemm["total_s"] == pytest.approx(10e-6) and gemm["gpu"] == "0"
        assert gemm["launch_delay_p50_s"] == pytest.approx(0.0)  # the fake launches end as the kernel starts

        kernel_time = "/api/v1/query_range?metric=gpu_kernel_time_seconds&start=-5m&step=1s&agg=sum"
        q = wait_for(lambda: call(agent, kernel_time)[1].get("series"), timeout=10)  # stored at the next flush
        got = {s["labels"]["kernel"]: sum(v for v in s["values"] if v) for s in q}
        assert got == pytest.approx({"gemm": 10e-6, "at::native::vectorized_elementwise_kernel": 4e-6}), q
        code, q = call(agent, "/api/v1/query_range?metric=gpu_kernel_launches&start=-5m&step=1s&agg=sum&kernel=gemm")
        assert [sum(v for v in s["values"] if v) for s in q["series"]] == [1.0]

        code, out = call(agent, "/api/v1/trace", {"duration": "1s"})  # too soon after the first
        assert code == 202 and out["processes"][0]["next_allowed_unix"] > time.time() + 60
        second = out["id"]
        refused = wait_for(lambda: [t for t in call(agent, "/api/v1/traces")[1]["traces"] if t["id"] == second])
        assert refused[0]["status"] == "refused" and "duty budget of 1 %" in refused[0]["reason"]
        assert call(agent, f"/api/v1/traces/{second}/kernels")[0] == 404
        assert call(agent, "/api/v1/traces/nope/kernels")[0] == 404
    finally:
        prog.terminate()
        _, err = prog.communicate(timeout=30)
    assert "1 trace file(s)" in err, err
    assert call(agent, "/api/v1/traces")[1]["opted_in"] == []  # it unregistered as it exited


def test_the_dashboard_shows_the_kernels_of_the_last_trace(tmp_path, browser):  # noqa: F811

    a = AgentProc(tmp_path, "--simulate", "healthy")
    try:
        a.wait_ready()
        done = {"id": "0123456789abcdef", "host": "h", "pid": 42, "status": "written", "file": "h.42.x.pt.trace.json.gz",
                "duration_s": 5.0, "profiler_start_unix_ns": time.time_ns(), "answered_unix": time.time()}
        (a.data / "trace-requests" / "done.0123456789abcdef.h.42.json").write_text(json.dumps(done))
        kernels = [{"gpu": "0", "name": "<img src=x onerror=alert(1)>", "short_name": "<img src=x onerror=alert(1)>",
                    "count": 3, "total_s": 2e-3, "p50_s": 6e-4, "p99_s": 9e-4, "launch_delay_p50_s": None},
                   {"gpu": "0", "name": TEMPLATED, "short_name": short_name(TEMPLATED), "count": 9, "total_s": 0.5,
                    "p50_s": 0.05, "p99_s": 0.06, "launch_delay_p50_s": 4e-6}]
        (a.data / "traces" / (done["file"] + ".kernels.json")).write_text(json.dumps({"kernels": kernels}))
        page = Page(browser, f"http://127.0.0.1:{a.port}").open("/ui/")
        page.until("!document.querySelector('#kernels-box').hidden")
        rows = page.js("[...document.querySelectorAll('#kernels tbody tr')].map(r => r.innerText)")
        assert rows[0].split("\t")[:4] == ["at::native::vectorized_elementwise_kernel", "0", "9", "500.00 ms"]
        assert rows[1].startswith("<img src=x onerror=alert(1)>")  # text, never markup
        assert "pid 42, 5 s" in page.js("document.querySelector('#kernels-note').textContent")
        assert page.errors == []
    finally:
        a.stop()


# -- the agent's side, in process: hostile files in its directories, retention ----------------------
def _traces(tmp_path):
    import types

    from gpuscope.agent.trace_api import Traces

    data = tmp_path / "data"
    (data / "traces").mkdir(parents=True)
    (data / "trace-requests").mkdir()
    return Traces(types.SimpleNamespace(cfg=types.SimpleNamespace(data_path=data), store=None)), data


FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "traces", "compute_bound.pt.trace.json.gz")


def _written(data, req_id: str, file: str, **fields) -> None:
    od.mark_done(str(data / "trace-requests"), req_id, "h", 7, status="written", file=file, **fields)


def test_the_agent_never_writes_or_reads_through_a_planted_symlink(tmp_path):
    import shutil

    t, data = _traces(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    name = "h.7.0123456789abcdef.pt.trace.json.gz"
    shutil.copy(FIXTURE, data / "traces" / name)
    os.symlink(victim, data / "traces" / f"{name}.kernels.json.tmp")  # the old cache's temporary name
    os.symlink(FIXTURE, data / "traces" / "h.8.0123456789abcdef.pt.trace.json.gz")  # could point anywhere
    _written(data, "0123456789abcdef", name)
    _written(data, "fedcba9876543210", "h.8.0123456789abcdef.pt.trace.json.gz")
    t.ingest()
    assert victim.read_text() == "precious"
    assert json.loads((data / "traces" / f"{name}.kernels.json").read_text())["kernels"]
    assert not os.path.lexists(data / "traces" / "h.8.0123456789abcdef.pt.trace.json.gz.kernels.json")


def test_listing_survives_hostile_answers_and_caches(tmp_path):
    import asyncio

    t, data = _traces(tmp_path)
    _written(data, "0123456789abcdef", "a.pt.trace.json.gz", profiler_start_unix_ns=10**400)
    (data / "traces" / "a.pt.trace.json.gz.kernels.json").write_text(
        json.dumps({"kernels": [1, {"count": "many"}, {"count": 3, "name": "<k>"}]}))

    async def listing():
        return await t.list_(None)

    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a loop of its own, whatever runs in this thread
        body = json.loads(pool.submit(asyncio.run, listing()).result().text)
    assert body["traces"][0]["start_unix"] is None and body["traces"][0]["kernel_launches"] == 3


def test_retention_keeps_the_newest_traces_and_answers(tmp_path, monkeypatch):
    from gpuscope.agent import trace_api

    t, data = _traces(tmp_path)
    monkeypatch.setattr(trace_api, "KEEP_TRACES", 2)
    monkeypatch.setattr(trace_api, "KEEP_ANSWERS", 3)
    for i in range(5):
        for path in (data / "traces" / f"h.{i}.pt.trace.json.gz", data / "traces" / f"h.{i}.pt.trace.json.gz.kernels.json",
                     data / "trace-requests" / f"done.{i}.h.{i}.json"):
            path.write_text("{}")
            os.utime(path, ns=(i * 10**9, i * 10**9))
    (data / "traces" / "unrelated.txt").write_text("kept")
    t.prune()
    assert sorted(p.name for p in (data / "traces").iterdir()) == [
        "h.3.pt.trace.json.gz", "h.3.pt.trace.json.gz.kernels.json",
        "h.4.pt.trace.json.gz", "h.4.pt.trace.json.gz.kernels.json", "unrelated.txt"]
    assert sorted(p.name for p in (data / "trace-requests").iterdir()) == [
        "done.2.h.2.json", "done.3.h.3.json", "done.4.h.4.json"]
    monkeypatch.setattr(trace_api, "KEEP_TRACES", 100)
    monkeypatch.setattr(trace_api, "KEEP_TRACES_BYTES", 2)  # the byte cap: only the newest (2 bytes) fits
    t.prune()
    assert not (data / "traces" / "h.3.pt.trace.json.gz").exists() and (data / "traces" / "h.4.pt.trace.json.gz").exists()


def test_the_first_window_is_estimated_by_the_prior_not_charged_after_the_fact():
    # Nothing charged yet: a window's cost is its length and PRIOR_OVERHEAD_PER_S a second of it beyond.
    b = od.Budget(0.01)
    assert b.estimate(2.0) == 2.0 * (1 + od.PRIOR_OVERHEAD_PER_S)
    # The agent's own 2 s window would cost 10 s (> 6 s of any 10 minutes): it is shortened to what fits.
    d, why = b.fit(2.0, now=100.0)
    assert why == "" and od.MIN_DURATION_S <= d < 2.0 and b.estimate(d) <= 6.0
    assert b.estimate(round(d + 0.1, 1)) > 6.0  # the longest tenth of a second that fits
    # Once charged, the measured overhead is the estimate, scaled up for a longer window.
    b.spend(100.0, 4.0, duration_s=1.0)
    assert b.estimate(1.0) == 4.0 and b.estimate(2.0) == 8.0 and b.estimate(0.5) == 3.5
    # A process whose 1 s windows cost 7 s can never fit 1 % of 10 minutes: the agent's are refused, with why.
    b = od.Budget(0.01)
    b.spend(0.0, 7.0, duration_s=1.0)
    d, why = b.fit(1.0, now=10_000.0)
    assert "estimated to cost 7.0 s" in why and "6 s (1 %) of any 10 minutes" in why
    # ... while a window asked by hand may still stand alone in its 700 s
    assert b.refuse(1.0, now=10_000.0) == ""


def test_the_agents_windows_keep_to_one_percent_of_any_ten_minutes_when_estimates_hold():
    """Windows whose cost is 4.5x their length, asked every second by the agent: over two hours every span of
    600 s holds at most 6 s of their cost, the first window included (estimated by the prior)."""
    b = od.Budget(0.01)
    t, wins = 0.0, []
    while t < 7200:
        d, why = b.fit(2.0, now=t)
        if why:
            t += 1.0
            continue
        cost = 4.5 * d
        wins.append((t, t + cost))
        b.spend(t, cost, duration_s=d)
        t += cost
    assert len(wins) >= 10
    for left in [a for a, _ in wins] + [b_ - 600 for _, b_ in wins]:
        inside = sum(max(0.0, min(e, left + 600) - max(s, left)) for s, e in wins)
        assert inside <= 6.0 + 1e-9, (left, inside)
