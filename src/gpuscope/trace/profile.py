"""GPU time by launching stack, folded: one trace's flame graph as samples tagged with where it ran, the
merge of many (processes, nodes, windows), and the two files profilers read: pprof and speedscope.

A sample is a stack (root first: thread > Python frames > CPU ops > the GPU op, as `gpuscope.trace.flame`
charges it), its labels (node, job, pid) and two values: GPU time in ns and the number of GPU ops it
launched. GPU ops whose launch is not in the trace are one sample under `[launch not in the trace]`, so a
profile's total is all the GPU time of its windows. Thread ids mean nothing across processes: the thread
frame reads `main thread` (its id is the process id) or `other thread`.

The folded form (`Profile.to_json`) is what the agent caches beside each trace and serves; `from_json`
reads it back from anyone (another agent, a file someone planted) under caps, every flaw one sentence.

    >>> from gpuscope.trace.kineto import load
    >>> p = fold(load("tests/fixtures/traces/launch_bound.pt.trace.json.gz"), node="n1", job="slurm/7")
    >>> merged = merge([p, p]); merged.total_ns == 2 * p.total_ns
    True
    >>> open("gpu.pb.gz", "wb").write(merged.pprof())  # doctest: +SKIP
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .flame import Frame, gpu_flame, speedscope_doc
from .model import Trace

FORMAT = "gpuscope.profile/1"
NO_LAUNCHER = "[launch not in the trace]"
SAMPLE_TYPES = (("gpu_time", "nanoseconds"), ("launches", "count"))
LABELS = ("node", "job", "pid")
FRAME_KINDS = frozenset(("thread", "user", "python", "op", "sampled", "kernel", "memcpy", "memset"))

# What one folded profile may hold when read from outside (a window of a busy program folds into a few
# thousand stacks; a fleet's merge into some hundred thousand).
MAX_FRAMES = 500_000
MAX_SAMPLES = 1_000_000
MAX_WINDOWS = 100_000
MAX_DEPTH = 1024
MAX_TEXT = 4096  # characters of a frame's name or file, or a label's value
_MAX_VALUE = 2**62  # ns: 146 years; a pprof value is an int64 and sums of many must not wrap


class ProfileError(ValueError):
    """A folded profile that cannot be read, in one sentence."""


class NoProtobuf(RuntimeError):
    """pprof was asked for where protobuf is missing or too old, in one sentence."""


Labels = tuple[tuple[str, str], ...]  # sorted (key, value), empty values left out


@dataclass
class Profile:
    """Folded GPU time: per (stack, labels) [ns, launches], over `windows` (where and when each trace ran)."""

    frames: list[Frame] = field(default_factory=list)
    samples: dict[tuple[tuple[int, ...], Labels], list[int]] = field(default_factory=dict)
    windows: list[dict[str, Any]] = field(default_factory=list)
    _index: dict[Frame, int] = field(default_factory=dict, repr=False)

    def frame_id(self, frame: Frame) -> int:
        i = self._index.get(frame)
        if i is None:
            i = self._index[frame] = len(self.frames)
            self.frames.append(frame)
        return i

    def add(self, stack: tuple[int, ...], labels: Labels, ns: int, launches: int) -> None:
        acc = self.samples.get((stack, labels))
        if acc is None:
            self.samples[(stack, labels)] = [ns, launches]
        else:
            acc[0] += ns
            acc[1] += launches

    @property
    def total_ns(self) -> int:
        return sum(v[0] for v in self.samples.values())

    @property
    def total_launches(self) -> int:
        return sum(v[1] for v in self.samples.values())

    def by_stack(self) -> dict[tuple[Frame, ...], list[int]]:
        """[ns, launches] per stack of frames, summed over labels."""
        out: dict[tuple[Frame, ...], list[int]] = {}
        for (stack, _), (ns, n) in self.samples.items():
            acc = out.setdefault(tuple(self.frames[i] for i in stack), [0, 0])
            acc[0] += ns
            acc[1] += n
        return out

    # -- the folded form ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT,
                "frames": [[f.name, f.kind, f.file, f.line] for f in self.frames],
                "samples": [[list(stack), dict(labels), ns, n] for (stack, labels), (ns, n) in self.samples.items()],
                "windows": self.windows}

    @classmethod
    def from_json(cls, doc: Any) -> Profile:
        """A folded profile from JSON someone else wrote; ProfileError (one sentence) for anything not shaped
        like `to_json`'s output or beyond the caps."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ProfileError(f"it is not a gpuscope profile (no \"format\": \"{FORMAT}\")")
        frames, samples, windows = doc.get("frames"), doc.get("samples"), doc.get("windows", [])
        if not isinstance(frames, list) or not isinstance(samples, list) or not isinstance(windows, list):
            raise ProfileError("its frames, samples or windows are not lists")
        for what, items, cap in (("frames", frames, MAX_FRAMES), ("samples", samples, MAX_SAMPLES),
                                 ("windows", windows, MAX_WINDOWS)):
            if len(items) > cap:
                raise ProfileError(f"it holds {len(items)} {what}, more than the {cap} allowed")
        p = cls()
        for i, f in enumerate(frames):
            if not (isinstance(f, list) and len(f) == 4 and _text(f[0]) and f[1] in FRAME_KINDS
                    and isinstance(f[2], str) and len(f[2]) <= MAX_TEXT and _int(f[3])):
                raise ProfileError(f"frame {i} is not [name, kind, file, line]")
            p.frames.append(Frame(f[0], f[2], f[3], f[1]))
        p._index = {f: i for i, f in enumerate(p.frames)}
        if len(p._index) != len(p.frames):
            raise ProfileError("it lists a frame twice")
        n_frames = len(p.frames)
        for i, s in enumerate(samples):
            if not (isinstance(s, list) and len(s) == 4 and isinstance(s[0], list) and 0 < len(s[0]) <= MAX_DEPTH
                    and all(_int(x) and x < n_frames for x in s[0]) and _int(s[2]) and _int(s[3])):
                raise ProfileError(f"sample {i} is not [stack of frame indices, labels, ns, launches]")
            p.add(tuple(s[0]), _labels(s[1], i), s[2], s[3])
        for i, w in enumerate(windows):
            if not isinstance(w, dict) or not all(k in _WINDOW_KEYS and _window_value(v) for k, v in w.items()):
                raise ProfileError(f"window {i} is not an object of {', '.join(sorted(_WINDOW_KEYS))}")
            p.windows.append(w)
        if p.total_ns >= _MAX_VALUE or p.total_launches >= _MAX_VALUE:
            raise ProfileError("its totals are beyond what a profile can hold")
        return p

    # -- the files profilers read -------------------------------------------------------------------
    def pprof(self) -> bytes:
        """The profile as pprof's profile.proto, gzip-compressed (what `go tool pprof`, Pyroscope, Parca and
        Cloud Profiler read). Needs protobuf (`pip install 'gpuscope[profile]'`)."""
        return gzip.compress(self.pprof_message().SerializeToString(), mtime=0)

    def pprof_message(self) -> Any:
        try:
            from ._pprof.profile_pb2 import Profile as Message
        except Exception as e:  # ImportError, or protobuf's VersionError for a runtime older than the gencode
            raise NoProtobuf(f"Writing pprof needs protobuf 7.35.1 or newer ({type(e).__name__}): "
                             "pip install 'gpuscope[profile]', or ask for speedscope or json.") from None

        strings: dict[str, int] = {"": 0}

        def s(text: str) -> int:
            i = strings.get(text)
            if i is None:
                i = strings[text] = len(strings)
            return i

        out = Message()
        for kind, unit in SAMPLE_TYPES:
            out.sample_type.add(type=s(kind), unit=s(unit))
        out.default_sample_type = s(SAMPLE_TYPES[0][0])
        out.period_type.type, out.period_type.unit, out.period = s("gpu_time"), s("nanoseconds"), 1
        functions: dict[tuple[str, str], int] = {}
        locations: dict[int, int] = {}  # frame index -> location id
        for i, f in enumerate(self.frames):
            name = _function_name(f)
            fid = functions.get((name, f.file))
            if fid is None:
                fid = functions[(name, f.file)] = len(functions) + 1
                out.function.add(id=fid, name=s(name), system_name=s(name), filename=s(f.file))
            lid = locations[i] = len(locations) + 1
            out.location.add(id=lid).line.add(function_id=fid, line=f.line)
        for (stack, labels), (ns, n) in self.samples.items():
            sample = out.sample.add(location_id=[locations[i] for i in reversed(stack)], value=[ns, n])
            for key, value in labels:
                if key == "pid" and value.isdigit():
                    sample.label.add(key=s("pid"), num=int(value))
                else:
                    sample.label.add(key=s(key), str=s(value))
        starts = [w["start_unix_ns"] for w in self.windows if _int(w.get("start_unix_ns"))]
        ends = [w["end_unix_ns"] for w in self.windows if _int(w.get("end_unix_ns"))]
        if starts:
            out.time_nanos = min(starts)
            if ends:
                out.duration_nanos = max(0, max(ends) - min(starts))
        out.comment.append(s(self.summary()))
        out.string_table.extend(strings)
        return out

    def speedscope(self, title: str = "GPU time by launching stack") -> dict[str, Any]:
        """Speedscope's JSON (https://www.speedscope.app), the same writer as one trace's flame graph."""
        stacks = {k: v[0] for k, v in self.by_stack().items()}
        return speedscope_doc(title, stacks, f"GPU time (µs): {self.summary()}")

    def summary(self) -> str:
        pids = {(w.get("node"), w.get("pid")) for w in self.windows}
        nodes = {w.get("node") for w in self.windows}
        return (f"{self.total_ns / 1e9:.6g} s of GPU time, {self.total_launches} GPU ops, {len(self.windows)} "
                f"window(s) of {len(pids)} process(es) on {len(nodes)} node(s)")


_WINDOW_KEYS = frozenset(("node", "job", "pid", "rank", "start_unix_ns", "end_unix_ns", "file"))


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _MAX_VALUE


def _text(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_TEXT


def _window_value(v: Any) -> bool:
    return v is None or _int(v) or (isinstance(v, str) and len(v) <= MAX_TEXT)


def _labels(raw: Any, i: int) -> Labels:
    if not isinstance(raw, dict) or not all(k in LABELS and isinstance(v, str) and len(v) <= MAX_TEXT
                                            for k, v in raw.items()):
        raise ProfileError(f"sample {i}'s labels are not an object of {', '.join(LABELS)} (text)")
    return tuple(sorted((k, v) for k, v in raw.items() if v))


def _function_name(f: Frame) -> str:
    """A Python frame's function, without the ' (file:line)' the flame graph shows (pprof keeps both apart)."""
    suffix = f" ({f.file}:{f.line})"
    return f.name[:-len(suffix)] if f.file and f.name.endswith(suffix) else f.name


def _thread(frame: Frame, pid: int | None) -> Frame:
    if frame.kind != "thread":
        return frame
    return Frame("main thread" if pid is not None and frame.name == f"thread {pid}" else "other thread")


def fold(trace: Trace, *, node: str = "", job: str = "", pid: int | None = None) -> Profile:
    """One trace's GPU time by launching stack, every sample labelled node, job and pid; its window from the
    trace's "gpuscope" key (the bootstrap writes host, pid, rank and the profiler's start and stop); `pid`
defaults to that key's, else to the one process whose host events the trace holds."""
    meta = trace.meta.get("gpuscope")
    meta = meta if isinstance(meta, dict) else {}
    if pid is None:
        pid = meta["pid"] if _int(meta.get("pid")) else _host_pid(trace)
    labels = tuple(sorted((k, v) for k, v in (("node", node), ("job", job),
                                              ("pid", "" if pid is None else str(pid))) if v))
    flame = gpu_flame(trace)
    p = Profile()
    for stack, ns in flame.stacks.items():
        ids = tuple(p.frame_id(_thread(f, pid)) for f in stack)
        p.add(ids, labels, ns, flame.launches.get(stack, 0))
    if flame.unattributed_ops:
        p.add((p.frame_id(Frame(NO_LAUNCHER, kind="op")),), labels, flame.unattributed_ns, flame.unattributed_ops)
    window = {"node": node or None, "job": job or None, "pid": pid,
              "rank": meta.get("rank") if _int(meta.get("rank")) else None,
              "start_unix_ns": meta.get("profiler_start_unix_ns") if _int(meta.get("profiler_start_unix_ns")) else None,
              "end_unix_ns": meta.get("profiler_stop_unix_ns") if _int(meta.get("profiler_stop_unix_ns")) else None}
    p.windows.append(window)
    return p


def _host_pid(trace: Trace) -> int | None:
    """The process whose host events the trace holds (Kineto writes the OS pid), when it is one."""
    import numpy as np

    pids = np.unique(trace.events["pid"][trace.events["device"] == -1])
    pids = pids[pids > 0]  # Kineto's own rows (-1) are no process
    return int(pids[0]) if len(pids) == 1 else None


def merge(profiles: Iterable[Profile]) -> Profile:
    """One profile summing many: equal frames are one frame, equal (stack, labels) one sample."""
    out = Profile()
    for p in profiles:
        remap = [out.frame_id(f) for f in p.frames]
        for (stack, labels), (ns, n) in p.samples.items():
            out.add(tuple(remap[i] for i in stack), labels, ns, n)
        out.windows.extend(p.windows)
    return out


def window_overlaps(window: dict[str, Any], since_unix_ns: int) -> bool:
    """Whether a window ended at or after `since_unix_ns` (a window without an end counts as ended now)."""
    end = window.get("end_unix_ns")
    return not _int(end) or end >= since_unix_ns
