"""Inline SVG time-series panels for the HTML report: no plotting library, no script, no network.

A panel has a time axis (seconds since the run began), a y axis with units, one line per series
(a min-max band behind it where points were merged), coloured background bands (verdicts), and
transparent hover columns whose titles list the values under the pointer.

    >>> svg = panel([Line("power", "#c79", [0.0, 1.0, 2.0], [100.0, 200.0, None])], 0.0, 2.0,
    ...             Axis("W"), bands=[Band(0.0, 1.0, "#2a2", "idle 0-1 s")])
    >>> svg.startswith("<svg") and "idle 0-1 s" in svg
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

W, H = 960, 170  # viewBox; the page scales it to its width
ML, MR, MT, MB = 62, 14, 8, 24  # margins: room for y labels on the left, time labels below
HOVER_COLUMNS = 96


@dataclass
class Line:
    label: str
    color: str
    t: Sequence[float]
    y: Sequence[float | None]
    lo: Sequence[float | None] | None = None  # min per point, where points are merged buckets
    hi: Sequence[float | None] | None = None
    dashed: bool = False


@dataclass
class Band:
    start: float
    end: float
    color: str
    title: str
    opacity: float = 0.16


@dataclass
class Axis:
    unit: str  # shown beside the axis, e.g. "%" or "GB/s"
    scale: float = 1.0  # value * scale is displayed
    lo: float | None = 0.0
    hi: float | None = None  # fixed top (displayed units), else from the data
    fmt: Callable[[float], str] = field(default=lambda v: f"{v:g}")


def nice_step(span: float, target: int) -> float:
    """A 1-2-5 step that cuts `span` into about `target` pieces."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def time_ticks(t0: float, t1: float, target: int = 8) -> list[float]:
    """Tick positions in seconds on steps people read: 1 2 5 10 15 30 s, 1 2 5 10 15 30 min, 1 2 3 6 12 h."""
    span = max(t1 - t0, 1e-9)
    steps = [0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
             86400]
    step = next((s for s in steps if span / s <= target), steps[-1] * math.ceil(span / (steps[-1] * target)))
    first = math.ceil(t0 / step - 1e-9) * step
    return [first + i * step for i in range(int((t1 - first) / step + 1e-9) + 1)]


def fmt_time(s: float) -> str:
    """0 s, 45 s, 2:30, 1:02:03 (h:mm:ss)."""
    if abs(s) < 120:
        return f"{s:.1f} s".replace(".0 s", " s") if s % 1 else f"{s:.0f} s"
    s = round(s)
    h, rem = divmod(int(s), 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def _num(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _decimate(t: Sequence[float], ys: Sequence[Sequence[float | None] | None], cols: int
              ) -> tuple[list[float], list[list[float | None]]]:
    """At most `cols` points: each column gets the mean of its points (first series list) or the
    min/max (for lo/hi series, by position 1 and 2)."""
    n = len(t)
    if n <= cols:
        return list(t), [list(y) if y is not None else [None] * n for y in ys]
    per = math.ceil(n / cols)
    tt: list[float] = []
    out: list[list[float | None]] = [[] for _ in ys]
    for i in range(0, n, per):
        tt.append(t[i])
        for k, y in enumerate(ys):
            vals = [v for v in (y[i:i + per] if y is not None else []) if v is not None]
            if not vals:
                out[k].append(None)
            elif k == 1:
                out[k].append(min(vals))
            elif k == 2:
                out[k].append(max(vals))
            else:
                out[k].append(sum(vals) / len(vals))
    return tt, out


def panel(lines: Sequence[Line], t0: float, t1: float, axis: Axis, bands: Sequence[Band] = (),
          title: str = "", hlines: Sequence[tuple[float, str, str]] = ()) -> str:
    """One chart as an <svg> string. `hlines`: (value, colour, label) reference lines (limits)."""
    pw, ph = W - ML - MR, H - MT - MB
    t1 = t1 if t1 > t0 else t0 + 1.0
    vals = [v * axis.scale for ln in lines for v in list(ln.y) + list(ln.hi or []) if v is not None]
    vals += [v * axis.scale for v, _, _ in hlines]
    lo = axis.lo if axis.lo is not None else (min(vals) if vals else 0.0)
    hi = axis.hi if axis.hi is not None else (max(vals) if vals else 1.0)
    if hi <= lo:
        hi = lo + 1.0
    step = nice_step(hi - lo, 4)
    hi = lo + math.ceil((hi - lo) / step - 1e-9) * step if axis.hi is None else hi

    def x(t: float) -> float:
        return ML + (t - t0) / (t1 - t0) * pw

    def y(v: float) -> float:
        return MT + ph - (v * axis.scale - lo) / (hi - lo) * ph

    out = [f'<svg class="panel" viewBox="0 0 {W} {H}" xmlns="http://www.w3.org/2000/svg" role="img" '
           f'aria-label="{escape(title)}" preserveAspectRatio="xMidYMid meet">']
    if title:
        out.append(f"<title>{escape(title)}</title>")
    out.append(f'<rect class="plot" x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="#fff" stroke="#ccd"/>')
    for b in bands:
        a, z = max(t0, b.start), min(t1, b.end)
        if z <= a:
            continue
        out.append(f'<rect class="band" x="{x(a):.1f}" y="{MT}" width="{max(0.5, x(z) - x(a)):.1f}" height="{ph}" '
                   f'fill="{b.color}" fill-opacity="{b.opacity}"><title>{escape(b.title)}</title></rect>')
    # Grid and y labels.
    v = lo
    while v <= hi + step * 1e-6:
        yy = y(v / axis.scale)
        out.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#e4e6ec"/>')
        out.append(f'<text x="{ML - 6}" y="{yy + 4:.1f}" text-anchor="end" class="tick">{escape(axis.fmt(v))}</text>')
        v += step
    out.append(f'<text x="12" y="{MT + ph / 2:.1f}" class="unit" transform="rotate(-90 12 {MT + ph / 2:.1f})" '
               f'text-anchor="middle">{escape(axis.unit)}</text>')
    for tt in time_ticks(t0, t1):
        xx = x(tt)
        out.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{MT + ph}" y2="{MT + ph + 4}" stroke="#889"/>')
        out.append(f'<text x="{xx:.1f}" y="{H - 6}" text-anchor="middle" class="tick">{escape(fmt_time(tt))}</text>')
    for val, color, label in hlines:
        yy = y(val)
        out.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="{color}" '
                   f'stroke-dasharray="2 3"><title>{escape(label)}</title></line>')
    # Series: the min-max envelope first, then the mean line, broken where values are missing.
    drawn: list[tuple[Line, list[float], list[float | None]]] = []
    for ln in lines:
        t, (mean, mn, mx) = _decimate(ln.t, [ln.y, ln.lo, ln.hi], pw)
        drawn.append((ln, t, mean))
        if ln.lo is not None and ln.hi is not None and any(a is not None and b is not None and b > a
                                                            for a, b in zip(mn, mx, strict=False)):
            for run in _runs(t, mn, mx):
                top = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, _, b in run)
                bottom = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b, _ in reversed(run))
                out.append(f'<polygon points="{top} {bottom}" fill="{ln.color}" fill-opacity="0.18" stroke="none"/>')
        for run in _runs(t, mean):
            pts = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in run)
            dash = ' stroke-dasharray="5 3"' if ln.dashed else ""
            out.append(f'<polyline class="series" points="{pts}" fill="none" stroke="{ln.color}" stroke-width="1.6"'
                       f'{dash}><title>{escape(ln.label)}</title></polyline>')
    out.append(_hover(drawn, t0, t1, axis, x, pw, ph))
    out.append("</svg>")
    return "".join(out)


def _runs(t: Sequence[float], *ys: Sequence[float | None]) -> list[list[tuple[float, ...]]]:
    """Consecutive points where every series has a value."""
    runs: list[list[tuple[float, ...]]] = []
    cur: list[tuple[float, ...]] = []
    for i, tt in enumerate(t):
        vs = [y[i] for y in ys]
        if any(v is None for v in vs):
            if cur:
                runs.append(cur)
            cur = []
            continue
        cur.append((tt, *[float(v) for v in vs if v is not None]))
    if cur:
        runs.append(cur)
    return runs


def _hover(drawn: list[tuple[Line, list[float], list[float | None]]], t0: float, t1: float, axis: Axis,
           x: Callable[[float], float], pw: float, ph: float) -> str:
    """Transparent columns whose titles give each series' mean in that stretch of time."""
    out = ['<g class="hover">']
    n = HOVER_COLUMNS
    width = (t1 - t0) / n
    idx = [0] * len(drawn)
    for c in range(n):
        a, z = t0 + c * width, t0 + (c + 1) * width
        parts = []
        for k, (ln, t, ys) in enumerate(drawn):
            vals = []
            i = idx[k]
            while i < len(t) and t[i] < z:
                if t[i] >= a and ys[i] is not None:
                    vals.append(ys[i])
                i += 1
            idx[k] = i
            if vals:
                m = sum(v for v in vals if v is not None) / len(vals)
                parts.append(f"{ln.label}: {axis.fmt(m * axis.scale)} {axis.unit}".rstrip())
        if not parts:
            continue
        title = f"{fmt_time(a)} – {fmt_time(z)}\n" + "\n".join(parts)
        out.append(f'<rect x="{x(a):.1f}" y="{MT}" width="{pw / n:.1f}" height="{ph}" fill="transparent">'
                   f"<title>{escape(title)}</title></rect>")
    out.append("</g>")
    return "".join(out)
