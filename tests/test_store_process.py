"""The store across processes: one writer per directory (an OS lock), readers in other processes
while the writer writes, and a writer killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from test_store_support import SEC, child_env, snapshot

from gpuscope.store import Store, StoreLocked

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX locks and signals")


def spawn(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-u", "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())


def expect_line(p: subprocess.Popen[str], prefix: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    assert p.stdout is not None
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.strip()
    p.kill()
    raise AssertionError(f"child never printed {prefix!r}; stderr: {p.stderr.read() if p.stderr else ''}")


def test_a_second_writer_gets_storelocked_naming_the_holder(tmp_path: Path) -> None:
    with Store(tmp_path):
        with pytest.raises(StoreLocked) as e:
            Store(tmp_path)
        msg = str(e.value)
        assert f"process {os.getpid()}" in msg and msg.endswith(".") and "\n" not in msg
        Store(tmp_path, readonly=True).close()  # readers are welcome
    Store(tmp_path).close()  # released on close


def test_the_lock_is_released_when_the_writer_is_killed(tmp_path: Path) -> None:
    p = spawn("""
        import sys, time
        from gpuscope.store import Store
        s = Store(sys.argv[1])
        print("ready", flush=True)
        time.sleep(60)
    """, str(tmp_path))
    try:
        expect_line(p, "ready")
        with pytest.raises(StoreLocked, match=f"process {p.pid};"):
            Store(tmp_path)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    Store(tmp_path).close()


def test_a_reader_in_another_process_sees_flushed_data_and_never_blocks_the_writer(tmp_path: Path) -> None:
    writer = Store(tmp_path, flush_interval=0.1)
    writer.append(snapshot(0))
    writer.flush()
    reader = spawn("""
        import json, sys, time
        from gpuscope.store import Store
        T0 = int(sys.argv[2])
        r = Store(sys.argv[1], readonly=True)
        print("ready", flush=True)
        t_end = time.monotonic() + 4.0
        while time.monotonic() < t_end:
            res = r.query("gpu_power_watts", T0, T0 + 600 * 10**9, 0.01, agg="count", labels={"gpu": "0"})
            snap = r.latest()
            print(json.dumps({"count": int(res[0].values.sum()), "latest": snap.time_ns}), flush=True)
            time.sleep(0.02)
        print("done", flush=True)
    """, str(tmp_path), str(snapshot(0).time_ns))
    try:
        expect_line(reader, "ready")
        k = 1
        t_end = time.monotonic() + 3.0
        while time.monotonic() < t_end:  # 200 Hz of snapshots while the reader queries
            writer.append(snapshot(k, step_ns=5_000_000))
            k += 1
            time.sleep(0.005)
        # append never waits on a flush: with the flush thread held inside one, appends still return. (Timing
        # each append instead measured how long a loaded machine left the thread waiting.)
        w = writer._writer
        real_slice = w._flush_slice
        inside, release = threading.Event(), threading.Event()

        def held_slice(items):
            inside.set()
            release.wait(30)
            real_slice(items)

        w._flush_slice = held_slice
        try:
            writer.append(snapshot(k, step_ns=5_000_000))
            k += 1
            assert inside.wait(30), "the flush thread never flushed"
            returned = threading.Event()
            more = [snapshot(k + j, step_ns=5_000_000) for j in range(5)]
            k += 5
            t = threading.Thread(target=lambda: ([writer.append(x) for x in more], returned.set()), daemon=True)
            t.start()
            assert returned.wait(30), "append waited on the flush in progress"
        finally:
            release.set()
            w._flush_slice = real_slice
        writer.flush()
        flushes = writer.stats()["writer"]["flushes"]
        out, err = reader.communicate(timeout=30)
        rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    finally:
        if reader.poll() is None:
            reader.kill()
        writer.close()
    assert reader.returncode == 0, err
    counts = [r["count"] for r in rows]
    assert counts == sorted(counts) and counts[-1] >= k * 0.8 and len(set(counts)) > 5, counts
    assert flushes >= 10


def test_sigkill_loses_at_most_the_last_flush_interval_and_the_store_reopens(tmp_path: Path) -> None:
    interval = 0.25
    p = spawn("""
        import sys, time
        from gpuscope import GpuIdentity, GpuRecord, Snapshot
        from gpuscope.store import Store
        s = Store(sys.argv[1], flush_interval=float(sys.argv[2]))
        ident = GpuIdentity(index=0, uuid="GPU-crash", name="Crash H200")
        k = 0
        while True:
            t = time.time_ns()
            s.append(Snapshot(t, [GpuRecord(ident, t, {"gpu_power_watts": float(k)})], [], None, []))
            print("appended", k, t, flush=True)
            k += 1
            if k == 50:
                s.flush()
                print("flushed", k, flush=True)
            time.sleep(0.01)
    """, str(tmp_path), str(interval))
    appended: list[tuple[int, int]] = []
    try:
        assert p.stdout is not None
        expect_line(p, "flushed")
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            parts = p.stdout.readline().split()
            if parts and parts[0] == "appended":
                appended.append((int(parts[1]), int(parts[2])))
        kill_ns = time.time_ns()
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait()
    assert p.returncode == -signal.SIGKILL
    with Store(tmp_path) as s:  # opens cleanly as a writer: the lock died with the process
        r = s.query("gpu_power_watts", appended[0][1] - 10 * SEC, kill_ns + SEC, 0.001, agg="last")
        stored = r[0].values.astype(int).tolist()
        assert stored == list(range(len(stored)))  # a prefix: nothing missing before the end
        assert len(stored) >= 50  # everything before the explicit flush
        slack_ns = int((interval + 0.5) * SEC)  # one interval, plus a flush that was under way
        must = [k for k, t in appended if t < kill_ns - slack_ns]
        assert stored[-1] >= must[-1], (len(stored), must[-1])
        s.append(snapshot(0, t0=time.time_ns()))  # and it keeps working
        s.flush()
        assert s.stats()["series"] >= 2
