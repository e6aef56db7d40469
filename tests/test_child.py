"""The child under `gpuscope run` and `gpuscope trace run`: a child that floods its stdout and stderr
never passes through us (it writes into the very pipes our caller reads) while the sampler, the
verdicts and the status line go on and the exit code is the child's; and gpuscope._child with real
processes: a checked command, a forwarded signal, a tree reaped with a bounded wait."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

MiB = 1 << 20

# Writes its pid, then OUT MiB of b"o" to stdout and ERR MiB of zero bytes to stderr as fast as it can
# (1 MiB writes, five to stdout for one to stderr, so both pipes stay busy to the end), then what it wrote
# and when, and exits 7.
FLOOD = """\
import json, os, sys, time
pidfile, stamps, out_mib, err_mib = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
open(pidfile, "w").write(str(os.getpid()))
start = time.time()
o, z = b"o" * (1 << 20), b"\\0" * (1 << 20)
n_out = n_err = 0
while n_out < out_mib or n_err < err_mib:
    if n_out < out_mib:
        sys.stdout.buffer.write(o); sys.stdout.buffer.flush(); n_out += 1
    if n_err < err_mib and (n_out % 5 == 0 or n_out >= out_mib):
        sys.stderr.buffer.write(z); sys.stderr.buffer.flush(); n_err += 1
json.dump({"start": start, "end": time.time(), "out": n_out << 20, "err": n_err << 20}, open(stamps, "w"))
raise SystemExit(7)
"""


class Drain(threading.Thread):
    """Reads a pipe to its end at no more than `rate` bytes/s (a slow terminal), keeping only counts:
    the `fill` bytes, and the other bytes with how many fill bytes had come before each piece."""

    def __init__(self, fd: int, fill: bytes, rate: float) -> None:
        super().__init__(daemon=True)
        self.fd, self.fill, self.rate = fd, fill, rate
        self.total = self.filled = 0
        self.other: list[tuple[int, bytes]] = []  # (fill bytes read before it, the piece without fill)

    def run(self) -> None:
        t0 = None  # from the first byte: however long gpuscope took to start, the drain takes its time
        while chunk := os.read(self.fd, 1 << 16):
            t0 = time.monotonic() if t0 is None else t0
            rest = chunk.replace(self.fill, b"")
            if rest:
                self.other.append((self.filled + len(chunk.split(rest[:1], 1)[0]), rest))
            self.filled += len(chunk) - len(rest)
            self.total += len(chunk)
            ahead = self.total / self.rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)

    def text(self) -> str:
        return b"".join(piece for _, piece in self.other).decode(errors="replace")

    def fill_before(self, needle: str) -> int | None:
        """How many fill bytes had been read when `needle` arrived (None: it never did)."""
        at = self.text().encode().find(needle.encode())
        if at < 0:
            return None
        seen = 0
        for before, piece in self.other:
            if seen + len(piece) > at:
                return before
            seen += len(piece)
        return None


def flood(tmp_path: Path, verb: list[str], out_mib: int, err_mib: int, seconds: float) -> dict:
    """Runs `gpuscope VERB -- FLOOD` with stdout and stderr on pipes drained over about `seconds`; checks,
    while the child floods, that its stdout and stderr are those pipes themselves (nothing of ours in
    between) and follows gpuscope's memory."""
    pidfile, stamps = tmp_path / "pid", tmp_path / "stamps.json"
    p = subprocess.Popen([sys.executable, "-m", "gpuscope.cli", *verb, "--", sys.executable, "-c", FLOOD,
                          str(pidfile), str(stamps), str(out_mib), str(err_mib)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    out = Drain(p.stdout.fileno(), b"o", out_mib * MiB / seconds)
    err = Drain(p.stderr.fileno(), b"\0", err_mib * MiB / seconds)
    out.start()
    err.start()
    same_pipes, rss_max = None, 0
    try:
        me = psutil.Process(p.pid)
        while p.poll() is None:
            try:
                rss_max = max(rss_max, me.memory_info().rss)
            except psutil.Error:
                break
            if same_pipes is None and pidfile.exists() and pidfile.read_text():
                child = int(pidfile.read_text())
                same_pipes = all(os.stat(f"/proc/{child}/fd/{fd}").st_ino == os.fstat(pipe.fileno()).st_ino
                                 for fd, pipe in ((1, p.stdout), (2, p.stderr)))
            time.sleep(0.1)
        p.wait(timeout=120)
        out.join(timeout=120)
        err.join(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not out.is_alive() and not err.is_alive()
    return {"code": p.returncode, "out": out, "err": err, "same_pipes": same_pipes, "rss_max": rss_max,
            "stamps": json.loads(stamps.read_text())}


def test_run_a_child_that_floods_its_output_to_a_slow_reader(tmp_path):
    # 240 MiB drained over >= 14 s: the child spends the run blocked on full pipes, the status line
    # (every 10 s without a terminal) and the verdicts (every 5 s) must come meanwhile.
    r = flood(tmp_path, ["run", "--simulate", "healthy", "--gpus", "1", "--json", "r.json", "--no-html"],
              200, 40, 14.0)
    s, out, err = r["stamps"], r["out"], r["err"]
    assert r["code"] == 7, err.text()
    assert r["same_pipes"] is True  # the child writes into our caller's pipes: we hold none of it
    assert (out.total, out.filled) == (200 * MiB, 200 * MiB) == (s["out"], s["out"])  # all of it, and only it
    assert err.filled == s["err"] == 40 * MiB
    text = err.text()
    assert "exit code 7" in text and "Traceback" not in text
    # The live status line came while the child was still flooding stderr: the loop never waited on it.
    first_status = err.fill_before("GPU0 SM")
    assert first_status is not None and first_status < err.filled, text
    report = json.loads((tmp_path / "r.json").read_text())
    flood_end_s = s["end"] - report["started_at"]
    made_while_flooding = [seg for seg in report["timeline"] if seg["end_s"] < flood_end_s]
    assert len(made_while_flooding) >= 2, (flood_end_s, report["timeline"])  # the 5 s and the 10 s verdicts
    assert report["exit_code"] == 7 and report["duration_s"] >= s["end"] - s["start"]
    assert r["rss_max"] < 200 * MiB  # far less than what went through (figure in docs/RELIABILITY.md)
    print(f"run flood: {(s['out'] + s['err']) / MiB:.0f} MiB in {s['end'] - s['start']:.1f} s, "
          f"gpuscope rss max {r['rss_max'] / MiB:.0f} MiB, {len(made_while_flooding)} verdicts meanwhile, "
          f"first status line after {first_status / MiB:.0f} of {err.filled / MiB:.0f} MiB of stderr")


def test_trace_run_a_child_that_floods_its_output(tmp_path):
    r = flood(tmp_path, ["trace", "run", "--out", "traces", "--delay", "0.1", "--duration", "0.3"], 200, 40, 3.0)
    s, out, err = r["stamps"], r["out"], r["err"]
    assert r["code"] == 7, err.text()
    assert r["same_pipes"] is True
    assert (out.total, out.filled) == (200 * MiB, 200 * MiB) == (s["out"], s["out"])
    assert err.filled == s["err"] == 40 * MiB
    text = err.text()
    assert "gpuscope trace: exit code 7" in text and "Traceback" not in text
    assert r["rss_max"] < 200 * MiB
    print(f"trace run flood: {(s['out'] + s['err']) / MiB:.0f} MiB in {s['end'] - s['start']:.1f} s, "
          f"gpuscope rss max {r['rss_max'] / MiB:.0f} MiB")


# -- gpuscope._child with real processes ------------------------------------------------------------
from gpuscope._child import Forwarder, RunError, check, exit_code, reap, reap_all, start  # noqa: E402


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(path: Path, n: int = 1, timeout_s: float = 30.0) -> list[str]:
    """The first `n` words written to `path` once they are all there."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        words = path.read_text().split() if path.exists() else []
        if len(words) >= n:
            return words[:n]
        time.sleep(0.05)
    raise AssertionError(f"{path} never held {n} words")


# Its SIGTERM handler writes the signal into argv[1] and exits 42; it ignores SIGTERM instead with argv[2] == "ignore".
# With argv[3] = N, it starts N children of its own, each the same program (writing into argv[1].K).
# It writes its pid and its children's into argv[1].pids once they all run, then sleeps.
TREE = """\
import os, signal, subprocess, sys, time
out, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
def answer(sig, _):
    open(out, "w").write(str(sig)); sys.exit(42)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore" else answer)
kids = [subprocess.Popen([sys.executable, "-c", sys.argv[4], f"{out}.{k}", sys.argv[5 + k] if len(sys.argv) > 5 + k
                          else "answer", "0", sys.argv[4]]) for k in range(n)]
for k in range(n):
    while not os.path.exists(f"{out}.{k}.pids"):
        time.sleep(0.02)
open(out + ".pids.tmp", "w").write(" ".join(str(p) for p in [os.getpid()] + [k.pid for k in kids]))
os.rename(out + ".pids.tmp", out + ".pids")
time.sleep(60)
"""


def tree(tmp_path: Path, mode: str = "answer", kids: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], list[int]]:
    out = tmp_path / "sig"
    child = start([sys.executable, "-c", TREE, str(out), mode, str(len(kids)), TREE, *kids])
    return child, [int(w) for w in wait_for(Path(f"{out}.pids"), 1 + len(kids))]


def test_check_and_start_refuse_what_cannot_run_with_a_shells_exit_code(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\necho hi\n")  # not executable
    cases = [([], 2, "Nothing to run"), ([" "], 2, "an empty string"), (["no-such-command-here"], 127, "not found"),
             ([str(tmp_path / "nope")], 127, "does not exist"), ([str(tmp_path)], 126, "a directory")]
    for cmd, code, needle in cases:
        try:
            check(cmd)
        except RunError as e:
            assert (e.exit_code, e.code) == (code, code) and needle in str(e), (cmd, e)
        else:
            raise AssertionError(f"{cmd} was not refused")
    check([str(script)])  # it exists: only starting it can tell
    try:
        start([str(script)])
    except RunError as e:
        assert e.exit_code == 126 and "permission denied" in str(e)
    else:
        raise AssertionError("a file without x permission was started")
    assert [exit_code(rc) for rc in (0, 3, -signal.SIGTERM, -signal.SIGKILL, None)] == [0, 3, 143, 137, 1]
    from gpuscope.runcmd import RunError as RunError_of_runcmd

    assert RunError_of_runcmd is RunError  # `except runcmd.RunError` still catches what _child raises


def test_a_signal_to_us_is_forwarded_to_the_child_and_its_children_past_one_gone(tmp_path):
    gone_early = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    handle = psutil.Process(gone_early.pid)
    gone_early.kill()
    gone_early.wait()  # its handle now raises NoSuchProcess: the others must still get the signal
    forward = Forwarder(lambda c: [handle, *psutil.Process(c.pid).children(recursive=True)])
    forward.install()
    try:
        child, (pid, kid) = tree(tmp_path, kids=("answer",))
        forward.child = child
        os.kill(os.getpid(), signal.SIGTERM)  # to us alone, as `kill PID` would
        assert exit_code(child.wait(timeout=30)) == 42 and forward.interrupts == 1
        assert wait_for(tmp_path / "sig") == wait_for(tmp_path / "sig.0") == [str(int(signal.SIGTERM))]
    finally:
        forward.restore()
        if forward.child is not None:
            reap(forward.child, grace_s=1.0)
            reap_all([psutil.Process(p) for p in (kid,) if not gone(p)], grace_s=1.0)


def test_a_second_signal_terminates_and_a_child_that_stays_is_killed_after_the_grace(tmp_path):
    forward = Forwarder(lambda c: [])
    forward.install()
    try:
        child, _ = tree(tmp_path, mode="ignore")
        forward.child = child
        os.kill(os.getpid(), signal.SIGTERM)  # forwarded, ignored
        os.kill(os.getpid(), signal.SIGTERM)  # the second: terminate, ignored too
        assert forward.interrupts == 2 and child.poll() is None
        first = time.monotonic()
        while child.poll() is None and time.monotonic() - first < 30:
            forward.kill_if_overdue(0.5)  # as the supervising loop calls it
            time.sleep(0.05)
        assert child.returncode == -signal.SIGKILL and time.monotonic() - first >= 0.5
    finally:
        forward.restore()
        if forward.child is not None:
            reap(forward.child, grace_s=1.0)


def test_reap_kills_a_child_that_ignores_sigterm_once_the_bounded_wait_is_over(tmp_path):
    child, _ = tree(tmp_path, mode="ignore")
    t0 = time.monotonic()
    reap(child, grace_s=1.0)
    waited = time.monotonic() - t0
    assert child.returncode == -signal.SIGKILL and waited >= 1.0
    (tmp_path / "polite").mkdir()
    polite, _ = tree(tmp_path / "polite")
    reap(polite, grace_s=30.0)
    assert exit_code(polite.returncode) == 42  # it answered SIGTERM: no SIGKILL was needed
    print(f"reap: SIGKILL after {waited:.2f} s of a 1 s grace")


def test_reap_all_ends_the_grandchildren_left_behind_even_one_that_ignores_sigterm(tmp_path):
    child, (pid, *kids) = tree(tmp_path, kids=("answer", "ignore", "answer"))
    descendants = psutil.Process(pid).children(recursive=True)  # as trace run lists them before the child ends
    assert sorted(p.pid for p in descendants) == sorted(kids)
    os.kill(kids[2], signal.SIGKILL)  # one already gone when the clean-up comes
    reap(child, grace_s=5.0)  # the child goes; its children are orphans now, not ours to wait for
    assert exit_code(child.returncode) == 42 and not any(gone(k) for k in kids[:2])
    t0 = time.monotonic()
    reap_all(descendants, grace_s=1.0)
    waited = time.monotonic() - t0
    assert all(gone(k) for k in kids), [(k, gone(k)) for k in kids]
    assert wait_for(tmp_path / "sig.0") == [str(int(signal.SIGTERM))]  # the polite one was asked first
    assert waited >= 1.0  # the one that ignored SIGTERM had its whole grace before SIGKILL
    print(f"reap_all: 3 orphans ended in {waited:.2f} s (grace 1 s)")
