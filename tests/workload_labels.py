"""What a correct diagnosis says for each reference workload (../shared/workloads/README.md), shared by
the GPU tests and the replay of their recordings."""

from __future__ import annotations

#: The labelled verdict; host-bound ones are told apart by the process's stacks.
EXPECTED = {
    "compute_bound": {"compute_bound"},
    "memory_bound": {"memory_bound"},
    "h2d_pageable": {"transfer_bound"},
    "launch_bound": {"launch_bound"},
    "input_starved": {"input_starved"},
    "sync_heavy": {"sync_bound"},
    "idle_allocated": {"idle_allocated"},
    "healthy_training": {"healthy", "compute_bound"},
}

#: Without permission to sample the stacks, metrics alone say this, honestly.
FALLBACK = {"launch_bound": "launch_or_sync_bound", "sync_heavy": "launch_or_sync_bound",
            "input_starved": "launch_or_sync_bound"}

#: The labelled verdict must come within this many seconds of the workload's steady state.
WITHIN_S = 15.0


def steady_start(run: dict) -> float:
    """When a `gpuscope run` report's workload reached its steady state: its process on the GPU and,
    for a workload that computes, its loop started (the GPU busy in three samples in a row after
    set-up); a workload that never computes (idle_allocated) is steady once it is on the GPU."""
    start = run["gpu_start_s"]
    s = run["series"]["0"]
    util = s["gpu_utilization_ratio"]["mean"]
    busy = [t for i, t in enumerate(s["t"]) if t >= start and all(
        (util[j] or 0) >= 0.01 for j in range(i, min(i + 3, len(util))))]
    return busy[0] if busy else start
