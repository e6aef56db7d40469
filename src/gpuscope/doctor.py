"""`gpuscope doctor`: what this machine supports, in words a user can act on."""

from __future__ import annotations

import os
import platform
import time
from typing import Any

from ._records import Capability
from .catalog import CATALOG
from .sampler import Sampler, SamplerConfig


def examine(sampler: Sampler, seconds: float = 1.2) -> dict[str, Any]:
    """Sample for `seconds` (long enough for a GPM window and the slow fields) and report."""
    sampler.open()
    t_end = time.monotonic() + seconds
    snap = sampler.sample_once()
    while time.monotonic() < t_end:
        time.sleep(min(sampler.config.interval, max(0.0, t_end - time.monotonic())))
        snap = sampler.sample_once()
    # One more pass of every cadence group so rare fields are read at least once.
    sampler._next_due.clear()
    snap = sampler.sample_once()
    caps = sampler.capabilities()
    try:
        import pynvml

        binding = getattr(pynvml, "__version__", "") or _dist_version("nvidia-ml-py")
    except ImportError:  # pragma: no cover
        binding = ""
    gpus = []
    for g in snap.gpus:
        ident = g.identity
        c = caps.get(ident.label, {})
        unsupported = {k: v.reason for k, v in c.items() if not v.supported}
        supported = sorted(k for k, v in c.items() if v.supported)
        gpus.append({
            "gpu": ident.label, "uuid": ident.uuid, "name": ident.name, "architecture": ident.architecture,
            "compute_capability": ident.compute_capability, "pci_bus_id": ident.pci_bus_id,
            "memory_total_bytes": ident.memory_total_bytes, "mig_mode": ident.mig_mode,
            "numa_node": ident.numa_node, "healthy": g.healthy,
            "gpm": _gpm_word(c),
            "processes": sum(1 for p in snap.processes if p.gpu == ident.label),
            "processes_visible_on_host": sum(1 for p in snap.processes if p.gpu == ident.label and p.host_visible),
            "supported": supported, "unsupported": unsupported,
        })
    first = snap.gpus[0].identity if snap.gpus else None
    return {
        "simulated": snap.simulated,
        "host": snap.hostname,
        "platform": platform.platform(),
        "driver_version": first.driver_version if first else "",
        "cuda_version": first.cuda_version if first else "",
        "nvml_binding": binding,
        "root": hasattr(os, "geteuid") and os.geteuid() == 0,
        "gpus": gpus,
        "events": [{"kind": e.kind, "gpu": e.gpu, "message": e.message} for e in sampler.events_history],
        "nvml_calls": sampler.overhead()["nvml_calls"],
        "cuda_probes": _probes_word(sampler),
    }


def _gpm_word(c: dict[str, Capability]) -> dict[str, Any]:
    cap = c.get("gpu_sm_active_ratio")
    return {"supported": bool(cap and cap.supported), "reason": cap.reason if cap and not cap.supported else ""}


def _probes_word(sampler: Sampler) -> dict[str, Any]:
    """Whether the eBPF probes on libcuda (sources.cudaprobe) run here, on how many driver libraries, or why not."""
    cap = sampler.cuda_probe_capability
    if not cap.supported and not cap.reason.startswith("off (GPUSCOPE_CUDAPROBE"):
        # The sampler leaves them off on the simulated node: whether this machine's kernel takes them is still
        # the question, so load them once, attached to nothing.
        from .sources.cudaprobe import CudaProbe

        probe = CudaProbe(libraries=())
        cap = probe.open()
        probe.close()
    return {"supported": cap.supported, "reason": cap.reason, "libraries": sampler.cuda_probe_libraries}


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return ""


def render(report: dict[str, Any]) -> str:
    lines = []
    sim = report["simulated"]
    title = "gpuscope doctor" + (f" — SIMULATED node, scenario '{sim}'" if sim else "")
    lines.append(title)
    lines.append(f"  driver {report['driver_version'] or '?'}, CUDA {report['cuda_version'] or '?'}, "
                 f"nvidia-ml-py {report['nvml_binding'] or '?'}, host {report['host']}")
    if not report["root"]:
        lines.append("  running as a normal user: per-process data of other users' processes and some "
                     "profiling counters may be hidden; run as root to see everything")
    if not report["gpus"]:
        lines.append("  NVML works but lists no GPU (a container without GPUs passed in? check "
                     "NVIDIA_VISIBLE_DEVICES / --gpus).")
    for g in report["gpus"]:
        lines.append("")
        mem = g["memory_total_bytes"] / 2**20
        state = "" if g["healthy"] else "  ** LOST: NVML cannot reach this GPU **"
        lines.append(f"GPU {g['gpu']}  {g['name']}  {g['architecture']} {g['compute_capability']}  "
                     f"bus {g['pci_bus_id']}  {mem:.0f} MiB  MIG {'on' if g['mig_mode'] else 'off'}  "
                     f"NUMA {g['numa_node'] if g['numa_node'] is not None else '?'}{state}")
        if g["gpm"]["supported"]:
            lines.append("  GPM: yes — true SM activity, occupancy, tensor/FP pipes, DRAM and PCIe bandwidth")
        else:
            lines.append(f"  GPM: no — {g['gpm']['reason']}. Only NVML's coarse 'utilization' is available, "
                         "which counts a GPU as busy while any kernel or copy runs.")
        lines.append(f"  processes: {g['processes']} on the GPU, {g['processes_visible_on_host']} visible "
                     "to this user on the host")
        lines.append(f"  metrics: {len(g['supported'])} supported, {len(g['unsupported'])} not")
        for name, reason in sorted(g["unsupported"].items()):
            unit = CATALOG[name].help.split(".")[0] if name in CATALOG else ""
            lines.append(f"    - {name}: {reason}" + (f"  ({unit})" if unit and len(unit) < 60 else ""))
    if report["events"]:
        lines.append("")
        lines.append("events while examining:")
        lines.extend(f"  {e['kind']} GPU {e['gpu']}: {e['message']}" for e in report["events"][:20])
    if report.get("tracing"):
        lines.append("")
        lines.extend(tracing_lines(report["tracing"]))
    probes = report.get("cuda_probes")
    if probes:
        lines.append("")
        lines.append("CUDA driver probes (eBPF: launches, copies, syncs per process, no restart): "
                     + ("no — " + probes["reason"] if not probes["supported"]
                        else f"yes — on {probes['libraries']} libcuda file(s) now" if probes["libraries"]
                        else "yes — the kernel loads them; they attach to each GPU process's libcuda as it starts"))
    calls = [c for c in report["nvml_calls"] if c["count"]]
    if calls:
        lines.append("")
        lines.append("NVML call cost on this machine (median / max, microseconds):")
        for c in calls[:12]:
            lines.append(f"  {c['call']:<42} {c['median_us']:9.1f} {c['max_us']:9.1f}  x{c['count']}")
    return "\n".join(lines)


def tracing_lines(tracing: dict[str, Any]) -> list[str]:
    """One line per way of tracing that needs this machine's help (the injection library for native programs)."""
    inj = tracing.get("injection")
    if not inj:
        return []
    if inj.get("works"):
        return [f"trace injection (native CUDA programs): yes — {inj.get('library')} (CUPTI: {inj.get('cupti')})"]
    return [f"trace injection (native CUDA programs): no — {inj.get('reason')}"]


def run(simulate: str | None = None, gpus: int | None = None, seconds: float = 1.2) -> dict[str, Any]:
    sampler = Sampler(SamplerConfig(interval=0.1), simulate=simulate, gpus=gpus)
    try:
        return examine(sampler, seconds)
    finally:
        sampler.stop()
