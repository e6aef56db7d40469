"""Where a host-bound process's Python threads spend their time: a few seconds of stack samples.

When a GPU waits on its process's CPU thread, the metrics cannot say what the thread does: launching
many small kernels, waiting on synchronisations (.item(), .cpu()), or preparing data. A performance
engineer would look at the thread's stacks; this module does the same with py-spy (sampling from
outside, without pausing the process) and sorts every sample into one of four kinds:

- ``sync``: the thread waits for the GPU (a line with .item(), .cpu(), .tolist(), .numpy(),
  synchronize(), block_until_ready(), copy_to_host(), asnumpy(), device_get(); torch.cuda's synchronize
  frames, or a framework's device-to-host read below the line: a JAX array's __float__ or __array__);
- ``data``: data loading and preparation (torch.utils.data, numpy, PIL, OpenCV, torchvision
  transforms, pandas, datasets; or user lines in a loader-like function that call numpy/PIL/cv2);
- ``launch``: calls that issue GPU work: PyTorch's (torch.nn, torch.optim, autograd, tensor ops), and a
  line that calls into JAX, CuPy, numba-cuda's kernel launcher or Triton's (jax.numpy lives in
  jax/_src/numpy/, a data path by its name: what the line called decides, before any data rule);
- ``other``: any other host work.

Every busy Python thread is sampled (py-spy samples the threads that run, not the idle ones), and each
thread's samples are also kept apart (`HostProfile.threads`): a runtime that dispatches from several
threads shows which one waits on the GPU and which one launches. Native threads (an XLA runtime's)
have no Python stack; the process record's `busy_threads` names them.

It needs permission to read the process's memory (ptrace: the same user with
kernel.yama.ptrace_scope 0, or root / CAP_SYS_PTRACE). Without it, `profile()` says why and the
verdicts fall back to what the metrics alone can tell.
"""

from __future__ import annotations

import linecache
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("sync", "data", "launch", "other")

_SYNC_LINE = re.compile(r"\.item\(\)|\.cpu\(\)|\.tolist\(\)|\.numpy\(\)|synchronize\(|\.to\(\s*['\"]cpu['\"]"
                        r"|block_until_ready\(|copy_to_host\(|asnumpy\(|device_get\(")
_SYNC_FRAME = ("torch/cuda/__init__.py", "torch/cuda/streams.py", "torch/cuda/graphs.py")
_DATA_PATHS = ("/torch/utils/data/", "/numpy/", "/PIL/", "/cv2/", "/torchvision/transforms/",
               "/torchvision/io/", "/torchvision/datasets/", "/pandas/", "/datasets/", "/albumentations/",
               "/webdataset/", "/decord/", "/skimage/", "/scipy/", "/pyarrow/", "/h5py/", "/tokenizers/",
               "/transformers/tokenization", "/torchaudio/", "/librosa/")
_DATA_LINE = re.compile(r"\b(np|numpy|rng|PIL|Image|cv2|pd|pandas|transforms|h5py|imageio)\.")
_DATA_FUNC = re.compile(r"load|batch|augment|transform|collate|decode|preprocess|getitem", re.IGNORECASE)
_TORCH_PATHS = ("/torch/nn/", "/torch/optim/", "/torch/autograd/", "/torch/_tensor.py", "/torch/functional.py",
                "/torch/amp/", "/torch/_ops.py", "/torch/overrides.py")
_LIB_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen")
_MATMUL = re.compile(r"\w\s*@\s*\w")
#: Other frameworks' Python code that issues GPU work when a user line calls into it: JAX's dispatch (and
#: jax.numpy, under jax/_src/numpy/), CuPy's Python layer, numba-cuda's kernel launcher, Triton's launcher.
_GPU_PATHS = ("/jax/", "/jaxlib/", "/cupy/", "/cupyx/", "/numba/cuda/", "/numba_cuda/", "/triton/runtime/")
#: Their functions that wait for the GPU: a device-to-host read of an array, or an explicit wait.
_GPU_SYNC_FUNCS = frozenset(("block_until_ready", "device_get", "copy_to_host", "synchronize", "asnumpy", "tolist",
                             "__float__", "__int__", "__bool__", "__index__", "__array__", "_value"))
#: A line that issues GPU work through JAX or CuPy.
_GPU_LINE = re.compile(r"\b(jnp|jax|lax|cp|cupy|cupyx)\.")
#: A numba-cuda kernel launch, kernel[grid, block](...): a launch, whatever its arguments (np.float32(0.5)).
_KERNEL_LAUNCH = re.compile(r"\w\s*\[[^\[\]]+,[^\[\]]+\]\s*\(")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>.*?):(?P<line>\d+)\)$")
_PROFILER_FRAME = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\): (?P<func>.*)$")
# py-spy --threads: the stack's first frame names its thread, by OS thread id (or pthread id) and name.
_THREAD_FRAME = re.compile(r"^thread \((?P<id>0x[0-9A-Fa-f]+|\d+)\)(?::\s*(?P<name>.*))?$")
#: Threads described in a profile's evidence, the most sampled first.
MAX_THREADS = 8


@dataclass
class ThreadStacks:
    """One thread's part of a profile: its samples, their kinds, and the line of its dominant kind."""

    tid: int | None  # the OS thread id (None where py-spy gave only a pthread id)
    name: str
    samples: int
    shares: dict[str, float]
    where: str = ""  # 'file.py:12 func (80 %)' of its dominant kind

    def dominant(self) -> str:
        return max(KINDS, key=lambda k: self.shares.get(k, 0.0))


@dataclass
class HostProfile:
    """What the process's busy threads did, as shares of the stack samples, and their top lines."""

    pid: int
    samples: int
    shares: dict[str, float]  # kind -> share of samples
    top: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # kind -> [(file:line func, share)]
    seconds: float = 0.0
    threads: list[ThreadStacks] = field(default_factory=list)  # per sampled thread, the most sampled first

    def dominant(self) -> str:
        return max(KINDS, key=lambda k: self.shares.get(k, 0.0))

    def where(self, kind: str, n: int = 2) -> str:
        """'file.py:12 load_batch (61 %), ...' for the top lines of one kind."""
        return ", ".join(f"{loc} ({share * 100:.0f} %)" for loc, share in self.top.get(kind, [])[:n])

    def as_evidence(self) -> dict[str, object]:
        ev: dict[str, object] = {
            "stack_samples": self.samples, "stack_shares": {k: round(v, 3) for k, v in self.shares.items()},
            "stack_top_lines": {k: [[loc, round(s, 3)] for loc, s in v[:3]] for k, v in self.top.items()}}
        if self.threads:
            ev["stack_threads"] = [{"tid": t.tid, "name": t.name, "samples": t.samples, "kind": t.dominant(),
                                    "shares": {k: round(v, 3) for k, v in t.shares.items() if v},
                                    "at": t.where} for t in self.threads[:MAX_THREADS]]
        return ev


class ProfileUnavailable(Exception):
    """Stack sampling cannot run here; the message says why in one sentence."""


def py_spy() -> str | None:
    """The py-spy executable: on PATH, beside this Python, or in this environment's scripts folder."""
    found = shutil.which("py-spy")
    if found:
        return found
    for d in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        if (d / "py-spy").exists():
            return str(d / "py-spy")
    return None


def _user_file(path: str) -> bool:
    return not any(m in path for m in _LIB_MARKERS) and not path.startswith("<")


def _frames(stack: str) -> list[tuple[str, str, int]]:
    out = []
    for part in stack.split(";"):
        m = _FRAME.match(part.strip())
        if m:
            out.append((m["func"], m["file"], int(m["line"])))
    return out


def classify_stack(frames: list[tuple[str, str, int]]) -> tuple[str, tuple[str, str, int] | None]:
    """The kind of one sample (root first, leaf last) and the user frame that explains it."""
    user = [f for f in frames if _user_file(f[1])]
    at = user[-1] if user else (frames[-1] if frames else None)
    below = frames[frames.index(at) + 1:] if at in frames else []  # library frames the user line called
    files = [f[1] for f in below]
    source = linecache.getline(at[1], at[2]) if at and _user_file(at[1]) else ""
    if any(f.endswith(s) for f in files for s in _SYNC_FRAME) or _SYNC_LINE.search(source) or any(
            f[0].rpartition(".")[2] in _GPU_SYNC_FUNCS and any(p in f[1] for p in _GPU_PATHS) for f in below):
        return "sync", at
    if (files and any(p in files[0] for p in _GPU_PATHS)) or (not files and _KERNEL_LAUNCH.search(source)):
        return "launch", at  # the line called a GPU framework, or launches a kernel: it issues GPU work
    in_loader = any(_DATA_FUNC.search(u[0].rpartition(".")[2]) for u in user)  # load_batch, __getitem__, ...
    if any(p in f for f in files for p in _DATA_PATHS) or _DATA_LINE.search(source) or (in_loader and not files):
        return "data", at
    if (any(p in f for f in files for p in _TORCH_PATHS) or "torch." in source or _MATMUL.search(source)
            or _GPU_LINE.search(source)):
        return "launch", at
    return "other", at


_BUILTIN = re.compile(r"^<built-in (?:method|function) (\w+)")
_SYNC_BUILTINS = frozenset(("item", "cpu", "tolist", "numpy", "synchronize", "_local_scalar_dense"))


def classify_profiler_frames(names: list[str], is_user_file: Callable[[str], bool]) -> str:
    """The kind of one stack from a PyTorch profiler trace: its Python frame names, root first
    (`input_starved.py(13): load_batch`, `<built-in method item of Tensor object at 0x...>`).

    The profiler names library files relative to sys.path (`numpy/_core/numeric.py`) and shows the C
    methods called, where py-spy shows neither; `is_user_file` tells the program's files from libraries'.
    """
    frames = []
    for name in names:
        b = _BUILTIN.match(name)
        if b is not None:
            if b.group(1) in _SYNC_BUILTINS:  # the profiler names the call that waits, py-spy its source line
                return "sync"
            continue
        m = _PROFILER_FRAME.match(name)
        if m is None:
            continue
        path = m["file"] if is_user_file(m["file"]) else "/site-packages/" + m["file"]
        frames.append((m["func"], path, int(m["line"])))
    return classify_stack(frames)[0]


def parse_raw(text: str, pid: int, seconds: float = 0.0) -> HostProfile:
    """py-spy's raw (collapsed) output: one 'frame;frame;... count' line per distinct stack, its first frame
    'thread (TID): name' with --threads."""
    counts: Counter[str] = Counter()
    lines: dict[str, Counter[str]] = {k: Counter() for k in KINDS}
    per_thread: dict[tuple[str, str], tuple[Counter[str], dict[str, Counter[str]]]] = {}
    total = 0
    for row in text.splitlines():
        stack, _, n = row.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        first, _, rest = stack.partition(";")
        thread = _THREAD_FRAME.match(first.strip())
        kind, at = classify_stack(_frames(rest if thread else stack))
        counts[kind] += int(n)
        total += int(n)
        loc = f"{os.path.basename(at[1])}:{at[2]} {at[0]}" if at is not None else None
        if loc is not None:
            lines[kind][loc] += int(n)
        if thread is not None:
            mine = per_thread.setdefault((thread["id"], (thread["name"] or "").strip()),
                                         (Counter(), {k: Counter() for k in KINDS}))
            mine[0][kind] += int(n)
            if loc is not None:
                mine[1][kind][loc] += int(n)
    shares = {k: counts[k] / total if total else 0.0 for k in KINDS}
    top = {k: [(loc, c / total) for loc, c in lines[k].most_common(3)] for k in KINDS if lines[k]}
    threads = []
    for (tid, name), (kinds, locs) in per_thread.items():
        n = sum(kinds.values())
        lead = max(KINDS, key=lambda k: kinds[k])
        at = locs[lead].most_common(1)
        threads.append(ThreadStacks(int(tid) if tid.isdigit() else None, name, n,
                                    {k: kinds[k] / n for k in KINDS},
                                    f"{at[0][0]} ({at[0][1] / n * 100:.0f} %)" if at else ""))
    threads.sort(key=lambda t: (-t.samples, t.tid or 0))
    return HostProfile(pid, total, shares, top, seconds, threads)


def profile(pid: int, seconds: float = 2.0, rate: int = 100) -> HostProfile:
    """Sample the Python stacks of `pid` for `seconds` without pausing it. Raises ProfileUnavailable."""
    exe = py_spy()
    if exe is None:
        raise ProfileUnavailable("py-spy is not installed (pip install py-spy).")
    with tempfile.TemporaryDirectory(prefix="gpuscope-stacks-") as tmp:
        out = Path(tmp) / "raw.txt"
        cmd = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
               "--format", "raw", "--nonblocking", "--full-filenames", "--threads", "-o", str(out)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 20)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ProfileUnavailable(f"py-spy could not run: {e}.") from None
        if p.returncode != 0 or not out.exists():
            msg = (p.stderr or p.stdout).strip().splitlines()
            reason = next((m for m in msg if "rror" in m or "ermission" in m), msg[-1] if msg else "no output")
            raise ProfileUnavailable(f"py-spy could not sample process {pid}: {reason.strip()}")
        return parse_raw(out.read_text(errors="replace"), pid, seconds)


class Profiler:
    """Profiles a process at most once per `every_s` and remembers the result (and failures)."""

    def __init__(self, seconds: float = 2.0, every_s: float = 30.0) -> None:
        self.seconds, self.every_s = seconds, every_s
        self._cache: dict[int, tuple[float, HostProfile | None, str | None]] = {}
        self._lock = threading.Lock()

    def __call__(self, pid: int) -> tuple[HostProfile | None, str | None]:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(pid)
            if hit is not None and now - hit[0] < self.every_s:
                return hit[1], hit[2]
        try:
            result: tuple[HostProfile | None, str | None] = (profile(pid, self.seconds), None)
        except ProfileUnavailable as e:
            result = (None, str(e))
        except Exception as e:  # noqa: BLE001 - evidence gathering must never break a diagnosis
            result = (None, f"stack sampling failed: {e}")
        with self._lock:
            now = time.monotonic()
            if len(self._cache) > 256:  # pids churn: forget the results too old to be served again
                self._cache = {k: v for k, v in self._cache.items() if now - v[0] < self.every_s}
            self._cache[pid] = (now, *result)
        return result
