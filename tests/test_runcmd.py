"""`gpuscope run -- CMD`: the exit code is CMD's, Ctrl-C reaches CMD and its children, nothing is left
running, the whole run is kept (bounded), the run's processes are told apart from others', and the
JSON and HTML reports say what happened."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from types import SimpleNamespace

import psutil

from gpuscope._records import ProcessRecord
from gpuscope.report.processes import RunProcesses
from gpuscope.report.timeline import GpuTimeline
from gpuscope.runcmd import Segment, _summarise, render, spans

# A child that starts a grandchild, writes both pids, runs ~7.5 s and exits 3.
FAMILY = ("import os, subprocess, sys, time\n"
          "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
          "open(sys.argv[1], 'w').write(f'{os.getpid()} {g.pid}')\n"
          "time.sleep(7.5)\n"
          "g.kill(); g.wait()\n"
          "raise SystemExit(3)\n")


def gpuscope(*args: str, **kw):
    return subprocess.Popen([sys.executable, "-m", "gpuscope.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def test_run_keeps_the_family_and_writes_json_and_html(tmp_path):
    pids, out, html = tmp_path / "pids", tmp_path / "r.json", tmp_path / "r.html"
    p = gpuscope("run", "--simulate", "transfer_bound", "--json", str(out), "--html", str(html), "--",
                 sys.executable, "-c", FAMILY, str(pids), "--token=hunter2", "<script>alert(1)</script>")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    assert "exit code 3" in err and "transfer_bound" in err and "change first" in err and "Traceback" not in err
    assert "timeline: 0.0–" in err and f"report: {html}" in err
    child, grandchild = map(int, pids.read_text().split())
    report = json.loads(out.read_text())
    assert report["exit_code"] == 3 and report["simulated"] == "transfer_bound"
    assert report["verdict_share"]["0"]["transfer_bound"] == 1.0
    assert report["energy_joules"] > 0
    # On the simulated node the simulated GPU process stands for the command's GPU work: from the start.
    # (the first sample's time, however late a loaded machine took it; the series keeps it to the ms)
    assert report["gpu_start_s"] is not None and 0 <= report["gpu_start_s"]
    assert abs(report["gpu_start_s"] - report["series"]["0"]["t"][0]) <= 1e-3
    assert [s["kind"] for s in report["spans"]] == ["transfer_bound"]  # merged into one span
    assert report["spans"][0]["start_s"] >= 0 and report["spans"][0]["end_s"] > 6
    rows = {r["pid"]: r for r in report["processes"]}
    assert rows[child]["ours"] and rows[grandchild]["ours"] and rows[child]["gpu"] is None
    assert "hunter2" not in rows[child]["cmdline"] and "hunter2" not in report["command"]
    assert any(r["gpu"] == "0" and r["gpu_memory_max_bytes"] for r in report["processes"])
    series = report["series"]["0"]
    assert len(series["t"]) > 60 and any(v for v in series["gpu_pcie_rx_bytes_per_second"]["mean"] if v)

    page = html.read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "hunter2" not in page
    parser = _Tags()
    parser.feed(page)
    assert sum(1 for t, _ in parser.tags if t == "svg") >= 5
    bands = [a for t, a in parser.tags if t == "rect" and a.get("class") == "band"]
    assert bands
    text = "".join(parser.text)
    assert "transfer_bound" in text and str(grandchild) in text and "SIMULATED" in text


def test_ctrl_c_reaches_the_family_none_outlives_us_and_the_report_is_written(tmp_path):
    pidfile, html, out = tmp_path / "pid", tmp_path / "r.html", tmp_path / "r.json"
    child_code = ("import os, signal, subprocess, sys, time\n"
                  # The grandchild ignores SIGINT: only gpuscope's clean-up can end it.
                  "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                  "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)'])\n"
                  f"open({str(pidfile)!r}, 'w').write(f'{{os.getpid()}} {{g.pid}}')\n"
                  "signal.signal(signal.SIGINT, lambda *a: sys.exit(42))\n"
                  "time.sleep(60)\n")
    # A session of its own: no controlling terminal, so the SIGINT below reaches gpuscope alone (as a
    # `kill -INT` would), and gpuscope must forward it.
    p = gpuscope("run", "--simulate", "idle_allocated", "--html", str(html), "--json", str(out), "--",
                 sys.executable, "-c", child_code, start_new_session=True)
    t_end = time.monotonic() + 20
    while not pidfile.exists() and time.monotonic() < t_end:
        time.sleep(0.1)
    time.sleep(2.5)  # the process tree is read every ~2 s
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 42, err  # the child's own answer to Ctrl-C
    assert "interrupted" in err and "Traceback" not in err
    child, grandchild = map(int, pidfile.read_text().split())
    assert gone(child) and gone(grandchild)
    assert html.exists() and "SIMULATED" in html.read_text()
    report = json.loads(out.read_text())
    assert report["interrupted"] and {child, grandchild} <= {r["pid"] for r in report["processes"]}


def test_missing_command_nothing_to_run_and_not_executable(tmp_path):
    p = gpuscope("run", "--", "no-such-command-here")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 127 and err.strip() == "gpuscope: Command not found: no-such-command-here."
    p = gpuscope("run")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 2 and "Nothing to run" in err and len(err.strip().splitlines()) == 1
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\necho hi\n")  # not executable
    p = gpuscope("run", "--simulate", "healthy", "--", str(script))
    _, err = p.communicate(timeout=30)
    assert p.returncode == 126 and "permission denied" in err and len(err.strip().splitlines()) == 1


def test_a_command_that_exits_at_once_gets_one_sentence_and_its_code(tmp_path):
    p = gpuscope("run", "--simulate", "healthy", "--no-html", "--", sys.executable, "-c", "raise SystemExit(5)",
                 cwd=tmp_path)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 5, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "exited with code 5 after" in lines[0] and "too soon for a verdict" in lines[0]
    assert list(tmp_path.iterdir()) == []  # --no-html: nothing written


def test_report_write_failures_are_one_sentence_and_keep_the_exit_code(tmp_path):
    # A directory missing at the start is refused before the run (test_bad_input_audit.py); this one goes away
    # while the command runs.
    gone = tmp_path / "gone"
    gone.mkdir()
    p = gpuscope("run", "--simulate", "healthy", "--html", str(gone / "r.html"), "--json", str(gone / "r.json"),
                 "--", sys.executable, "-c", f"import os; os.rmdir({str(gone)!r}); raise SystemExit(4)")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 4, err
    assert "cannot write the HTML report" in err and "cannot write the JSON report" in err and "Traceback" not in err


def test_one_path_for_both_reports_is_refused_before_the_run(tmp_path):
    same = str(tmp_path / "r")
    p = gpuscope("run", "--simulate", "healthy", "--html", same, "--json", same, "--", sys.executable, "-c", "pass")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 2 and "--html and --json both name" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_default_html_name_in_the_working_directory(tmp_path):
    p = gpuscope("run", "--simulate", "healthy", "--", sys.executable, "-c", "pass", cwd=tmp_path)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    files = [f.name for f in tmp_path.iterdir()]
    assert len(files) == 1 and files[0].startswith("gpuscope-run-") and files[0].endswith(".html")


# -- units ----------------------------------------------------------------------------------------
def test_timeline_keeps_full_rate_for_ten_minutes_then_halves():
    tl = GpuTimeline()
    for i in range(6000):  # 10 min at 10 Hz
        tl.add(i / 10, {"gpu_power_watts": 100.0})
    assert len(tl) == 6000 and tl.samples_per_bucket == 1


def test_timeline_memory_is_bounded_and_keeps_mean_and_peaks():
    small = GpuTimeline(max_points=256)
    for i in range(256):
        small.add(float(i), {"gpu_power_watts": 1.0})
    size_full = small.nbytes()
    tl = GpuTimeline(max_points=256)
    n, total, peak_at = 100_000, 0.0, 77_777
    for i in range(n):
        v = 500.0 if i == peak_at else float(i % 100)
        total += v
        tl.add(i / 10, {"gpu_power_watts": v, "gpu_sm_active_ratio": None if i % 2 else 0.5,
                        "gpu_clock_event_reasons": 4.0 if i == 12_345 else 0.0})
    assert len(tl) <= 256 and tl.nbytes() <= size_full * 1.01  # the same memory as 256 samples
    pts = tl.points()
    power = pts["gpu_power_watts"]
    assert max(power["max"]) == 500.0 and min(power["min"]) == 0.0  # a one-sample spike survives
    counts = [tl.samples_per_bucket] * (len(tl) - 1)
    counts.append(n - sum(counts))
    mean = sum(m * c for m, c in zip(power["mean"], counts, strict=True)) / n
    assert math.isclose(mean, total / n, rel_tol=1e-3)
    assert set(pts["gpu_sm_active_ratio"]["mean"]) == {0.5}  # missing values do not drag the mean
    assert sum(1 for m in pts["gpu_clock_event_reasons"] if m & 4) == 1  # the one throttled sample's bucket
    assert pts["t"][0] == 0.0 and pts["t_end"][-1] == (n - 1) / 10


def _rec(pid: int, gpu: str = "0", mem: float = 1e9, sm: float | None = 0.5) -> ProcessRecord:
    return ProcessRecord(pid=pid, gpu=gpu, gpu_uuid="GPU-x", type="compute", name="python", cmdline=f"job {pid}",
                         gpu_memory_bytes=mem, sm_ratio=sm, cpu_cores=1.0, thread_cpu_max_ratio=0.9)


def test_run_processes_tells_the_run_from_other_users():
    child = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys, time\n"
                              "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(20)'])\n"
                              "print(g.pid, flush=True)\n"
                              "time.sleep(20)\n"], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        procs = RunProcesses(child.pid)
        procs.poll_tree(0.5)
        assert procs.gpu_start_s is None
        stranger = os.getpid()  # pytest: the child's parent, not its descendant
        procs.observe(SimpleNamespace(processes=[_rec(stranger, "1", 2e9)]), 1.0)
        assert procs.gpu_start_s is None
        # The grandchild shows up on GPU 0 before the next tree read: the ancestry check finds it ours.
        procs.observe(SimpleNamespace(processes=[_rec(grandchild, mem=1e9), _rec(stranger, "1", 3e9)]), 3.0)
        procs.observe(SimpleNamespace(processes=[_rec(grandchild, mem=4e9, sm=0.7)]), 4.0)
        assert procs.gpu_start_s == 3.0 and procs.gpu_start_by_gpu == {"0": 3.0}
        procs.poll_tree(4.5)
        rows = procs.table()
        by = {(r["pid"], r["gpu"]): r for r in rows}
        assert by[(child.pid, None)]["ours"] and by[(child.pid, None)]["cmdline"].startswith(os.path.basename(
            sys.executable)) or sys.executable in by[(child.pid, None)]["cmdline"]
        g = by[(grandchild, "0")]
        assert g["ours"] and g["gpu_memory_max_bytes"] == 4e9 and math.isclose(g["sm_ratio_mean"], 0.6)
        assert g["gpu_first_seen_s"] == 3.0
        s = by[(stranger, "1")]
        assert not s["ours"] and s["gpu_memory_max_bytes"] == 3e9 and s["cpu_cores_mean"] == 1.0
        assert [r["ours"] for r in rows] == sorted((r["ours"] for r in rows), reverse=True)  # the run's first
        assert {p.pid for p in procs.live_descendants()} == {grandchild}
    finally:
        for p in psutil.Process(child.pid).children(recursive=True):
            p.kill()
        child.kill()
        child.wait()


def test_spans_merge_consecutive_verdicts_and_share_is_by_time():
    segs = [Segment("0", "compute_bound", 0, 10, "cb"), Segment("0", "compute_bound", 10, 15, "cb"),
            Segment("0", "compute_bound", 15, 35, "cb"), Segment("0", "input_starved", 35, 50, "is", ["use workers"],
                                                                "warning"),
            Segment("0", "throttled", 20, 30, "th", severity="warning", primary=False),
            Segment("0", "throttled", 30, 40, "th", severity="warning", primary=False),
            Segment("1", "idle", 0, 50, "idle")]
    main = spans(segs)
    assert [(s["gpu"], s["kind"], s["start_s"], s["end_s"], s["verdicts"]) for s in main] == [
        ("0", "compute_bound", 0, 35, 3), ("0", "input_starved", 35, 50, 1), ("1", "idle", 0, 50, 1)]
    side = spans(segs, primary=False)
    assert [(s["kind"], s["start_s"], s["end_s"]) for s in side] == [("throttled", 20, 40)]
    r = _summarise(segs, 50.0, {"0": 0.0}, {"0": 5000.0}, 0, False, None)
    assert math.isclose(r["verdict_share"]["0"]["compute_bound"], 0.7) and r["energy_joules"] == 5000.0
    # A warning that held 15 s comes before an info verdict; the throttling (20 s, warning) wins on time.
    assert r["change_first"]["kind"] == "throttled"
    r.update(command="python train.py", gpu_start_s=2.0)
    text = render(r)
    assert "timeline: 0.0–35 s compute_bound, 35–50 s input_starved" in text
    assert "also: throttled 20–40 s" in text and "first used a GPU at 2.0 s" in text
