"""Every threshold the trace rules (`gpuscope.trace.rules`) use, in one place, each with its reason.

Reasoned from what each quantity means and from Nsight Systems' expert rules where it has one; the
golden H200 traces (tests/fixtures/traces) are the sanity check, not the source.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuleThresholds:
    # -- severity: what a finding costs, as a share of the traced time ----------------------------
    #: A quarter of the time lost is the first thing to fix; one twentieth is worth fixing.
    high_share: float = 0.25
    medium_share: float = 0.05

    # -- transfers -----------------------------------------------------------------------------
    #: Pageable copies under 1 % of the time are a scalar or two moved per step: not worth a finding.
    pageable_min_share: float = 0.01
    #: Nsight's cuda_memcpy_sync ignores host->device copies up to 64 KB: the driver stages them
    #: through a pinned buffer and returns at once, so they do not block the host.
    sync_htod_max_bytes: int = 64 * 1024
    #: Synchronous copies/memsets that block the host less than 1 % of the time do not matter.
    sync_transfer_min_share: float = 0.01

    # -- syncs in a loop -----------------------------------------------------------------------
    #: A sync from the same line this many times is a loop, not a one-off (the profiler's own
    #: cudaDeviceSynchronize at start and stop, a checkpoint, an epoch-end metric).
    sync_min_count: int = 10
    #: ... and this often: one .item() per training step (a few per second) is harmless logging.
    sync_min_per_s: float = 50.0
    #: The GPU stays idle after each sync until the host queues work again; when that idle time
    #: adds up to this share of the trace, the syncs cost real throughput.
    sync_idle_min_share: float = 0.10

    # -- idle gaps -----------------------------------------------------------------------------
    #: Nsight's gpu_gaps default: a gap this long is always worth a look.
    gap_long_s: float = 0.5
    #: Shorter than this is the usual distance between dependent kernels (launch latency), not idling.
    gap_min_s: float = 10e-6
    #: Gaps of at least gap_min_s summing to this share of the GPU's active span: mostly waiting.
    gap_idle_share: float = 0.30
    #: How many of the largest gaps to explain with the host's stack.
    gap_examples: int = 3

    # -- tiny kernels --------------------------------------------------------------------------
    #: A kernel shorter than the ~5-10 µs a launch costs on the host cannot keep the GPU busy alone.
    tiny_kernel_s: float = 10e-6
    #: Enough tiny kernels to matter: at least this many, at this rate, and this share of all kernels.
    tiny_min_count: int = 100
    tiny_min_per_s: float = 5000.0
    tiny_min_kernel_share: float = 0.5
    #: Launch-bound: the GPU is idle at least this share of its span (busy GPUs hide launch cost).
    tiny_min_idle_share: float = 0.30

    # -- occupancy -----------------------------------------------------------------------------
    #: Kernels (by name) that take at least this share of the GPU's kernel time are worth tuning.
    occupancy_min_kernel_share: float = 0.10
    #: Kineto's "est. achieved occupancy %" below this leaves most warp slots empty to hide latency.
    #: 0 means Kineto could not compute it (e.g. cluster-launched cuBLAS kernels), not "empty".
    occupancy_low_pct: float = 25.0

    # -- matrix math off the tensor cores -----------------------------------------------------------
    #: Matrix-multiply / convolution kernels on the CUDA cores taking this share of the traced time: the
    #: tensor cores do the same math 8x (TF32) to 16x (bf16) faster, so most of it is won back; under a
    #: tenth it is a few small products in a step whose time goes elsewhere.
    tensor_unused_min_share: float = 0.10

    # -- passes over memory --------------------------------------------------------------------------
    #: Elementwise / reduction kernels (longer than tiny_kernel_s) this share of the kernel time: the GPU's
    #: work is mostly moving bytes at a few operations each (the cut gemm_min_share makes for matrix math);
    #: a training step's optimizer and activations take a third or so, a healthy mix.
    elementwise_min_kernel_share: float = 0.6
    #: ... and this share of the traced time (as tensor_unused_min_share): less is not where the time goes.
    elementwise_min_share: float = 0.10

    # -- verdicts (`gpuscope.trace.verdicts`): one bottleneck per GPU from the evidence above -------
    #: Copies busy this share of the GPU's active span, longer than its kernels: transfer-bound.
    transfer_min_share: float = 0.5
    #: ... and from pageable memory when this share of the copy time is.
    transfer_pageable_share: float = 0.5
    #: GPU idle at most this share of its active span: the host keeps it fed; what limits the kernels
    #: (math or memory) needs hardware counters, which a trace lacks.
    busy_max_idle_share: float = 0.20
    #: Matrix-multiply / convolution kernels this share of the kernel time: compute-bound work (the
    #: metrics' tensor-pipe cut); a training step with much of its time in elementwise and optimizer
    #: kernels is a healthy mix, not compute-bound.
    gemm_min_share: float = 0.6
    #: A cause (syncs, tiny kernels, what the host did in the gaps) explaining this share of the idle
    #: time is certain; less is the likeliest cause, said with less confidence. An idle share below
    #: `gap_idle_share` also lowers the confidence: the GPU is then not mostly waiting.
    cause_min_share: float = 0.5
    #: Moments in the GPU's idle time at which the host's stack is read, spread evenly over it: 200
    #: puts a share's sampling error under ~4 points, like py-spy's 2 s at 100 Hz.
    idle_samples: int = 200


DEFAULT = RuleThresholds()
