"""The Prometheus text exposition: format (checked by the real promtool), labels, top-N processes,
escaping, DCGM names and units, and the render budget."""

from __future__ import annotations

import dataclasses
import math
import statistics
import subprocess
import time

import pytest
from servers import find_binary, need_binary

from gpuscope import Sampler, SamplerConfig
from gpuscope._records import Event, GpuIdentity, GpuRecord, HostRecord, ProcessRecord, Snapshot
from gpuscope.catalog import CATALOG, series_key
from gpuscope.export.exposition import CONTENT_TYPE, Exposition, render
from gpuscope.sim import SCENARIOS
from gpuscope.testing import healthy_gpus, lost_gpu, mig_gpu

MIB = 1 << 20


# ---- a strict parser of our own, independent of the renderer ---------------------------------

def _labels(body: str) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(body):
        eq = body.index("=", i)
        name = body[i:eq]
        assert body[eq + 1] == '"', body
        j, val = eq + 2, []
        while body[j] != '"':
            if body[j] == "\\":
                j += 1
                val.append({"n": "\n", "\\": "\\", '"': '"'}[body[j]])
            else:
                val.append(body[j])
            j += 1
        assert name not in out, f"duplicate label {name}"
        out[name] = "".join(val)
        i = j + 1
        if i < len(body):
            assert body[i] == ",", body
            i += 1
    return out


def parse(text: bytes) -> tuple[dict[str, tuple[str, str]], list[tuple[str, dict[str, str], float]]]:
    """(family -> (type, help), samples). Asserts HELP/TYPE once per family, before its samples,
    and each family's samples contiguous."""
    s = text.decode("utf-8")
    assert s.endswith("\n")
    fams: dict[str, tuple[str, str]] = {}
    helps: dict[str, str] = {}
    samples: list[tuple[str, dict[str, str], float]] = []
    current = None
    done: set[str] = set()
    for line in s.splitlines():
        if line.startswith("# HELP "):
            name, _, h = line[7:].partition(" ")
            assert name not in helps, f"second HELP for {name}"
            helps[name] = h
        elif line.startswith("# TYPE "):
            name, _, t = line[7:].partition(" ")
            assert name not in fams, f"second TYPE for {name}"
            assert t in ("gauge", "counter"), line
            fams[name] = (t, helps.get(name, ""))
            if current is not None:
                done.add(current)
            current = name
        else:
            if "{" in line:
                name, rest = line.split("{", 1)
                body, value = rest.rsplit("} ", 1)
                labels = _labels(body)
            else:
                name, value = line.split(" ")
                labels = {}
            assert name == current, f"{name} outside its family block ({current})"
            assert name not in done
            samples.append((name, labels, float(value)))
    return fams, samples


def series(samples: list, name: str, **match: str) -> list[tuple[dict[str, str], float]]:
    return [(lab, v) for n, lab, v in samples if n == name and all(lab.get(k) == v for k, v in match.items())]


def one(samples: list, name: str, **match: str) -> float:
    found = series(samples, name, **match)
    assert len(found) == 1, (name, match, found)
    return found[0][1]


def promtool_check(text: bytes) -> tuple[int, str]:
    tool = need_binary("promtool")
    p = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    return p.returncode, (p.stdout + p.stderr).decode()


# ---- snapshots ------------------------------------------------------------------------------

def simulated_snapshot(scenario: str, gpus: int | None = None) -> Snapshot:
    s = Sampler(SamplerConfig(interval=0.05, events=False), simulate=scenario, gpus=gpus)
    try:
        s.sample_once()
        time.sleep(0.22)  # one GPM window, so the profiling series are there
        return s.sample_once()
    finally:
        s.stop()


def fake_snapshot(nvml, *, ticks: int = 2, after=None) -> Snapshot:
    s = Sampler(SamplerConfig(interval=0.05, events=False, collect_host=False), nvml=nvml)
    try:
        snap = s.sample_once()
        if after is not None:
            after(nvml)
        for _ in range(ticks - 1):
            time.sleep(0.22)
            snap = s.sample_once()
        return snap
    finally:
        s.stop()


def ident(i: int = 0, **kw) -> GpuIdentity:
    base = dict(index=i, uuid=f"GPU-{i:04d}", name="NVIDIA H200", pci_bus_id=f"00000000:{i + 1:02x}:00.0",
                architecture="Hopper", compute_capability="9.0", driver_version="580.1", cuda_version="13.0")
    base.update(kw)
    return GpuIdentity(**base)


def proc(pid: int, mem_gib: float | None, gpu: str = "0", **kw) -> ProcessRecord:
    base = dict(pid=pid, gpu=gpu, gpu_uuid=f"GPU-{int(gpu.split('/')[0]):04d}", type="compute", name=f"p{pid}",
                user="alice", gpu_memory_bytes=None if mem_gib is None else mem_gib * (1 << 30), sm_ratio=0.1,
                memory_ratio=0.05, cpu_cores=0.5, thread_cpu_max_ratio=0.4, rss_bytes=float(1 << 30), threads=4)
    base.update(kw)
    return ProcessRecord(**base)


def snapshot(values: dict[str, float] | None = None, procs: list[ProcessRecord] | None = None, *,
             gpus: int = 1, simulated: str | None = None, events: list[Event] | None = None,
             host: dict[str, float] | None = None, healthy: bool = True) -> Snapshot:
    vals = {"gpu_power_watts": 350.5, "gpu_memory_used_bytes": 3000.0 * MIB} if values is None else values
    recs = [GpuRecord(ident(i), 1, dict(vals), healthy) for i in range(gpus)]
    return Snapshot(1, recs, procs or [], HostRecord(1, host) if host else None, events or [], simulated, "node-a")


# ---- promtool on every scenario, both modes ---------------------------------------------------

@pytest.fixture(scope="module")
def scenario_snapshots() -> dict[str, Snapshot]:
    snaps = {name: simulated_snapshot(name) for name in SCENARIOS}
    # Faults the timed scenarios only reach later: a lost GPU, MIG instances.
    snaps["fake_lost_gpu"] = fake_snapshot(lost_gpu(), after=lambda nv: setattr(nv.gpus[1], "lost", True))
    snaps["fake_mig"] = fake_snapshot(mig_gpu())
    snaps["synthetic_faults"] = snapshot(
        {series_key("gpu_xid_events_total", xid=79): 1.0, series_key("gpu_xid_events_total", xid=13): 4.0,
         series_key("gpu_ecc_events_total", type="corrected"): 2.0, series_key("gpu_retired_pages", cause="sbe"): 1.0,
         "gpu_healthy": 0.0, "gpu_energy_joules_total": 10.0},
        [proc(1, 1.0, name='we"ird\\name\n', pod="p", namespace="n", container="c")], healthy=False,
        events=[Event(1, "xid", "0", "XID 79", {"xid": 79})])
    return snaps


def test_promtool_accepts_canonical_mode_for_every_scenario(scenario_snapshots):
    for name, snap in scenario_snapshots.items():
        text = render(snap, extra={"gpuscope_sampler_cpu_seconds_total": 1.5, "gpuscope_sampler_ticks_total": 10.0})
        rc, out = promtool_check(text)
        assert rc == 0, f"{name}: promtool check metrics failed:\n{out[:3000]}"
        parse(text)


# What dcgm-exporter's own names and labels make promtool's linter say; nothing else is allowed.
DCGM_DIALECT_LINT = (
    "label names should be written in 'snake_case' not 'camelCase'",  # UUID, modelName, Hostname
    'counter metrics should have "_total" suffix',  # DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, ...
    "metric name should not include type 'counter'",  # DCGM_FI_DEV_PCIE_REPLAY_COUNTER
)


def test_promtool_accepts_dcgm_mode_for_every_scenario(scenario_snapshots):
    for name, snap in scenario_snapshots.items():
        text = render(snap, mode="dcgm")
        rc, out = promtool_check(text)
        # Exit 3 = lint problems only (a parse error exits 1).
        assert rc in (0, 3), f"{name}: promtool could not parse the DCGM exposition:\n{out[:3000]}"
        problems = {line.split(" ", 1)[1] for line in out.splitlines() if line.strip()}
        assert problems <= set(DCGM_DIALECT_LINT), f"{name}: unexpected lint {problems - set(DCGM_DIALECT_LINT)}"
        parse(text)


def test_prometheus_client_parser_reads_the_same_series():
    parser = pytest.importorskip("prometheus_client.parser")
    snap = simulated_snapshot("mixed")
    text = render(snap, extra={"gpuscope_sampler_ticks_total": 3.0})
    _, ours = parse(text)
    theirs = [(s.name, s.labels, s.value) for f in parser.text_string_to_metric_families(text.decode())
              for s in f.samples]
    assert sorted((n, sorted(lab.items()), v) for n, lab, v in ours) == \
        sorted((n, sorted(lab.items()), v) for n, lab, v in theirs)


# ---- canonical mode ---------------------------------------------------------------------------

def test_canonical_device_labels_types_and_info():
    snap = simulated_snapshot("mixed")
    fams, samples = parse(render(snap, hostname="gpu-node-7"))
    assert fams["gpu_power_watts"][0] == "gauge"
    assert fams["gpu_energy_joules_total"][0] == "counter"
    assert fams["gpu_throttle_seconds_total"][0] == "counter"
    assert fams["gpu_power_watts"][1] == CATALOG["gpu_power_watts"].help
    for name, (kind, _) in fams.items():
        if name in CATALOG:
            assert kind == CATALOG[name].kind.value
            assert (kind == "counter") == name.endswith("_total"), name
    power = series(samples, "gpu_power_watts")
    assert sorted(lab["gpu"] for lab, _ in power) == [str(i) for i in range(8)]
    for g in snap.gpus:
        lab = next(lab for lab, _ in power if lab["gpu"] == g.identity.label)
        assert lab == {"gpu": g.identity.label, "uuid": g.uuid, "model": "NVIDIA H200 (simulated)",
                       "hostname": "gpu-node-7", "simulated": "mixed"}
        assert one(samples, "gpu_power_watts", gpu=g.identity.label) == g.values["gpu_power_watts"]
    info = series(samples, "gpu_info", gpu="3")[0]
    assert info[1] == 1
    ident3 = snap.gpus[3].identity
    assert {k: info[0][k] for k in ("driver", "cuda", "pci_bus_id", "architecture", "compute_capability", "mig")} == {
        "driver": ident3.driver_version, "cuda": ident3.cuda_version, "pci_bus_id": ident3.pci_bus_id,
        "architecture": "Hopper", "compute_capability": "9.0", "mig": "false"}
    reasons = {lab["reason"] for lab, _ in series(samples, "gpu_throttle_seconds_total", gpu="0")}
    assert {"sw_power_cap", "hw_thermal", "gpu_idle"} <= reasons
    assert series(samples, "host_cpu_core_ratio", cpu="0")[0][0] == {"hostname": "gpu-node-7", "cpu": "0",
                                                                      "simulated": "mixed"}


def test_every_series_of_a_simulated_node_is_marked_and_real_ones_are_not():
    snap = simulated_snapshot("healthy")
    for mode in ("canonical", "dcgm"):
        _, samples = parse(render(snap, mode=mode, extra={"gpuscope_sampler_ticks_total": 1.0}))
        assert samples
        assert all(lab.get("simulated") == "healthy" for _, lab, _ in samples), mode
    real = fake_snapshot(healthy_gpus(2))
    for mode in ("canonical", "dcgm"):
        _, samples = parse(render(real, mode=mode))
        assert samples and not any("simulated" in lab for _, lab, _ in samples)


def test_missing_values_are_absent_never_zero():
    snap = snapshot({"gpu_power_watts": 100.0}, [proc(1, 2.0, sm_ratio=None, cpu_cores=None)])
    _, samples = parse(render(snap))
    names = {n for n, _, _ in samples}
    assert "gpu_sm_active_ratio" not in names and "gpu_memory_used_bytes" not in names
    assert "gpu_process_sm_active_ratio" not in names and "process_cpu_cores" not in names
    assert one(samples, "gpu_process_memory_used_bytes", pid="1") == 2.0 * (1 << 30)
    assert "host_cpu_ratio" not in names


def test_non_finite_values_use_prometheus_spelling():
    snap = snapshot({"gpu_power_watts": math.inf, "gpu_temperature_celsius": -math.inf,
                     "gpu_sm_active_ratio": math.nan})
    text = render(snap).decode()
    assert 'gpu_power_watts{gpu="0"' in text and text.count("+Inf\n") == 1 and text.count("-Inf\n") == 1
    assert "NaN\n" in text


def test_top_n_processes_by_gpu_memory_and_the_rest_summed_as_other():
    procs = [proc(100 + i, float(i), cpu_cores=0.1 * i, threads=i) for i in range(1, 21)]  # 1..20 GiB
    procs.append(proc(999, None, name="no-memory-reading"))
    procs += [proc(200 + i, 50.0 + i, gpu="1") for i in range(3)]
    snap = snapshot(procs=procs, gpus=2)
    _, samples = parse(render(snap, top_processes=5))
    mem0 = series(samples, "gpu_process_memory_used_bytes", gpu="0")
    pids = sorted(lab["pid"] for lab, _ in mem0)
    assert pids == sorted(["116", "117", "118", "119", "120", "other"])  # the 5 largest + other
    assert one(samples, "gpu_process_memory_used_bytes", gpu="0", pid="other") == sum(range(1, 16)) * (1 << 30)
    other = series(samples, "process_threads", gpu="0", pid="other")[0]
    assert other[1] == sum(range(1, 16)) + 4
    assert other[0]["process"] == "other" and "user" not in other[0]
    assert one(samples, "process_cpu_cores", gpu="0", pid="other") == pytest.approx(
        sum(0.1 * i for i in range(1, 16)) + 0.5)
    # GPU 1 has 3 processes: all kept, no 'other'.
    assert sorted(lab["pid"] for lab, _ in series(samples, "gpu_process_memory_used_bytes", gpu="1")) == \
        ["200", "201", "202"]
    # Cardinality is bounded per GPU whatever the process count.
    for fam in ("gpu_process_memory_used_bytes", "process_resident_memory_bytes"):
        assert len(series(samples, fam, gpu="0")) == 6
    _, none_kept = parse(render(snap, top_processes=0))
    assert [lab["pid"] for lab, _ in series(none_kept, "gpu_process_memory_used_bytes", gpu="0")] == ["other"]
    with pytest.raises(ValueError):
        render(snap, top_processes=-1)


def test_process_labels_include_attribution_when_present():
    p = proc(7, 1.0, pod="trainer-0", namespace="ml", container="torch", slurm_job="4242", user="bob")
    _, samples = parse(render(snapshot(procs=[p, proc(8, 0.5, user="")])))
    lab = series(samples, "gpu_process_sm_active_ratio", pid="7")[0][0]
    assert lab == {"gpu": "0", "uuid": "GPU-0000", "model": "NVIDIA H200", "hostname": "node-a", "pid": "7",
                   "process": "p7", "user": "bob", "pod": "trainer-0", "namespace": "ml", "container": "torch",
                   "slurm_job": "4242"}
    lab8 = series(samples, "gpu_process_sm_active_ratio", pid="8")[0][0]
    assert "user" not in lab8 and "pod" not in lab8 and "job" not in lab8


AWKWARD = ['say "hi"', "back\\slash", "new\nline", "trailing\\", "ünïcødé 🚀", "a,b=c}{d", "\\n literal", ""]


def test_awkward_process_names_are_escaped_and_round_trip():
    procs = [proc(300 + i, 10.0 - i, name=n, user=n) for i, n in enumerate(AWKWARD)]
    text = render(snapshot(procs=procs))
    _, samples = parse(text)
    got = {lab["pid"]: lab.get("process", "") for lab, _ in series(samples, "gpu_process_memory_used_bytes")}
    assert got == {str(300 + i): n for i, n in enumerate(AWKWARD)}
    assert 'process="new\\nline"' in text.decode()  # escaped, not a line break
    if find_binary("promtool"):
        rc, out = promtool_check(text)
        assert rc == 0, out


def test_extra_metrics_are_emitted_as_given():
    extra = {"gpuscope_sampler_cpu_seconds_total": 12.5, "gpuscope_scrapes_total": 3.0,
             'gpuscope_store_bytes{tier="1s"}': 1024.0, "gpuscope_up": 1.0}
    fams, samples = parse(render(snapshot(), extra=extra))
    assert fams["gpuscope_sampler_cpu_seconds_total"] == ("counter", CATALOG["gpuscope_sampler_cpu_seconds_total"].help)
    assert fams["gpuscope_scrapes_total"][0] == "counter" and fams["gpuscope_up"][0] == "gauge"
    assert one(samples, "gpuscope_sampler_cpu_seconds_total") == 12.5
    assert one(samples, "gpuscope_store_bytes", tier="1s") == 1024.0
    assert series(samples, "gpuscope_up")[0][0] == {"hostname": "node-a"}
    # An invalid name is dropped, not rendered into a broken exposition.
    fams, _ = parse(render(snapshot(), extra={"bad name!": 1.0, "ok_total": 1.0}))
    assert "ok_total" in fams and len([f for f in fams if "bad" in f]) == 0


def test_no_snapshot_yet_renders_only_the_agent_metrics():
    fams, samples = parse(render(None, extra={"gpuscope_up": 1.0}, hostname="h"))
    assert list(fams) == ["gpuscope_up"] and samples == [("gpuscope_up", {"hostname": "h"}, 1.0)]
    assert render(None) == b""


def test_unknown_mode_is_refused_in_one_sentence():
    with pytest.raises(ValueError, match="Unknown exposition mode 'otel'"):
        render(snapshot(), mode="otel")


def test_identity_change_is_not_served_from_a_stale_cache():
    expo = Exposition()
    snap = snapshot()
    expo.render(snap)
    snap.gpus[0].identity = dataclasses.replace(snap.gpus[0].identity, driver_version="999.9")
    _, samples = parse(expo.render(snap))
    assert series(samples, "gpu_info")[0][0]["driver"] == "999.9"


def test_content_type_is_the_text_format():
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


# ---- DCGM mode ----------------------------------------------------------------------------------

def test_dcgm_names_units_and_labels():
    vals = {
        "gpu_utilization_ratio": 0.87, "gpu_memory_utilization_ratio": 0.301, "gpu_memory_used_bytes": 41088.4 * MIB,
        "gpu_memory_free_bytes": 100 * MIB, "gpu_sm_clock_hertz": 1.98e9, "gpu_memory_clock_hertz": 3.201e9,
        "gpu_power_watts": 512.34, "gpu_energy_joules_total": 1234.5678, "gpu_temperature_celsius": 61.0,
        "gpu_sm_active_ratio": 0.8, "gpu_tensor_active_ratio": 0.5, "gpu_dram_active_ratio": 0.25,
        "gpu_pcie_tx_bytes_per_second": 1.5e9, "gpu_pcie_rx_bytes_per_second": 2.5e9,
        "gpu_pcie_replay_errors_total": 3.0, "gpu_clock_event_reasons": 4.0,
        series_key("gpu_throttle_seconds_total", reason="sw_power_cap"): 2.5,
        series_key("gpu_throttle_seconds_total", reason="sw_thermal"): 1.0,
        series_key("gpu_throttle_seconds_total", reason="hw_thermal"): 0.5,
        "gpu_thermal_throttle_seconds_total": 1.25,  # the two held together part of the time
        series_key("gpu_throttle_seconds_total", reason="hw_slowdown"): 9.0,  # no DCGM counterpart
        "gpu_healthy": 1.0,  # no DCGM counterpart
    }
    snap = snapshot(vals, [proc(1, 1.0)])
    fams, samples = parse(render(snap, mode="dcgm"))
    assert one(samples, "DCGM_FI_DEV_GPU_UTIL") == 87
    assert one(samples, "DCGM_FI_DEV_MEM_COPY_UTIL") == 30
    assert one(samples, "DCGM_FI_DEV_FB_USED") == 41088
    assert one(samples, "DCGM_FI_DEV_FB_FREE") == 100
    assert one(samples, "DCGM_FI_DEV_SM_CLOCK") == 1980
    assert one(samples, "DCGM_FI_DEV_MEM_CLOCK") == 3201
    assert one(samples, "DCGM_FI_DEV_POWER_USAGE") == 512.34
    assert one(samples, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION") == 1234568  # mJ
    assert one(samples, "DCGM_FI_DEV_GPU_TEMP") == 61
    assert one(samples, "DCGM_FI_PROF_SM_ACTIVE") == 0.8  # DCP ratios stay 0..1
    assert one(samples, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE") == 0.5
    assert one(samples, "DCGM_FI_PROF_DRAM_ACTIVE") == 0.25
    assert one(samples, "DCGM_FI_PROF_PCIE_TX_BYTES") == 1.5e9  # bytes per second
    assert one(samples, "DCGM_FI_PROF_PCIE_RX_BYTES") == 2.5e9
    assert one(samples, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER") == 3
    assert one(samples, "DCGM_FI_DEV_POWER_VIOLATION") == 2_500_000_000  # ns
    assert one(samples, "DCGM_FI_DEV_THERMAL_VIOLATION") == 1_250_000_000  # either thermal reason, once
    assert one(samples, "DCGM_FI_DEV_XID_ERRORS") == 0
    assert fams["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"][0] == "counter"
    assert fams["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"][0] == "counter"
    assert fams["DCGM_FI_PROF_PCIE_TX_BYTES"][0] == "gauge"
    assert fams["DCGM_FI_DEV_XID_ERRORS"][0] == "gauge"
    assert fams["DCGM_FI_DEV_SM_CLOCK"][1] == "SM clock frequency (in MHz)."
    assert all(n.startswith("DCGM_FI_") for n in fams)  # no canonical, process or host series
    lab = series(samples, "DCGM_FI_DEV_GPU_UTIL")[0][0]
    assert lab == {"gpu": "0", "UUID": "GPU-0000", "pci_bus_id": "00000000:01:00.0", "device": "nvidia0",
                   "modelName": "NVIDIA H200", "Hostname": "node-a", "DCGM_FI_DRIVER_VERSION": "580.1"}
    text = render(snap, mode="dcgm").decode()
    assert text.index('gpu="0",UUID=') < text.index("pci_bus_id") < text.index("device=") < text.index("modelName")


def test_dcgm_integer_fields_print_as_integers():
    text = render(snapshot({"gpu_memory_used_bytes": 5.0 * MIB, "gpu_power_watts": 100.0}), mode="dcgm").decode()
    assert [line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith("DCGM_FI_DEV_FB_USED")] == ["5"]
    assert [line.rsplit(" ", 1)[1] for line in text.splitlines()
            if line.startswith("DCGM_FI_DEV_POWER_USAGE")] == ["100.0"]


def test_dcgm_xid_errors_is_the_last_code():
    expo = Exposition()
    key = lambda c: series_key("gpu_xid_events_total", xid=c)  # noqa: E731
    snap = snapshot({"gpu_power_watts": 1.0})
    _, s = parse(expo.render(snap, mode="dcgm"))
    assert one(s, "DCGM_FI_DEV_XID_ERRORS") == 0
    snap = snapshot({key(13): 1.0})
    _, s = parse(expo.render(snap, mode="dcgm"))
    assert one(s, "DCGM_FI_DEV_XID_ERRORS") == 13
    lab = series(s, "DCGM_FI_DEV_XID_ERRORS")[0][0]
    assert lab["err_code"] == "13" and "illegal memory access" in lab["err_msg"]
    # 31 arrives: it is the last one, although 13 was seen more often.
    snap = snapshot({key(13): 5.0, key(31): 1.0})
    expo.render(snap, mode="dcgm")
    snap = snapshot({key(13): 5.0, key(31): 2.0})
    _, s = parse(expo.render(snap, mode="dcgm"))
    assert one(s, "DCGM_FI_DEV_XID_ERRORS") == 31
    # Nothing new: it stays.
    _, s = parse(expo.render(snap, mode="dcgm"))
    assert one(s, "DCGM_FI_DEV_XID_ERRORS") == 31
    # Two codes moved in one tick: the later event wins.
    ev = [Event(10, "xid", "0", "", {"xid": 79}), Event(5, "xid", "0", "", {"xid": 13})]
    snap = snapshot({key(13): 6.0, key(31): 2.0, key(79): 1.0}, events=ev, healthy=False)
    _, s = parse(expo.render(snap, mode="dcgm"))
    assert one(s, "DCGM_FI_DEV_XID_ERRORS") == 79
    # A new sampler in the same process starts its counters afresh: so does the last code.
    _, s = parse(expo.render(snapshot({"gpu_power_watts": 1.0}), mode="dcgm"))
    assert one(s, "DCGM_FI_DEV_XID_ERRORS") == 0


def test_dcgm_pod_labels_when_one_pod_holds_the_gpu():
    procs = [proc(1, 1.0, pod="web-0", namespace="prod", container="srv"),
             proc(2, 1.0, gpu="1", pod="a", namespace="x", container="c"),
             proc(3, 1.0, gpu="1", pod="b", namespace="x", container="c")]
    _, s = parse(render(snapshot(procs=procs, gpus=2), mode="dcgm"))
    lab0 = series(s, "DCGM_FI_DEV_POWER_USAGE", gpu="0")[0][0]
    assert (lab0["pod"], lab0["namespace"], lab0["container"]) == ("web-0", "prod", "srv")
    assert "pod" not in series(s, "DCGM_FI_DEV_POWER_USAGE", gpu="1")[0][0]


def test_dcgm_mig_instance_labels():
    snap = fake_snapshot(mig_gpu())
    _, s = parse(render(snap, mode="dcgm"))
    ids = sorted(lab.get("GPU_I_ID", "-") for lab, _ in series(s, "DCGM_FI_PROF_SM_ACTIVE"))
    assert ids == ["1", "2"]
    assert {lab["gpu"] for lab, _ in series(s, "DCGM_FI_PROF_SM_ACTIVE")} == {"0"}


def test_simulated_power_and_energy_agree_in_both_modes():
    snap = simulated_snapshot("compute_bound")
    _, c = parse(render(snap))
    _, d = parse(render(snap, mode="dcgm"))
    assert one(d, "DCGM_FI_DEV_POWER_USAGE") == one(c, "gpu_power_watts")
    assert one(d, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION") == round(one(c, "gpu_energy_joules_total") * 1000)
    assert one(d, "DCGM_FI_DEV_FB_USED") == round(one(c, "gpu_memory_used_bytes") / MIB)
    assert one(d, "DCGM_FI_DEV_GPU_UTIL") == round(one(c, "gpu_utilization_ratio") * 100)


# ---- the render budget ---------------------------------------------------------------------------

def big_snapshot() -> Snapshot:
    snap = simulated_snapshot("mixed", gpus=8)
    base = snap.processes
    snap.processes = [dataclasses.replace(base[i % 8], pid=base[i % 8].pid + 1 + i, name=f"worker-{i}",
                                          gpu_memory_bytes=float((64 - i) << 28)) for i in range(64)]
    return snap


def test_render_8_gpus_64_processes_within_5_ms():
    snap = big_snapshot()
    expo = Exposition()
    extra = {"gpuscope_sampler_cpu_seconds_total": 1.0}
    _, samples = parse(expo.render(snap, extra=extra))
    assert len(series(samples, "gpu_process_memory_used_bytes")) == 64
    assert len(samples) > 900
    times = []
    for _ in range(60):
        # this thread's CPU time: what the render costs, not how long a loaded machine left the thread waiting
        t0 = time.thread_time()
        expo.render(snap, extra=extra)
        times.append(time.thread_time() - t0)
    assert statistics.median(times) < 0.005, f"median render {statistics.median(times) * 1e3:.2f} ms CPU"


DCGM_DEFAULT_SET = (  # dcgm-exporter etc/default-counters.csv, the 25 enabled metric lines
    "DEV_SM_CLOCK DEV_MEM_CLOCK DEV_MEMORY_TEMP DEV_GPU_TEMP DEV_POWER_USAGE DEV_TOTAL_ENERGY_CONSUMPTION "
    "DEV_PCIE_REPLAY_COUNTER DEV_GPU_UTIL DEV_MEM_COPY_UTIL DEV_ENC_UTIL DEV_DEC_UTIL DEV_XID_ERRORS DEV_FB_FREE "
    "DEV_FB_USED DEV_FB_RESERVED DEV_NVLINK_BANDWIDTH_TOTAL DEV_VGPU_LICENSE_STATUS DEV_UNCORRECTABLE_REMAPPED_ROWS "
    "DEV_CORRECTABLE_REMAPPED_ROWS DEV_ROW_REMAP_FAILURE PROF_GR_ENGINE_ACTIVE PROF_PIPE_TENSOR_ACTIVE "
    "PROF_DRAM_ACTIVE PROF_PCIE_TX_BYTES PROF_PCIE_RX_BYTES").split()


def test_dcgm_mode_covers_dcgm_exporters_default_set_but_the_two_documented_gaps():
    s = Sampler(SamplerConfig(interval=0.05, events=False, gpm_graphics=True), simulate="healthy")
    try:
        s.sample_once()
        time.sleep(0.22)
        snap = s.sample_once()
    finally:
        s.stop()
    fams, _ = parse(render(snap, mode="dcgm"))
    missing = {f"DCGM_FI_{x}" for x in DCGM_DEFAULT_SET} - set(fams)
    assert missing == {"DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_VGPU_LICENSE_STATUS"}


def test_label_contexts_of_ended_processes_are_forgotten(monkeypatch):
    """A node whose processes churn (6,000 pids an hour) must not keep a label context per pid it ever saw: the
    model keeps the contexts in use and forgets the others two periods after their process ended."""
    from gpuscope._recent import Recent
    from gpuscope.export import _model

    t = [0.0]
    monkeypatch.setattr(_model, "Recent", lambda period, **kw: Recent(period, clock=lambda: t[0], **kw))
    model = _model.Model()
    live = [proc(1, 1.0), proc(2, 2.0)]
    for step in range(600):  # ten minutes at one scrape per second, a new short-lived pid every second
        t[0] = float(step)
        snap = snapshot(procs=[*live, proc(1000 + step, 0.5)])
        rows = dict((fam.name, r) for fam, r in model.rows(snap))
        assert any(dict(ctx.labels).get("pid") == str(1000 + step) for ctx, _, _ in rows["gpu_process_memory_used_bytes"])
    pids = {dict(ctx.labels).get("pid") for ctx in (model._ctx.get(k) for k in model._ctx.keys()) if ctx is not None}
    assert {"1", "2"} <= pids  # the live ones stay
    assert len(pids - {"1", "2", None}) <= 2 * _model.CTX_PERIOD_S + 1  # of 600 ended pids, only the recent ones
    assert "1000" not in pids
