"""Verdicts over a past range from the store: `gpuscope diagnose --since`, the agent's ?start=&end=."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from gpuscope import Sampler
from gpuscope.diagnose.history import NoData, diagnose_range
from gpuscope.store import Store

HOUR = 3600


def _fill(path, end_s: float) -> None:
    """An hour at 1 Hz on GPU 0: 30 min on the tensor cores (thermally throttled in its last 10 min),
    then 30 min holding 20 GiB with nothing running."""
    with Sampler(simulate="healthy", gpus=1) as s, Store(path) as store:
        store.append(s.sample_once())  # the node's identity (memory size, max clock)
        t = np.arange(end_s - HOUR, end_s - 5, 1.0)
        busy = t < end_s - HOUR / 2
        hot = busy & (t >= end_s - HOUR / 2 - 600)
        g = {"gpu": "0"}
        cols = [
            ("gpu_sm_active_ratio", g, np.where(busy, 0.95, 0.0)),
            ("gpu_tensor_active_ratio", g, np.where(busy, 0.9, 0.0)),
            ("gpu_dram_active_ratio", g, np.where(busy, 0.2, 0.0)),
            ("gpu_utilization_ratio", g, np.where(busy, 1.0, 0.0)),
            ("gpu_memory_used_bytes", g, np.full(len(t), 20.0 * 2**30)),
            ("gpu_sm_clock_hertz", g, np.where(hot, 1.2e9, 1.98e9)),
            ("gpu_throttle_seconds_total", {"gpu": "0", "reason": "sw_thermal"}, np.cumsum(hot.astype(float))),
            ("process_thread_cpu_max_ratio", {"gpu": "0", "pid": "77", "process": "python"}, np.full(len(t), 0.4)),
        ]
        store.append_batch([(m, lab) for m, lab, _ in cols], (t * 1e9).astype(np.int64),
                           np.column_stack([v for _, _, v in cols]))
        store.flush()


def test_an_hour_from_the_store_gives_spans_and_shares(tmp_path):
    now = time.time()
    _fill(tmp_path, now)
    with Store(tmp_path, readonly=True) as store:
        r = diagnose_range(store, int((now - HOUR) * 1e9), int(now * 1e9))
    primary = [(s.kind, round((s.end_ns - s.start_ns) / 1e9 / 60)) for s in r.spans if s.primary and s.gpu == "0"]
    kinds = [k for k, _ in primary]
    assert kinds[0] == "compute_bound" and kinds[-1] == "idle_allocated", primary
    share = r.share()["0"]
    assert share["compute_bound"] == pytest.approx(0.5, abs=0.05)
    assert share["idle_allocated"] == pytest.approx(0.5, abs=0.05)
    side = [s for s in r.spans if not s.primary and s.kind == "throttled"]
    assert len(side) == 1 and "sw_thermal" in side[0].summary
    # the throttled span lies in minutes 20..30 of the hour
    a, b = (side[0].start_ns / 1e9 - (now - HOUR)) / 60, (side[0].end_ns / 1e9 - (now - HOUR)) / 60
    assert 18 <= a <= 22 and 28 <= b <= 32, (a, b)


def test_an_empty_range_is_one_sentence(tmp_path):
    _fill(tmp_path, time.time())
    with Store(tmp_path, readonly=True) as store:
        with pytest.raises(NoData, match="no GPU samples"):
            diagnose_range(store, int((time.time() - 10 * HOUR) * 1e9), int((time.time() - 9 * HOUR) * 1e9))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "gpuscope.cli", "diagnose", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_since_reads_the_store(tmp_path):
    _fill(tmp_path / "store", time.time())
    p = _cli("--since", "1h", "--data-dir", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert {"compute_bound", "idle_allocated"} <= set(data["share"]["0"])
    assert any(s["kind"] == "throttled" for s in data["spans"])
    p = _cli("--since", "1h", "--data-dir", str(tmp_path))
    assert p.returncode == 0 and "compute_bound" in p.stdout and "idle_allocated" in p.stdout


@pytest.mark.parametrize("args, code, words", [
    (["--since", "yesterday-ish"], 2, "--since"),
    (["--start=-1h", "--end=-2h"], 2, "after"),
    (["--since", "1h", "--simulate", "healthy"], 2, "history"),
    (["--since", "1h", "--data-dir", "/nonexistent/dir"], 1, "No gpuscope store"),
    (["--since", "1h", "--bogus"], 2, "see 'gpuscope diagnose --help'"),
])
def test_cli_range_bad_input(args, code, words):
    p = _cli(*args)
    assert p.returncode == code, (p.returncode, p.stderr)
    assert words in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_cli_range_with_no_data(tmp_path):
    _fill(tmp_path / "store", time.time())
    p = _cli("--start=-10h", "--end=-9h", "--data-dir", str(tmp_path))
    assert p.returncode == 1 and "no GPU samples" in p.stderr and "Traceback" not in p.stderr


class _Counting:
    """A store that counts its range queries (the timeline's cache should spare them)."""

    def __init__(self, store) -> None:
        self.store, self.read_s = store, 0.0

    def query(self, metric, start_ns, end_ns, *a, **k):
        self.read_s = max(self.read_s, (end_ns - start_ns) / 1e9)  # the longest range read
        return self.store.query(metric, start_ns, end_ns, *a, **k)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_timeline_windows_are_aligned_cached_once_over_and_cut_to_the_range(tmp_path):
    from gpuscope.diagnose.history import WindowCache, timeline

    now = time.time()
    _fill(tmp_path, now)
    start, end = int((now - HOUR) * 1e9), int(now * 1e9)
    with Store(tmp_path, readonly=True) as raw:
        store, cache = _Counting(raw), WindowCache()
        spans = timeline(store, start, end, cache=cache)
        primary = [s for s in spans if s.primary and s.gpu == "0"]
        assert [s.kind for s in primary][0] == "compute_bound" and primary[-1].kind == "idle_allocated"
        assert min(s.start_ns for s in spans) >= start and max(s.end_ns for s in spans) <= end
        assert any(s.kind == "throttled" for s in spans if not s.primary)
        assert store.read_s >= HOUR and len(cache) > 0
        # Again a minute later: the windows that were over come from the cache; only the newest
        # (not yet settled) ones are read, in one run, and the spans are the same.
        store.read_s = 0.0
        again = timeline(store, start, end, cache=cache)
        assert 0 < store.read_s <= 120  # a window or two (60 s windows over an hour)
        assert [(s.kind, s.start_ns, s.end_ns) for s in again] == [(s.kind, s.start_ns, s.end_ns) for s in spans]
        # Nothing counts as over: nothing is cached, everything is read.
        fresh = WindowCache()
        timeline(store, start, end, cache=fresh, settled_ns=start)
        assert len(fresh) == 0


def test_window_cache_keeps_a_bounded_number_of_windows_per_length():
    from gpuscope.diagnose.history import WindowCache

    cache, w15, w60 = WindowCache(per_length=100), 15_000_000_000, 60_000_000_000
    for a in range(0, 60):  # an hour's range at 60 s windows
        cache.put((a * w60, (a + 1) * w60, 1.0), [])
    for a in range(0, 5000):  # a 15-minute range left open for about 21 hours
        cache.put((a * w15, (a + 1) * w15, 0.25), [])
        if a % 500 == 0:  # the hour's range reloaded now and then: its windows stay in use
            assert cache.get((0, w60, 1.0)) == []
    assert len(cache) == 160
    assert cache.get((4999 * w15, 5000 * w15, 0.25)) == [] and cache.get((4900 * w15, 4901 * w15, 0.25)) == []
    assert cache.get((4899 * w15, 4900 * w15, 0.25)) is None  # the oldest of that length went
    assert all(cache.get((a * w60, (a + 1) * w60, 1.0)) == [] for a in range(60))


def test_window_cache_keeps_what_the_timeline_draws_not_the_processes_verdicts():
    from gpuscope.diagnose.history import WindowCache
    from gpuscope.diagnose.windows import Verdict

    def verdict(pid=None, processes=()):
        return Verdict("0", "sync_bound", "warning", 0.9, "s", {"sm": [0.1] * 100}, ["fix"], pid=pid,
                       processes=list(processes))

    shared = verdict(processes=[verdict(pid=p) for p in range(12)])
    cache = WindowCache()
    cache.put((0, 10, 1.0), [(shared, 0, 10)])
    [(kept, a, b)] = cache.get((0, 10, 1.0))
    assert (a, b) == (0, 10) and kept.processes == [] and kept.evidence == {}
    assert (kept.gpu, kept.kind, kept.severity, kept.summary, kept.primary, kept.recommendations) == (
        "0", "sync_bound", "warning", "s", True, ["fix"])
    assert len(shared.processes) == 12 and shared.evidence  # the caller's verdict is not changed


def test_timeline_of_an_empty_range_is_one_sentence(tmp_path):
    from gpuscope.diagnose.history import timeline

    with pytest.raises(NoData, match="empty"):
        timeline(None, 10, 10)


# ---- a GPU that fell off the bus, from the store --------------------------------------------------

LOST_AFTER_S = 10.0  # the gpu_lost scenario loses GPU 1 after 10 s


def _lost_gpu_store(path, seconds: float = 40.0, offset_s: float = 3.0) -> tuple[float, float]:
    """The gpu_lost scenario run by the real sampler on a fake clock (`seconds` of it, 10 Hz) and written
    to a real store, its times starting `offset_s` past a round 10 s; returns (start, the moment GPU 1
    was lost) in wall seconds, as the store holds them."""
    from gpuscope import SamplerConfig

    s = Sampler(SamplerConfig(interval=0.1, collect_host=False), simulate="gpu_lost")
    s.open()
    t = [0.0]
    s.nvml.lib.clock = lambda: t[0]
    s.nvml.lib.t0 = 0.0
    s._gpm_source.clock = lambda: t[0]
    base = (time.time() - 2 * seconds) // 10 * 10 + offset_s
    lost = None
    with Store(path) as store:
        for k in range(int(seconds / 0.1)):
            t[0] = k * 0.1
            snap = s._tick(1000.0 + t[0])
            ns = int((base + t[0]) * 1e9)
            snap.time_ns = ns
            for g in snap.gpus:
                g.time_ns = ns
                if not g.healthy and lost is None:
                    lost = base + t[0]
            for e in snap.events:  # events carry the real clock; they happened in this (fake) tick
                e.time_ns = ns
            store.append(snap)
        store.flush()
    s.stop()
    assert lost is not None and abs(lost - base - LOST_AFTER_S) < 0.2
    return base, lost


def test_a_lost_gpus_past_range_is_gpu_lost_from_the_moment_it_was_lost(tmp_path):
    from gpuscope.diagnose.history import WindowCache, timeline

    base, lost = _lost_gpu_store(tmp_path)
    # 37 s from 3 s in: the loss (at 10 s) falls inside a window of the range's and of the timeline's
    start, end = base + 3.0, base + 40.0
    a, b = int(start * 1e9), int(end * 1e9)
    with Store(tmp_path, readonly=True) as store:
        assert [e.gpu for e in store.events(a, b, kind="gpu_lost")] == ["1"]
        r = diagnose_range(store, a, b)
        bands = [s for s in timeline(store, a, b, cache=WindowCache(), settled_ns=b) if s.primary]
    for spans in ([s for s in r.spans if s.primary], bands):
        gpu1 = [(s.kind, s.start_ns / 1e9 - start, s.end_ns / 1e9 - start) for s in spans if s.gpu == "1"]
        after = [k for k, _s0, s1 in gpu1 if s1 > lost - start + 1e-3]
        assert after and set(after) == {"gpu_lost"}, gpu1
        first = next(s0 for k, s0, _ in gpu1 if k == "gpu_lost")
        assert first == pytest.approx(lost - start, abs=0.15), gpu1  # from the moment, not a window early
        assert gpu1[-1][0] == "gpu_lost" and gpu1[-1][2] == pytest.approx(end - start, abs=0.15)
        assert all(k != "gpu_lost" for k, _, _ in gpu1[:-1])  # it was working before
        assert {s.kind for s in spans if s.gpu == "0"} == {"healthy"}  # the GPU that stayed
    assert [v.kind for v in r.overall if v.gpu == "1" and v.primary] == ["gpu_lost"]
    assert r.share()["1"]["gpu_lost"] == pytest.approx((end - lost) / (end - start), abs=0.02)


def test_cli_since_says_gpu_lost_after_the_loss(tmp_path):
    _base, lost = _lost_gpu_store(tmp_path / "store")
    p = _cli("--since", "5m", "--data-dir", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr
    gpu1 = [(s["kind"], s["start"], s["end"]) for s in json.loads(p.stdout)["spans"] if s["gpu"] == "1" and s["primary"]]
    assert {k for k, _a, b in gpu1 if b > lost + 1e-3} == {"gpu_lost"}, gpu1
    assert min(a for k, a, _b in gpu1 if k == "gpu_lost") == pytest.approx(lost, abs=0.15)
