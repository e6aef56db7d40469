"""Golden: `gpuscope run` on issue 21's workloads on an H200 (tests/gpu/test_issue21_verdicts.py), replayed.

Each recording (tests/fixtures/recordings/runs/run_<workload>.json.gz) is the run's JSON report: GPU 0's
series at 10 Hz, each process's reads on it (SM share, NVML's per-process figure, CPU cores, busiest
thread, busy threads, GPU memory), the frameworks each process loaded, and the verdict timeline with its
evidence (the stack shares py-spy measured, per process on a shared GPU). As tests/test_run_recordings.py
does, the replay cuts the series into the windows `run` uses (the last 10 s, every 5 s), here with each
process's figures over the window as gpuscope.diagnose.windows makes them (medians; its SM and NVML
shares weighted by the time each read covers), runs `diagnose` over them and
checks (tests/issue21_labels.py, the checks the GPU test made live): each process's own verdict on the
shared GPU, the GPU named as shared by them, JAX eager never idle and launch-bound, CuPy and Numba
waiting on their host, FP32 GEMMs off the tensor cores, every fix in the workload's framework's words.

The H200's raw py-spy stacks of the JAX, Numba and CuPy workloads (tests/fixtures/recordings/stacks) are
classified here too: what the stack rules say of a thread that dispatches through JAX or launches Numba
kernels.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest
from issue21_labels import FRAMEWORK, NAMES, Made, Own, check, check_report, live

from gpuscope.diagnose import GpuWindow, ProcessView, advice, diagnose
from gpuscope.diagnose.stacks import HostProfile, parse_raw
from gpuscope.diagnose.windows import time_share

FIXTURES = Path(__file__).parent / "fixtures" / "recordings"
RUNS = FIXTURES / "runs"
STACKS = FIXTURES / "stacks"
WORKLOADS = Path(__file__).parent / "gpu" / "workloads"
WINDOW_S, EVERY_S = 10.0, 5.0  # as gpuscope.runcmd
#: A process is on the GPU at a window's end when it was read this shortly before it (reads come every second).
LAST_READ_S = 1.5


def load(name: str) -> dict[str, Any]:
    return json.loads(gzip.decompress((RUNS / f"run_{name}.json.gz").read_bytes()))


@pytest.fixture(scope="module", params=NAMES)
def recording(request) -> tuple[str, dict[str, Any]]:
    return request.param, load(request.param)


def _mid(xs: list[float | None]) -> float | None:
    vals = sorted(v for v in xs if v is not None)
    if not vals:
        return None
    n = len(vals)
    return vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2


def profile_of(data: dict[str, Any], pid: int) -> tuple[HostProfile | None, str | None]:
    """The stacks sampled live of process `pid` (its own verdict's evidence on a shared GPU, the GPU's where it
    had the GPU alone), or why they could not be."""
    for seg in data["timeline"]:
        found = [p["evidence"] for p in seg.get("processes") or [] if p["pid"] == pid]
        if not found and seg.get("pids") == [pid]:
            found = [seg["evidence"]]
        for ev in found:
            if "stack_shares" in ev:
                top = {k: [(loc, share) for loc, share in v] for k, v in ev["stack_top_lines"].items()}
                return HostProfile(pid, ev["stack_samples"], ev["stack_shares"], top), None
            if "stack_sampling" in ev:
                return None, ev["stack_sampling"]
    return None, None


def window(data: dict[str, Any], a: float, b: float) -> GpuWindow:
    """GPU 0 over [a, b] from the recording: its series, and each process on it at b with its medians."""
    s = data["series"]["0"]
    idx = [i for i, t in enumerate(s["t"]) if a <= t <= b]
    series = {k: [v["mean"][i] if isinstance(v, dict) else v[i] for i in idx]
              for k, v in s.items() if k.startswith("gpu_")}
    gpu = data["gpus"][0]
    w = GpuWindow("0", [s["t"][i] for i in idx], series, memory_total_bytes=gpu["memory_total_bytes"],
                  sm_clock_max_hertz=gpu.get("sm_clock_max_hertz"))
    for r in data["processes"]:
        ps = r["series"]
        if r["gpu"] != "0" or not ps:
            continue
        keep = [i for i, t in enumerate(ps["t"]) if a <= t <= b]
        if not keep or ps["t"][keep[-1]] < b - LAST_READ_S:
            continue

        def mid(f: str, keep: list[int] = keep, ps: dict[str, Any] = ps) -> float | None:
            return _mid([ps[f][i] for i in keep])

        busy = mid("threads_busy")
        profile, error = profile_of(data, r["pid"])
        w.processes.append(ProcessView(
            r["pid"], r["name"], r["cmdline"], cpu_cores=mid("cpu_cores"), thread_cpu_max_ratio=mid("thread_cpu_max_ratio"),
            gpu_memory_bytes=ps["gpu_memory_bytes"][keep[-1]], profile=profile, profile_error=error,
            frameworks=tuple(r["frameworks"]), sm_ratio=time_share([ps["sm_ratio"][i] for i in keep]),
            utilization_ratio=time_share([ps["utilization_ratio"][i] for i in keep]),
            threads_busy=None if busy is None else int(busy + 0.5),
            memory=[(ps["t"][i], ps["gpu_memory_bytes"][i]) for i in keep if ps["gpu_memory_bytes"][i] is not None]))
    return w


def replay(data: dict[str, Any]) -> list[Made]:
    """The verdicts the rules give now over the recording's windows, every 5 s (the program's exit aside)."""
    made = []
    t = EVERY_S
    while t <= data["duration_s"] - 2.0:
        for v in diagnose([window(data, max(0.0, t - WINDOW_S), t)]):
            if v.primary and v.gpu == "0":
                side: dict[int, list[str]] = {}
                for pv in v.processes:
                    if not pv.primary:
                        side.setdefault(pv.pid, []).append(pv.kind)
                made.append(Made(t, v.kind, v.severity, list(v.recommendations), v.summary, dict(v.evidence),
                                 {pv.pid: Own(pv.kind, pv.severity, list(pv.recommendations), pv.summary)
                                  for pv in v.processes if pv.primary}, side))
                break
        t += EVERY_S
    return made


def test_the_recording_replays_its_verdicts(recording):
    name, data = recording
    made = replay(data)
    print(name, [(m.t, m.kind, {pid: o.kind for pid, o in m.processes.items()}) for m in made])
    check(name, data, made, data["duration_s"] - 1.0)
    # the fixes are those of the framework the recorded processes loaded, whichever the kind
    fw = (FRAMEWORK[name],)
    for m in made:
        assert m.recommendations == advice.fixes(m.kind, fw), (m.t, m.kind)
        assert all(o.recommendations == advice.fixes(o.kind, fw) for o in m.processes.values()), m.processes


def test_the_recording_says_what_the_gpu_said(recording):
    """The verdicts made live on the H200, with the rules of that day, are in the recording and right."""
    name, data = recording
    check(name, data, live(data), data["duration_s"] - 1.0)
    check_report(name, data)


def test_replayed_and_live_verdicts_agree_in_the_steady_state(recording):
    """Each replayed window's verdict is the one the live run made over (nearly) the same window."""
    name, data = recording
    said = [(m.t, m.kind, {pid: o.kind for pid, o in m.processes.items()}) for m in live(data)]
    for m in replay(data):
        t, kind, own = min(said, key=lambda x: abs(x[0] - m.t))
        if abs(t - m.t) > 1.0 or m.t < data["gpu_start_s"] + WINDOW_S or m.t > data["duration_s"] - 3.0:
            continue  # no live verdict over that window, or one of the start-up's or the exit's
        assert (m.kind, {pid: o.kind for pid, o in m.processes.items()}) == (kind, own), (name, m.t, t)


# -- the raw stacks --------------------------------------------------------------------------------------

def raw_stacks(name: str) -> str:
    """py-spy's raw output for a workload on the H200, its paths to the workloads made this checkout's (the stack
    rules read the user's source lines)."""
    text = gzip.decompress((STACKS / f"{name}.txt.gz").read_bytes()).decode()
    return re.sub(r"\(([^();]*?)/tests/gpu/workloads/(\w+\.py):", lambda m: f"({WORKLOADS}/{m[2]}:", text)


@pytest.mark.parametrize(("name", "kind"), [("jax_eager", "launch"), ("numba_kernel", "launch")])
def test_the_h200s_stacks_of_a_jax_or_numba_dispatch_loop_are_launches(name, kind):
    """jax.numpy's frames lie under jax/_src/numpy/ and the Numba launch line holds np.float32(...): by name
    both looked like data preparation; what the line calls decides."""
    prof = parse_raw(raw_stacks(name), 1)
    print(name, prof.samples, prof.shares, prof.top)
    assert prof.samples >= 100 and prof.shares[kind] >= 0.9, prof.shares
    assert prof.shares["data"] == 0.0, prof.shares


def test_the_h200s_stacks_of_the_cupy_loop():
    """Its thread's time: the CuPy calls at line 21 (launches), the Python sum at line 23 and the float()
    read-back at line 22, both host work to py-spy: CuPy's Cython frames do not show below the line, so the
    read-back's wait is not seen as a sync, and the verdict is host_bound, not sync_bound (a trace says that)."""
    prof = parse_raw(raw_stacks("cupy_loop"), 1)
    print(prof.samples, prof.shares, prof.top)
    assert prof.samples >= 100 and prof.dominant() == "other" and prof.shares["data"] == 0.0, prof.shares
    assert [loc for loc, _ in prof.top["launch"]] == ["cupy_loop.py:21 step"], prof.top
    assert {loc for loc, _ in prof.top["other"]} >= {"cupy_loop.py:22 step", "cupy_loop.py:23 step"}, prof.top
