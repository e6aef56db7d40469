"""Every threshold the verdict rules use, in one place, each with the reason for its value.

Values are reasoned from what each metric means, not tuned on one run; the reference signatures
measured on an H200 (../shared/workloads/METRICS.md) are the sanity check, not the source.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Thresholds:
    # -- how much evidence a verdict needs -----------------------------------------------------
    min_window_s: float = 5.0  # less than this is not a steady state
    min_samples: int = 10

    # -- busy or not ---------------------------------------------------------------------------
    #: SM activity (share of SMs busy, time-averaged) above which the GPU does real work.
    sm_busy: float = 0.80
    #: Below this the SMs are essentially idle: nothing but tiny kernels or copies.
    sm_idle: float = 0.05
    #: NVML utilization counts any kernel or copy; above this with idle SMs the GPU only *looks* busy.
    util_active: float = 0.05

    # -- pipes and memory ----------------------------------------------------------------------
    #: Tensor pipes busy this much of the time: tensor cores carry the math.
    tensor_used: float = 0.20
    #: Non-tensor FP32/FP16 pipes this busy while tensor pipes are idle: matrix math on CUDA cores.
    fp_pipes_busy: float = 0.30
    tensor_unused: float = 0.05
    #: DRAM bandwidth near its ceiling: memory-bandwidth-bound (HBM rarely sustains more than ~90 %).
    dram_bound: float = 0.70
    #: SMs busy but pipes and DRAM both below these: stalls on memory latency / access patterns.
    pipes_low: float = 0.15
    dram_low: float = 0.30

    # -- transfers -----------------------------------------------------------------------------
    #: Host<->device bytes per second that matter next to idle SMs (a PCIe Gen4 x16 link moves ~25 GB/s).
    pcie_busy_bytes_per_s: float = 2e9
    #: Pinned host->device copies reach most of the link (~50 GB/s on Gen5 x16); pageable ones stall
    #: on a CPU copy far below it, with the copying thread saturated.
    pcie_pageable_below_bytes_per_s: float = 20e9

    # -- the CPU side --------------------------------------------------------------------------
    #: A process's busiest thread at this share of one core is the bottleneck (Python's GIL).
    thread_saturated: float = 0.85
    #: A process using this many cores in all, with at least one busy thread (half a core or more,
    #: _records.THREAD_BUSY_RATIO), is as busy on the host as a saturated thread: a runtime that
    #: dispatches from several threads (JAX/XLA, TensorFlow, multi-stream PyTorch) spreads its launch
    #: work so that no thread reaches `thread_saturated`. A GPU it holds while its SMs idle waits on it.
    process_cpu_busy: float = 0.85

    # -- processes sharing a GPU ---------------------------------------------------------------
    #: A process whose part of the GPU's SM work is at least this share of a fair one (1/n of n
    #: processes) is one of its main users: where the SMs are busy, the GPU's own verdict is its own.
    process_share_major: float = 0.5
    #: A process doing this much of the GPU's SM work owns the GPU's pattern (bursts, copies) too.
    process_share_dominant: float = 0.8
    #: NVML utilization (a kernel of some process ran) this high in the median sample: the GPU's time is full.
    #: Shared by processes in turns (time-slicing), its SMs below `sm_busy` then say that some turns run small
    #: kernels, not that the GPU waits on a host.
    timeslice_util: float = 0.95
    #: A process whose kernels ran at least this share of the time (NVML's per-process figure) on such a GPU
    #: holds it most of the time: its main user, judged by the GPU's figures over its own turns.
    timeslice_main_share: float = 0.5
    #: NVML's per-process figure counts a process's whole turns (its context switched in, its queue filling the
    #: slice), more than its kernels ran at full rate, so the GPU's figures over its share of the time read low:
    #: its turns are judged as if they took this part of that share (SM busy from 60 %, compute-bound from 45 %
    #: of the tensor pipes over its turns). On an H200 the bf16 matmul beside three processes, at 84 % of the
    #: time, showed SMs 70 % and tensor pipes 62 % over its turns; alone a second later, 96 % and 93 %.
    timeslice_turn_scale: float = 0.75
    #: A process whose kernels ran this share of the time or more takes turns on the GPU (one below it only
    #: set up, or holds memory).
    timeslice_min_share: float = 0.02
    #: This share of such a GPU's full time or more no process's on record: its per-process figures lag (read
    #: every 5 s, a new process's first read covering its first second), so who holds it is not known yet.
    #: Under time-slicing the processes' figures sum to the GPU's (shared_four on an H200: 0.72 + 0.20 + 0.08).
    timeslice_unaccounted: float = 0.25

    # -- oscillation (input starvation) --------------------------------------------------------
    #: Share of samples with idle SMs while the rest are busy bursts.
    idle_share: float = 0.40
    burst_sm: float = 0.30
    #: Bursts must repeat: one idle->busy change is a start-up, not starvation.
    min_bursts: int = 2
    #: NVML utilization below this in a sample means no kernel or copy ran at all in its period.
    gap_util: float = 0.01
    #: Share of such fully idle samples (in at least `min_bursts` separate gaps) that makes the GPU's
    #: work intermittent: it stops and waits, rather than running small work steadily.
    gap_share: float = 0.20

    # -- the host thread's stacks (when py-spy may sample them) ----------------------------------
    #: Fewer samples than this say nothing.
    stack_min_samples: int = 20
    #: Share of the busy thread's samples spent preparing data that names input starvation.
    stack_data: float = 0.40
    #: Share spent waiting for the GPU (.item(), .cpu(), synchronize()) that names sync-bound: the GPU
    #: and the host take turns instead of overlapping.
    stack_sync: float = 0.20
    #: Share spent issuing PyTorch GPU work that names launch-bound.
    stack_launch: float = 0.40

    # -- start-up and wind-down ----------------------------------------------------------------
    #: Fully idle samples at the start (torch import, model build) or the end of a window are left
    #: out when the rest still spans `min_window_s`: a job that starts is not a job that waits.
    trim_idle_edges: bool = True

    # -- idle allocated ------------------------------------------------------------------------
    #: Memory held while nothing runs: above this many bytes someone reserved the GPU.
    held_bytes: float = 1 << 30

    # -- throttling ----------------------------------------------------------------------------
    #: Share of the window with a thermal / hardware slowdown / power-brake reason active.
    throttle_share: float = 0.20

    # -- imbalance and stragglers: one GPU of a job slower than its peers --------------------------
    #: The busiest GPU of a job does real work (SM activity at least this) ...
    imbalance_busy: float = 0.50
    #: ... and the least busy is this far below it (SM activity, 0..1): a straggler or uneven work.
    imbalance_gap: float = 0.30
    #: An SM clock this share below its peers' median: in a synchronous job every step runs at the slowest GPU's
    #: pace, so 10 % less clock is 10 % less for the whole job; healthy GPUs of one model boost within a few %.
    straggler_clock_drop: float = 0.10
    #: A link rate below this share of its peers' median, where the peers' rate matters (pcie_busy_bytes_per_s):
    #: the GPU's traffic does not take the path its peers' does (an NVLink down, a link trained narrower).
    straggler_link_ratio: float = 0.5
    #: The host's CPU (all cores) this busy: the node's processes compete for CPU (data loaders, launches).
    host_cpu_saturated: float = 0.90

    # -- memory growth -------------------------------------------------------------------------
    #: Growth that would fill the GPU within this time is worth a warning.
    oom_horizon_s: float = 3600.0
    #: The fit must explain the curve (R²) and grow by at least this much in the window.
    growth_r2: float = 0.9
    growth_min_bytes: float = 256 << 20


DEFAULT = Thresholds()
