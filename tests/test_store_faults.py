"""The store under bad text, failing writes, clock jumps and a lost GPU: the writer never stops silently, what
it cannot write is repaired or dropped and counted, and its health says so while it lasts.

What each test measures is what the store recorded (counts, stamps, its own health), never how long the
machine took."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_store_process import expect_line, spawn
from test_store_support import SEC, T0, child_env, identity, snapshot

from gpuscope import Event, GpuRecord, Snapshot
from gpuscope.catalog import series_key
from gpuscope.store import Store


def encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def count(store: Store, metric: str = "gpu_power_watts", gpu: str = "0", lo: int = T0 - 10 * SEC,
          hi: int = T0 + 7200 * SEC) -> int:
    r = store.query(metric, lo, hi, (hi - lo) / 1e9, agg="count", labels={"gpu": gpu})
    return int(r[0].values.sum()) if r else 0


# -- bad text ---------------------------------------------------------------------------------------------
def test_surrogates_in_a_process_name_and_an_event_are_repaired_and_every_flush_goes_on(tmp_path: Path,
                                                                                         caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="gpuscope.store"), Store(tmp_path, flush_interval=3600) as s:
        snap = snapshot(0)
        snap.processes[0].name = "ev\udcffil"  # psutil's surrogate escape of the byte 0xff
        snap.events.append(Event(T0, "guard", None, "bad \ud800 text", {"labels": {"route": "/\udcfe"}, 7: "x"}))
        s.append(snap)
        s.flush()
        for k in range(1, 6):
            s.append(snapshot(k))
            s.flush()
        h = s.health()
        assert h["healthy"] and h["write_errors"] == 0 and h["flush_thread_alive"], h
        assert h["records_dropped"] == 0
        assert h["records_repaired"] == 4 + 1  # the process's four series (memory, SM, CPU, threads), one event
        assert count(s) == 6
        names = {r["labels"]["process"] for r in s.series("gpu_process_memory_used_bytes")}
        assert names == {"ev\\xffil", "python"}
        (ev,) = s.events(T0, T0 + SEC, kind="guard")
        assert ev.message == "bad \\ud800 text" and ev.data == {"labels": {"route": "/\\xfe"}, "7": "x"}
    assert not [r for r in caplog.records if r.exc_info]  # no traceback
    with Store(tmp_path, readonly=True) as r:
        assert all(encodable(str(x)) for x in r.series())
        assert count(r) == 6


def test_an_event_that_cannot_be_stored_is_dropped_and_counted_and_the_rest_of_the_flush_is_kept(
        tmp_path: Path) -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop  # json.dumps cannot write a circular structure
    with Store(tmp_path, flush_interval=3600) as s:
        s.append(snapshot(0, events=[Event(T0, "xid", "0", "fine", {}), Event(T0, "xid", "0", "circular", loop),
                                     Event(2**70, "xid", "0", "stamp out of range", {})]))
        s.flush()
        h = s.health()
        assert h["healthy"] and h["records_dropped"] == 2 and h["write_errors"] == 0
        assert [e.message for e in s.events(T0, T0 + SEC)] == ["fine"]
        assert count(s) == 1


def test_close_never_raises_and_says_in_one_line_what_was_not_written(tmp_path: Path, monkeypatch: Any,
                                                                      caplog: Any) -> None:
    from gpuscope.store._writer import Writer

    s = Store(tmp_path, flush_interval=3600)
    s.append(snapshot(0))
    s.flush()

    def broken(self: Writer, *a: Any) -> None:
        raise RuntimeError("a bug in the writer")

    monkeypatch.setattr(Writer, "_meta", broken)
    s.append(snapshot(1))
    with caplog.at_level(logging.WARNING, logger="gpuscope.store"):
        s.close()  # no exception
    lines = [r.getMessage() for r in caplog.records if r.name == "gpuscope.store"]
    assert not [r for r in caplog.records if r.exc_info]
    assert any("closed" in m and "not written" in m and "a bug in the writer" in m for m in lines), lines
    monkeypatch.undo()
    with Store(tmp_path, readonly=True) as r:
        assert count(r) == 1


# -- clock jumps ------------------------------------------------------------------------------------------
class Clocks:
    """The clocks a live store sees, moved by the test: monotonic seconds, and a wall clock that can jump."""

    def __init__(self, wall_ns: int = T0) -> None:
        self.mono, self.wall = 1000.0, wall_ns

    def monotonic(self) -> float:
        return self.mono

    def wall_ns(self) -> int:
        return self.wall

    def tick(self, s: float) -> None:
        self.mono += s
        self.wall += round(s * SEC)


def feed(store: Store, clocks: Clocks, seconds: float, appended: dict[int, float], hz: int = 2) -> None:
    """A sampler at `hz` stamping with the wall clock, the store flushing once a second (both by the clocks)."""
    for i in range(int(seconds * hz)):
        t = clocks.wall_ns()
        k = float(len(appended))
        store.append(Snapshot(t, [GpuRecord(identity(0), t, {"gpu_power_watts": k})], [], None, [], None, "h"))
        appended[t] = k
        clocks.tick(1 / hz)
        if (i + 1) % hz == 0:
            store.flush()


def stored(store: Store, lo: int, hi: int) -> dict[int, float]:
    """Every stored sample of the series in [lo, hi), stamp -> value (raw tier; each stamp its own bucket)."""
    out: dict[int, float] = {}
    for a in range(lo, hi, 40_000 * SEC // 2):  # within the points a query may ask for
        b = min(hi, a + 40_000 * SEC // 2)
        for r in store.query("gpu_power_watts", a, b, 0.5, agg="last", labels={"gpu": "0"}):
            (c,) = store.query("gpu_power_watts", a, b, 0.5, agg="count", labels={"gpu": "0"})
            assert set(c.values.tolist()) <= {1.0}, "two samples in one half second"
            assert (np.diff(r.timestamps_ns) > 0).all()
            out.update(zip(r.timestamps_ns.tolist(), r.values.tolist(), strict=True))
    return out


def counts_per_tier(store: Store, lo: int, hi: int) -> list[int]:
    """Samples counted through raw, 1 s, 1 min and 1 h steps (each served by its own tier where it holds data)."""
    out = []
    for step in (0.5, 1.0, 60.0, 3600.0):
        rs = store.query("gpu_power_watts", lo, hi, max(step, (hi - lo) / SEC / 90_000), agg="count",
                         labels={"gpu": "0"})
        out.append(int(sum(r.values.sum() for r in rs)))
    return out


def test_a_clock_that_steps_back_an_hour_loses_no_sample_and_keeps_the_order(tmp_path: Path) -> None:
    clocks = Clocks()
    appended: dict[int, float] = {}
    with Store(tmp_path, flush_interval=3600, clock=clocks.monotonic, wall_clock_ns=clocks.wall_ns) as s:
        feed(s, clocks, 25 * 60, appended)  # 25 minutes: two blocks sealed
        clocks.wall -= 3600 * SEC  # NTP steps the clock back an hour
        feed(s, clocks, 25 * 60, appended)  # stamps before everything sealed
        h = s.health()
        assert h["healthy"] and h["records_dropped"] == 0 and h["late_samples"] == 25 * 60 * 2
    lo, hi = T0 - 3600 * SEC, T0 + 3600 * SEC
    with Store(tmp_path, readonly=True) as r:
        got = stored(r, lo, hi)
        assert got == appended  # every sample, once, at its stamp, with its value
        assert counts_per_tier(r, lo, hi) == [len(appended)] * 4  # and in every rollup tier


def test_late_samples_survive_kill_9(tmp_path: Path) -> None:
    p = spawn("""
        import sys, time
        from gpuscope import GpuIdentity, GpuRecord, Snapshot
        from gpuscope.store import Store
        T0, SEC = int(sys.argv[2]), 10**9
        s = Store(sys.argv[1], flush_interval=3600)
        ident = GpuIdentity(index=0, uuid="GPU-test-0", name="Test H200")
        def put(t, k):
            s.append(Snapshot(t, [GpuRecord(ident, t, {"gpu_power_watts": float(k)})], [], None, [], None, "h"))
        for k in range(1300):  # 21 minutes and 40 s at 1 Hz: two blocks sealed
            put(T0 + k * SEC, k)
            if k % 10 == 9:
                s.flush()
        for k in range(300):  # the clock stepped back an hour: 5 minutes of late samples, staged, not sealed
            put(T0 - 3600 * SEC + k * SEC, 1300 + k)
            if k % 10 == 9:
                s.flush()
        print("late", s.health()["late_samples_unwritten"], flush=True)
        time.sleep(60)
    """, str(tmp_path), str(T0))
    try:
        line = expect_line(p, "late")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert line == "late 300"  # still waiting for their block to complete when killed
    with Store(tmp_path) as s:  # the late rows come back from disk and are written at the first flush
        s.flush()
        assert counts_per_tier(s, T0 - 3600 * SEC, T0 + 3600 * SEC) == [1600] * 4


def test_a_clock_that_jumps_a_day_ahead_and_back_loses_nothing_and_retention_keeps_the_history(
        tmp_path: Path, caplog: Any) -> None:
    clocks = Clocks()
    appended: dict[int, float] = {}
    with caplog.at_level(logging.WARNING, logger="gpuscope.store"), \
            Store(tmp_path, flush_interval=3600, clock=clocks.monotonic, wall_clock_ns=clocks.wall_ns) as s:
        feed(s, clocks, 15 * 60, appended)
        clocks.wall += 86_400 * SEC  # a bad time source: a day ahead, for 15 minutes
        feed(s, clocks, 15 * 60, appended)
        clocks.wall -= 86_400 * SEC  # corrected
        feed(s, clocks, 15 * 60, appended)
        h = s.health()
        assert h["healthy"] and h["records_dropped"] == 0 and h["late_samples"] == 15 * 60 * 2
        raw = s.stats()["tiers"]["raw"]
    assert raw["oldest_ns"] == T0  # retention (raw: 1 day) measured from the store's clock, not the jumped stamps
    assert any("ahead of the store's clock" in m for m in caplog.messages)
    with Store(tmp_path, readonly=True) as r:
        got = stored(r, T0 - SEC, T0 + 3600 * SEC)
        got.update(stored(r, T0 + 86_400 * SEC, T0 + 90_000 * SEC))
        assert got == appended
        assert counts_per_tier(r, T0 - SEC, T0 + 90_000 * SEC) == [len(appended)] * 4


# -- a GPU lost mid-run -------------------------------------------------------------------------------------
def test_a_gpu_that_falls_off_the_bus_mid_run_loses_nothing_the_sampler_produced(tmp_path: Path) -> None:
    from host_fakes import FakeHostReader

    from gpuscope import Sampler, SamplerConfig
    from gpuscope.testing import lost_gpu

    nvml = lost_gpu()
    produced: dict[tuple[str, str], int] = {}
    with Sampler(SamplerConfig(interval=0.01, collect_host=False, events=False), nvml=nvml,
                 host_reader=FakeHostReader()) as sampler, Store(tmp_path, flush_interval=3600) as s:
        for k in range(60):
            if k == 30:
                nvml.gpus[1].lost = True  # falls off the bus between two ticks
            snap = sampler.sample_once()
            s.append(snap)
            for g in snap.gpus:
                for key in g.values:
                    produced[(g.identity.label, key)] = produced.get((g.identity.label, key), 0) + 1
            if k % 10 == 9:
                s.flush()
        assert s.health()["healthy"] and s.health()["write_errors"] == 0
        lo, hi = snap.time_ns - 3600 * SEC, snap.time_ns + SEC
        got = {}
        for r in s.series():
            lab = r["labels"]
            if "gpu" in lab and "pid" not in lab:
                key = (lab["gpu"], series_key(r["metric"], **{k: v for k, v in lab.items() if k not in ("gpu", "uuid")}))
                res = s.query(r["metric"], lo, hi, 3601.0, agg="count", labels=lab)
                got[key] = int(sum(x.values.sum() for x in res))
        lost = [e for e in s.events(lo, hi, kind="gpu_lost")]
        (healthy,) = s.query("gpu_healthy", lo, hi, 3601.0, agg="min", labels={"gpu": "1"})
    assert got == produced  # every value of both GPUs, before and after the loss, is stored
    assert produced[("1", "gpu_power_watts")] == 30 and produced[("0", "gpu_power_watts")] == 60
    assert len(lost) == 1 and lost[0].gpu == "1" and healthy.values.tolist() == [0.0]


# -- a full disk, and back -----------------------------------------------------------------------------------
# The disk fills as RLIMIT_FSIZE 0 in the writer's own process: no file of it may grow, whatever the machine,
# without root, a loop device or a tmpfs (SQLite gets EFBIG where a full disk gives ENOSPC: both fail the
# write, and the store must treat both alike). Python ignores SIGXFSZ, so the write fails instead of killing it.
DISK_FULL_CHILD = """
    import json, resource, sys, time
    from gpuscope import GpuIdentity, GpuRecord, Snapshot
    from gpuscope.store import Store
    s = Store(sys.argv[1], flush_interval=0.2)
    ident = GpuIdentity(index=0, uuid="GPU-test-0", name="Test H200")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    k = 0
    def run(seconds):
        global k
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            t = time.time_ns()
            s.append(Snapshot(t, [GpuRecord(ident, t, {"gpu_power_watts": float(k)})], [], None, [], None, "h"))
            k += 1
            time.sleep(0.01)
    def report(tag):
        print(tag, json.dumps({"appended": k, **s.health()}), flush=True)
    run(0.5)
    s.flush()
    report("before")
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))  # the disk is full
    run(3.0)
    report("full")
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space again
    run(1.0)
    s.flush()  # however busy the machine: one flush has run since
    report("after")
    s.close()
    report("closed")
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="RLIMIT_FSIZE is POSIX")
def test_a_full_disk_loses_nothing_says_so_while_it_lasts_and_one_line_says_it_recovered(tmp_path: Path) -> None:
    p = spawn(DISK_FULL_CHILD, str(tmp_path))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    rep = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if " {" in line}
    before, full, after = rep["before"], rep["full"], rep["after"]
    assert before["healthy"] and before["write_errors"] == 0
    # while the disk is full: unhealthy, with the error and how long since the last good flush
    assert not full["healthy"] and full["write_errors"] >= 3, full
    assert "cannot write" in full["reason"] and full["last_error"] and full["last_error_at"]
    assert full["last_flush_age_seconds"] >= 2.0  # 3 s of full disk, flushes every 0.2 s: nothing got through
    assert after["healthy"] and after["failing_for_seconds"] is None
    assert after["samples_dropped"] == 0 and after["records_dropped"] == 0
    # one line when it started, one when it recovered (how long it was down), no traceback
    lines = [x for x in err.splitlines() if "gpuscope.store" in x or "store" in x]
    started = [x for x in lines if "cannot write" in x]
    recovered = [x for x in lines if re.search(r"recovered: .* \([1-9][0-9]* failed meanwhile", x)]
    assert len(started) == 1 and len(recovered) == 1, err
    down = float(re.search(r"succeeded ([0-9.]+) s after", recovered[0]).group(1))
    assert down >= full["last_flush_age_seconds"] - 0.05  # the line says it to 0.1 s (3.0 for an age of 3.001)
    assert "Traceback" not in err
    # what was lost: nothing (the 3 s of samples waited in memory and were written on recovery)
    with Store(tmp_path, readonly=True) as r:
        (res,) = r.query("gpu_power_watts", 0, 2**62, 10**9, agg="count", labels={"gpu": "0"})
        (last,) = r.query("gpu_power_watts", 0, 2**62, 10**9, agg="max", labels={"gpu": "0"})
    assert int(res.values.sum()) == rep["closed"]["appended"] and last.values.max() == rep["closed"]["appended"] - 1


# -- a store file made read-only, or replaced, during a run ------------------------------------------------
READ_ONLY_CHILD = """
    import json, os, sys, time
    from gpuscope import GpuIdentity, GpuRecord, Snapshot
    from gpuscope.store import Store, StoreError
    if os.geteuid() == 0:  # root writes any file: run as nobody, as the agent's user would be
        import encodings.ascii, fcntl, gpuscope.store._export  # noqa: F401 - imported while they can be read
        os.setgid(65534)
        os.setuid(65534)
    d = os.path.join(sys.argv[1], "store")
    s = Store(d, flush_interval=0.2)
    ident = GpuIdentity(index=0, uuid="GPU-test-0", name="Test H200")
    k = 0
    def run(seconds):
        global k
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            t = time.time_ns()
            s.append(Snapshot(t, [GpuRecord(ident, t, {"gpu_power_watts": float(k)})], [], None, [], None, "h"))
            k += 1
            time.sleep(0.01)
    run(0.5)
    s.flush()
    print("ready", flush=True)
    sys.stdin.readline()  # the test makes the files read-only
    run(1.5)
    s.flush()  # however busy the machine: one flush has run since
    print("during", json.dumps({"appended": k, **s.health()}), flush=True)
    s.close()
    try:
        Store(d)
        print("reopened", flush=True)
    except StoreError as e:
        print("refused", str(e), flush=True)
"""


def _shared_tmp() -> Path:
    """A directory the child can use after it drops to nobody (pytest's own are private to root)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="gpuscope-ro-"))
    d.chmod(0o777)
    return d


def test_store_files_made_read_only_during_a_run_lose_nothing_and_a_restart_says_why_it_cannot_write() -> None:
    base = _shared_tmp()
    try:
        p = subprocess.Popen([sys.executable, "-u", "-c", textwrap.dedent(READ_ONLY_CHILD), str(base)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=child_env())
        expect_line(p, "ready")
        for f in (base / "store").iterdir():
            if f.name != "writer.lock":
                f.chmod(0o444)
        out, err = p.communicate("go\n", timeout=60)
        assert p.returncode == 0 and "Traceback" not in err, err
        during = json.loads(next(x for x in out.splitlines() if x.startswith("during ")).split(" ", 1)[1])
        # POSIX checks permissions when a file is opened: the writer's open files keep taking its writes
        assert during["healthy"] and during["write_errors"] == 0, during
        (refused,) = [x for x in out.splitlines() if x.startswith(("refused", "reopened"))]
        assert refused.startswith("refused") and "cannot be written" in refused and "only read it" in refused
        with Store(base / "store", readonly=True) as r:  # readers still read it all
            (res,) = r.query("gpu_power_watts", 0, 2**62, 10**9, agg="count", labels={"gpu": "0"})
        assert int(res.values.sum()) == during["appended"]  # nothing lost
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_store_file_replaced_during_a_run_makes_the_store_unhealthy_and_says_why(tmp_path: Path,
                                                                                   caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="gpuscope.store"):
        s = Store(tmp_path, flush_interval=3600)
        s.append(snapshot(0))
        s.flush()
        db = tmp_path / "gpuscope.db"
        shutil.copy(db, tmp_path / "copy.db")  # a restore from a backup, say, over the open store
        os.replace(tmp_path / "copy.db", db)
        for k in range(1, 4):
            s.append(snapshot(k))
            s.flush()
        h = s.health()
        assert not h["healthy"] and "removed or replaced" in h["reason"] and h["write_errors"] == 3
        s.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "gpuscope.store"]
    assert len([x for x in lines if "cannot write" in x]) == 1 and not [r for r in caplog.records if r.exc_info]
    assert any(x.startswith("store closed while it could not write") for x in lines)


def test_an_export_after_a_clock_step_back_is_in_time_order(tmp_path: Path) -> None:
    clocks = Clocks()
    appended: dict[int, float] = {}
    with Store(tmp_path, flush_interval=3600, clock=clocks.monotonic, wall_clock_ns=clocks.wall_ns) as s:
        feed(s, clocks, 12 * 60, appended)
        clocks.wall -= 300 * SEC + SEC // 4  # back into the sealed first block (between its stamps)
        feed(s, clocks, 60, appended, hz=1)
        s.flush()
        n = s.export(T0 - 3600 * SEC, T0 + 3600 * SEC, tmp_path / "out.jsonl", fmt="jsonl", metrics=["gpu_power_watts"])
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    stamps = [r["time_ns"] for r in rows]
    assert n == len(rows) == len(appended) and stamps == sorted(stamps) and set(stamps) == set(appended)


def test_a_long_flush_under_way_is_busy_not_unhealthy_until_it_is_stuck(tmp_path: Path) -> None:
    """Sealing a block of many series can take seconds on a loaded node: /readyz must not flap for it,
    yet a flush that never ends (a lock held elsewhere) is reported, and the longest flush is kept."""
    import threading

    from gpuscope.store import _writer

    clocks = Clocks()
    entered, release = threading.Event(), threading.Event()
    # Its own flush thread (every second) enters the slow flush; health is read on the test's clocks.
    with Store(tmp_path, flush_interval=1, clock=clocks.monotonic, wall_clock_ns=clocks.wall_ns) as s:
        w = s._writer
        assert w is not None
        feed(s, clocks, 5, {})
        real = w._flush_slice

        def slow(items: list) -> None:  # type: ignore[type-arg]
            entered.set()
            release.wait(60)
            real(items)

        w._flush_slice = slow  # type: ignore[method-assign]
        try:
            assert entered.wait(30)
            clocks.tick(30)  # 30 s into the flush: busy
            h = s.health()
            assert h["healthy"] and h["flush_running_seconds"] == 30 and h["last_flush_age_seconds"] >= 30
            clocks.tick(_writer.BUSY_MAX_S)  # past the bound: stuck
            h = s.health()
            assert not h["healthy"] and "no flush of the store has completed" in h["reason"]
        finally:
            release.set()
        w._flush_slice = real  # type: ignore[method-assign]
        s.flush()  # waits for the slow one (the flush lock), then flushes
        h = s.health()
        assert h["healthy"] and h["flush_running_seconds"] is None
        assert h["longest_flush_seconds"] >= 30 + _writer.BUSY_MAX_S
