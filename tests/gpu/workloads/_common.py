"""Shared helpers for the workloads of issue 21 (any framework: nothing here imports one).

Same interface as the reference workloads' _common (../shared/workloads): `args()` and
`run_for(seconds, step)`, so tests/fixtures/traces/capture.py can record any PyTorch one of them.
"""
import argparse
import os
import time


def args(default_seconds=20.0, **extra):
    """--seconds (or $WORKLOAD_SECONDS) and --device, plus `extra` as --name=default options."""
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=float(os.environ.get("WORKLOAD_SECONDS", default_seconds)))
    p.add_argument("--device", default="cuda")
    for name, default in extra.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    return p.parse_args()


def run_for(seconds, step, sync=None):
    """Call step() until `seconds` have passed, then sync() (the framework's wait for the GPU); print steps/s."""
    t0 = time.time()
    n = 0
    while time.time() - t0 < seconds:
        step()
        n += 1
    if sync is not None:
        sync()
    print(f"steps={n} steps_per_s={n / (time.time() - t0):.2f}", flush=True)
