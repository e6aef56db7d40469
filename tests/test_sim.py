"""The simulated node: every scenario runs through the real sampler, carries the signature measured on an
H200 (shared/workloads/METRICS.md), and says it is simulated. Scenarios that unfold over seconds are
driven by a hand-moved clock, not by sleeping."""

import time

import pytest

from gpuscope import Sampler, SamplerConfig
from gpuscope.sim import DESCRIPTIONS, SCENARIOS, SimulatedNode, UnknownScenario, describe

GIB = 1 << 30
MIB = 1 << 20


def run(name, gpus=None, **cfg):
    """Two ticks of Sampler(simulate=name), far enough apart for GPM; returns (sampler, snapshot)."""
    config = SamplerConfig(**{"interval": 0.05, "gpm_window": 0.1, "events": False, **cfg})
    s = Sampler(config, simulate=name, gpus=gpus)
    try:
        s.sample_once()
        time.sleep(0.12)
        return s, s.sample_once()
    finally:
        s.stop()


def on_fake_clock(name, clock, **cfg):
    """A sampler on SimulatedNode(name) whose scenario time is `clock` (FakeNVML keeps t0 from its own
    construction, so both the clock and t0 are replaced)."""
    node = SimulatedNode(name)
    node.nvml.clock = clock
    node.nvml.t0 = clock()
    config = SamplerConfig(**{"interval": 0.05, "events": False, **cfg})
    return node, Sampler(config, nvml=node.nvml, host_reader=node.host_reader, host_source=node.host_source)


class Clock:
    def __init__(self):
        self.t = 500.0

    def __call__(self):
        return self.t


def test_scenario_list():
    assert SCENARIOS == sorted(DESCRIPTIONS)
    assert {"compute_bound", "h2d_pinned", "launch_bound", "idle_allocated", "throttled", "memory_leak",
            "gpu_lost", "xid_storm", "mixed"} <= set(SCENARIOS)
    assert all(describe(s) for s in SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_scenario_builds_and_samples(name):
    s, snap = run(name)
    assert snap.simulated == name
    assert s.simulated == name
    expected_gpus = {"gpu_lost": 2, "mixed": 8}.get(name, 1)
    assert len(snap.gpus) == expected_gpus
    for g in snap.gpus:
        assert g.healthy
        assert g.sm_active_ratio is not None and 0.0 <= g.sm_active_ratio <= 1.0
        assert g.utilization_ratio is not None and 0.0 <= g.utilization_ratio <= 1.0
        assert 0 < g.memory_used_bytes < g.values["gpu_memory_total_bytes"]
        assert g.power_watts > 0
        assert "simulated" in g.identity.name
    assert len(snap.processes) == expected_gpus * {"shared_gpu": 2}.get(name, 1)
    assert all(p.host_visible and p.name for p in snap.processes)
    assert snap.host is not None and 0.0 <= snap.host.values["host_cpu_ratio"] <= 1.0


def test_unknown_scenario_lists_the_choices():
    with pytest.raises(UnknownScenario) as exc:
        SimulatedNode("warp_drive")
    msg = str(exc.value)
    assert "warp_drive" in msg
    for name in SCENARIOS:
        assert name in msg
    assert isinstance(exc.value, ValueError)
    with pytest.raises(UnknownScenario):
        Sampler(SamplerConfig(events=False), simulate="warp_drive")


def test_scenario_names_accept_dashes():
    assert SimulatedNode("compute-bound").scenario == "compute_bound"


@pytest.mark.parametrize("n", [0, 65])
def test_gpu_count_is_bounded(n):
    with pytest.raises(UnknownScenario, match="1 to 64"):
        SimulatedNode("healthy", gpus=n)


def test_gpu_count_can_be_chosen():
    s, snap = run("healthy", gpus=3)
    assert [g.identity.label for g in snap.gpus] == ["0", "1", "2"]


# ---- signatures ---------------------------------------------------------------------------------------


def test_compute_bound_signature():
    _, snap = run("compute_bound")
    g = snap.gpus[0]
    assert g.values["gpu_tensor_active_ratio"] > 0.5
    assert g.sm_active_ratio > 0.9
    assert "sw_power_cap" in g.throttle_reasons


def test_h2d_pinned_signature():
    # the headline lie: NVML utilization ~100 % while the SMs do nothing
    _, snap = run("h2d_pinned")
    g = snap.gpus[0]
    assert g.utilization_ratio >= 0.9
    assert g.sm_active_ratio < 0.05
    assert g.values["gpu_pcie_rx_bytes_per_second"] > 40e9


def test_launch_bound_signature():
    _, snap = run("launch_bound")
    g = snap.gpus[0]
    assert g.sm_active_ratio < 0.05
    (p,) = snap.processes
    assert p.thread_cpu_max_ratio >= 0.9
    assert "serve.py" in p.cmdline


def test_idle_allocated_signature():
    _, snap = run("idle_allocated")
    g = snap.gpus[0]
    assert g.memory_used_bytes > 40 * GIB
    assert g.sm_active_ratio == 0.0
    assert g.utilization_ratio == 0.0


def test_throttled_signature():
    _, snap = run("throttled")
    g = snap.gpus[0]
    assert {"hw_thermal", "sw_thermal"} & set(g.throttle_reasons)
    assert g.values["gpu_temperature_celsius"] >= 85


def test_mixed_node_has_a_different_behaviour_per_gpu():
    _, snap = run("mixed")
    assert snap.gpu(1).values["gpu_tensor_active_ratio"] > 0.5  # compute_bound
    assert snap.gpu(5).memory_used_bytes > 40 * GIB and snap.gpu(5).sm_active_ratio == 0.0  # idle_allocated
    assert snap.gpu(3).sm_active_ratio < 0.05  # launch_bound


def test_memory_leak_grows():
    clock = Clock()
    node, s = on_fake_clock("memory_leak", clock)
    try:
        first = s.sample_once().gpus[0].memory_used_bytes
        for _ in range(10):
            clock.t += 0.1
            snap = s.sample_once()
        grown = snap.gpus[0].memory_used_bytes - first
        assert grown == pytest.approx(900 * MIB, rel=0.05)  # ~0.9 GiB/s
        (p,) = snap.processes
        assert p.gpu_memory_bytes is not None
    finally:
        s.stop()


def test_gpu_lost_after_ten_seconds():
    clock = Clock()
    node, s = on_fake_clock("gpu_lost", clock, events=True)
    try:
        for _ in range(3):
            clock.t += 3.0  # 9 s of scenario time
            snap = s.sample_once()
            assert all(g.healthy for g in snap.gpus)
        clock.t += 1.5  # 10.5 s: GPU 1 falls off the bus
        snaps = []
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            snaps.append(s.sample_once())
            xid79 = [e for sn in snaps for e in sn.events if e.kind == "xid" and e.data.get("xid") == 79]
            if not snaps[-1].gpu(1).healthy and xid79:
                break
            time.sleep(0.02)
        last = snaps[-1]
        assert last.gpu(0).healthy and not last.gpu(1).healthy
        assert last.gpu(1).values["gpu_healthy"] == 0.0
        events = [e for sn in snaps for e in sn.events]
        assert [e.gpu for e in events if e.kind == "gpu_lost"] == ["1"]
        assert [e.gpu for e in events if e.kind == "xid" and e.data["xid"] == 79] == ["1"]
        assert last.gpu(1).values['gpu_xid_events_total{xid="79"}'] == 1
    finally:
        s.stop()


def test_xid_storm_bursts():
    clock = Clock()
    node, s = on_fake_clock("xid_storm", clock, events=True)
    try:
        clock.t += 1.0
        snap = s.sample_once()
        assert not [e for e in snap.events if e.kind == "xid"]  # nothing before 2 s
        clock.t += 1.5  # 2.5 s: the first burst of five
        snaps = []
        deadline = time.monotonic() + 2.0
        key = 'gpu_xid_events_total{{xid="{}"}}'
        while time.monotonic() < deadline:
            snaps.append(s.sample_once())
            v = snaps[-1].gpus[0].values
            if sum(v.get(key.format(c), 0) for c in (13, 31, 43)) == 5 and any(
                    e.kind == "ecc" for sn in snaps for e in sn.events):
                break
            time.sleep(0.02)
        v = snaps[-1].gpus[0].values
        counts = {c: v.get(key.format(c), 0) for c in (13, 31, 43)}
        assert sum(counts.values()) == 5 and all(n >= 1 for n in counts.values())
        assert v['gpu_ecc_events_total{type="corrected"}'] == 1
        xids = [e for sn in snaps for e in sn.events if e.kind == "xid"]
        assert sum(e.count for e in xids) == 5
        assert snaps[-1].gpus[0].healthy
        # the next burst, 3 s later, counts again
        clock.t += 3.0
        s.sample_once()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            time.sleep(0.02)
            v = s.sample_once().gpus[0].values
            if sum(v.get(key.format(c), 0) for c in (13, 31, 43)) == 10:
                break
        assert sum(v.get(key.format(c), 0) for c in (13, 31, 43)) == 10
    finally:
        s.stop()



def test_processes_are_dealt_over_the_gpus_and_share_memory():
    with Sampler(SamplerConfig(interval=0.05), simulate="mixed", gpus=8, processes=100) as s:
        s.start()
        deadline = time.time() + 5
        while (snap := s.latest()) is None or len(snap.processes) < 100:
            assert time.time() < deadline, "the simulated node never reported its 100 processes"
            time.sleep(0.05)
    per_gpu: dict[str, list] = {}
    for p in snap.processes:
        per_gpu.setdefault(p.gpu, []).append(p)
    assert sorted(len(v) for v in per_gpu.values()) == [12, 12, 12, 12, 13, 13, 13, 13]
    assert len({p.pid for p in snap.processes}) == 100
    for g in snap.gpus:
        procs = per_gpu[str(g.index)]
        assert sum(p.gpu_memory_bytes for p in procs) <= g.values["gpu_memory_used_bytes"]
        assert len({p.cmdline for p in procs}) == len(procs)  # each rank tells itself apart


def test_process_count_out_of_range_is_one_sentence():
    with pytest.raises(UnknownScenario, match="1 to 4096 processes"):
        SimulatedNode("healthy", processes=0)


# ---- process churn -------------------------------------------------------------------------------------


class Ticking:
    """A sampler whose ticks run on the same hand-moved clock as the node: tick() is one tick at clock.t,
    so every tick lists the processes (their period is the interval) whatever the machine's speed."""

    def __init__(self, node, clock):
        node.nvml.clock = clock
        node.nvml.t0 = clock()
        self.clock = clock
        config = SamplerConfig(interval=0.05, processes=0.05, events=False)
        self.sampler = Sampler(config, nvml=node.nvml, host_reader=node.host_reader, host_source=node.host_source)
        self.sampler.open()

    def tick(self):
        return self.sampler._tick(self.clock.t)

    def stop(self):
        self.sampler.stop()


def churning(clock, churn_s, gpus=4, processes=20):
    node = SimulatedNode("mixed", gpus=gpus, processes=processes, churn_s=churn_s)
    return node, Ticking(node, clock)


def test_churn_replaces_every_process_once_per_period_and_keeps_the_count():
    clock = Clock()
    node, s = churning(clock, churn_s=10.0)
    try:
        snaps = [(0.0, s.tick())]
        for _ in range(51):  # 20.4 s of the node's clock: two periods, short of the third round (20.5 s)
            clock.t += 0.4
            snaps.append((clock.t - 500.0, s.tick()))
    finally:
        s.stop()
    first = {p.pid for p in snaps[0][1].processes}
    seen: dict[int, list[float]] = {}
    for t, snap in snaps:
        assert len(snap.processes) == 20 and len({p.pid for p in snap.processes}) == 20
        for p in snap.processes:
            seen.setdefault(p.pid, []).append(t)
    # One replacement every 10 s / 20 = 0.5 s, node-wide: 40 in 20.4 s, each a pid never seen before.
    assert node.replaced == 40
    assert len(seen) == 20 + 40
    assert min(set(seen) - first) > max(first)
    # A process born and gone inside the run lived one period, as the ticks (0.4 s apart) saw it.
    lives = [ts[-1] - ts[0] for pid, ts in seen.items() if pid not in first and ts[-1] < snaps[-1][0]]
    assert len(lives) == 20
    assert all(10.0 - 0.4 - 1e-9 <= life <= 10.0 + 1e-9 for life in lives), lives
    # Spread, not all at once: no tick saw more than one new process per 0.5 s of clock, plus one.
    for (t0, a), (t1, b) in zip(snaps, snaps[1:], strict=False):
        new = {p.pid for p in b.processes} - {p.pid for p in a.processes}
        assert len(new) <= (t1 - t0) / 0.5 + 1


def test_churn_shows_as_process_start_and_stop_events_with_new_command_lines():
    clock = Clock()
    node, s = churning(clock, churn_s=4.0, gpus=2, processes=8)
    try:
        prev = s.tick()
        starts, stops = [], []
        for _ in range(10):  # 5 s: 10 replacements, one every 0.5 s
            clock.t += 0.5
            snap = s.tick()
            before, now = {p.pid: p for p in prev.processes}, {p.pid: p for p in snap.processes}
            got_start = sorted(e.data["pid"] for e in snap.events if e.kind == "process_start")
            got_stop = sorted(e.data["pid"] for e in snap.events if e.kind == "process_stop")
            assert got_start == sorted(now.keys() - before.keys())
            assert got_stop == sorted(before.keys() - now.keys())
            for pid in now.keys() - before.keys():
                new = now[pid]
                old = next(p for p in prev.processes if p.gpu == new.gpu and p.pid not in now)
                assert new.cmdline != old.cmdline and "--run " in new.cmdline
                assert new.started_at > old.started_at
            starts += got_start
            stops += got_stop
            prev = snap
    finally:
        s.stop()
    assert len(starts) == len(stops) == node.replaced == 10
    for g in {p.gpu for p in prev.processes}:
        cmds = [p.cmdline for p in prev.processes if p.gpu == g]
        assert len(set(cmds)) == len(cmds)


def test_no_churn_unless_asked():
    clock = Clock()
    node = SimulatedNode("mixed", gpus=2, processes=8)
    s = Ticking(node, clock)
    try:
        pids = {p.pid for p in s.tick().processes}
        clock.t += 3600.0
        assert {p.pid for p in s.tick().processes} == pids
    finally:
        s.stop()
    assert node.churn_s is None and node.replaced == 0


def test_a_clock_jump_of_many_periods_replaces_each_process_once():
    clock = Clock()
    node, s = churning(clock, churn_s=2.0, gpus=1, processes=3)
    try:
        pids = {p.pid for p in s.tick().processes}
        clock.t += 1000.0
        after = {p.pid for p in s.tick().processes}
    finally:
        s.stop()
    assert len(after) == 3 and not after & pids and node.replaced == 3


@pytest.mark.parametrize("churn", [0, 0.5, -1, float("inf"), float("nan"), 8 * 86400, True])
def test_churn_out_of_range_is_one_sentence(churn):
    with pytest.raises(UnknownScenario, match="lives 1 s to 7 days"):
        SimulatedNode("healthy", churn_s=churn)


@pytest.mark.parametrize(("argv", "says"), [
    (["agent", "--churn", "60"], "--churn only applies to a simulated node"),
    (["agent", "--simulate", "mixed", "--churn", "500ms"], "--churn must be between 1s and 7d"),
    (["agent", "--simulate", "mixed", "--churn", "soon"], "Argument --churn"),
])
def test_agent_churn_flag_errors_are_one_sentence(argv, says, capsys):
    from gpuscope.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("name", SCENARIOS)
def test_no_simulated_gpu_draws_over_its_power_limit_without_the_power_cap_reason(name):
    # A real GPU's power limiter cuts its clocks (sw_power_cap) rather than let the draw pass the limit.
    clock = Clock()
    node, s = on_fake_clock(name, clock, interval=0.1, medium=0.1, gpm=False, collect_processes=False,
                            collect_host=False)
    over = []
    s.open()
    try:
        for k in range(300):  # 30 s of scenario time, power and reasons read every tick
            clock.t = 500.0 + k * 0.1
            snap = s._tick(clock.t)
            for g in snap.gpus:
                watts, limit = g.power_watts, g.values.get("gpu_power_limit_watts")
                if not g.healthy or watts is None:
                    continue
                assert limit, "the simulated GPU has a power limit"
                if watts > limit and "sw_power_cap" not in g.throttle_reasons:
                    over.append((k, g.identity.label, round(watts, 1), limit))
    finally:
        s.stop()
    assert over == [], f"{len(over)} readings over the limit without sw_power_cap, e.g. {over[:3]}"
