"""What `gpuscope top` shows, as plain strings: GPU lines, process rows, sort, filter and tree order.

No Textual here, so the layout can be tested and reused for `--once` without a terminal.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

_BLOCKS = " ▁▂▃▄▅▆▇█"
RING = 120  # sparkline history per GPU: 30 s at the default 4 refreshes per second


# Control characters (C0, DEL, C1) and bidi/zero-width format marks, as visible escapes: a command line,
# process or GPU name may hold terminal escape sequences (colours, cursor moves, title or clipboard
# writes) or newlines, which must show as text and never reach the terminal or break a row.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"})
_ESCAPES.update({c: f"\\u{c:04x}" for c in (0x200B, 0x200C, 0x200D, 0x200E, 0x200F, *range(0x202A, 0x202F),
                                             *range(0x2066, 0x206A), 0xFEFF)})


def printable(text: object) -> str:
    """`text` with every control character written as an escape ('\\x1b'), safe to draw in a terminal.

    >>> printable("a\\x1b[31mb\\nc")
    'a\\\\x1b[31mb\\\\nc'
    """
    return str(text).translate(_ESCAPES)


def clip(text: str, width: int, words: bool = False) -> str:
    """`text` cut to `width` characters, with '…' where something was cut; with `words`, the cut falls
    between words (a verdict's '90.4 %' is never shown as '90.').

    >>> clip("SMs 90.4 % busy", 8, words=True)
    'SMs…'
    >>> clip("python train.py", 10)
    'python tr…'
    """
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    cut = text[:width - 1]
    if words and not text[width - 1].isspace():
        space = cut.rfind(" ")
        if space > 0:
            cut = cut[:space]
    cut = cut.rstrip()
    return cut if cut.endswith("…") else cut + "…"


def pct(v: float | None, width: int = 4) -> str:
    """A ratio 0..1 as a percentage, '-' where unknown."""
    return f"{'-':>{width}}" if v is None else f"{v * 100:>{width - 1}.0f}%"


def gib(v: float | None, unit: str = "") -> str:
    """Bytes in GiB with one decimal: the one memory format of top (GPU memory, RSS, host memory).

    >>> gib(3.5 * 2**30, " GiB"), gib(113 * 2**20), gib(None)
    ('3.5 GiB', '0.1', '-')
    """
    return "-" if v is None else f"{v / 2**30:.1f}{unit}"


def elapsed(seconds: float | None) -> str:
    """How long a process has run: MM:SS under an hour, H:MM:SS under a day, then days and HH:MM.

    >>> elapsed(332), elapsed(3725), elapsed(2 * 86400 + 3900), elapsed(None)
    ('05:32', '1:02:05', '2d 01:05', '-')
    """
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    m, sec = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    if h < 1:
        return f"{m:02d}:{sec:02d}"
    if h < 24:
        return f"{h}:{m:02d}:{sec:02d}"
    d, h = divmod(h, 24)
    return f"{d}d {h:02d}:{m:02d}"


def rate(v: float | None) -> str:
    """Bytes per second as GB/s."""
    return "-" if v is None else f"{v / 1e9:.1f}"


def bar(ratio: float | None, width: int) -> str:
    """A ratio 0..1 as a bar of `width` cells, in eighths of a cell (blank where unknown).

    >>> bar(0.5, 8), bar(0.0625, 2), bar(None, 3)
    ('████    ', '▏ ', '   ')
    """
    if ratio is None or not math.isfinite(ratio):
        return " " * width
    eighths = round(max(0.0, min(1.0, ratio)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")).ljust(width)


def host_line(hv: dict[str, float | None], width: int) -> str | None:
    """The node's CPU and memory as nvitop's bars, with the load: None when the source gave neither."""
    cpu, used, total = hv.get("host_cpu_ratio"), hv.get("host_memory_used_bytes"), hv.get("host_memory_total_bytes")
    if cpu is None and used is None:
        return None
    mem = None if used is None or not total else used / total
    load = hv.get("host_load1")
    cpu_tail, mem_tail = f"] {pct(cpu)}", f"] {pct(mem)} {gib(used)}/{gib(total)} GiB"
    load_text = "" if load is None else f"   load {load:.1f}"
    fixed = len(" CPU [") + len(cpu_tail) + len("   MEM [") + len(mem_tail) + len(load_text)
    w = max(4, min(50, (width - fixed) // 2))
    return clip(f" CPU [{bar(cpu, w)}{cpu_tail}   MEM [{bar(mem, w)}{mem_tail}{load_text}", width, words=True)


def sparkline(values: Iterable[float | None], width: int) -> str:
    """The last `width` ratios as block characters (a gap where unknown)."""
    tail = list(values)[-width:]
    out = ["·" if v is None or not math.isfinite(v) else _BLOCKS[max(0, min(8, round(v * 8)))] for v in tail]
    return "".join(out).rjust(width)


class Rings:
    """A bounded history of SM activity per GPU key, for the sparklines."""

    def __init__(self, size: int = RING) -> None:
        self.size = size
        self._rings: dict[str, deque[float | None]] = {}

    def push(self, gpus: Sequence[dict[str, Any]]) -> None:
        for g in gpus:
            ring = self._rings.setdefault(g["key"], deque(maxlen=self.size))
            ring.append(g["values"].get("gpu_sm_active_ratio") if g["healthy"] else None)

    def get(self, key: str) -> deque[float | None]:
        return self._rings.get(key, deque())


def throttle_text(g: dict[str, Any]) -> str:
    return ",".join(g["throttle"]) if g["throttle"] else "no throttle"


def verdict_text(g: dict[str, Any]) -> str:
    v = g.get("verdict")
    if not g["healthy"]:
        return "LOST: the GPU stopped answering (fell off the bus or hung)"
    if v is None:
        return "verdict: gathering (needs 5 s of samples)"
    side = "".join(f" +{k}" for k in dict.fromkeys(s["kind"] for s in g.get("side", [])))
    return f"{v['kind']}{side}: {v['summary']}"


_ALLOCATION = {"unallocated": "unallocated", "allocated_idle": "allocated, idle:", "in_use_by_pod": "in use by",
               "in_use_outside_kubernetes": "in use outside Kubernetes"}


def allocation_text(g: dict[str, Any]) -> str:
    """The GPU's Kubernetes state, with the pods that hold it: 'k8s: in use by ml/train-0'; '' outside Kubernetes.

    >>> allocation_text({"allocation": {"state": "allocated_idle", "pods": [{"namespace": "nb", "pod": "lab"}]}})
    'k8s: allocated, idle: nb/lab'
    """
    a = g.get("allocation")
    if not a or not a.get("state"):
        return ""
    text = _ALLOCATION.get(a["state"], a["state"])
    pods = list(dict.fromkeys(f"{p['namespace']}/{p['pod']}" for p in a.get("pods", [])))
    if a["state"] in ("allocated_idle", "in_use_by_pod"):
        text += " " + (", ".join(pods) if pods else "a pod")
    return "k8s: " + text


def severity(g: dict[str, Any]) -> str:
    if not g["healthy"]:
        return "critical"
    sides = [s.get("severity", "info") for s in g.get("side", [])]
    levels = [g["verdict"]["severity"]] if g.get("verdict") else []
    for s in ("critical", "warning"):
        if s in levels + sides:
            return s
    return "info"


def _clock(v: dict[str, float | None]) -> str:
    cur, top = v.get("gpu_sm_clock_hertz"), v.get("gpu_sm_clock_max_hertz")
    if cur is None:
        return "-"
    return f"{cur / 1e9:.2f}" + (f"/{top / 1e9:.2f}" if top else "") + " GHz"


def _power(v: dict[str, float | None]) -> str:
    p, lim = v.get("gpu_power_watts"), v.get("gpu_power_limit_watts")
    return ("-" if p is None else f"{p:.0f}") + (f"/{lim:.0f}" if lim else "") + " W"


def _mem(v: dict[str, float | None]) -> str:
    return f"{gib(v.get('gpu_memory_used_bytes'))}/{gib(v.get('gpu_memory_total_bytes'))} GiB"


def _temp(v: dict[str, float | None]) -> str:
    t = v.get("gpu_temperature_celsius")
    return "-" if t is None else f"{t:.0f}C"


def dense_head(width: int) -> str:
    fp32 = f"{'FP32':>5}" if width >= 90 else ""
    return (f"{'GPU':<4}{'SM':>5}{'tensor':>7}{fp32}{'DRAM':>5}│{'NVML util*':>10} {'mem GiB':>11}"
            f" {'power W':>8} {'temp':>4}  verdict")[:width]


def dense_line(g: dict[str, Any], width: int) -> str:
    """One GPU in one line, so 8 GPUs fit on 80x24 (FP32 only from 90 columns)."""
    label = f"{printable(g['gpu']):<4}"
    if not g["healthy"]:
        return clip(printable(f"{label} LOST — {verdict_text(g)}"), width, words=True)
    v = g["values"]
    used, total = v.get("gpu_memory_used_bytes"), v.get("gpu_memory_total_bytes")
    mem = f"{gib(used)}/{gib(total)}"
    p, lim = v.get("gpu_power_watts"), v.get("gpu_power_limit_watts")
    power = ("-" if p is None else f"{p:.0f}") + (f"/{lim:.0f}" if lim else "")
    fp32 = pct(v["gpu_fp32_active_ratio"], 5) if width >= 90 else ""
    head = (f"{label}{pct(v['gpu_sm_active_ratio'], 5)}{pct(v['gpu_tensor_active_ratio'], 7)}{fp32}"
            f"{pct(v['gpu_dram_active_ratio'], 5)}│{pct(v['gpu_utilization_ratio'], 10)} {mem:>11} {power:>8}"
            f" {_temp(v):>4}  ")
    tail = g["verdict"]["kind"] if g.get("verdict") else "…"
    if g["throttle"]:
        tail += f" [{throttle_text(g)}]"
    if alloc := allocation_text(g):
        tail += f"  {alloc}"
    return clip(head + printable(tail), width, words=True)


def panel_lines(g: dict[str, Any], width: int, ring: Iterable[float | None]) -> list[str]:
    """One GPU in three lines: the verdict, what the SMs and memory really do (with SM history), and
    the NVML figures."""
    alloc = allocation_text(g)
    title = printable(f"GPU {g['gpu']} {g['name']}" + (f" [{alloc}]" if alloc else ""))
    if not g["healthy"]:
        return [clip(f"{title}  LOST", width), clip(printable(f"  {verdict_text(g)}"), width, words=True), ""]
    v = g["values"]

    def r(key: str) -> str:
        return "-" if v[key] is None else f"{v[key] * 100:.0f}"

    rest = (f"  occ {pct(v['gpu_sm_occupancy_ratio'])}  tensor {pct(v['gpu_tensor_active_ratio'])}"
            f"  FP32/16/64 {r('gpu_fp32_active_ratio')}/{r('gpu_fp16_active_ratio')}/{r('gpu_fp64_active_ratio')}%"
            f"  DRAM {pct(v['gpu_dram_active_ratio'])}  GB/s rx/tx PCIe {rate(v['gpu_pcie_rx_bytes_per_second'])}"
            f"/{rate(v['gpu_pcie_tx_bytes_per_second'])} NVLink {rate(v['gpu_nvlink_rx_bytes_per_second'])}"
            f"/{rate(v['gpu_nvlink_tx_bytes_per_second'])}")
    head = f"  SM active {pct(v['gpu_sm_active_ratio'])} "
    act = head + sparkline(ring, max(8, min(60, width - len(head) - len(rest)))) + rest
    nvml = (f"  NVML util (any kernel running) {pct(v['gpu_utilization_ratio'])}  mem {_mem(v)}  power {_power(v)}"
            f"  {_temp(v)}  clock {_clock(v)}: {printable(throttle_text(g))}")
    return [clip(f"{title}  {printable(verdict_text(g))}", width, words=True), clip(act, width, words=True),
            clip(nvml, width, words=True)]


# -- processes ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class SortKey:
    name: str
    title: str
    key: Callable[[dict[str, Any]], Any]
    descending: bool  # the natural direction: biggest users first, names A..Z


def _shown(field: str, factor: float, digits: int) -> Callable[[dict[str, Any]], float]:
    """A number as the table shows it (a ratio in whole percent, bytes in GiB to 0.1): two rows that
    show the same figure tie, and the tie goes to the pid, so rows do not swap on noise nobody sees."""
    def key(p: dict[str, Any]) -> float:
        v = p.get(field)
        return -1.0 if v is None else round(v * factor, digits)  # as pct() and gib() compute it
    return key


SORT_KEYS: tuple[SortKey, ...] = (
    SortKey("sm", "SM%", _shown("sm_ratio", 100, 0), True),
    SortKey("gpu_memory", "GPU-MEM", _shown("gpu_memory_bytes", 2**-30, 1), True),
    SortKey("cpu", "CPU%", _shown("cpu_cores", 100, 0), True),
    SortKey("rss", "RSS", _shown("rss_bytes", 2**-30, 1), True),
    SortKey("pid", "PID", lambda p: p["pid"], False),
    SortKey("user", "USER", lambda p: p["user"], False),
    SortKey("gpu", "GPU", lambda p: p["gpu"], False),
    SortKey("command", "COMMAND", lambda p: p["command"] or p["name"], False),
)


def matches(p: dict[str, Any], text: str) -> bool:
    """Case-insensitive substring over what a person would type: pid, user, command, GPU, container, pod."""
    if not text:
        return True
    hay = f"{p['pid']} {p['user']} {p['name']} {p['command']} gpu{p['gpu']} {p['container']} {p['pod']}".lower()
    return text.lower() in hay


def ordered(procs: Sequence[dict[str, Any]], sort: SortKey, reverse: bool = False, text: str = "",
            tree: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The rows to show, each with its tree prefix ('' when flat). In tree order a child follows its
    parent (ppid), siblings sorted by `sort`; a process whose parent is not shown is a root."""
    shown = [p for p in procs if matches(p, text)]
    desc = sort.descending != reverse
    # Ties in pid order, whichever way the sort goes (a reversed sort keeps the order of equal keys): the
    # order of equal rows is not left to the order the source listed them in, which changes.
    shown.sort(key=lambda p: (p["pid"], p["gpu"], p["host"]))
    shown.sort(key=sort.key, reverse=desc)
    if not tree:
        return [("", p) for p in shown]
    pids = {p["pid"] for p in shown}
    children: dict[int, list[dict[str, Any]]] = {}
    roots = []
    for p in shown:
        parent = p.get("ppid")
        if parent is not None and parent in pids and parent != p["pid"]:
            children.setdefault(parent, []).append(p)
        else:
            roots.append(p)
    out: list[tuple[str, dict[str, Any]]] = []
    seen: set[int] = set()

    def walk(p: dict[str, Any], indent: str, branch: str) -> None:
        out.append((indent + branch, p))
        if p["pid"] in seen:  # the same pid on two GPUs: list its children once
            return
        seen.add(p["pid"])
        kids = children.get(p["pid"], [])
        below = indent + {"": "", "└─ ": "   "}.get(branch, "│  ")
        for i, k in enumerate(kids):
            walk(k, below, "└─ " if i == len(kids) - 1 else "├─ ")

    for r in roots:
        walk(r, "", "")
    return out


def proc_head(width: int, sort: SortKey, reverse: bool) -> str:
    arrow = "▼" if sort.descending != reverse else "▲"
    cols = _proc_cols(width)
    parts = []
    for title, w, align in cols:
        t = title + (arrow if title == sort.title else "")
        parts.append(f"{t:<{w}}" if align == "<" else f"{t:>{w}}")
    return " ".join(parts)[:width]


def _proc_cols(width: int) -> list[tuple[str, int, str]]:
    cols = [("PID", 7, ">"), ("USER", 8, "<"), ("GPU", 4, "<"), ("GPU-MEM", 9, ">"), ("SM%", 4, ">"),
            ("CPU%", 5, ">")]
    if width >= 90:  # on 80 columns the command keeps its room
        cols.append(("RSS", 9, ">"))
    cols.append(("ELAPSED", 8, ">"))
    if width >= 110:
        cols.append(("CONTAINER/POD", 18, "<"))
    if width >= 120:  # the process's own verdict on a shared GPU, the GPU's where it is alone
        cols.append(("VERDICT", 20, "<"))
    used = sum(w + 1 for _, w, _ in cols)
    cols.append(("COMMAND", max(8, width - used), "<"))
    return cols


def proc_line(prefix: str, p: dict[str, Any], width: int, now_s: float | None = None) -> str:
    """One process row; ELAPSED counts from its start to `now_s` (the overview's time, epoch seconds)."""
    cpu, started = p.get("cpu_cores"), p.get("started_at")
    values = {
        "PID": str(p["pid"]), "USER": printable(p["user"] or "-"), "GPU": printable(p["gpu"]),
        "GPU-MEM": gib(p.get("gpu_memory_bytes"), " GiB"), "SM%": pct(p.get("sm_ratio")),
        "CPU%": "-" if cpu is None else f"{cpu * 100:.0f}%", "RSS": gib(p.get("rss_bytes"), " GiB"),
        "ELAPSED": elapsed(None if started is None or now_s is None else now_s - started),
        "CONTAINER/POD": printable(p.get("pod") or p.get("container") or "-"),
        "VERDICT": printable((p.get("verdict") or {}).get("kind") or "-"),
        "COMMAND": prefix + printable(p["command"] or p["name"] or "?"),
    }
    parts = []
    for title, w, align in _proc_cols(width):
        s = clip(values[title], w)
        parts.append(f"{s:<{w}}" if align == "<" else f"{s:>{w}}")
    return " ".join(parts)[:width]


def plain(overview: dict[str, Any], width: int = 120) -> str:
    """The overview as a plain text table (`gpuscope top --once`)."""
    lines = []
    if overview.get("simulated"):
        lines.append(f"SIMULATED node — scenario '{printable(overview['simulated'])}' (not real GPUs)")
    lines += [printable(e) for e in overview.get("errors", [])]
    lines.append(dense_head(width))
    lines += [dense_line(g, width) for g in overview["gpus"]]
    lines.append("* NVML util: the share of time any kernel ran, not how busy the SMs are")
    lines.append("")
    sort = SORT_KEYS[0]
    lines.append(proc_head(width, sort, False))
    now_s = overview["time_ns"] / 1e9
    lines += [proc_line(prefix, p, width, now_s) for prefix, p in ordered(overview["processes"], sort)]
    return "\n".join(lines)
