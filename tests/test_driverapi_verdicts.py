"""The CUDA driver calls the eBPF probes count (sources.cudaprobe) as evidence for the verdicts
(diagnose.driverapi): a GPU that waits on its process's host side, with no stacks sampled, is launch-bound
when the process launches thousands of kernels a second and sync-bound when its threads wait in
synchronisations; without the probes' counters the verdict is what it was."""

from __future__ import annotations

import pytest
from record_windows import EAGER, GIB, proc, window

from gpuscope.diagnose import diagnose
from gpuscope.diagnose.driverapi import LAUNCH_RATE, SYNC_SHARE, over

PID = 4242
T0 = 1000.0  # record_windows' first snapshot, unix seconds


def probed(launches_per_s: float, sync_share: float, syncs_per_s: float = 50.0, graphs_per_s: float = 0.0):
    """A process its GPU waits on (one thread saturated), whose probe counters grow at these rates."""
    def procs(t: float):
        return [proc(PID, sm=0.0005, util=0.2, cpu=1.0, threads=(1.0,), memory=4 * GIB,
                     cuda_launches=1e6 + launches_per_s * t, cuda_graph_launches=graphs_per_s * t,
                     cuda_copies=10.0 * t, cuda_h2d_bytes=1e6 * t, cuda_d2h_bytes=0.0, cuda_d2d_bytes=0.0,
                     cuda_other_copy_bytes=0.0, cuda_syncs=syncs_per_s * t, cuda_sync_seconds=sync_share * t)]
    return procs


def primary(verdicts):
    (v,) = [v for v in verdicts if v.primary]
    return v


GPU = {**EAGER, "gpu_utilization_ratio": 0.2}


def test_many_launches_a_second_is_launch_bound():
    v = primary(diagnose([window(GPU, probed(40_000, 0.02))]))
    assert v.kind == "launch_bound", v.summary
    assert v.evidence["cuda_launches_per_s"] == pytest.approx(40_000, rel=1e-6)
    assert v.evidence["cuda_sync_share"] == pytest.approx(0.02, abs=1e-4)
    assert "40,000 launches/s" in v.summary and "launch-bound" in v.summary
    assert v.recommendations and v.recommendations != primary(diagnose([window(GPU, probed(0, 0.9))])).recommendations


def test_threads_waiting_in_synchronisations_is_sync_bound():
    v = primary(diagnose([window(GPU, probed(2_000, 0.6, syncs_per_s=2_000))]))
    assert v.kind == "sync_bound", v.summary
    assert v.evidence["cuda_sync_share"] == pytest.approx(0.6, abs=1e-4)
    assert "60 % of its time in synchronisations" in v.summary


def test_calls_below_both_marks_leave_the_verdict_as_it_was_with_the_evidence():
    v = primary(diagnose([window(GPU, probed(LAUNCH_RATE / 10, SYNC_SHARE / 3))]))
    assert v.kind == "launch_or_sync_bound"
    assert v.evidence["cuda_launches_per_s"] == pytest.approx(LAUNCH_RATE / 10, rel=1e-6)


def test_without_the_probes_nothing_changes():
    plain = lambda t: [proc(PID, sm=0.0005, util=0.2, cpu=1.0, threads=(1.0,), memory=4 * GIB)]  # noqa: E731
    v = primary(diagnose([window(GPU, plain)]))
    assert v.kind == "launch_or_sync_bound" and "cuda_launches_per_s" not in v.evidence


def test_a_process_of_a_shared_gpu_is_told_apart_by_its_own_calls():
    def procs(t: float):
        launcher = probed(30_000, 0.01)(t)[0]
        syncer = probed(500, 0.7)(t)[0]
        syncer.pid = PID + 1
        return [launcher, syncer]

    v = primary(diagnose([window(GPU, procs)]))
    own = {p.pid: p.kind for p in v.processes if p.primary}
    assert own == {PID: "launch_bound", PID + 1: "sync_bound"}, [(p.pid, p.kind, p.summary) for p in v.processes]


def test_rates_need_two_probed_reads_a_second_apart_and_counters_that_only_grow():
    recs = probed(1000, 0.1)
    assert over([(T0, recs(0.0)[0])]) is None
    assert over([(T0, recs(0.0)[0]), (T0 + 0.5, recs(0.5)[0])]) is None
    assert over([(T0, recs(5.0)[0]), (T0 + 5, recs(0.0)[0])]) is None  # the probes restarted: no rate
    calls = over([(T0, recs(0.0)[0]), (T0 + 4, recs(4.0)[0])])
    assert calls.launches_per_s == pytest.approx(1000) and calls.copy_bytes_per_s == pytest.approx(1e6)


def _store(path, end_s: float, launches_per_s: float, sync_share: float) -> None:
    """Ten minutes at 1 Hz of a GPU waiting on its process's saturated thread, the probes' counters stored as the
    agent stores them (the process's series)."""
    import numpy as np

    from gpuscope import Sampler
    from gpuscope.store import Store

    with Sampler(simulate="healthy", gpus=1) as s, Store(path) as store:
        store.append(s.sample_once())  # the node's identity
        t = np.arange(end_s - 600, end_s - 5, 1.0)
        g, p = {"gpu": "0"}, {"gpu": "0", "pid": "77", "process": "engine"}
        since = t - t[0]
        cols = [("gpu_sm_active_ratio", g, np.full(len(t), 0.001)), ("gpu_utilization_ratio", g, np.full(len(t), 0.2)),
                ("gpu_memory_used_bytes", g, np.full(len(t), 4.0 * 2**30)),
                ("process_thread_cpu_max_ratio", p, np.full(len(t), 1.0)), ("process_cpu_cores", p, np.full(len(t), 1.0)),
                ("gpu_process_sm_active_ratio", p, np.full(len(t), 0.0005)),
                ("gpu_process_utilization_ratio", p, np.full(len(t), 0.2)),
                ("process_cuda_launches_total", p, 5e5 + launches_per_s * since),
                ("process_cuda_graph_launches_total", p, np.zeros(len(t))),
                ("process_cuda_syncs_total", p, 100.0 * since),
                ("process_cuda_sync_seconds_total", p, sync_share * since),
                ("process_cuda_h2d_bytes_total", p, 1e6 * since)]
        store.append_batch([(m, lab) for m, lab, _ in cols], (t * 1e9).astype(np.int64),
                           np.column_stack([v for _, _, v in cols]))
        store.flush()


@pytest.mark.parametrize(("launches", "sync", "kind"), [(40_000, 0.02, "launch_bound"), (300, 0.6, "sync_bound")])
def test_a_past_range_from_the_store_reads_the_probes_counters(tmp_path, launches, sync, kind):
    import time

    from gpuscope.diagnose.history import diagnose_range
    from gpuscope.store import Store

    now = time.time()
    _store(tmp_path, now, launches, sync)
    with Store(tmp_path, readonly=True) as store:
        r = diagnose_range(store, int((now - 600) * 1e9), int(now * 1e9))
    kinds = {s.kind for s in r.spans if s.primary and s.gpu == "0"}
    assert kinds == {kind}, [(s.kind, s.summary) for s in r.spans if s.primary]
    span = next(s for s in r.spans if s.primary)
    assert f"{launches:,} launches/s" in span.summary, span.summary
