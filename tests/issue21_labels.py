"""What a correct diagnosis says for issue 21's workloads (tests/gpu/workloads: each docstring names its
verdict), shared by the GPU tests (tests/gpu/test_issue21_verdicts.py) and the replay of their recordings
(tests/test_issue21_recordings.py): the same checks over the verdicts made live and over those replayed.

A verdict here is a `Made`: the GPU's primary verdict of one window and, on a GPU that processes share,
each process's own primary verdict (pid -> `Own`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from workload_labels import WITHIN_S, steady_start

from gpuscope.diagnose import advice

#: The GPU's primary verdict while the workload runs. cupy_loop's host spends most of each step in its own
#: Python sum, the rest launching and in the float() read-back that waits for the GPU: its stacks make it
#: host_bound (a sync share of 20 % or more: sync_bound); either way the GPU waits on the host.
GPU = {
    "shared_two": {"compute_bound"},
    "shared_four": {"compute_bound"},
    "jax_eager": {"launch_bound"},
    "cupy_loop": {"sync_bound", "host_bound"},
    "numba_kernel": {"launch_bound"},
    "fp32_gemm": {"tensor_cores_unused"},
}
#: The shared workloads' processes (tests/gpu/workloads/_shared_roles.py), by the role in their command line.
ROLES = {"shared_two": ("matmul_bf16", "item_sync"),
         "shared_four": ("matmul_bf16", "item_sync", "tiny_launch", "holder")}
#: Each role's own verdict.
OWN = {"matmul_bf16": {"compute_bound"}, "item_sync": {"sync_bound"}, "tiny_launch": {"launch_bound"},
       "holder": {"idle_allocated"}}
#: The roles that need no change: nothing but an info verdict, no side verdict, never what to change first.
HEALTHY = {"matmul_bf16"}
#: Without permission to sample the stacks, the metrics alone say this of a process that waits on its host.
FALLBACK = {"launch_bound": "launch_or_sync_bound", "sync_bound": "launch_or_sync_bound",
            "host_bound": "launch_or_sync_bound"}
#: What each workload runs on, as gpuscope._frameworks names it.
FRAMEWORK = {"shared_two": "torch", "shared_four": "torch", "jax_eager": "jax", "cupy_loop": "cupy",
             "numba_kernel": "numba", "fp32_gemm": "torch"}
#: A problem's fixes name the framework's own API ...
WORDS = {"torch": re.compile(r"torch\.|\.item\(\)"), "jax": re.compile(r"jax\."),
         "cupy": re.compile(r"cupy"), "numba": re.compile(r"@cuda\.jit|cuda\.(to_device|stream|grid|pinned)")}
#: ... and never another framework's.
FOREIGN = {"torch": re.compile(r"jax\.|cupy|@cuda\.jit"),
           "jax": re.compile(r"torch|\.item\(\)|loss\.detach|DataLoader|cupy|@cuda\.jit"),
           "cupy": re.compile(r"torch|\.item\(\)|loss\.detach|DataLoader|jax\.|@cuda\.jit"),
           "numba": re.compile(r"torch|\.item\(\)|loss\.detach|DataLoader|jax\.|cupy\.")}
#: What the H200 shows wrong, kept as findings, not as the truth: `check` leaves these out and says so, and each
#: entry gets a strict xfail test in both suites that asserts the right verdicts, so a fixed rule turns it into a
#: failure that asks for the entry's removal. shared_four's GPU and matmul verdicts were here (2026-12-02: a GPU
#: time-sliced between four processes, NVML 100 %, SMs 63 %, read as waiting on its host) until the rules judged
#: a time-sliced GPU by its main user's turns (gpuscope.diagnose.timeslice).
KNOWN_WRONG: dict[str, dict[str, str]] = {}
#: The first verdict over a window that lies wholly in the steady state.
WINDOW_S = 10.0
#: The last verdict before the run's end: its window may have lost a process that ended first.
LAST_WINDOW_S = 5.0
#: The jax_eager docstring's fix, said in JAX's words.
JAX_FIX = "jax.jit"
NAMES = tuple(GPU)


@dataclass
class Own:
    kind: str
    severity: str
    recommendations: list[str]
    summary: str = ""


@dataclass
class Made:
    """One window's verdict on GPU 0, made at `t` (seconds since the run began: the window's end)."""

    t: float
    kind: str
    severity: str
    recommendations: list[str]
    summary: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    processes: dict[int, Own] = field(default_factory=dict)  # primary ones
    side: dict[int, list[str]] = field(default_factory=dict)  # pid -> kinds of its side verdicts


def live(data: dict[str, Any]) -> list[Made]:
    """The verdicts a `gpuscope run` report made on GPU 0 (its timeline)."""
    out = []
    for s in data["timeline"]:
        if not (s["primary"] and s["gpu"] == "0"):
            continue
        own = {p["pid"]: Own(p["kind"], p["severity"], p["recommendations"], p["summary"])
               for p in s.get("processes") or [] if p["primary"]}
        side: dict[int, list[str]] = {}
        for p in s.get("processes") or []:
            if not p["primary"]:
                side.setdefault(p["pid"], []).append(p["kind"])
        out.append(Made(s["end_s"], s["kind"], s["severity"], s["recommendations"], s["summary"], s["evidence"],
                        own, side))
    return out


def roles(data: dict[str, Any]) -> dict[str, int]:
    """role -> pid of a shared workload's processes on GPU 0, from their command lines."""
    out = {}
    for r in data["processes"]:
        if r["gpu"] == "0" and "_shared_roles.py" in (r["cmdline"] or ""):
            role = next(a for a in r["cmdline"].split() if a in OWN)
            assert role not in out, (role, out)
            out[role] = r["pid"]
    return out


def stacks_sampled(data: dict[str, Any]) -> bool:
    """Whether py-spy could sample the stacks (no verdict says it could not)."""
    for s in data["timeline"]:
        if "stack_sampling" in (s.get("evidence") or {}):
            return False
        if any("stack_sampling" in (p.get("evidence") or {}) for p in s.get("processes") or []):
            return False
    return True


def expected(kinds: set[str], stacks: bool) -> set[str]:
    return kinds if stacks else {FALLBACK.get(k, k) for k in kinds}


def settles(made: list[tuple[float, str]], want: set[str], steady: float, end: float, what: str) -> float:
    """The labelled verdict comes within WITHIN_S of the workload's steady state and stays until `end`; its
    time."""
    first = next((t for t, k in made if k in want), None)
    assert first is not None, (what, want, made)
    assert first - steady <= WITHIN_S, (what, steady, made)
    wrong = [(t, k) for t, k in made if first < t < end and k not in want]
    assert not wrong, (what, want, wrong, made)
    return first


def check_words(fw: str, kind: str, recs: list[str], what: str) -> None:
    """A verdict's fixes are in its framework's words: a problem names the framework's API; none names another
    framework's."""
    text = " ".join(recs)
    assert recs, (what, kind)
    assert not FOREIGN[fw].search(text), (what, kind, FOREIGN[fw].search(text), text)
    if kind not in advice.NEUTRAL and kind not in advice.SAME_AS_CUDA.get(fw, ()) and kind != "compute_bound":
        assert WORDS[fw].search(text), (what, kind, text)


def known_wrong(name: str, strict: bool = False) -> dict[str, str]:
    """The parts of workload `name` the checks leave out (KNOWN_WRONG), printed; none when `strict`."""
    known = {} if strict else KNOWN_WRONG.get(name, {})
    for what, why in known.items():
        print(f"{name}: {what} left out, known wrong on the H200: {why}")
    return known


def check(name: str, data: dict[str, Any], made: list[Made], end: float, strict: bool = False) -> None:
    """The verdicts `made` over a run of workload `name` (its report `data`) say what the workload's docstring
    says, up to `end` (the run's exit aside): the GPU's and each process's, the GPU named as shared by its
    processes, every fix in the workload's framework's words, a healthy process given nothing but healthy.
    The KNOWN_WRONG parts are left out unless `strict`."""
    known = known_wrong(name, strict)
    stacks = stacks_sampled(data)
    steady = steady_start(data)
    fw = FRAMEWORK[name]
    want = expected(GPU[name], stacks)
    assert all(m.kind != "idle" for m in made if m.t > steady), (name, [(m.t, m.kind) for m in made])
    if "GPU 0" in known:
        first = next(m.t for m in made if m.t >= steady + WINDOW_S)
    else:
        first = settles([(m.t, m.kind) for m in made], want, steady, end, f"{name}: GPU 0")
    steady_made = [m for m in made if first <= m.t < end]
    for m in steady_made:
        check_words(fw, m.kind, m.recommendations, f"{name}: GPU 0 at {m.t:.1f} s")
    if name == "jax_eager":
        assert all(JAX_FIX in " ".join(m.recommendations) for m in steady_made), steady_made
    if name not in ROLES:
        assert all(not m.processes for m in made), (name, "one process: the GPU's verdict is its own")
        return
    pids = roles(data)
    assert sorted(pids) == sorted(ROLES[name]), (name, pids)
    for m in steady_made:
        # the GPU's own verdict says that it is shared, and by whom (each with its own verdict): by every process
        # of the workload, but in the last window, where one may have ended already
        present = set(m.processes)
        assert present <= set(pids.values()), (pids, present)
        assert present == set(pids.values()) or m.t >= end - LAST_WINDOW_S, (m.t, pids, present)
        assert f"Shared by {len(present)} processes" in m.summary, m.summary
        assert all(str(pid) in m.summary for pid in present), (pids, m.summary)
        by = {r["pid"]: r for r in m.evidence["shared_by"]}
        assert set(by) == present, (present, by)
        assert all(by[pid]["kind"] == m.processes[pid].kind for pid in present), (by, m.processes)
    for role, pid in pids.items():
        own = [(m.t, m.processes[pid].kind) for m in made if pid in m.processes]
        if role not in known:
            settles(own, expected(OWN[role], stacks), steady, end, f"{name}: {role} ({pid})")
        for m in made:
            v = m.processes.get(pid)
            if v is None or m.t >= end:
                continue
            if role in HEALTHY and role not in known:  # nothing beyond healthy, start-up included
                assert v.severity == "info" and not m.side.get(pid), (name, role, m.t, v, m.side)
            if m.t >= first:
                check_words(fw, v.kind, v.recommendations, f"{name}: {role} ({pid}) at {m.t:.1f} s")
                assert str(pid) in v.summary, v.summary


def check_report(name: str, data: dict[str, Any], strict: bool = False) -> None:
    """What a live report says beyond its verdicts: each GPU process's row names its framework and its verdict
    over the run, a process that never used the GPU (a launcher) has none, and what to change first is a
    problem of the workload's, in its framework's words, never a healthy process's."""
    known = known_wrong(name, strict)
    stacks = stacks_sampled(data)
    fw = FRAMEWORK[name]
    rows = [r for r in data["processes"] if r["ours"]]
    on_gpu = [r for r in rows if r["gpu"] == "0"]
    assert on_gpu and all(fw in r["frameworks"] for r in on_gpu), [(r["pid"], r["frameworks"]) for r in on_gpu]
    assert all(r["verdict"] is None for r in rows if r["gpu"] is None), rows
    pids = roles(data) if name in ROLES else {}
    for role, pid in pids.items():
        if role in known:
            continue
        (row,) = [r for r in on_gpu if r["pid"] == pid]
        assert row["verdict"] in expected(OWN[role], stacks), (name, role, row["verdict"], row["verdict_share"])
    if name not in ROLES:
        (row,) = on_gpu
        assert row["verdict"] in expected(GPU[name], stacks), (name, row["verdict"], row["verdict_share"])
    cf = data["change_first"]
    if cf is None:
        assert all(k in ("compute_bound", "healthy") for k in GPU[name]), (name, "nothing to change")
        return
    check_words(fw, cf["kind"], cf["advice"], f"{name}: change first")
    problems = (set().union(*(expected(OWN[r], stacks) for r in pids if r not in HEALTHY)) if pids
                else expected(GPU[name], stacks))
    assert cf["kind"] in problems, (name, cf)
