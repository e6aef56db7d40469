"""Prometheus text exposition (format 0.0.4) of a sampler snapshot: what `/metrics` serves.

    >>> from gpuscope import Sampler
    >>> from gpuscope.export.exposition import render
    >>> with Sampler(simulate="healthy") as s:
    ...     text = render(s.sample_once()).decode()
    >>> 'gpu_power_watts{gpu="0"' in text
    True

A scrape reads a snapshot the sampler already took; it never calls NVML. Missing or unsupported
values are absent, never 0. Data from the simulated node carries `simulated="<scenario>"` on every
series.

Canonical mode (the default) uses the catalog's names: base units, ratios 0..1, `_total` counters.
Device series carry `gpu`, `uuid`, `model`, `hostname` plus their own labels (`reason`, `xid`, ...);
`gpu_info` (=1) carries `driver`, `cuda`, `pci_bus_id`, `architecture`, `compute_capability`, `mig`.
Per-process series (`gpu_process_memory_used_bytes`, `gpu_process_sm_active_ratio`,
`gpu_process_memory_utilization_ratio`, `gpu_process_utilization_ratio`, `gpu_process_energy_joules_total`,
`process_cpu_cores`, `process_thread_cpu_max_ratio`, `process_resident_memory_bytes`, `process_threads`,
`process_threads_busy`)
add `pid`, `process`, `user` and, where attribution found them, `pod`, `namespace`, `container`,
`slurm_job` (not `job`: Prometheus owns that label and would rename ours to `exported_job`) and `workload`:
the job the process is one rank of, which may span nodes, first found of `slurm/<SLURM_JOB_ID>`,
`torchrun/<TORCHELASTIC_RUN_ID>` (its environment) and `k8s/<namespace>/<owner>` (the pod's owner by
Kubernetes' naming: gpuscope._cgroup.workload_of), at most 128 characters. The GPU's own series carry
`workload` too while exactly one workload runs on it (processes that name none do not count), in both
namings; like `pod` there, it starts new GPU series only when the GPU changes jobs. Cardinality
is bounded: per GPU the `top_processes` largest by GPU memory get their own series, the rest are summed
into one with `pid="other", process="other"` (gauges only: a sum over whichever processes fall outside the
top is no counter). Per-pod series (`gpu_pod_memory_used_bytes`, `gpu_pod_sm_active_ratio`,
`gpu_pod_energy_joules_total`; gpuscope.shares) carry the GPU's labels and `namespace`, `pod`, or
`container` where the pod is unknown. Empty labels are left out (Prometheus treats them as absent).

DCGM mode (`mode="dcgm"`) speaks dcgm-exporter's dialect so DCGM Grafana dashboards work unchanged:
names `DCGM_FI_*`, DCGM units (%, MiB, MHz, mJ, ns), integer values where DCGM's field is an integer,
labels `gpu`, `UUID`, `pci_bus_id`, `device` (nvidia<N>), `modelName`, `Hostname`,
`DCGM_FI_DRIVER_VERSION`, plus `container`/`namespace`/`pod` when one pod holds the GPU, `workload` when one
workload runs on it, and
`GPU_I_ID` on a MIG instance. Emitted:

- 23 of the 25 fields of dcgm-exporter's default set (etc/default-counters.csv):
  SM_CLOCK, MEM_CLOCK (MHz), GPU_TEMP, MEMORY_TEMP (C), POWER_USAGE (W),
  TOTAL_ENERGY_CONSUMPTION (counter, mJ), PCIE_REPLAY_COUNTER (counter), GPU_UTIL, MEM_COPY_UTIL,
  ENC_UTIL, DEC_UTIL (%), XID_ERRORS (gauge: the last XID code, 0 for none; labels `err_code`,
  `err_msg`), FB_FREE, FB_USED, FB_RESERVED (MiB), CORRECTABLE_REMAPPED_ROWS,
  UNCORRECTABLE_REMAPPED_ROWS (counters), ROW_REMAP_FAILURE, PROF_GR_ENGINE_ACTIVE,
  PROF_PIPE_TENSOR_ACTIVE, PROF_DRAM_ACTIVE (ratio 0..1), PROF_PCIE_TX_BYTES / PROF_PCIE_RX_BYTES
  (gauges, bytes/s). PROF_GR_ENGINE_ACTIVE needs the sampler's `gpm_graphics` option (the agent's
  `[sampler] gpm_graphics = true`; that GPM metric costs ~1.4 ms of CPU per read, so it is off by
  default, and /api/v1/capabilities says so);
- the opt-in fields we have: PROF_SM_ACTIVE, PROF_SM_OCCUPANCY, PROF_PIPE_FP64/FP32/FP16_ACTIVE,
  PROF_PIPE_TENSOR_HMMA/IMMA/DFMA_ACTIVE, PROF_PIPE_INT_ACTIVE, PROF_NVLINK_TX/RX_BYTES,
  ECC_SBE_VOL_TOTAL, ECC_DBE_VOL_TOTAL, FB_TOTAL, ENFORCED_POWER_LIMIT, MAX_SM_CLOCK, PSTATE,
  PCIE_LINK_GEN, PCIE_LINK_WIDTH, CLOCKS_EVENT_REASONS, ROW_REMAP_PENDING;
- violation counters in ns: POWER_, THERMAL_, SYNC_BOOST_, BOARD_LIMIT_, LOW_UTIL_, RELIABILITY_VIOLATION.

Both in one exposition (`mode="canonical,dcgm"`): the canonical series and the DCGM ones side by side, so
one Prometheus job feeds a DCGM Grafana dashboard and gpuscope's own views (per-process and host series,
verdicts, the agent's health). No name is in both sets (every DCGM family starts with `DCGM_FI_`, none of
the catalog's does), and the agent's own series (`extra`), which each mode carries, are written once,
with the canonical `hostname` label: no series is duplicated.

Where we differ from dcgm-exporter:

- not emitted: NVLINK_BANDWIDTH_TOTAL (its unit is undocumented; see gpu_nvlink_*_bytes_total),
  VGPU_LICENSE_STATUS, retired-page and NVLink-error counters, DCGM_EXP_* (exporter-computed
  windows), GPU_I_PROFILE on MIG (NVML does not name the profile cheaply); no per-process series.
- the violation counters are accumulated from the clock-event reasons at the sampling rate (DCGM
  reads NVML's violation timers); THERMAL is the time either thermal reason (software or hardware)
  held, counted once, so it never grows faster than wall time; LOW_UTIL is the GPU-idle reason.
- DCGM_FI_PROF_* fields come from NVML GPM (Hopper and newer); on older GPUs they are absent, where
  DCGM's profiling module might have them. PCIe rates on GPUs without GPM are absent too (the
  byte counters are in canonical mode).
- XID_ERRORS: the last code is the one whose counter moved between two renders (with several in one
  tick, the latest event wins); a process that starts with XIDs already counted reports the most
  frequent code until a new one arrives.
- a MIG instance reports its own UUID in `UUID` (dcgm-exporter reports the parent's).
- the agent's own metrics (`extra`) are added, with a `Hostname` label.

Why we render the text ourselves instead of through prometheus_client: the text format is a few
lines of string building, and almost nothing in it changes between scrapes (names, HELP/TYPE
headers, every label set), so each series' line prefix is escaped and joined once and cached; a
scrape formats only the values. Measured on this project's 2-core dev machine with
benchmarks/bench_scrape.py (8 simulated GPUs, 64 processes, 975 series, 183 kB): render 0.56 ms
median (first render, caches cold: 2.5 ms; DCGM mode 0.27 ms), against 9.8 ms for prometheus_client
0.26 exposing the same series through a custom collector of GaugeMetricFamily / CounterMetricFamily
and generate_latest: 17x slower, because it builds metric objects, escapes every label and formats
every line on every scrape; on its own it would miss the 5 ms budget.
prometheus_client stays useful in tests as an independent parser of what we emit.
"""

from __future__ import annotations

from .._records import Snapshot
from ._model import BOTH, CANONICAL, DCGM, MODES, Ctx, Family, Labels, Model, escape

__all__ = ["BOTH", "CANONICAL", "CONTENT_TYPE", "DCGM", "MODES", "Exposition", "render"]

#: The Content-Type header for what render() returns.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_INF, _NINF = float("inf"), float("-inf")


def _fmt(v: float) -> str:
    if v - v == 0:  # finite (inf - inf and nan - nan are nan)
        return repr(v)
    if v != v:
        return "NaN"
    return "+Inf" if v == _INF else "-Inf"


class Exposition:
    """A renderer with its own caches. `render()` uses a shared one; an agent that serves several
    sampler instances can keep one each."""

    def __init__(self) -> None:
        self.model = Model()
        self._prefix: dict[Family, dict[tuple[Ctx, Labels], str]] = {}
        self._size = 0

    def render(self, snapshot: Snapshot | None, *, mode: str = CANONICAL, top_processes: int = 16,
               extra: dict[str, float] | None = None, hostname: str | None = None) -> bytes:
        """The exposition of one snapshot (None: only `extra`) as UTF-8 bytes."""
        fams = self.model.rows(snapshot, mode=mode, top_processes=top_processes, extra=extra, hostname=hostname)
        if self._size > 50_000:
            self._prefix.clear()
            self._size = 0
        out: list[str] = []
        append = out.append
        for fam, rows in fams:
            append(fam.header)
            cache = self._prefix.get(fam)
            if cache is None:
                cache = self._prefix[fam] = {}
            for ctx, sl, v in rows:
                prefix = cache.get((ctx, sl))
                if prefix is None:
                    prefix = cache[(ctx, sl)] = _prefix(fam.name, ctx.labels + sl)
                    self._size += 1
                if v - v == 0:
                    append(prefix + repr(v) + "\n")
                else:
                    append(prefix + _fmt(v) + "\n")
        return "".join(out).encode("utf-8", "replace")


def _prefix(name: str, labels: Labels) -> str:
    if not labels:
        return name + " "
    return name + "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels) + "} "


_DEFAULT = Exposition()


def render(snapshot: Snapshot | None, *, mode: str = CANONICAL, top_processes: int = 16,
           extra: dict[str, float] | None = None, hostname: str | None = None) -> bytes:
    """Prometheus text exposition 0.0.4 of `snapshot`.

    mode: 'canonical' (catalog names), 'dcgm' (dcgm-exporter's names, units and labels) or 'canonical,dcgm'
    (both, the agent's own series once).
    top_processes: per GPU, how many processes (largest GPU memory first) get their own series; the
    rest are summed into pid="other". extra: the agent's own metrics, name (or series key) -> value.
    hostname: the `hostname` label; default the snapshot's, else this machine's.
    Raises ValueError for an unknown mode or a negative top_processes.
    """
    return _DEFAULT.render(snapshot, mode=mode, top_processes=top_processes, extra=extra, hostname=hostname)
