"""Series of processes that ended are deleted once retention has removed all their data: the series
table, the writer's registry and a reader's cache stay bounded on a node that runs many short jobs,
and series ids are never reused (a returning pid gets a new series, never another one's values)."""

from __future__ import annotations

import sqlite3
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
from test_store_support import SEC, T0, gpu_values, identity

from gpuscope import GpuRecord, HostRecord, ProcessRecord, Snapshot
from gpuscope.store import Retention, Store

DAY = 86_400 * SEC
ROUND = 15 * DAY  # past every tier's guard (the 1 h tier's 7-day block) and its age
SHORT = Retention(raw_s=3600, rollup_1s_s=3600, rollup_1m_s=3600, rollup_1h_s=3600)
SM = "gpu_process_sm_active_ratio"


def proc(pid: int, gpu: int, sm: float) -> ProcessRecord:
    return ProcessRecord(pid=pid, gpu=str(gpu), gpu_uuid=f"GPU-test-{gpu}", type="compute", name="job",
                         user="bob", gpu_memory_bytes=float(1 << 30), sm_ratio=sm, cpu_cores=1.0, threads=4)


def tick(t: int, procs: list[ProcessRecord]) -> Snapshot:
    recs = [GpuRecord(identity(i), t, gpu_values(i, 0)) for i in range(2)]
    return Snapshot(t, recs, procs, HostRecord(t, {"host_cpu_ratio": 0.5}), [], None, "testhost")


def run_round(store: Store, base: int, pids: list[int], sm: float = 0.25, n: int = 5) -> None:
    """n snapshots a second apart at `base` with these processes running, then a flush."""
    for k in range(n):
        store.append(tick(base + k * SEC, [proc(p, p % 2, sm) for p in pids]))
    store.flush()


def series_rows(path: Path) -> int:
    with sqlite3.connect(path / "gpuscope.db") as c:
        return int(c.execute("SELECT COUNT(*) FROM series").fetchone()[0])


def test_series_of_ended_processes_are_deleted_and_everything_stays_bounded(tmp_path: Path) -> None:
    with Store(tmp_path, flush_interval=60, retention=SHORT) as store:
        w = store._writer
        assert w is not None
        sizes = []
        for r in range(8):
            pids = [10_000 + 10 * r + i for i in range(3)]  # three short jobs per round, new pids each time
            run_round(store, T0 + r * ROUND, pids)
            listed = {int(s["labels"]["pid"]) for s in store.series(SM)}
            assert listed == set(pids), (r, listed)  # the previous rounds' processes are gone
            sizes.append((series_rows(tmp_path), len(w.reg.metric), len(w.reg.layouts), len(w.reg.by_key),
                          len(w.dec._proc), len(store._reader._series)))
        assert all(s == sizes[1] for s in sizes[1:]), sizes  # bounded: flat from round to round
        rows, reg, *_ = sizes[-1]
        gpu_host = len(store.series()) - 3 * 4  # 4 series per job
        assert rows == reg == gpu_host + 12
        st = store.stats()
        assert st["series"] == rows
        # Every chunk, staging and latest row belongs to a live series; every layout holds live series only.
        with sqlite3.connect(tmp_path / "gpuscope.db") as c:
            ids = {i for (i,) in c.execute("SELECT id FROM series")}
            assert {i for (i,) in c.execute("SELECT DISTINCT series_id FROM chunks")} <= ids
            assert {i for (i,) in c.execute("SELECT series_id FROM latest")} <= ids
            for (blob,) in c.execute("SELECT sids FROM layouts"):
                assert set(np.frombuffer(blob, dtype=np.int64).tolist()) <= ids
            assert int(c.execute("SELECT value FROM meta WHERE key = 'series.deleted'").fetchone()[0]) == 7 * 12
        snap = store._reader.latest()
        assert snap is not None and {p.pid for p in snap.processes} == {10_070, 10_071, 10_072}


def test_a_returning_pid_gets_a_new_series_and_the_old_range_stays_empty(tmp_path: Path) -> None:
    a, b, c = T0, T0 + ROUND, T0 + 2 * ROUND
    with Store(tmp_path, flush_interval=60, retention=SHORT) as store:
        run_round(store, a - 100 * SEC, [], n=1)  # the GPUs' and the host's series first: 4242's are the newest ids
        run_round(store, a, [4242], sm=0.125)
        old = {sid for sid, _, _ in store._reader.find(SM, {"pid": "4242"})}
        assert store.query(SM, a, a + 10 * SEC, 1, labels={"pid": "4242"})[0].values.tolist() == [0.125] * 5
        run_round(store, b, [])  # 4242 ended; its data ages out and its series go (the newest ids)
        assert store.series(SM) == []
    with Store(tmp_path, flush_interval=60, retention=SHORT) as store:  # a restart must not reuse the ids
        run_round(store, c, [4242], sm=0.875)
        new = {sid for sid, _, _ in store._reader.find(SM, {"pid": "4242"})}
        assert len(new) == 1 and min(new) > max(old)
        top = store._writer.reg.next_ids()[0]  # type: ignore[union-attr]
        assert top > max(new)
        assert store.query(SM, a, b, 3600, labels={"pid": "4242"}) == []
        r = store.query(SM, c, c + 10 * SEC, 1, labels={"pid": "4242"})
        assert len(r) == 1 and r[0].values.tolist() == [0.875] * 5
        assert store.query(SM, a, c + 10 * SEC, 3600)[0].values.tolist() == [0.875]


def test_a_reader_opened_before_the_deletion_keeps_answering_correctly(tmp_path: Path) -> None:
    a, b = T0, T0 + ROUND
    with Store(tmp_path, flush_interval=60, retention=SHORT) as store:
        run_round(store, a, [4242, 4243], sm=0.125)
        reader = Store(tmp_path, readonly=True)
        try:
            assert {s["labels"]["pid"] for s in reader.series(SM)} == {"4242", "4243"}  # cached now
            assert len(reader.query(SM, a, a + 10 * SEC, 1)) == 2
            stale = {sid for sid, _, _ in reader._reader.find(SM, {})}
            run_round(store, b, [5555], sm=0.625)  # the old jobs' series are deleted, a new one appears
            assert {s["labels"]["pid"] for s in reader.series(SM)} == {"5555"}
            assert not stale & set(reader._reader._series)  # the cache dropped the deleted ids
            assert reader.query(SM, a, a + 10 * SEC, 1) == []
            r = reader.query(SM, b, b + 10 * SEC, 1)
            assert [x.labels["pid"] for x in r] == ["5555"] and r[0].values.tolist() == [0.625] * 5
            # Ids cached before the deletion read nothing, and never another series' data.
            assert all(not parts for parts in reader._reader.fetch(sorted(stale), a, b + 10 * SEC, 0).values())
            snap = reader.latest()
            assert snap is not None and [p.pid for p in snap.processes] == [5555]
            assert "4242" not in reader.labels()["pid"]
        finally:
            reader.close()


def test_chunks_encoded_per_layout_are_the_bytes_of_one_chunk_per_series() -> None:
    """The seal encodes a layout's series together (encode_chunks); every chunk must be what encode_chunk
    writes for that series alone: quantised, lossless (no scale, NaN, inf, too large) and integer columns."""
    from gpuscope.store._codec import decode_chunk, encode_chunk, encode_chunks
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 60, 601):
        for trial in range(12):
            k = int(rng.integers(1, 9))
            v = rng.random((n, k)) * [1.0, 1e3, 1e12, 1e20][trial % 4]
            if trial % 3 == 0:
                v[0, 0] = np.nan
            if trial % 5 == 2:
                v[-1, -1] = np.inf
            if trial % 6 == 3:
                v[:, 0] = np.arange(n) * 3.0  # delta-of-delta wins
            scales = [[None, 1.0, 1e4, 1e3, 1e6][int(i)] for i in rng.integers(0, 5, k)]
            cnt = rng.integers(1, 20, n)
            big = rng.integers(0, 2**40, (n, k))
            got = encode_chunks([cnt, v, v * 2, big], scales)
            assert len(got) == k
            for j in range(k):
                assert got[j] == encode_chunk([cnt, v[:, j], v[:, j] * 2, big[:, j]], scales[j]), (n, trial, j)
                assert np.array_equal(decode_chunk(got[j])[0], cnt)


def test_a_series_in_two_layouts_of_one_block_is_sealed_whole(tmp_path: Path) -> None:
    """A GPU whose set of series changes mid-block holds its series in two layouts; the seal merges the
    pieces of such a series and encodes the others per layout: every value comes back once, in order."""
    with Store(tmp_path, flush_interval=60, retention=SHORT) as store:
        for k in range(20):
            t = T0 + k * SEC
            vals = {"gpu_power_watts": 100.0 + k, "gpu_sm_active_ratio": k / 100}
            if k >= 10:
                vals["gpu_memory_used_bytes"] = float(k)
            store.append(Snapshot(t, [GpuRecord(identity(0), t, vals)], [], None, [], None, "testhost"))
            store.flush()
        store.append(tick(T0 + 700 * SEC, []))  # past the block's end and the grace: it is sealed
        store.flush()
        w = store._writer
        assert w is not None and w.w[0] == T0 + 600 * SEC
        assert store.query("gpu_power_watts", T0, T0 + 20 * SEC, 1, labels={"gpu": "0"})[0].values.tolist() == \
            [100.0 + k for k in range(20)]
        assert store.query("gpu_sm_active_ratio", T0, T0 + 20 * SEC, 1, labels={"gpu": "0"})[0].values.tolist() == \
            [k / 100 for k in range(20)]
        assert store.query("gpu_memory_used_bytes", T0, T0 + 20 * SEC, 1, labels={"gpu": "0"})[0].values.tolist() == \
            [float(k) for k in range(10, 20)]
    with sqlite3.connect(tmp_path / "gpuscope.db") as c:  # from chunks, not the hot window
        rows = c.execute("SELECT COUNT(*), SUM(n) FROM chunks WHERE tier = 0 AND t_min < ?", (T0 + 600 * SEC,)).fetchone()
        assert tuple(rows) == (3, 20 + 20 + 10)  # one chunk per series and block; tick()'s GPUs come at T0 + 700 s


def layout_rows(path: Path) -> int:
    with sqlite3.connect(path / "gpuscope.db") as c:
        return int(c.execute("SELECT COUNT(*) FROM layouts").fetchone()[0])


def test_memory_follows_the_series_in_use_while_the_store_keeps_every_series_history(tmp_path: Path) -> None:
    """Default retention (years): ended processes' series stay stored and queryable, but the writer lets go
    of them once they are past the hot window, and so does the layouts table: memory is flat round after
    round while the series table grows by the new jobs' series."""
    gap = 25 * 60 * SEC  # past a 10-minute seal and the 10-minute hot window
    with Store(tmp_path, flush_interval=60) as store:
        w = store._writer
        assert w is not None
        sizes, rows = [], []
        for r in range(10):
            pids = [20_000 + 10 * r + i for i in range(3)]
            run_round(store, T0 + r * gap, pids, sm=(r + 1) / 16)
            sizes.append((len(w.reg.metric), len(w.reg.layouts), len(w.reg.by_key), len(w.dec._proc),
                          layout_rows(tmp_path)))
            rows.append(series_rows(tmp_path))
        assert all(s == sizes[2] for s in sizes[2:]), sizes  # flat once the first rounds are past the window
        assert max(sizes[-1][0], sizes[-1][2]) < rows[-1] - 4 * 3 * 7  # memory holds far fewer than stored
        assert [b - a for a, b in pairwise(rows[2:])] == [12] * 7  # the store keeps every job's series
        assert w.reg.parked >= 4 * 3 * 8
        # Every job is still listed and its data served, from any reader.
        listed = {int(s["labels"]["pid"]) for s in store.series(SM)}
        assert listed == {20_000 + 10 * r + i for r in range(10) for i in range(3)}
        got = store.query(SM, T0, T0 + 10 * SEC, 1, labels={"pid": "20001"})
        assert len(got) == 1 and got[0].values.tolist() == [1 / 16] * 5
        # The newest values are the last snapshot's processes only.
        snap = store._reader.latest()
        assert snap is not None and {p.pid for p in snap.processes} == {20_090, 20_091, 20_092}
        # A job seen again after it was let go is found by its key: one series, both periods.
        first = {sid for sid, _, _ in store._reader.find(SM, {"pid": "20000"})}
        back = T0 + 10 * gap
        run_round(store, back, [20_000], sm=0.75)
        assert w.reg.found >= 4
        assert {sid for sid, _, _ in store._reader.find(SM, {"pid": "20000"})} == first
        both = store.query(SM, T0, back + 10 * SEC, 1, labels={"pid": "20000"}, agg="count")
        assert len(both) == 1 and np.nansum(both[0].values) == 10
    with Store(tmp_path, readonly=True) as reader:  # a fresh reader sees the same
        assert len(reader.series(SM)) == 30
        assert reader._reader.labels()["pid"][:2] == ["20000", "20001"]


def test_a_query_over_many_series_reads_only_those_with_data_in_its_range_and_misses_none(tmp_path: Path) -> None:
    """Past 256 matching series, a query asks first which hold samples in its range (a chunk of any tier, staging,
    late rows, the hot window): the answer is the same as reading them all, sealed or not, in-process or not."""
    from gpuscope.store import _read

    gap = 25 * 60 * SEC
    rounds = [[30_000 + 1000 * r + i for i in range(100)] for r in range(4)]
    with Store(tmp_path, flush_interval=60) as store:
        for r, pids in enumerate(rounds):
            run_round(store, T0 + r * gap, pids, sm=(r + 1) / 8)
        assert len(store.series(SM)) == 400 > _read.ACTIVE_FILTER_OVER
        readers = [store]
        with Store(tmp_path, readonly=True) as other:  # reads staging from the file, not the writer's memory
            readers.append(other)
            for rd in readers:
                for r, pids in enumerate(rounds):  # the last round is not sealed yet: staging / the hot window
                    got = rd.query(SM, T0 + r * gap, T0 + r * gap + 10 * SEC, 1)
                    assert sorted(int(x.labels["pid"]) for x in got) == pids, (rd.readonly, r)
                    assert all(x.values.tolist() == [(r + 1) / 8] * 5 for x in got)
                whole = rd.query(SM, T0, T0 + 4 * gap, 60, agg="count")
                assert len(whole) == 400 and sum(float(np.nansum(x.values)) for x in whole) == 400 * 5


def test_decoded_time_lines_are_bounded_by_bytes_and_a_query_needing_more_still_gets_every_chunk(
        tmp_path: Path, monkeypatch: Any) -> None:
    """Each short job has time lines of its own: the decoders' caches are bounded by bytes, and a read that needs
    more time lines than the cache holds (a rollup, a query over many jobs) still decodes every chunk."""
    from gpuscope.store import _read

    monkeypatch.setattr(_read, "TIMELINE_CACHE_BYTES", 200)  # a few time lines (5 stamps each: 40 bytes)
    gap = 25 * 60 * SEC
    with Store(tmp_path, flush_interval=60) as store:
        for r in range(3):
            pids = [40_000 + 100 * r + i for i in range(40)]
            for i, p in enumerate(pids):  # staggered starts: a time line per job
                run_round(store, T0 + r * gap + i * 7 * SEC, [p], sm=0.5, n=5)
        got = store.query(SM, T0, T0 + 3 * gap, 1, agg="count")
        assert len(got) == 120 and sum(float(np.nansum(x.values)) for x in got) == 120 * 5
        for dec in (store._reader.decoder, store._writer.decoder):  # type: ignore[union-attr]
            assert dec.corrupt == 0
            assert dec.timelines.bytes <= 200 or len(dec.timelines) == 1


def test_after_a_seal_the_writer_hands_free_heap_back_and_counts_it(tmp_path: Path) -> None:
    """glibc keeps freed heap pages below a live block for reuse, so RSS stays at its highest; the writer trims the
    heap after each seal (its largest allocation) and health() counts what RSS fell by. The trim itself is shown
    in a fresh interpreter, whose heap layout is known (this one's depends on the tests run before)."""
    import subprocess
    import sys

    from gpuscope import _heap

    probe = """
import ctypes, sys
sys.path.insert(0, sys.argv[1])
from gpuscope import _heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
blocks = [libc.malloc(64 << 10) for _ in range(800)]  # 50 MB of heap, below the mmap threshold
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
pins = [libc.malloc(64) for _ in range(8)]  # live blocks above them: free() alone cannot give them back
for b in blocks[:-1]:
    libc.free(b)
print(_heap.give_back())
"""
    src = str(Path(_heap.__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", probe, src], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 32 << 20  # most of the 50 MB went back to the OS
    with Store(tmp_path, flush_interval=60) as store:
        run_round(store, T0, [50_000 + i for i in range(50)])
        run_round(store, T0 + 25 * 60 * SEC, [51_000])  # seals a block: the trim runs after it
        assert isinstance(store.health()["memory_given_back_bytes"], int)
        assert _heap._libc  # glibc's malloc_trim was found and called (Linux)
