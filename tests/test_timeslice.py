"""A GPU its processes take turns on (time-slicing, diagnose/timeslice.py): its time full (NVML 100 %), its SMs
63 % busy in all because the turns of small kernels fill few SMs. The main user (its kernels 72 % of the time)
is judged over its own turns, the GPU's verdict is that of the main user's turns and names the time-slicing,
the other processes keep their host-side verdicts. The figures are those of shared_four on an H200
(tests/fixtures/recordings/runs/run_shared_four.json.gz); windows are built as the sampler builds them
(record_windows), the per-process utilization read every 5 s as the sampler reads it."""

from __future__ import annotations

import pytest
from record_windows import GIB, proc, window

from gpuscope.diagnose import diagnose
from gpuscope.diagnose.stacks import HostProfile
from gpuscope.diagnose.windows import time_share

#: GPU 0 under shared_four's four processes.
SLICED = {"gpu_utilization_ratio": 1.0, "gpu_sm_active_ratio": 0.634, "gpu_tensor_active_ratio": 0.563,
          "gpu_dram_active_ratio": 0.14, "gpu_fp32_active_ratio": 0.012, "gpu_fp16_active_ratio": 0.0,
          "gpu_pcie_rx_bytes_per_second": 2e8, "gpu_pcie_tx_bytes_per_second": 7e7}
#: The same GPU time with small kernels only: NVML 100 %, SMs 30 %, no tensor core.
SMALL = {**SLICED, "gpu_sm_active_ratio": 0.30, "gpu_tensor_active_ratio": 0.0, "gpu_fp32_active_ratio": 0.1}

MATMUL, ITEM, TINY, HOLDER = 791, 792, 793, 794


def launching(pid: int, line: str) -> HostProfile:
    return HostProfile(pid, 199, {"sync": 0.0, "data": 0.0, "launch": 0.995, "other": 0.005},
                       {"launch": [(line, 0.995)]})


def syncing(pid: int) -> HostProfile:
    return HostProfile(pid, 199, {"sync": 0.97, "data": 0.0, "launch": 0.0, "other": 0.03},
                       {"sync": [("_shared_roles.py:27 item_sync.<locals>.step", 0.97)]})


def four(shares: dict[int, float], first_read: dict[int, float] | None = None, next_read_s: float = 5.0):
    """shared_four's processes with these NVML time shares (read at t=0 and every 5 s from `next_read_s` on;
    `first_read` is what the read at t=0 said), their host threads each at a full core but the holder's."""
    def procs(t: float):
        u = first_read if first_read is not None and t < next_read_s else shares
        return [proc(pid, "python3", sm=u.get(pid, 0.0) * 0.634, util=u.get(pid, 0.0),
                     cpu=0.0 if pid == HOLDER else 1.0, threads=() if pid == HOLDER else (1.0,),
                     memory=4.6 * GIB if pid == HOLDER else 2 * GIB) for pid in (MATMUL, ITEM, TINY, HOLDER)]
    return procs


PROFILES = {MATMUL: launching(MATMUL, "_shared_roles.py:20 matmul_bf16.<locals>.<lambda>"), ITEM: syncing(ITEM),
            TINY: launching(TINY, "_shared_roles.py:39 tiny_launch.<locals>.step")}


def verdict_of(w):
    for p in w.processes:
        p.profile = PROFILES.get(p.pid)
    (v,) = [v for v in diagnose([w]) if v.primary]
    return v, {p.pid: p for p in v.processes if p.primary}


@pytest.fixture(scope="module")
def sliced():
    return verdict_of(window(SLICED, four({MATMUL: 0.72, ITEM: 0.08, TINY: 0.2}), seconds=10.5))


def test_the_gpu_is_judged_by_its_main_users_turns_and_named_time_sliced(sliced):
    v, _ = sliced
    assert v.kind == "compute_bound" and v.severity == "info", (v.kind, v.summary)
    assert "time-sliced between 3 processes" in v.summary and "holds it 72 % of the time" in v.summary, v.summary
    assert "not a host" in v.summary and "Shared by 4 processes" in v.summary, v.summary
    ev = v.evidence
    assert (ev["main_pid"], ev["main_time_share"], ev["time_sliced_by"]) == (MATMUL, 0.72, 3), ev
    # the GPU's figures over the main user's turns: tensor 56.3 % / 72 %, SMs 63.4 % / 72 %
    assert ev["main_tensor_active"] == pytest.approx(0.563 / 0.72, abs=1e-3), ev
    assert ev["main_sm_active"] == pytest.approx(0.634 / 0.72, abs=1e-3), ev
    assert ev["sm_active"] == pytest.approx(0.634) and "stack_shares" not in ev, ev  # no host's stacks decide it


def test_the_main_user_waits_on_the_gpu_not_its_host(sliced):
    _, own = sliced
    m = own[MATMUL]
    assert (m.kind, m.severity) == ("compute_bound", "info"), m.summary
    assert "72 % of the time" in m.summary and "time-sliced with 2 other processes" in m.summary, m.summary
    assert "launch queue is full" in m.summary and "_shared_roles.py:20" in m.summary, m.summary
    assert m.evidence["time_share"] == 0.72 and m.evidence["stack_shares"]["launch"] == 0.995, m.evidence


def test_the_other_processes_keep_their_own_verdicts(sliced):
    _, own = sliced
    assert {pid: v.kind for pid, v in own.items()} == {
        MATMUL: "compute_bound", ITEM: "sync_bound", TINY: "launch_bound", HOLDER: "idle_allocated"}
    assert f"time-sliced, {MATMUL} (python3) holding it 72 % of the time" in own[TINY].summary, own[TINY].summary


def test_turns_of_small_kernels_are_not_a_busy_gpu():
    """A main user whose turns leave the SMs mostly idle (30 % / 90 %) is what it was: its host decides."""
    v, own = verdict_of(window(SMALL, four({MATMUL: 0.9, ITEM: 0.05, TINY: 0.05}), seconds=10.5))
    assert v.kind in ("sync_bound", "launch_bound") and "main_pid" not in v.evidence, (v.kind, v.evidence)
    assert own[MATMUL].kind == "launch_bound", own[MATMUL].summary


def test_one_process_at_full_time_is_not_time_sliced():
    """NVML 100 % and SMs 63 % from one process is one process's work (its small kernels), not contention."""
    w = window(SLICED, lambda t: [proc(MATMUL, "python3", sm=0.634, util=1.0, cpu=1.0, threads=(1.0,))],
               seconds=10.5)
    w.processes[0].profile = PROFILES[MATMUL]
    (v,) = [v for v in diagnose([w]) if v.primary]
    assert v.kind == "launch_bound" and "main_pid" not in v.evidence, (v.kind, v.summary)


def test_a_gpu_whose_time_is_mostly_no_ones_on_record_yet_gets_no_verdict():
    """The window of the start: the first per-process read covered the first second, when only the .item() loop
    ran; 60 % of the GPU's full time is no process's on record until the next read: not known who holds it."""
    w = window(SLICED, four({MATMUL: 0.72, ITEM: 0.08, TINY: 0.2}, first_read={ITEM: 0.4}, next_read_s=6.0),
               seconds=5.9)
    assert [v.kind for v in diagnose([w]) if v.primary] == []
    # from the next read on, the main user is known
    v, own = verdict_of(window(SLICED, four({MATMUL: 0.72, ITEM: 0.08, TINY: 0.2}, first_read={ITEM: 0.4}),
                               seconds=10.5))
    assert v.kind == "compute_bound" and own[MATMUL].kind == "compute_bound", (v.kind, v.summary)


def test_a_time_share_counts_each_read_for_the_time_it_covers():
    # a read covers the time since the read before it; the window's first value covered time before it
    assert time_share([0.0] * 5 + [0.68]) == 0.68
    assert time_share([0.4] * 5 + [0.08] * 5 + [0.1]) == pytest.approx((0.08 * 5 + 0.1 * 5) / 10)
    assert time_share([0.3, None, 0.3]) == 0.3 and time_share([None, None]) is None and time_share([]) is None
