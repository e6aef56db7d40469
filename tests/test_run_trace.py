"""`gpuscope run --trace -- CMD`: a GPU whose verdict the metrics cannot settle gets a trace of its
processes, and the trace's verdict refines it. The command is a real child interpreter with a fake
`torch` (no torch, no GPU here) whose profiler writes the golden sync_heavy trace, so the real trace
rules and verdicts run on a real trace."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_trace_run import FAKE_TORCH

from gpuscope.diagnose import Verdict
from gpuscope.runcmd import run
from gpuscope.trace import ondemand
from gpuscope.trace.onrun import TRACE_WAITING, Tracing

GOLDEN = Path(__file__).parent / "fixtures" / "traces" / "sync_heavy.pt.trace.json.gz"

# The golden trace as this process's own: its pid 601 becomes ours, as in a trace the process wrote.
PROFILER = FAKE_TORCH["profiler.py"].split("    def export_chrome_trace")[0] + textwrap.indent(textwrap.dedent("""
    def export_chrome_trace(self, path):
        import gzip, re
        with open(os.environ["FAKE_TORCH_GOLDEN"], "rb") as f:
            raw = gzip.decompress(f.read())
        mine = str(os.getpid()).encode()
        raw = re.sub(rb'"(pid|tid)": 601\\b', lambda m: b'"' + m.group(1) + b'": ' + mine, raw)
        with open(path, "wb") as f:
            f.write(raw)
"""), "    ")

# argv: torch|none, seconds to run, and optionally a directory: then it runs on until a trace was written there
# and 15 s more (three verdicts' worth, at most 120 s), so that verdicts come after the trace's analysis however
# long a loaded machine took to write and analyse it.
CHILD = textwrap.dedent("""
    import glob, os, sys, time
    if sys.argv[1] == "torch":
        import torch
        torch.cuda.init()
    end = time.monotonic() + float(sys.argv[2])
    if len(sys.argv) > 3:
        cap = time.monotonic() + 120
        while not glob.glob(os.path.join(sys.argv[3], "*.pt.trace.json*")) and time.monotonic() < cap:
            time.sleep(0.2)
        end = max(end, time.monotonic() + 15)
    time.sleep(max(0.0, end - time.monotonic()))
""")


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_run_trace")
    (root / "torch").mkdir()
    for name, text in dict(FAKE_TORCH, **{"profiler.py": PROFILER}).items():
        (root / "torch" / name).write_text(text)
    (root / "child.py").write_text(CHILD)
    return root


def test_a_sync_bound_gpu_gets_a_trace_and_its_certain_verdict(fake, tmp_path):
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    e.update(PYTHONPATH=str(fake), FAKE_TORCH_GOLDEN=str(GOLDEN))
    out, html = tmp_path / "r.json", tmp_path / "r.html"
    # Verdicts at 5 and 10 s ask for a trace; it is written and analysed by about 18 s; the verdicts after it
    # (the child runs 15 s past the trace's writing) and the tail are refined.
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "run", "--simulate", "sync_bound", "--trace",
                        "--json", str(out), "--html", str(html), "--", sys.executable, str(fake / "child.py"),
                        "torch", "23", str(tmp_path / "r-traces")], capture_output=True, text=True, env=e,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    report = json.loads(out.read_text())
    [req] = report["trace"]["requests"]
    assert req["gpu"] == "0" and req["family"] == "host" and req["request_id"] and req["note"] is None, req
    # asked at the second verdict in a row: made 5 s apart, so no sooner than 10 s (later on a loaded machine)
    assert 10 - 0.5 <= req["requested_at_s"] < report["duration_s"]
    assert report["trace"]["kept"] and report["trace"]["dir"] == str(tmp_path / "r-traces")
    assert Path(req["file"]).parent == tmp_path / "r-traces" and Path(req["file"]).exists()
    assert req["verdict"] == "sync_bound" and req["confidence"] >= 0.9 and "sync_heavy.py:9" in req["line"]
    assert req["refined_verdicts"] >= 1
    kinds = [s["kind"] for s in report["spans"] if s["gpu"] == "0"]
    assert kinds[0] == "launch_or_sync_bound" and kinds[-1] == "sync_bound", kinds
    refined = report["spans"][-1]
    assert "certain: from the trace" in refined["summary"] and refined["evidence"]["trace"] == req["file"]
    assert refined["evidence"]["metrics_verdict"] == "launch_or_sync_bound"
    assert report["change_first"]["kind"] in ("launch_or_sync_bound", "sync_bound")
    assert f"trace of GPU 0 (asked at {req['requested_at_s']:.0f} s): {req['file']}" in p.stderr
    assert "sync_bound (certain) at sync_heavy.py:9" in p.stderr
    page = html.read_text()
    assert os.path.basename(req["file"]) in page and "certain: from the trace" in page
    assert not list(Path(report["trace"]["dir"]).glob("req.*"))  # requests stay private to the run


def test_a_command_that_never_answers_keeps_the_metrics_verdict(fake, tmp_path):
    # No torch: the process never opts in, so the request times out (3 s here) and the run goes on.
    code, report = run([sys.executable, str(fake / "child.py"), "none", "16"], simulate="sync_bound",
                       trace=True, trace_timeout_s=3.0, out=io.StringIO())
    assert code == 0
    [req] = report["trace"]["requests"]
    assert req["note"] == "no trace came: the process did not answer" and req["file"] is None
    assert {s["kind"] for s in report["spans"]} == {"launch_or_sync_bound"}
    assert report["trace"]["kept"] is False and report["trace"]["dir"] is None


def test_without_trace_nothing_is_injected(tmp_path):
    probe = "import os, sys; sys.exit(3 if 'GPUSCOPE_TRACE_DIR' in os.environ else 0)"
    code, report = run([sys.executable, "-c", probe], simulate="healthy", out=io.StringIO())
    assert code == 0 and "trace" not in report


def v(kind: str, confidence: float = 0.7, gpu: str = "0") -> Verdict:
    return Verdict(gpu, kind, "warning", confidence, kind, {}, [])


def test_a_trace_is_asked_after_two_unsettled_verdicts_once_per_family(tmp_path):
    t = Tracing(str(tmp_path / "req"), str(tmp_path), lambda gpu: [10**7], timeout_s=60)
    t.observe([v("launch_or_sync_bound"), v("healthy", gpu="1")], 5)
    assert t.records == [] and not t.waiting()
    t.observe([v("launch_or_sync_bound"), v("input_starved", 0.85, gpu="1")], 10)  # stacks' input_starved is settled
    [req] = t.records
    assert req["gpu"] == "0" and t.waiting()
    assert [r["pids"] for r in ondemand.pending_for(str(tmp_path / "req"), 10**7, req_host(tmp_path), 0)] == [[10**7]]
    t.poll(final=True)  # nobody answers
    assert req["note"] == "no trace came: the process did not answer" and not t.waiting()
    for at in (15, 20, 25):
        t.observe([v("host_bound", 0.6)], at)  # the same family: no second trace
    assert len(t.records) == 1
    t.observe([v("input_starved", 0.7)], 30)
    t.observe([v("input_starved", 0.7)], 35)  # another family, twice: one more
    assert [r["family"] for r in t.records] == ["host", "input"]
    assert TRACE_WAITING == "tracing 3 s to tell launch- from sync-bound…"


def req_host(tmp_path: Path) -> str:
    [name] = [n for n in os.listdir(tmp_path / "req") if n.startswith("req.")]
    return json.loads((tmp_path / "req" / name).read_text())["host"]


def test_change_first_counts_the_time_before_a_trace_for_the_verdict_the_trace_settled():
    from gpuscope.runcmd import _change_first

    def span(kind, a, b, **ev):
        return {"gpu": "0", "kind": kind, "start_s": a, "end_s": b, "severity": "warning", "summary": kind,
                "recommendations": [f"fix {kind}"], "evidence": ev}

    spans = [span("launch_or_sync_bound", 0, 15), span("sync_bound", 15, 23, metrics_verdict="launch_or_sync_bound")]
    cf = _change_first(spans)
    assert cf["kind"] == "sync_bound" and cf["seconds"] == 23 and cf["advice"] == ["fix sync_bound"]
    # Without the trace's word, the longest verdict wins as before.
    spans[1]["evidence"] = {}
    assert _change_first(spans)["kind"] == "launch_or_sync_bound"
