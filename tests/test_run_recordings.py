"""Golden: `gpuscope run` on every reference workload on an H200 (tests/gpu/test_gpu_run.py), replayed.

Each recording is the run's JSON report: the GPU's series at 10 Hz, the processes, and the verdict
timeline with its evidence (for host-bound GPUs, the stack shares py-spy measured). The replay cuts
the series into the windows `run` uses (the last 10 s, every 5 s) and checks the labelled verdict
comes within 15 s of the workload's steady state and stays.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from workload_labels import EXPECTED, WITHIN_S, steady_start

from gpuscope.diagnose import GpuWindow, ProcessView, diagnose
from gpuscope.diagnose.stacks import HostProfile

RUNS = Path(__file__).parent / "fixtures" / "recordings" / "runs"
def load(name: str) -> dict:
    return json.loads(gzip.decompress((RUNS / f"run_{name}.json.gz").read_bytes()))


def profile_of(data: dict, pid: int) -> HostProfile | None:
    for seg in data["timeline"]:
        ev = seg.get("evidence") or {}
        if "stack_shares" in ev:
            top = {k: [(loc, share) for loc, share in v] for k, v in ev["stack_top_lines"].items()}
            return HostProfile(pid, ev["stack_samples"], ev["stack_shares"], top)
    return None


def window(data: dict, a: float, b: float) -> GpuWindow:
    s = data["series"]["0"]
    idx = [i for i, t in enumerate(s["t"]) if a <= t <= b]
    series = {k: [v["mean"][i] if isinstance(v, dict) else v[i] for i in idx]
              for k, v in s.items() if k.startswith("gpu_")}
    w = GpuWindow("0", [s["t"][i] for i in idx], series, memory_total_bytes=data["gpus"][0]["memory_total_bytes"],
                  sm_clock_max_hertz=data["gpus"][0].get("sm_clock_max_hertz"))
    for p in data["processes"]:
        if p.get("gpu") == "0" and p.get("gpu_first_seen_s") is not None and p["gpu_first_seen_s"] <= b:
            w.processes.append(ProcessView(p["pid"], p["name"], p["cmdline"],
                                           thread_cpu_max_ratio=p["thread_cpu_max_ratio"],
                                           gpu_memory_bytes=p["gpu_memory_max_bytes"],
                                           profile=profile_of(data, p["pid"])))
    return w


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_run_recording_replayed(name):
    data = load(name)
    steady = steady_start(data)
    made: list[tuple[float, str, str]] = []
    t = 5.0
    while t <= data["duration_s"] - 2.0:  # the program's exit aside, as on the GPU
        for v in diagnose([window(data, max(0.0, t - 10.0), t)]):
            if v.primary:
                made.append((t, v.kind, v.severity))
        t += 5.0
    first = next((m for m in made if m[1] in EXPECTED[name]), None)
    assert first is not None, made
    assert first[0] - steady <= WITHIN_S, (steady, made)
    assert all(k in EXPECTED[name] for tm, k, _ in made if tm > first[0]), made
    if name == "healthy_training":  # no bottleneck at any time, start-up included
        assert all(sev == "info" for _, _, sev in made), made


def test_the_recordings_say_what_the_gpu_said():
    """The verdicts made live on the H200 (with the rules of that day) are in the recordings."""
    for name, kinds in EXPECTED.items():
        live = {s["kind"] for s in load(name)["timeline"] if s["primary"]}
        assert live & kinds, (name, live)
