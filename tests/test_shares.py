"""Shared GPUs on the fake NVML: per-process SM shares scaled to the GPU's GPM SM activity, energy shared
out by SM share, missing samples, a process that ends, the per-pod roll-up, and what /metrics shows of it.

The real GPM, NVML and process sources run on a fake clock, so each window is exact; expectations are
computed from what the sources recorded (GPM values and windows, the energy counter), not from timing.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pynvml
import pytest
from host_fakes import FakeHostReader
from prometheus_client.parser import text_string_to_metric_families

from gpuscope._hostproc import HostProcInfo
from gpuscope.export.exposition import render
from gpuscope.fakenvml import AMPERE, FakeGPU, FakeNVML, FakeProcess
from gpuscope.shares import fractions, owner, roll_up
from gpuscope.sources.gpm import GpmSource
from gpuscope.sources.nvml import NvmlSource
from gpuscope.sources.procs import ProcessSource

GIB = 1 << 30


class Rig:
    """One GPU with GPM, the energy counter and the process source, stepped on a fake clock."""

    def __init__(self, open_devices, procs, infos=None, gpm_percent=60.0, architecture=9):
        self.t = 0.0
        clock = lambda: self.t  # noqa: E731
        self.gpu = FakeGPU(index=0, architecture=architecture, gpm={2: gpm_percent}, processes=procs,
                           energy_mj=1_000_000)
        self.fake = FakeNVML([self.gpu], clock=clock)
        self.nv, devs = open_devices(self.fake)
        self.dev = devs[0]
        self.gpm = GpmSource(self.nv, 0.1, clock=clock)
        self.nvsrc = NvmlSource(self.nv, [])
        self.src = ProcessSource(self.nv, FakeHostReader(infos or {}))
        self.windows: list[tuple[float, float]] = []  # (GPM SM activity, window seconds) as recorded
        self.extra_samples: list[tuple[int, int]] = []  # (pid, smUtil) of processes NVML no longer lists
        real = self.fake.nvmlDeviceGetProcessUtilization

        def util(h, last):
            try:
                out = list(real(h, last))
            except pynvml.NVMLError:
                if not self.extra_samples:
                    raise
                out = []
            now = int(time.time() * 1e6)
            out += [SimpleNamespace(pid=pid, timeStamp=now, smUtil=sm, memUtil=0, encUtil=0, decUtil=0)
                    for pid, sm in self.extra_samples]
            return out

        self.fake.nvmlDeviceGetProcessUtilization = util
        self.gpm_step()  # the first GPM sample: no value yet
        self.energy()

    def gpm_step(self, dt: float = 0.25) -> None:
        self.t += dt
        self.gpm.collect("gpm", self.dev, self.t)
        if "gpm_window_s" in self.dev.state and self.dev.state.get("gpm_window_s") not in (None, 0):
            w = self.dev.state.pop("gpm_window_s")
            self.windows.append((self.dev.values["gpu_sm_active_ratio"], w))

    def energy(self, add_joules: float = 0.0) -> None:
        self.gpu.energy_mj += int(add_joules * 1000)
        self.nvsrc.collect("energy", self.dev, self.t)

    def collect(self):
        time.sleep(0.001)  # NVML stamps samples in microseconds of wall time: one read, one stamp
        return {p.pid: p for p in self.src.collect([self.dev], [], utilization=True)}

    def mean_sm(self) -> float:
        """Time-weighted mean of the GPM windows recorded since the last call."""
        w = self.windows
        self.windows = []
        return sum(v * s for v, s in w) / sum(s for _, s in w)


def procs(*sm: int) -> list[FakeProcess]:
    return [FakeProcess(pid=100 + i, used_memory_bytes=(i + 1) * GIB, sm_percent=s, mem_percent=5)
            for i, s in enumerate(sm)]


def test_fractions_are_parts_of_the_busy_time():
    assert fractions({1: 300.0, 2: 100.0}) == {1: 0.75, 2: 0.25}
    assert fractions({1: 0.0, 2: 0.0}) == {1: 0.0, 2: 0.0}  # nobody ran
    assert fractions({}) == {}


def test_shares_scale_to_the_gpus_sm_activity(open_devices):
    rig = Rig(open_devices, procs(50, 30, 20), gpm_percent=60.0)
    rig.gpm_step()
    recs = rig.collect()
    assert [round(recs[p].sm_ratio, 9) for p in (100, 101, 102)] == [0.30, 0.18, 0.12]
    assert sum(r.sm_ratio for r in recs.values()) == pytest.approx(rig.dev.values["gpu_sm_active_ratio"]) \
        == pytest.approx(0.60)
    # NVML's own figure is kept beside the share, unscaled
    assert [recs[p].utilization_ratio for p in (100, 101, 102)] == [0.5, 0.3, 0.2]
    cap = rig.dev.caps["gpu_process_sm_active_ratio"]
    assert cap.supported and cap.reason == ""


def test_shares_sum_to_the_mean_sm_activity_of_their_window(open_devices):
    rig = Rig(open_devices, procs(70, 10), gpm_percent=90.0)
    rig.gpm_step()
    rig.collect()  # the first window
    rig.mean_sm()
    for pct in (90.0, 20.0, 20.0, 50.0):  # the GPU's SM activity changes within the next window
        rig.gpu.gpm[2] = pct
        rig.gpm_step(0.3)
    expected = rig.mean_sm()
    recs = rig.collect()
    total = sum(r.sm_ratio for r in recs.values())
    assert total == pytest.approx(expected, rel=1e-9)
    assert total != pytest.approx(rig.dev.values["gpu_sm_active_ratio"])  # the window's mean, not the last value
    assert recs[100].sm_ratio == pytest.approx(expected * 70 / 80)


def test_energy_is_shared_by_sm_share_and_sums_to_the_gpus(open_devices):
    rig = Rig(open_devices, procs(50, 30, 20))
    rig.gpm_step()
    first = rig.collect()
    assert [first[p].energy_joules for p in (100, 101, 102)] == [0.0, 0.0, 0.0]  # no window yet
    rig.gpm_step()
    rig.energy(10.0)
    recs = rig.collect()
    assert [recs[p].energy_joules for p in (100, 101, 102)] == pytest.approx([5.0, 3.0, 2.0])
    rig.gpu.processes[2].sm_percent = 0  # the third one stops computing
    rig.gpm_step()
    rig.energy(8.0)
    recs = rig.collect()
    assert [recs[p].energy_joules for p in (100, 101, 102)] == pytest.approx([10.0, 6.0, 2.0])
    assert sum(r.energy_joules for r in recs.values()) == pytest.approx(18.0)  # all of the GPU's, both windows


def test_missing_samples_mean_idle_and_leave_the_energy_unattributed(open_devices):
    rig = Rig(open_devices, procs(80, 0))  # the second process has no sample at all
    rig.gpm_step()
    rig.collect()
    rig.gpm_step()
    rig.energy(4.0)
    recs = rig.collect()
    assert recs[101].sm_ratio == 0.0 and recs[101].utilization_ratio == 0.0 and recs[101].energy_joules == 0.0
    assert recs[100].sm_ratio == pytest.approx(0.60)  # the one that ran takes all the GPU's SM activity
    assert recs[100].energy_joules == pytest.approx(4.0)
    for p in rig.gpu.processes:
        p.sm_percent = 0  # nobody runs: NVML answers NOT_FOUND
    rig.gpm_step()
    rig.energy(3.0)
    recs = rig.collect()
    assert all(r.sm_ratio == 0.0 for r in recs.values())
    assert recs[100].energy_joules == pytest.approx(4.0)  # the idle window's 3 J are no one's
    assert rig.dev.caps["gpu_process_sm_active_ratio"].supported
    rig.gpu.processes[0].sm_percent = 50
    rig.gpm_step()
    rig.energy(2.0)
    recs = rig.collect()
    assert recs[100].energy_joules == pytest.approx(6.0)  # only the new window's


def test_unsupported_per_process_utilization_is_none_with_a_reason(open_devices):
    rig = Rig(open_devices, procs(50))
    rig.fake.nvmlDeviceGetProcessUtilization = lambda h, last: (_ for _ in ()).throw(
        pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED))
    rig.gpm_step()
    recs = rig.collect()
    assert recs[100].sm_ratio is None and recs[100].energy_joules is None and recs[100].utilization_ratio is None
    assert recs[100].gpu_memory_bytes == GIB  # memory per process does not need it
    for m in ("gpu_process_sm_active_ratio", "gpu_process_energy_joules_total"):
        assert not rig.dev.caps[m].supported and "not supported" in rig.dev.caps[m].reason


def pod_infos():
    return {100: HostProcInfo(100, name="train", container="c1", pod_uid="u-a", pod="a", namespace="ml"),
            101: HostProcInfo(101, name="train", container="c2", pod_uid="u-a", pod="a", namespace="ml"),
            102: HostProcInfo(102, name="serve", container="f00d"),
            103: HostProcInfo(103, name="bare")}


def test_a_process_that_ends_keeps_its_pods_energy(open_devices):
    rig = Rig(open_devices, procs(40, 40, 20), infos=pod_infos())
    rig.gpm_step()
    rig.collect()
    rig.gpm_step()
    rig.energy(10.0)
    rig.collect()
    pod = {(r.namespace, r.pod): r for r in rig.src.pods}[("ml", "a")]
    assert pod.energy_joules == pytest.approx(8.0) and pod.processes == 2
    # 101 ends; NVML still has its last samples for the window in which it ran
    rig.gpu.processes = [p for p in rig.gpu.processes if p.pid != 101]
    rig.extra_samples = [(101, 40)]
    rig.gpm_step()
    rig.energy(10.0)
    expected_sm = rig.mean_sm()
    recs = rig.collect()
    assert 101 not in recs
    assert recs[100].sm_ratio == pytest.approx(expected_sm * 0.4)  # the shares keep their sizes
    assert sum(r.sm_ratio for r in recs.values()) == pytest.approx(expected_sm * 0.6)
    pod = {(r.namespace, r.pod): r for r in rig.src.pods}[("ml", "a")]
    assert pod.processes == 1
    assert pod.energy_joules == pytest.approx(16.0)  # 101's last 4 J went to its pod: the counter never falls
    assert (rig.dev.label, 101) not in rig.src._energy  # the ended process is forgotten
    rig.extra_samples = []
    rig.gpu.processes = []  # the pod's last process ends too
    rig.collect()
    assert rig.src.pods == []


def test_roll_up_per_pod_else_per_container(open_devices):
    rig = Rig(open_devices, procs(40, 20, 20, 20), infos=pod_infos())
    rig.gpm_step()
    rig.collect()
    rig.gpm_step()
    rig.energy(5.0)
    recs = rig.collect()
    pods = {(r.namespace, r.pod, r.container): r for r in rig.src.pods}
    assert set(pods) == {("ml", "a", ""), ("", "", "f00d")}  # 103 is in no container: not rolled up
    a = pods[("ml", "a", "")]
    assert a.processes == 2 and a.gpu_memory_bytes == 3 * GIB
    assert a.sm_ratio == pytest.approx(recs[100].sm_ratio + recs[101].sm_ratio) == pytest.approx(0.36)
    assert a.energy_joules == pytest.approx(3.0)
    assert pods[("", "", "f00d")].sm_ratio == pytest.approx(0.12)
    assert owner(recs[103]) is None


def test_roll_up_without_values_is_none_not_zero():
    from gpuscope._records import ProcessRecord

    rows = roll_up([ProcessRecord(1, "0", "u", "compute", pod="p", namespace="n")])
    assert rows[0].sm_ratio is None and rows[0].gpu_memory_bytes is None and rows[0].energy_joules is None


def test_without_gpm_the_share_is_nvmls_own_figure_and_says_so(open_devices):
    rig = Rig(open_devices, procs(50, 30), architecture=AMPERE)
    rig.gpm_step()
    rig.energy()
    recs = rig.collect()
    assert recs[100].sm_ratio == 0.5 and recs[101].sm_ratio == 0.3
    cap = rig.dev.caps["gpu_process_sm_active_ratio"]
    assert cap.supported and "no GPM" in cap.reason
    rig.energy(8.0)
    recs = rig.collect()
    assert recs[100].energy_joules == pytest.approx(5.0)  # energy is shared out by time alone


def metrics(snapshot, **kw):
    out = {}
    for fam in text_string_to_metric_families(render(snapshot, **kw).decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_the_sampler_exports_shares_and_pods(make_sampler):
    fake = FakeNVML([FakeGPU(index=0, gpm={2: 50.0}, processes=procs(60, 20, 20, 0))])
    s = make_sampler(fake, host_reader=FakeHostReader(pod_infos()), interval=0.01, processes=0.01,
                     process_utilization=0.15, gpm_window=0.1, energy=0.01)
    deadline = time.monotonic() + 30.0  # a bound for a stalled machine; the loop ends at its condition
    reads = 0
    while time.monotonic() < deadline:
        snap = s.sample_once()
        fake.gpus[0].energy_mj += 1000
        cap = s.devices[0].caps.get("gpu_process_sm_active_ratio")
        reads += cap is not None and cap.reason == "" and sum(p.energy_joules or 0 for p in snap.processes) > 0
        if reads >= 20:
            break
        time.sleep(0.02)
    assert reads >= 20
    shares = {p.pid: p.sm_ratio for p in snap.processes}
    assert sum(shares.values()) == pytest.approx(0.50)
    assert shares[100] == pytest.approx(0.30) and shares[103] == 0.0
    assert sum(p.energy_joules for p in snap.processes) > 0
    m = metrics(snap, top_processes=2)
    pod = {(lab.get("namespace"), lab.get("pod"), lab.get("container")): v for lab, v in m["gpu_pod_sm_active_ratio"]}
    assert pod == {("ml", "a", None): pytest.approx(0.40), (None, None, "f00d"): pytest.approx(0.10)}
    assert all(lab["gpu"] == "0" and lab["uuid"] for lab, _ in m["gpu_pod_energy_joules_total"])
    # the top two by GPU memory get their own series, the rest are summed into 'other'...
    assert {lab["pid"] for lab, _ in m["gpu_process_sm_active_ratio"]} == {"102", "103", "other"}
    # ...but a sum over whichever processes fall outside the top is no counter: 'other' has none
    assert {lab["pid"] for lab, _ in m["gpu_process_energy_joules_total"]} == {"102", "103"}
    util = {lab["pid"]: v for lab, v in m["gpu_process_utilization_ratio"]}
    assert util["102"] == pytest.approx(0.20) and util["other"] == pytest.approx(0.80)
