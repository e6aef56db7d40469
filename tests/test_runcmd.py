"""`gpuscope run -- CMD`: the exit code is CMD's, Ctrl-C reaches CMD, nothing is left running."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil


def gpuscope(*args: str, **kw):
    return subprocess.Popen([sys.executable, "-m", "gpuscope.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_exit_code_report_and_json(tmp_path):
    out = tmp_path / "r.json"
    p = gpuscope("run", "--simulate", "transfer_bound", "--json", str(out), "--",
                 sys.executable, "-c", "import time; time.sleep(7.5); raise SystemExit(3)")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    assert "exit code 3" in err and "transfer_bound" in err and "change first" in err
    report = json.loads(out.read_text())
    assert report["exit_code"] == 3 and report["simulated"] == "transfer_bound"
    assert report["verdict_share"]["0"]["transfer_bound"] == 1.0
    assert report["energy_joules"] > 0


def test_ctrl_c_is_forwarded_and_the_child_does_not_outlive_us(tmp_path):
    pidfile = tmp_path / "pid"
    child_code = ("import os, signal, sys, time\n"
                  f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
                  "signal.signal(signal.SIGINT, lambda *a: sys.exit(42))\n"
                  "time.sleep(60)\n")
    p = gpuscope("run", "--simulate", "idle_allocated", "--", sys.executable, "-c", child_code)
    t_end = time.monotonic() + 20
    while not pidfile.exists() and time.monotonic() < t_end:
        time.sleep(0.1)
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 42, err  # the child's own answer to Ctrl-C
    assert "interrupted" in err and "Traceback" not in err
    child = int(pidfile.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_missing_command_and_nothing_to_run():
    p = gpuscope("run", "--", "no-such-command-here")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 127 and "Command not found: no-such-command-here." in err
    p = gpuscope("run")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 127 and "Nothing to run" in err

