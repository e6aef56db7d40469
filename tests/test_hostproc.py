import os
import subprocess
import sys
import time

import psutil
import pytest

from gpuscope import _hostproc
from gpuscope._hostproc import HostProcessReader, HostProcInfo

# A child whose second thread spins while the main thread sleeps: one core saturated by one thread.
SPIN = """
import sys, threading, time
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
time.sleep(30)
"""
# Two threads hashing (hashlib releases the GIL on large buffers): about two cores for the process,
# yet no thread above one core.
TWO_HASHERS = """
import hashlib, threading, time
data = b"x" * 4_000_000
def hash_forever():
    while True:
        hashlib.sha256(data).digest()
for _ in range(2):
    threading.Thread(target=hash_forever, daemon=True).start()
print("ready", flush=True)
time.sleep(30)
"""
SLEEP = "import sys, time; print('ready', flush=True); time.sleep(30)"


@pytest.fixture
def child():
    procs = []

    def start(code, *args):
        p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()
        p.stdout.close()


def _counters(proc: psutil.Process) -> tuple[float, dict[int, float]]:
    """The kernel's CPU seconds for the process and for each of its threads (the counters the reader reads)."""
    with proc.oneshot():
        t = proc.cpu_times()
        threads = {th.id: th.user_time + th.system_time for th in proc.threads()}
    return t.user + t.system, threads


class Bracket:
    """Two reads of one reader, each between two reads of the kernel's counters, and the reader's own clock.

    The counters only grow, so whatever the reader saw lies between what was read just before and just after
    it: its figures are checked against bounds that hold exactly, however loaded the machine. Between the two
    reads it waits until the child has used `cpu_s` CPU seconds (a starved child just takes longer)."""

    def __init__(self, pid: int, cpu_s: float, *, per_thread: bool = False) -> None:
        self.stamps: list[float] = []
        self.reader = HostProcessReader(clock=self._clock)
        proc = psutil.Process(pid)
        b1 = _counters(proc)
        self.first = self.reader.read(pid)
        a1 = _counters(proc)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
            used = _counters(proc)
            if per_thread:
                spent = [used[1][t] - a1[1].get(t, 0.0) for t in used[1]]
                if len(spent) > 2 and sorted(spent)[-2] >= cpu_s:   # the two busiest threads both ran
                    break
            elif used[0] - a1[0] >= cpu_s:
                break
        b2 = _counters(proc)
        self.info = self.reader.read(pid)
        a2 = _counters(proc)
        self.dt = self.stamps[-1] - self.stamps[0]
        self.cores = ((b2[0] - a1[0]) / self.dt, (a2[0] - b1[0]) / self.dt)
        tids = a2[1].keys()
        self.busiest = (min(1.0, max(b2[1].get(t, 0.0) - a1[1].get(t, 0.0) for t in tids) / self.dt),
                        min(1.0, max(a2[1][t] - b1[1].get(t, 0.0) for t in tids) / self.dt))

    def _clock(self) -> float:
        self.stamps.append(time.monotonic())
        return self.stamps[-1]


def _within(value: float | None, bounds: tuple[float, float]) -> bool:
    return value is not None and bounds[0] - 1e-9 <= value <= bounds[1] + 1e-9


def test_spinning_thread_gives_cpu_and_busiest_thread_ratios(child):
    p = child(SPIN)
    b = Bracket(p.pid, 0.2)
    assert b.first is not None
    assert b.first.cpu_cores is None and b.first.thread_cpu_max_ratio is None  # first read: baseline only
    info = b.info
    assert info is not None
    # As much as the kernel says the process used between the reads (a busy machine gives the spinner less).
    assert _within(info.cpu_cores, b.cores), (info.cpu_cores, b.cores)
    # One busy thread: the busiest thread's share, which is nearly the process's (the main thread sleeps).
    assert _within(info.thread_cpu_max_ratio, b.busiest), (info.thread_cpu_max_ratio, b.busiest)
    assert info.thread_cpu_max_ratio <= 1.0 and info.thread_cpu_max_ratio > 0.5 * info.cpu_cores
    assert info.threads is not None and info.threads >= 2
    assert info.rss_bytes is not None and info.rss_bytes > 1_000_000
    assert info.name.startswith("python")
    assert info.user == psutil.Process().username()
    assert info.started_at == pytest.approx(psutil.Process(p.pid).create_time())
    assert info.started_at <= time.time()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_process_ratio_counts_all_threads_and_thread_ratio_the_busiest(child):
    p = child(TWO_HASHERS)
    b = Bracket(p.pid, 0.2, per_thread=True)
    info = b.info
    assert info is not None and info.cpu_cores is not None and info.thread_cpu_max_ratio is not None
    # Two busy threads: the process counts both, the busiest thread only one; each bound is the kernel's own.
    assert _within(info.cpu_cores, b.cores), (info.cpu_cores, b.cores)
    assert _within(info.thread_cpu_max_ratio, b.busiest), (info.thread_cpu_max_ratio, b.busiest)
    assert 0 < info.thread_cpu_max_ratio <= 1.0


def test_idle_process_has_low_ratios(child):
    p = child(SLEEP)
    reader = HostProcessReader()
    reader.read(p.pid)
    time.sleep(0.2)
    info = reader.read(p.pid)
    assert info is not None and info.cpu_cores is not None and info.cpu_cores < 0.2
    assert info.thread_cpu_max_ratio is not None and info.thread_cpu_max_ratio < 0.2


def test_process_that_exits_between_reads_gives_none(child):
    p = child(SLEEP)
    reader = HostProcessReader()
    assert reader.read(p.pid) is not None
    p.kill()
    p.wait()  # reaped: the pid is gone
    assert reader.read(p.pid) is None


def test_missing_and_invalid_pids_give_none():
    reader = HostProcessReader()
    assert reader.read(2**31 - 2) is None  # above any pid_max
    assert reader.read(-5) is None
    assert reader.read("nope") is None  # type: ignore[arg-type]


def test_cmdline_is_redacted(child):
    p = child(SLEEP, "--token", "abc123", "--lr", "0.1")
    info = HostProcessReader().read(p.pid)
    assert info is not None
    assert "abc123" not in info.cmdline
    assert "--token ***" in info.cmdline and "--lr 0.1" in info.cmdline


def test_attribution_comes_from_proc_root(child, tmp_path):
    p = child(SLEEP)
    cid = "ab" * 32
    (tmp_path / str(p.pid)).mkdir()
    (tmp_path / str(p.pid) / "cgroup").write_text(
        f"0::/kubepods.slice/kubepods-pod{'1' * 8}_{'2' * 4}_{'3' * 4}_{'4' * 4}_{'5' * 12}.slice/"
        f"cri-containerd-{cid}.scope\n")
    (tmp_path / str(p.pid) / "environ").write_bytes(
        b"KUBERNETES_SERVICE_HOST=10.0.0.1\0HOSTNAME=trainer-0\0POD_NAMESPACE=ml\0")
    info = HostProcessReader(proc_root=str(tmp_path)).read(p.pid)
    assert info is not None
    assert (info.container, info.pod_uid, info.pod, info.namespace) == (
        cid[:12], "11111111-2222-3333-4444-555555555555", "trainer-0", "ml")


def test_access_denied_fields_stay_empty_and_the_rest_is_read(child, monkeypatch):
    p = child(SLEEP, "--password", "pw")

    def denied(self, *a, **k):
        raise psutil.AccessDenied(self.pid)

    def no_tasks(task_dir):
        raise PermissionError(13, "Permission denied", task_dir)

    monkeypatch.setattr(psutil.Process, "cmdline", denied)
    monkeypatch.setattr(_hostproc, "_list_tasks", no_tasks)  # /proc/PID/task, where threads are read
    reader = HostProcessReader()
    reader.read(p.pid)
    time.sleep(0.1)
    info = reader.read(p.pid)
    assert info is not None
    assert info.cmdline == "" and info.threads is None and info.thread_cpu_max_ratio is None
    assert info.rss_bytes is not None and info.cpu_cores is not None and info.name


def test_forget_resets_the_baseline(child):
    a, b = child(SLEEP), child(SLEEP)
    reader = HostProcessReader()
    reader.read(a.pid), reader.read(b.pid)
    time.sleep(0.1)
    reader.forget({a.pid})
    info_a, info_b = reader.read(a.pid), reader.read(b.pid)
    assert info_a is not None and info_a.cpu_cores is not None  # kept: has a window
    assert info_b is not None and info_b.cpu_cores is None  # forgotten: first read again


def test_reads_closer_than_the_minimum_window_keep_the_last_ratio():
    t = [100.0]
    reader = HostProcessReader(clock=lambda: t[0])
    pid = os.getpid()
    reader.read(pid)
    t[0] += 1.0
    r1 = reader.read(pid)
    assert r1 is not None and r1.cpu_cores is not None
    r2 = reader.read(pid)  # no time has passed on the injected clock
    assert r2 is not None and (r2.cpu_cores, r2.thread_cpu_max_ratio) == (r1.cpu_cores, r1.thread_cpu_max_ratio)


def test_pid_reuse_starts_over(child, monkeypatch):
    p = child(SLEEP)
    reader = HostProcessReader()
    reader.read(p.pid)
    time.sleep(0.06)
    # The kept Process object no longer matches what holds the pid (as after pid reuse).
    monkeypatch.setattr(psutil.Process, "is_running", lambda self: False)
    info = reader.read(p.pid)
    assert info is not None and info.cpu_cores is None


def test_info_is_a_slots_dataclass():
    info = HostProcInfo(pid=1)
    assert not hasattr(info, "__dict__")
    assert (info.cpu_cores, info.cmdline, info.container) == (None, "", "")
