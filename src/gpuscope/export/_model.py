"""From a Snapshot to metric families and rows, shared by the text exposition and remote write.

A row is `(ctx, series_labels, value)`: `ctx` is a cached context object holding the labels every
series of one GPU (or process, or the host) carries, `series_labels` a cached tuple of the series'
own labels. Both are reused across snapshots, so a writer can cache whatever it builds from them
(the exposition's line prefix, remote write's encoded labels) keyed on `(family, ctx, series_labels)`
and pay for label escaping and encoding once per series, not once per scrape.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._node import node_name
from .._recent import Recent
from .._records import GpuIdentity, PodRecord, ProcessRecord, Snapshot
from ..catalog import CATALOG, POD_SERIES, PROCESS_SERIES, Kind, split_series_key

if TYPE_CHECKING:
    from .._records import PodRef

log = logging.getLogger("gpuscope.export")

Labels = tuple[tuple[str, str], ...]
Row = tuple["Ctx", Labels, float]

CANONICAL, DCGM = "canonical", "dcgm"
#: Both in one exposition: the names cannot clash (every DCGM family is DCGM_FI_*, no canonical one is), and
#: the agent's own series, which both modes carry, are written once, with the canonical `hostname` label.
BOTH = "canonical,dcgm"
MODES = (CANONICAL, DCGM, BOTH)
_MAX_CACHE = 20_000  # contexts and series kept; past it the caches start afresh (pid churn)
CTX_PERIOD_S = 120.0  # a context not used for two of these is forgotten (its process has ended)
_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass(frozen=True, eq=False, slots=True)
class Family:
    """One metric family. Hashed by identity: families are made once and reused."""

    name: str
    kind: str  # 'gauge' or 'counter'
    help: str
    order: int

    @property
    def header(self) -> str:
        h = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        return f"# HELP {self.name} {h}\n# TYPE {self.name} {self.kind}\n"


class Ctx:
    """The labels shared by a group of series (one GPU, one process on a GPU, the host)."""

    __slots__ = ("labels", "info")

    def __init__(self, labels: Labels, info: Labels = ()) -> None:
        self.labels = labels
        self.info = info  # canonical gpu_info's own labels


def escape(v: str) -> str:
    """A label value escaped as the text format wants it."""
    if "\\" in v or '"' in v or "\n" in v:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return v


# ---- families -------------------------------------------------------------------------------

_ORDER = {name: i for i, name in enumerate(CATALOG)}
_FAMILIES: dict[str, Family] = {}


def _family(name: str, kind: str, help: str, order: int) -> Family:
    fam = _FAMILIES.get(name)
    if fam is None:
        fam = _FAMILIES[name] = Family(name, kind, help, order)
    return fam


GPU_INFO = _family("gpu_info", "gauge",
                   "GPU identity: driver, CUDA version, PCI bus id, architecture, compute capability, MIG mode "
                   "in labels; always 1.", -1)
_CANON = {m.name: _family(m.name, m.kind.value, m.help, _ORDER[m.name]) for m in CATALOG.values()}

#: ProcessRecord attribute -> canonical family.
PROCESS_FIELDS: tuple[tuple[str, Family], ...] = tuple((attr, _CANON[name]) for attr, name in PROCESS_SERIES)
#: PodRecord attribute -> canonical family.
POD_FIELDS: tuple[tuple[str, Family], ...] = tuple((attr, _CANON[name]) for attr, name in POD_SERIES)

# dcgm-exporter's help texts (etc/default-counters.csv) for the fields it enables by default, so a
# DCGM dashboard's tooltips read the same; the rest say what they are in DCGM's unit.
_DCGM_HELP = {
    "DCGM_FI_DEV_SM_CLOCK": "SM clock frequency (in MHz).",
    "DCGM_FI_DEV_MEM_CLOCK": "Memory clock frequency (in MHz).",
    "DCGM_FI_DEV_MEMORY_TEMP": "Memory temperature (in C).",
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "Total energy consumption since boot (in mJ).",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "Total number of PCIe retries.",
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "Memory utilization (in %).",
    "DCGM_FI_DEV_ENC_UTIL": "Encoder utilization (in %).",
    "DCGM_FI_DEV_DEC_UTIL": "Decoder utilization (in %).",
    "DCGM_FI_DEV_XID_ERRORS": "Value of the last XID error encountered.",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_FB_RESERVED": "Framebuffer memory reserved (in MiB).",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "Number of remapped rows for uncorrectable errors",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "Number of remapped rows for correctable errors",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "Whether remapping of rows has failed",
    "DCGM_FI_DEV_THERMAL_VIOLATION": "Throttling duration due to thermal constraints (in ns).",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "Ratio of time the graphics engine is active.",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "Ratio of cycles the tensor (HMMA) pipe is active.",
    "DCGM_FI_PROF_DRAM_ACTIVE": "Ratio of cycles the device memory interface is active sending or receiving data.",
    "DCGM_FI_PROF_PCIE_TX_BYTES": "The rate of data transmitted over the PCIe bus - including both protocol "
                                  "headers and data payloads - in bytes per second.",
    "DCGM_FI_PROF_PCIE_RX_BYTES": "The rate of data received over the PCIe bus - including both protocol "
                                  "headers and data payloads - in bytes per second.",
}
_DCGM_UNIT = {100.0: "%", 1.0 / (1024 * 1024): "MiB", 1e-6: "MHz", 1000.0: "mJ"}
# DCGM reports these as doubles; every other DCGM_FI_DEV_* field is an int64 and is rounded here.
_DCGM_DOUBLE = {"DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_ENFORCED_POWER_LIMIT"}


def _dcgm_help(m: Any) -> str:
    if m.dcgm in _DCGM_HELP:
        return _DCGM_HELP[m.dcgm]
    unit = _DCGM_UNIT.get(m.dcgm_scale, {"watts": "W", "celsius": "C", "bytes/s": "B/s"}.get(m.unit, ""))
    return m.help + (f" (in {unit})" if unit else "")


#: canonical name -> (DCGM family, scale, is_int).
DCGM_ALIASES: dict[str, tuple[Family, float, bool]] = {
    m.name: (_family(m.dcgm, m.kind.value, _dcgm_help(m), 1000 + _ORDER[m.name]), m.dcgm_scale,
             not (m.dcgm.startswith("DCGM_FI_PROF_") or m.dcgm in _DCGM_DOUBLE))
    for m in CATALOG.values() if m.dcgm
}
XID_FAMILY = _family("DCGM_FI_DEV_XID_ERRORS", "gauge", _DCGM_HELP["DCGM_FI_DEV_XID_ERRORS"], 999)
STATE_FAMILY = _CANON["gpu_allocation_state"]
# Our per-reason throttle seconds, as DCGM's violation counters (ns since DCGM started watching).
# THERMAL is not here: it is the union of two reasons (gpu_thermal_throttle_seconds_total, an alias).
_VIOLATIONS = {
    "sw_power_cap": "POWER", "sync_boost": "SYNC_BOOST",
    "board_limit": "BOARD_LIMIT", "gpu_idle": "LOW_UTIL", "reliability": "RELIABILITY",
}
VIOLATION_FAMILIES = {
    reason: _family(f"DCGM_FI_DEV_{v}_VIOLATION", "counter",
                    f"Throttling duration due to {v.lower().replace('_', ' ')} constraints (in ns).",
                    2000 + i)
    for i, (reason, v) in enumerate(_VIOLATIONS.items())
}


def extra_family(name: str) -> Family | None:
    """The family of an agent metric passed in `extra`; None for an invalid name."""
    fam = _CANON.get(name) or _FAMILIES.get(name)
    if fam is not None:
        return fam
    if not _NAME_RE.match(name):
        return None
    kind = Kind.COUNTER.value if name.endswith("_total") else Kind.GAUGE.value
    return _family(name, kind, f"gpuscope agent metric {name}.", 5000 + len(_FAMILIES))


# ---- the model --------------------------------------------------------------------------------

class Model:
    """Turns snapshots into families and rows, caching contexts and parsed keys between calls.

    Safe to call from several scrape threads: the caches only grow (atomic dict writes) until they
    are cleared wholesale, and the one piece of state that must be consistent (DCGM's last XID) is
    guarded by a lock."""

    def __init__(self) -> None:
        # Contexts of processes and pods come and go with them: kept while used (each scrape uses the live ones),
        # forgotten two periods after their process ended (a 6,000-pids/h node grew by 6,000 contexts an hour).
        self._ctx: Recent[tuple[Any, ...], Ctx] = Recent(CTX_PERIOD_S, max_items=_MAX_CACHE)
        self._keys: dict[str, tuple[Family | None, Labels]] = {}
        self._dkeys: dict[str, tuple[Any, ...]] = {}
        self._extra_keys: dict[str, tuple[Family | None, Labels]] = {}
        self._xid_lock = threading.Lock()
        self._xid_counts: dict[str, dict[str, float]] = {}
        self._xid_last: dict[str, int] = {}
        self._warned: set[str] = set()

    def rows(self, snapshot: Snapshot | None, *, mode: str = CANONICAL, top_processes: int = 16,
             extra: dict[str, float] | None = None, hostname: str | None = None,
             ) -> list[tuple[Family, list[Row]]]:
        """Families in a stable order, each with its rows. Values are final (DCGM units in DCGM mode)."""
        if mode not in MODES:
            raise ValueError(f"Unknown exposition mode {mode!r}; use 'canonical', 'dcgm' or 'canonical,dcgm'.")
        if top_processes < 0:
            raise ValueError(f"top_processes must be 0 or more, got {top_processes}.")
        self._ctx.rotate()
        if len(self._keys) + len(self._dkeys) + len(self._extra_keys) > _MAX_CACHE:
            self._keys.clear()
            self._dkeys.clear()
            self._extra_keys.clear()
        buckets: dict[Family, list[Row]] = {}
        host = hostname or (snapshot.hostname if snapshot is not None else "") or _local_hostname()
        sim = snapshot.simulated if snapshot is not None else None
        if snapshot is not None:
            if mode != DCGM:
                self._canonical(snapshot, host, sim, top_processes, buckets)
            if mode != CANONICAL:
                self._dcgm(snapshot, host, sim, buckets, states=mode == DCGM)
        if extra:
            hctx = self._host_ctx(host, sim, DCGM if mode == DCGM else CANONICAL)
            for key, v in extra.items():
                parsed = self._extra_keys.get(key)
                if parsed is None:
                    parsed = self._extra_keys[key] = self._parse_extra(key)
                fam, sl = parsed
                if fam is not None and v is not None:
                    buckets.setdefault(fam, []).append((hctx, sl, v))
        return sorted(buckets.items(), key=lambda kv: kv[0].order)

    # -- canonical --------------------------------------------------------------------------
    def _canonical(self, snap: Snapshot, host: str, sim: str | None, top: int,
                   buckets: dict[Family, list[Row]]) -> None:
        keys = self._keys
        info_rows: list[Row] = []
        by_label: dict[str, Ctx] = {}
        work = workloads(snap.processes)
        for g in snap.gpus:
            ctx = self._gpu_ctx(g.identity, host, sim)
            by_label[g.identity.label] = ctx  # processes and pods add their own pod labels to this one
            if g.allocated_to:  # the GPU's own series name the pod that holds it
                ctx = self._held_ctx(ctx, g.allocated_to)
            wl = work.get(g.identity.label)
            if wl:  # and the one workload that runs on it
                ctx = self._workload_ctx(ctx, wl)
            info_rows.append((ctx, ctx.info, 1))
            for key, v in g.values.items():
                parsed = keys.get(key)
                if parsed is None:
                    parsed = keys[key] = self._parse_key(key)
                fam = parsed[0]
                if fam is not None:
                    b = buckets.get(fam)
                    if b is None:
                        b = buckets[fam] = []
                    b.append((ctx, parsed[1], v))
        if info_rows:
            buckets[GPU_INFO] = info_rows
        if snap.processes:
            self._processes(snap.processes, by_label, host, sim, top, buckets)
        if snap.pods:
            self._pods(snap.pods, by_label, buckets)
        if snap.host is not None:
            hctx = self._host_ctx(host, sim, CANONICAL)
            for key, v in snap.host.values.items():
                parsed = keys.get(key)
                if parsed is None:
                    parsed = keys[key] = self._parse_key(key)
                if parsed[0] is not None:
                    buckets.setdefault(parsed[0], []).append((hctx, parsed[1], v))

    def _parse_key(self, key: str) -> tuple[Family | None, Labels]:
        name, labels = split_series_key(key)
        fam = _CANON.get(name)
        if fam is None:
            self._warn(f"key {key!r}", "is not in the catalog; not exported")
        return fam, tuple(labels.items())

    def _parse_extra(self, key: str) -> tuple[Family | None, Labels]:
        try:
            name, labels = split_series_key(key)
        except (ValueError, IndexError):
            name, labels = "", {}
        fam = extra_family(name)
        if fam is None or not all(_LABEL_RE.match(k) for k in labels):
            self._warn(f"extra {key!r}", "is not a valid metric name or label set; not exported")
            return None, ()
        return fam, tuple(labels.items())

    def _gpu_ctx(self, ident: GpuIdentity, host: str, sim: str | None) -> Ctx:
        k = ("gpu", ident.label, ident.uuid, ident.name, ident.driver_version, ident.cuda_version,
             ident.pci_bus_id, ident.architecture, ident.compute_capability, ident.mig_mode, host, sim)
        ctx = self._ctx.get(k)
        if ctx is None:
            labels: Labels = (("gpu", ident.label), ("uuid", ident.uuid), ("model", ident.name), ("hostname", host))
            info: Labels = (
                ("driver", ident.driver_version), ("cuda", ident.cuda_version), ("pci_bus_id", ident.pci_bus_id),
                ("architecture", ident.architecture), ("compute_capability", ident.compute_capability),
                ("mig", "true" if ident.mig_mode else "false"))
            ctx = self._ctx[k] = Ctx(_finish(labels, sim), _finish(info, None))
        return ctx

    def _held_ctx(self, gctx: Ctx, holders: list[PodRef]) -> Ctx:
        """A GPU's context with namespace, pod and container of the pod that holds it (none when pods share it)."""
        held = holder(holders)
        if held is None:
            return gctx
        k = ("held", gctx, held)
        ctx = self._ctx.get(k)
        if ctx is None:
            base = tuple(kv for kv in gctx.labels if kv[0] != "simulated")
            sim = tuple(kv for kv in gctx.labels if kv[0] == "simulated")
            own = (("namespace", held[1]), ("pod", held[2]), ("container", held[0]))
            ctx = self._ctx[k] = Ctx(_finish(base + own + sim, None), gctx.info)
        return ctx

    def _workload_ctx(self, gctx: Ctx, workload: str) -> Ctx:
        """A GPU's context with the `workload` label of the one workload running on it."""
        k = ("workload", gctx, workload)
        ctx = self._ctx.get(k)
        if ctx is None:
            base = tuple(kv for kv in gctx.labels if kv[0] != "simulated")
            sim = tuple(kv for kv in gctx.labels if kv[0] == "simulated")
            ctx = self._ctx[k] = Ctx(_finish(base + (("workload", workload),) + sim, None), gctx.info)
        return ctx

    def _host_ctx(self, host: str, sim: str | None, mode: str) -> Ctx:
        k = ("host", host, sim, mode)
        ctx = self._ctx.get(k)
        if ctx is None:
            ctx = self._ctx[k] = Ctx(_finish((("Hostname" if mode == DCGM else "hostname", host),), sim))
        return ctx

    def _processes(self, procs: list[ProcessRecord], by_label: dict[str, Ctx], host: str, sim: str | None,
                   top: int, buckets: dict[Family, list[Row]]) -> None:
        per_gpu: dict[str, list[ProcessRecord]] = {}
        for p in procs:
            per_gpu.setdefault(p.gpu, []).append(p)
        for label, plist in per_gpu.items():
            gctx = by_label.get(label)
            if gctx is None:  # a process on a GPU this snapshot does not list
                gctx = self._ctx.setdefault(("gpu-min", label, plist[0].gpu_uuid, host, sim), Ctx(_finish(
                    (("gpu", label), ("uuid", plist[0].gpu_uuid), ("hostname", host)), sim)))
            if len(plist) > top:
                plist.sort(key=lambda p: (-(p.gpu_memory_bytes or 0.0), p.pid))
                kept, rest = plist[:top], plist[top:]
            else:
                kept, rest = plist, []
            for p in kept:
                pk = ("proc", gctx, p.pid, p.name, p.user, p.pod, p.namespace, p.container, p.slurm_job, p.workload)
                pctx = self._ctx.get(pk)
                if pctx is None:
                    pctx = self._ctx[pk] = Ctx(_process_labels(gctx, str(p.pid), p.name, p))
                for attr, fam in PROCESS_FIELDS:
                    v = getattr(p, attr)
                    if v is not None:
                        buckets.setdefault(fam, []).append((pctx, (), v))
            if rest:
                octx = self._ctx.get(("other", gctx))
                if octx is None:
                    octx = self._ctx[("other", gctx)] = Ctx(_process_labels(gctx, "other", "other", None))
                for attr, fam in PROCESS_FIELDS:
                    if fam.kind == "counter":  # a sum over whichever processes are outside the top is no counter
                        continue
                    vals = [v for v in (getattr(p, attr) for p in rest) if v is not None]
                    if vals:
                        buckets.setdefault(fam, []).append((octx, (), sum(vals)))

    def _pods(self, pods: list[PodRecord], by_label: dict[str, Ctx], buckets: dict[Family, list[Row]]) -> None:
        for r in pods:
            gctx = by_label.get(r.gpu)
            if gctx is None:
                continue
            k = ("pod", gctx, r.namespace, r.pod, r.container)
            ctx = self._ctx.get(k)
            if ctx is None:
                base = tuple(kv for kv in gctx.labels if kv[0] != "simulated")
                sim = tuple(kv for kv in gctx.labels if kv[0] == "simulated")
                ctx = self._ctx[k] = Ctx(_finish(base + (("namespace", r.namespace), ("pod", r.pod),
                                                         ("container", r.container)) + sim, None))
            for attr, fam in POD_FIELDS:
                v = getattr(r, attr)
                if v is not None:
                    buckets.setdefault(fam, []).append((ctx, (), v))

    # -- DCGM -------------------------------------------------------------------------------
    def _dcgm(self, snap: Snapshot, host: str, sim: str | None, buckets: dict[Family, list[Row]],
              states: bool = False) -> None:
        """dcgm-exporter's series. With `states` (DCGM naming alone), gpu_allocation_state too, with DCGM's
        labels: DCGM has no such field, and canonical,dcgm carries it once, in canonical naming."""
        pods: dict[str, set[tuple[str, str, str]]] = {}
        for p in snap.processes:
            if p.pod:
                pods.setdefault(p.gpu, set()).add((p.container, p.namespace, p.pod))
        dkeys = self._dkeys
        work = workloads(snap.processes)
        for g in snap.gpus:
            ident = g.identity
            pod = pods.get(ident.label)
            wl = work.get(ident.label, "")
            if g.allocated_to:  # the kubelet's word, where it has one; else the one pod whose processes run there
                held = holder(g.allocated_to)
                ctx = self._dcgm_ctx(ident, host, sim, held, wl)
            else:
                ctx = self._dcgm_ctx(ident, host, sim, next(iter(pod)) if pod and len(pod) == 1 else None, wl)
            violations: dict[Family, float] = {}
            xids: dict[str, float] | None = None
            for key, v in g.values.items():
                d = dkeys.get(key)
                if d is None:
                    d = dkeys[key] = _parse_dcgm_key(key)
                tag = d[0]
                if tag == 1:  # a plain alias
                    fam, scale, is_int = d[1]
                    x = v * scale
                    b = buckets.get(fam)
                    if b is None:
                        b = buckets[fam] = []
                    b.append((ctx, (), int(round(x)) if is_int and x - x == 0 else x))
                elif tag == 2:
                    violations[d[1]] = violations.get(d[1], 0.0) + v
                elif tag == 3:
                    if xids is None:
                        xids = {}
                    xids[d[1]] = v
                elif tag == 4 and states:
                    buckets.setdefault(STATE_FAMILY, []).append((ctx, d[1], v))
            for fam, secs in violations.items():
                buckets.setdefault(fam, []).append((ctx, (), int(round(secs * 1e9))))
            if g.healthy or xids:
                code = self._last_xid(ident.uuid or ident.label, xids or {}, snap)
                buckets.setdefault(XID_FAMILY, []).append((ctx, _xid_labels(code), code))

    def _dcgm_ctx(self, ident: GpuIdentity, host: str, sim: str | None,
                  pod: tuple[str, str, str] | None, workload: str = "") -> Ctx:
        k = ("dcgm", ident.label, ident.uuid, ident.name, ident.driver_version, ident.pci_bus_id, host, sim, pod,
             workload)
        ctx = self._ctx.get(k)
        if ctx is None:
            # dcgm-exporter's order: gpu, UUID, pci_bus_id, device, modelName, Hostname, driver, pod labels.
            labels: list[tuple[str, str]] = [
                ("gpu", str(ident.index)), ("UUID", ident.uuid), ("pci_bus_id", ident.pci_bus_id),
                ("device", f"nvidia{ident.index}"), ("modelName", ident.name), ("Hostname", host),
                ("DCGM_FI_DRIVER_VERSION", ident.driver_version)]
            if ident.gpu_instance_id is not None:
                labels.append(("GPU_I_ID", str(ident.gpu_instance_id)))
            if pod is not None:
                labels += [("container", pod[0]), ("namespace", pod[1]), ("pod", pod[2])]
            if workload:
                labels.append(("workload", workload))
            ctx = self._ctx[k] = Ctx(_finish(tuple(labels), sim))
        return ctx

    def _last_xid(self, gpu_key: str, counts: dict[str, float], snap: Snapshot) -> int:
        """DCGM_FI_DEV_XID_ERRORS is the last XID code. The snapshot holds counters by code, so the
        last one is the code whose counter moved since the previous render (ties broken by the
        snapshot's events, which are ordered); with no history, the most frequent code."""
        with self._xid_lock:
            prev = self._xid_counts.get(gpu_key)
            last = self._xid_last.get(gpu_key, 0)
            if prev and any(counts.get(c, 0.0) < n for c, n in prev.items()):
                # The counters went back: a new sampler. Forget what the old one saw.
                prev, last = None, 0
                self._xid_counts.pop(gpu_key, None)
                self._xid_last[gpu_key] = 0
            if counts and counts != prev:
                moved = [c for c, n in counts.items() if prev is None or n > prev.get(c, 0.0)]
                recent = [ev for ev in snap.events if ev.kind == "xid" and str(ev.data.get("xid")) in moved]
                if recent:
                    last = int(max(recent, key=lambda e: e.time_ns).data["xid"])
                elif moved:
                    last = int(max(moved, key=lambda c: (counts[c], c)))
                self._xid_counts[gpu_key] = dict(counts)
                self._xid_last[gpu_key] = last
            return last

    def _warn(self, what: str, why: str) -> None:
        if what not in self._warned and len(self._warned) < 1000:
            self._warned.add(what)
            log.warning("%s %s (logged once)", what, why)


def _parse_dcgm_key(key: str) -> tuple[Any, ...]:
    name, labels = split_series_key(key)
    alias = DCGM_ALIASES.get(name)
    if alias is not None and not labels:
        return (1, alias)
    if name == "gpu_throttle_seconds_total" and labels.get("reason") in VIOLATION_FAMILIES:
        return (2, VIOLATION_FAMILIES[labels["reason"]])
    if name == "gpu_xid_events_total" and "xid" in labels:
        return (3, labels["xid"])
    if name == "gpu_allocation_state" and "state" in labels:
        return (4, (("state", labels["state"]),))
    return (0,)


def holder(holders: list[PodRef]) -> tuple[str, str, str] | None:
    """(container, namespace, pod) of the one pod that holds a GPU (container '' when several of its
    containers do); None when no pod or several pods hold it (a shared GPU's series are no one pod's)."""
    pods = {(h.namespace, h.pod) for h in holders}
    if len(pods) != 1:
        return None
    (namespace, pod), = pods
    containers = {h.container for h in holders}
    return (next(iter(containers)) if len(containers) == 1 else "", namespace, pod)


def workloads(procs: list[ProcessRecord]) -> dict[str, str]:
    """GPU label -> the one workload its processes belong to; GPUs whose processes name none or several are
    left out (a shared GPU's series are no one job's), as `holder` does for pods. Processes without a workload
    (a monitoring tool beside the job) do not count."""
    seen: dict[str, set[str]] = {}
    for p in procs:
        if p.workload:
            seen.setdefault(p.gpu, set()).add(p.workload)
    return {gpu: next(iter(ws)) for gpu, ws in seen.items() if len(ws) == 1}


_XID_LABELS: dict[int, Labels] = {}


def _xid_labels(code: int) -> Labels:
    sl = _XID_LABELS.get(code)
    if sl is None:
        from ..sources.events import XID_MEANING

        msg = XID_MEANING.get(code, "") if code else ""
        sl = _XID_LABELS[code] = _finish((("err_code", str(code)), ("err_msg", msg)), None)
    return sl


def _finish(labels: Labels, sim: str | None) -> Labels:
    """Drop empty labels (Prometheus treats them as absent), and mark simulated data as simulated on
    every series."""
    if sim:
        labels = labels + (("simulated", sim),)
    return tuple(kv for kv in labels if kv[1] != "")


def _process_labels(gctx: Ctx, pid: str, name: str, p: ProcessRecord | None) -> Labels:
    base = tuple(kv for kv in gctx.labels if kv[0] != "simulated")
    sim = tuple(kv for kv in gctx.labels if kv[0] == "simulated")
    own: Labels = (("pid", pid), ("process", name))
    if p is not None:
        own += (("user", p.user), ("pod", p.pod), ("namespace", p.namespace), ("container", p.container),
                ("slurm_job", p.slurm_job), ("workload", p.workload))
    return _finish(base + own + sim, None)


_HOSTNAME: list[str] = []


def _local_hostname() -> str:
    if not _HOSTNAME:
        _HOSTNAME.append(node_name())
    return _HOSTNAME[0]


def sorted_labels(name: str, ctx: Ctx, sl: Labels) -> list[tuple[str, str]]:
    """All labels of a series, with __name__, sorted by name (remote write wants that)."""
    pairs = [("__name__", name), *ctx.labels, *sl]
    pairs.sort()
    return pairs

