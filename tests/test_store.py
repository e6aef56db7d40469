"""The store in one process: round trips, queries against numpy on the raw data, rollup tiers,
retention, corrupt blocks, export, and every bad input."""

from __future__ import annotations

import builtins
import csv
import json
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_store_support import SEC, T0, THROTTLE, gpu_values, snapshot

from gpuscope import Event, Sampler
from gpuscope.catalog import PROCESS_SERIES
from gpuscope.store import QueryError, Retention, Store, StoreError
from gpuscope.store._aggregate import plan

POWER = ("gpu_power_watts", {"gpu": "0", "uuid": "GPU-test-0"})


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = Store(tmp_path / "data", flush_interval=60)
    yield s
    s.close()


def one_sentence(e: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith("."), msg
    return msg


def load(store: Store, t: np.ndarray, v: np.ndarray, series: tuple[str, dict[str, str]] = POWER,
         piece: int = 86_400) -> None:
    for a in range(0, len(t), piece):
        store.append_batch([series], t[a:a + piece], v[a:a + piece])
        store.flush()


def jittered(n: int, step_ns: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = T0 + np.arange(n, dtype=np.int64) * step_ns + rng.integers(-step_ns // 5, step_ns // 5, n)
    v = np.round(rng.normal(300.0, 20.0, n), 3)
    return t, v


def by_bucket(t: np.ndarray, v: np.ndarray, start: int, step_ns: int, agg: str) -> tuple[np.ndarray, np.ndarray]:
    b = (t - start) // step_ns
    keys = np.unique(b)
    out = []
    for k in keys:
        x = v[b == k]
        if agg.startswith("p"):
            out.append(np.percentile(x, float(agg[1:]), method="inverted_cdf"))
        else:
            out.append({"mean": x.mean, "min": x.min, "max": x.max, "sum": x.sum,
                        "count": lambda x=x: float(len(x)), "last": lambda x=x: x[-1]}[agg]())
    return start + keys * step_ns, np.array(out)


# -- round trips -------------------------------------------------------------------------------------
def test_sampler_snapshots_round_trip(tmp_path: Path) -> None:
    with Sampler(simulate="mixed") as s, Store(tmp_path) as store:
        snaps = []
        for _ in range(4):
            snaps.append(s.sample_once())
            store.append(snaps[-1])
            time.sleep(0.05)
        store.flush()
        last = snaps[-1]
        assert store.latest() is last  # the writer hands back its own last snapshot
        # a process has a series for each field it reported (the CUDA call counters are None without the probes)
        per_process = sum(getattr(p, attr) is not None for p in last.processes for attr, _ in PROCESS_SERIES)
        assert per_process >= 9 * len(last.processes)
        expected = sum(len(g.values) for g in last.gpus) + len(last.host.values) + per_process
        assert len(store.series()) == expected
        r = store.query("gpu_power_watts", snaps[0].time_ns, last.time_ns + 1, 0.01, agg="last", labels={"gpu": 3})
        assert len(r) == 1 and r[0].labels["uuid"] == last.gpus[3].uuid
        assert r[0].values[-1] == pytest.approx(last.gpus[3].power_watts, abs=1e-3)
    reader = Store(tmp_path, readonly=True)
    try:
        snap = reader.latest()
        assert snap is not None and snap.simulated == "mixed" and snap.hostname == last.hostname
        assert [g.identity.uuid for g in snap.gpus] == [g.uuid for g in last.gpus]
        assert snap.gpus[5].values == pytest.approx(last.gpus[5].values)
        assert {p.pid for p in snap.processes} == {p.pid for p in last.processes}
        assert snap.host is not None and snap.host.values == pytest.approx(last.host.values)
        node = reader.node()
        assert node["simulated"] == "mixed" and len(node["gpus"]) == 8 and node["gpus"][0].name.startswith("NVIDIA")
    finally:
        reader.close()


def test_hand_built_snapshots_round_trip_at_full_rate(store: Store) -> None:
    for k in range(50):
        store.append(snapshot(k))
    store.flush()
    r = store.query("gpu_power_watts", T0, T0 + 5 * SEC, 0.1, agg="last", labels={"gpu": "1"})
    assert len(r) == 1
    assert np.array_equal(r[0].timestamps_ns, T0 + np.arange(50) * 100_000_000)
    assert r[0].values.tolist() == [gpu_values(1, k)["gpu_power_watts"] for k in range(50)]
    thr = store.query("gpu_throttle_seconds_total", T0, T0 + 5 * SEC, 1, agg="max", labels={"reason": "sw_power_cap"})
    assert [x.labels["gpu"] for x in thr] == ["0", "1"] and thr[0].values[-1] == pytest.approx(4.9)
    procs = store.query("process_cpu_cores", T0, T0 + 5 * SEC, 0.1, agg="count", labels={"pid": 1000})
    assert procs[0].labels == {"gpu": "0", "pid": "1000", "process": "python", "user": "alice"}
    assert procs[0].values.sum() == 50  # new process records every tick: stored every tick


def test_series_labels_and_metrics(store: Store) -> None:
    store.append(snapshot(0))
    store.flush()
    assert store.series("gpu_power_watts", gpu=1) == [
        {"metric": "gpu_power_watts", "labels": {"gpu": "1", "uuid": "GPU-test-1"}}]
    assert {s["labels"]["reason"] for s in store.series("gpu_throttle_seconds_total")} == {"sw_power_cap"}
    labels = store.labels()
    assert labels["gpu"] == ["0", "1"] and labels["pid"] == ["1000", "1001"] and labels["cpu"] == ["0"]
    assert "host_cpu_ratio" in store.metrics()
    assert store.series("gpu_power_watts", gpu=7) == []
    assert store.series("gpu_xid_events_total") == []  # catalogued, nothing stored: empty, not an error


def test_events_are_stored_beside_the_series(store: Store) -> None:
    xid = Event(T0 + 5, "xid", "0", "XID 79: GPU has fallen off the bus", {"xid": 79}, 1)
    thr = Event(T0 + 7, "clock_events", "1", "throttled", {"reasons": ["sw_power_cap"]}, 3)
    store.append(snapshot(0, events=[xid, thr]))
    store.append(snapshot(1, events=[Event(T0 + SEC, "process_start", None, "pid 7 started", {})]))
    store.flush()
    assert store.events(T0, T0 + 2 * SEC) == [xid, thr, Event(T0 + SEC, "process_start", None, "pid 7 started", {})]
    assert store.events(T0, T0 + 2 * SEC, kind="xid") == [xid]
    assert store.events(T0, T0 + 2 * SEC, gpu=1) == [thr]
    assert store.events(T0 + 6, T0 + 2 * SEC, kind="xid") == []


def test_reopened_writer_continues_without_loss_or_duplicates(tmp_path: Path) -> None:
    with Store(tmp_path) as s:
        for k in range(30):
            s.append(snapshot(k))
    with Store(tmp_path) as s:  # staging rows come back into the hot window
        for k in range(30, 60):
            s.append(snapshot(k))
        s.flush()
        r = s.query("gpu_power_watts", T0, T0 + 10 * SEC, 0.1, agg="count", labels={"gpu": "0"})
        assert r[0].values.sum() == 60 and len(r[0].values) == 60


def test_samples_older_than_the_sealed_block_are_kept_and_counted(store: Store) -> None:
    t, v = jittered(12_000, 100_000_000)  # 20 minutes: the first block is sealed
    load(store, t, v)
    (before,) = store.query("gpu_power_watts", T0, T0 + SEC, 1.0, agg="count", labels={"gpu": "0"})
    store.append(snapshot(0))  # stamped T0 (the same series): in the sealed block
    store.flush()  # it came late: its block takes it once no more late rows come
    store.flush()
    w = store.stats()["writer"]
    assert w["dropped_late_samples"] == 0 and w["late_samples"] > 0
    for step in (0.1, 1.0, 60.0, 3600.0):  # raw, and every rollup tier
        (r,) = store.query("gpu_power_watts", T0, T0 + 3600 * SEC, step, agg="count", labels={"gpu": "0"})
        assert r.values.sum() == len(t) + 1, step
    (after,) = store.query("gpu_power_watts", T0, T0 + SEC, 1.0, agg="count", labels={"gpu": "0"})
    assert after.values.tolist() == [before.values[0] + 1]


def test_uncatalogued_metrics_are_lossless(store: Store) -> None:
    t = T0 + np.arange(5, dtype=np.int64) * SEC
    v = np.array([1 / 3, np.pi, np.nan, -1e-300, 12345.678901234567])
    store.append_batch([("my_custom_metric", {"job": "a"})], t, v)
    store.flush()
    r = store.query("my_custom_metric", T0, T0 + 5 * SEC, 1, agg="last")
    assert np.array_equal(r[0].values, v, equal_nan=True)


# -- queries against numpy ---------------------------------------------------------------------------
@pytest.mark.parametrize("agg", ["mean", "min", "max", "sum", "count", "last", "p50", "p90", "p99"])
def test_query_matches_numpy_on_the_raw_samples(store: Store, agg: str) -> None:
    t, v = jittered(72_000, 100_000_000)  # 2 h at 10 Hz: sealed raw and 1 s chunks, plus staged rows
    load(store, t, v)
    end = T0 + 7200 * SEC
    for step in (0.5, 1, 7, 60, 600):
        start = end - min(7200, step * 2000) * SEC
        r = store.query("gpu_power_watts", start, end, step, agg=agg)
        m = t >= start
        ts, want = by_bucket(t[m], v[m], start, int(step * SEC), agg)
        assert np.array_equal(r[0].timestamps_ns, ts)
        if agg.startswith("p") and step > 10:  # from 1 s rollups: an approximation within the bucket
            lo, hi = by_bucket(t[m], v[m], start, int(step * SEC), "min")[1], by_bucket(t[m], v[m], start, int(step * SEC), "max")[1]
            assert np.all((r[0].values >= lo) & (r[0].values <= hi))
        else:
            np.testing.assert_allclose(r[0].values, want, rtol=1e-12, atol=1e-9)


def test_rollup_tiers_match_numpy(tmp_path: Path) -> None:
    n = 8 * 86_400  # 8 days at 1 Hz: the 1 min (6 h blocks) and 1 h (7 day blocks) tiers fill
    rng = np.random.default_rng(3)
    t = T0 + np.arange(n, dtype=np.int64) * SEC + rng.integers(0, SEC // 2, n)
    v = np.round(rng.random(n), 4)
    series = ("gpu_sm_active_ratio", {"gpu": "0", "uuid": "u"})
    with Store(tmp_path) as store:
        load(store, t, v, series)
        sid = store._reader.find("gpu_sm_active_ratio", {})[0][0]
        for tier, res, a, b in ((1, SEC, T0 + 7 * 86_400 * SEC, T0 + 7 * 86_400 * SEC + 6 * 3600 * SEC),
                                (2, 60 * SEC, T0, T0 + 7 * 86_400 * SEC), (3, 3600 * SEC, T0, T0 + 7 * 86_400 * SEC)):
            parts = store._reader.fetch([sid], a, b, tier)[sid]
            assert parts and {k for k, _ in parts} == {tier}
            m = (t >= a) & (t < b)
            bk = t[m] // res
            keys, first = np.unique(bk, return_index=True)
            lastidx = np.r_[first[1:], m.sum()] - 1
            vm = v[m]
            got_t = np.concatenate([p.t for _, p in parts])
            assert np.array_equal(got_t, keys * res)
            cat = {f: np.concatenate([getattr(p, f) for _, p in parts]) for f in ("cnt", "mn", "mx", "sm", "last")}
            assert np.array_equal(cat["cnt"], np.diff(np.r_[first, m.sum()]))
            np.testing.assert_allclose(cat["mn"], np.minimum.reduceat(vm, first), atol=1e-12)
            np.testing.assert_allclose(cat["mx"], np.maximum.reduceat(vm, first), atol=1e-12)
            np.testing.assert_allclose(cat["sm"], np.add.reduceat(vm, first), atol=1e-9)
            np.testing.assert_allclose(cat["last"], vm[lastidx], atol=1e-12)
        # An hour-step query over the first week reads the 1 h tier and equals numpy on the raw samples.
        r = store.query("gpu_sm_active_ratio", T0, T0 + 7 * 86_400 * SEC, 3600, agg="mean")
        m = t < T0 + 7 * 86_400 * SEC
        np.testing.assert_allclose(r[0].values, by_bucket(t[m], v[m], T0, 3600 * SEC, "mean")[1], rtol=1e-12)
        st = store.stats()["tiers"]
        assert st["1h"]["points"] == 7 * 24 and st["1m"]["points"] >= 7 * 1440


def test_a_range_past_raw_retention_is_served_by_the_rollups(tmp_path: Path) -> None:
    t, v = jittered(6 * 36_000, 100_000_000)  # 6 h at 10 Hz, raw kept 1 h
    ret = Retention(raw_s=3600)
    with Store(tmp_path, retention=ret) as store:
        load(store, t, v, piece=36_000)
        assert store.stats()["tiers"]["raw"]["oldest_ns"] >= T0 + 4 * 3600 * SEC
        r = store.query("gpu_power_watts", T0, T0 + 60 * SEC, 0.5, agg="mean")  # raw is gone: 1 s means
        m = t < T0 + 60 * SEC
        np.testing.assert_allclose(r[0].values, by_bucket(t[m], v[m], T0, SEC, "mean")[1], rtol=1e-12)
        assert np.all(np.diff(r[0].timestamps_ns) == SEC)


def test_plan_picks_tiers_by_step_and_retention() -> None:
    inf = 2**63 - 1
    # raw from 100, 1 s complete to 500 from 0, 1 min complete to 300 from 0, 1 h empty.
    res = [1, 1, 1, 1]
    # raw dropped before 100, 1 s complete to 500, 1 min to 300, 1 h holds nothing.
    lo, hi = [100, 0, 0, None], [inf, 500, 300, 0]
    assert plan(0, 1000, 1, lo, hi, res) == [(1, 0, 500), (0, 500, 1000)]
    assert plan(0, 1000, 2, lo, hi, res) == [(2, 0, 300), (1, 300, 500), (0, 500, 1000)]
    assert plan(0, 1000, 0, lo, hi, res) == [(1, 0, 100), (0, 100, 1000)]
    assert plan(0, 1000, 3, lo, hi, res) == [(2, 0, 300), (1, 300, 500), (0, 500, 1000)]
    assert plan(600, 700, 1, lo, hi, res) == [(0, 600, 700)]
    # A coarser tier's bucket that straddles the edge moves the edge to the bucket's end.
    assert plan(0, 1000, 0, lo, hi, [1, 40, 60, 3600]) == [(1, 0, 120), (0, 120, 1000)]


# -- retention ---------------------------------------------------------------------------------------
def test_retention_by_age(tmp_path: Path) -> None:
    n = 12 * 3600
    t = T0 + np.arange(n, dtype=np.int64) * SEC
    v = np.round(np.sin(np.arange(n) / 100) * 100 + 300, 3)
    ret = Retention(raw_s=3600, rollup_1s_s=3 * 3600, events_max_age_s=7200)
    with Store(tmp_path, retention=ret) as store:
        store.append(snapshot(0, events=[Event(T0, "xid", "0", "old", {})]))
        store.flush()
        load(store, t[1:], v[1:], piece=3600)
        store.append(snapshot(0, t0=int(t[-1]) + SEC, events=[Event(int(t[-1]) + SEC, "xid", "0", "new", {})]))
        store.flush()
        st = store.stats()
        newest = st["newest_ns"]
        raw, sec = st["tiers"]["raw"], st["tiers"]["1s"]
        assert newest - 3600 * SEC - 600 * SEC <= raw["oldest_ns"] <= newest - 3600 * SEC
        # 1 s keeps what the 1 min tier has not rolled up yet (its 6 h block), then 3 h.
        assert T0 + 5 * 3600 * SEC <= sec["oldest_ns"] <= T0 + 6 * 3600 * SEC
        assert [e.message for e in store.events(T0, newest + SEC)] == ["new"]
        assert store.query("gpu_power_watts", T0, T0 + 3600 * SEC, 60)[0].values.size == 60  # 1 min tier


def _four_series_12h(path: Path, retention: Retention) -> dict[str, Any]:
    n = 12 * 3600
    rng = np.random.default_rng(5)
    t = T0 + np.arange(n, dtype=np.int64) * SEC
    series = [("gpu_sm_active_ratio", {"gpu": str(i), "uuid": str(i)}) for i in range(4)]
    with Store(path, retention=retention) as store:
        for a in range(0, n, 3600):
            store.append_batch(series, t[a:a + 3600], np.round(rng.random((3600, 4)), 4))
            store.flush()
        # What raw no longer holds comes from the rollups, with nothing counted twice.
        r = store.query("gpu_sm_active_ratio", T0, int(t[-1]) + 1, 60, agg="count", labels={"gpu": "2"})
        assert r[0].values.sum() == n
        return store.stats()["tiers"]


def test_retention_by_size_per_tier_drops_the_oldest_first(tmp_path: Path) -> None:
    cap = 100_000
    raw = _four_series_12h(tmp_path, Retention(raw_max_bytes=cap))["raw"]
    assert 0.5 * cap < raw["bytes"] <= cap
    assert raw["newest_ns"] >= T0 + 12 * 3600 * SEC - 700 * SEC and raw["oldest_ns"] > T0 + 3600 * SEC


def test_retention_by_total_size_sheds_the_finest_tier_first(tmp_path: Path) -> None:
    full = _four_series_12h(tmp_path / "full", Retention())
    cap = sum(v["bytes"] for v in full.values()) - full["raw"]["bytes"] // 2
    tiers = _four_series_12h(tmp_path / "capped", Retention(max_bytes=cap))
    assert sum(v["bytes"] for v in tiers.values()) <= cap
    assert tiers["raw"]["oldest_ns"] > full["raw"]["oldest_ns"]  # raw went first ...
    assert tiers["1s"]["oldest_ns"] == full["1s"]["oldest_ns"]  # ... and the rollups kept their history


def test_a_failed_flush_is_retried_without_loss(store: Store, monkeypatch: Any, caplog: Any) -> None:
    from gpuscope.store._writer import Writer

    real = Writer._stage
    calls = {"n": 0}

    def flaky(self: Writer, groups: Any, since: int) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise sqlite3.OperationalError("database or disk is full")
        real(self, groups, since)

    monkeypatch.setattr(Writer, "_stage", flaky)
    for k in range(10):
        store.append(snapshot(k, events=[Event(T0 + k, "xid", "0", f"x{k}", {})]))
    with caplog.at_level(logging.WARNING, logger="gpuscope.store"):
        store.flush()
    assert any("disk is full" in m for m in caplog.messages)
    for k in range(10, 20):
        store.append(snapshot(k))
    store.flush()
    r = Store(store.path, readonly=True)
    try:
        res = r.query("gpu_power_watts", T0, T0 + 10 * SEC, 0.1, agg="count", labels={"gpu": "0"})
        assert res[0].values.sum() == 20
        assert len(r.events(T0, T0 + SEC)) == 10
    finally:
        r.close()


def test_a_running_sampler_feeds_the_store(tmp_path: Path) -> None:
    from gpuscope import SamplerConfig

    with Store(tmp_path, flush_interval=0.2) as store:
        sampler = Sampler(SamplerConfig(interval=0.05), simulate="healthy")
        sampler.subscribe(store.append)  # called on the sampler thread after every tick
        sampler.start()
        time.sleep(1.0)
        sampler.stop()
        store.flush()
        snap = store.latest()
        assert snap is not None
        r = store.query("gpu_memory_used_bytes", snap.time_ns - 5 * SEC, snap.time_ns + 1, 0.05, agg="count")
        assert r[0].values.sum() == sampler.ticks


# -- bad input ---------------------------------------------------------------------------------------
def test_bad_queries_raise_one_clear_sentence(store: Store) -> None:
    store.append(snapshot(0))
    store.flush()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"metric": "gpu_nonsense_ratio"}, "Unknown metric"),
        ({"metric": "gpu_power_wats"}, "(did you mean 'gpu_power_watts'?)."),
        ({"start_ns": T0 + SEC, "end_ns": T0}, "inverted or empty"),
        ({"start_ns": T0, "end_ns": T0}, "inverted or empty"),
        ({"step_s": 7200}, "longer than the range"),
        ({"step_s": 0.000001}, "more than the 100,000 allowed"),
        ({"step_s": 0}, "positive number of seconds"),
        ({"step_s": float("nan")}, "positive number of seconds"),
        ({"agg": "median"}, "Unknown aggregation"),
        ({"agg": "p100"}, "Unknown aggregation"),
        ({"start_ns": "yesterday"}, "integer nanoseconds"),
    ]
    for kw, words in cases:
        args = {"metric": "gpu_power_watts", "start_ns": T0, "end_ns": T0 + 3600 * SEC, "step_s": 1.0, **kw}
        with pytest.raises(QueryError) as e:
            store.query(args.pop("metric"), args.pop("start_ns"), args.pop("end_ns"), args.pop("step_s"), **args)
        assert words in one_sentence(e)
    with pytest.raises(QueryError) as e:
        store.events(T0 + 1, T0)
    one_sentence(e)


def test_bad_setup_raises_one_clear_sentence(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(StoreError) as e:
        Store(afile / "data")
    assert "Cannot create the data directory" in one_sentence(e)
    with pytest.raises(StoreError) as e:
        Store(tmp_path / "nothing", readonly=True)
    assert "no gpuscope store" in one_sentence(e)
    with pytest.raises(StoreError) as e:
        Store(tmp_path / "d", flush_interval=0)
    one_sentence(e)
    with pytest.raises(StoreError) as e:
        Store(tmp_path / "d", retention=Retention(raw_s=-1))
    assert "raw_s" in one_sentence(e)
    with pytest.raises(StoreError) as e:
        Store(tmp_path / "d", retention=Retention(max_bytes=0))
    assert "max_bytes" in one_sentence(e)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "gpuscope.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError) as e:
        Store(tmp_path / "junk")
    assert "not a gpuscope store" in one_sentence(e)


def test_unwritable_directory(tmp_path: Path) -> None:
    import os
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    with pytest.raises(StoreError) as e:
        Store(d)
    assert "not writable" in one_sentence(e)


def test_bad_writes_raise_one_clear_sentence(tmp_path: Path) -> None:
    with Store(tmp_path) as w:
        w.append(snapshot(0))
        with pytest.raises(StoreError) as e:
            w.append_batch([POWER], np.arange(3), np.ones((3, 2)))
        one_sentence(e)
    r = Store(tmp_path, readonly=True)
    with pytest.raises(StoreError) as e:
        r.append(snapshot(1))
    assert "read-only" in one_sentence(e)
    r.close()


def test_a_corrupt_chunk_is_skipped_logged_once_and_the_rest_served(tmp_path: Path, caplog: Any) -> None:
    t, v = jittered(24_000, 100_000_000)  # 40 minutes: three sealed raw blocks
    with Store(tmp_path) as w:
        w.append_batch([POWER, ("gpu_power_watts", {"gpu": "1", "uuid": "u1"})], t, np.column_stack([v, v]))
    con = sqlite3.connect(tmp_path / "gpuscope.db")
    cid = con.execute("SELECT MIN(id) FROM chunks WHERE tier = 0").fetchone()[0]
    con.execute("UPDATE chunks SET data = zeroblob(length(data)) WHERE id = ?", (cid,))
    con.commit()
    con.close()
    r = Store(tmp_path, readonly=True)
    with caplog.at_level(logging.WARNING, logger="gpuscope.store"):
        for _ in range(2):
            res = {x.labels["gpu"]: x for x in r.query("gpu_power_watts", T0, T0 + 2400 * SEC, 0.5, agg="count")}
    assert res["1"].values.sum() == len(t)
    assert 0 < res["0"].values.sum() < len(t)  # one block missing, the others served
    assert sum("corrupt chunk" in m for m in caplog.messages) == 1
    assert r.stats()["corrupt_blocks_skipped"] >= 1
    r.close()


# -- export ------------------------------------------------------------------------------------------
@pytest.fixture
def exported(tmp_path: Path) -> tuple[Store, int]:
    s = Store(tmp_path / "data")
    for k in range(20):
        s.append(snapshot(k, procs=False, host=False))
    s.flush()
    yield s, 20 * 2 * len(gpu_values(0, 0))
    s.close()


def test_export_csv_and_jsonl_read_back(exported: tuple[Store, int], tmp_path: Path) -> None:
    s, n = exported
    assert s.export(T0, T0 + 10 * SEC, tmp_path / "out.csv", fmt="csv") == n
    with open(tmp_path / "out.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == n and set(rows[0]) == {"time_ns", "metric", "gpu", "reason", "uuid", "value", "resolution_s"}
    p = [r for r in rows if r["metric"] == "gpu_power_watts" and r["gpu"] == "1"]
    assert [float(r["value"]) for r in p] == [gpu_values(1, k)["gpu_power_watts"] for k in range(20)]
    assert s.export(T0, T0 + 10 * SEC, tmp_path / "out.jsonl", fmt="jsonl", metrics=["gpu_throttle_seconds_total"]) == 40
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert lines[3]["labels"] == {"gpu": "0", "reason": "sw_power_cap", "uuid": "GPU-test-0"}
    assert lines[3]["value"] == pytest.approx(gpu_values(0, 3)[THROTTLE])


def test_export_parquet_reads_back(exported: tuple[Store, int], tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    s, n = exported
    assert s.export(T0, T0 + 10 * SEC, tmp_path / "out.parquet") == n
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.num_rows == n and "gpu" in table.column_names
    assert sorted(set(table.column("metric").to_pylist())) == sorted(["gpu_power_watts", "gpu_sm_active_ratio",
                                                                      "gpu_memory_used_bytes", "gpu_throttle_seconds_total"])


def test_export_errors(exported: tuple[Store, int], tmp_path: Path, monkeypatch: Any) -> None:
    s, _ = exported
    with pytest.raises(StoreError) as e:
        s.export(T0, T0 + SEC, tmp_path / "x", fmt="xlsx")
    assert "Unknown export format" in one_sentence(e)
    with pytest.raises(StoreError) as e:
        s.export(T0, T0 + SEC, tmp_path / "no" / "such" / "dir.csv", fmt="csv")
    assert "Cannot write the export" in one_sentence(e)
    with pytest.raises(QueryError) as e:
        s.export(T0, T0 + SEC, tmp_path / "x.csv", fmt="csv", metrics=["gpu_bogus"])
    one_sentence(e)
    real_import = builtins.__import__

    def no_pyarrow(name: str, *a: Any, **k: Any) -> Any:
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(StoreError) as e:
        s.export(T0, T0 + SEC, tmp_path / "x.parquet")
    assert "needs pyarrow" in one_sentence(e)


def test_stats(store: Store) -> None:
    t, v = jittered(12_000, 100_000_000)
    load(store, t, v)
    st = store.stats()
    assert st["samples"] == len(t) and st["series"] == 1
    assert st["tiers"]["raw"]["bytes"] > 0 and st["tiers"]["1s"]["points"] > 0
    assert st["tiers"]["raw"]["oldest_ns"] == int(t[0]) and st["oldest_ns"] == T0  # the first 1 s bucket
    assert st["newest_ns"] == int(t[-1]) and st["file_bytes"] > 0
    assert st["writer"]["dropped_snapshots"] == 0
