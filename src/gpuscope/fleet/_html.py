"""The fleet report as text (the terminal), CSV (a row per group) and one self-contained HTML page.

The page is built on the `run` report kit: its SVG panels (gpuscope.report.svg), its atomic write, no
script, a Content-Security-Policy that forbids fetching anything; every label that came from the server
(group, node and model names) is HTML-escaped. A plot is drawn only when it has data.
"""

from __future__ import annotations

import csv
import io
from html import escape
from typing import Any

from .._version import __version__
from ..report.htmlpage import VERDICT_COLORS
from ..report.svg import Axis, Line, panel

__all__ = ["csv_text", "render_html", "text"]

_CSS = """
:root{--fg:#1d2330;--muted:#5b6475;--line:#dfe3ea;--bg:#f6f7f9;--card:#fff}
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;
color:var(--fg);background:var(--bg)}main{max-width:1200px;margin:0 auto;padding:20px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 10px}
.card{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:14px 16px;margin:10px 0}
.headline{font-size:18px;font-weight:600;border-left:4px solid #d1343a}
.kv{margin:0;display:grid;grid-template-columns:max-content 1fr;gap:3px 16px}.kv dt{color:var(--muted)}.kv dd{margin:0}
table{border-collapse:collapse;width:100%;background:var(--card);font-size:13px}
th,td{border-bottom:1px solid var(--line);padding:5px 8px;text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600}td.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
.sharebar{display:flex;height:12px;min-width:120px;border-radius:3px;overflow:hidden;border:1px solid var(--line)}
.sharebar span{display:block;height:100%}
.legend{display:flex;flex-wrap:wrap;gap:4px 16px;font-size:12.5px;color:var(--muted);margin:2px 0 4px}
.legend .solid{display:inline-block;width:18px;border-top:2px solid;vertical-align:3px;margin-right:5px}
figure{margin:8px 0 14px}figcaption{font-weight:600;font-size:13px}
svg.panel{width:100%;height:auto;display:block}svg .tick{font-size:11px;fill:#5b6475}svg .unit{font-size:11px;fill:#5b6475}
.muted{color:var(--muted)}tr.group td{border-bottom:none}tr.explain td{padding-top:0;font-size:12.5px}
.fix{color:var(--muted)}
footer{color:var(--muted);font-size:12px;margin:30px 0 10px}
"""


def _e(v: Any) -> str:
    return escape("" if v is None else str(v), quote=True)


def _money(v: float, currency: str) -> str:
    sign = {"USD": "$", "EUR": "€", "GBP": "£"}.get(currency)
    return f"{sign}{v:,.2f}" if sign else f"{v:,.2f} {currency}"


def _h(v: float) -> str:
    """Hours (or kWh, kg) for a table: 1,234.5 / 12.3 / 0.0667 / 0.0001 / 0."""
    if v >= 100:
        return f"{v:,.1f}"
    if v >= 0.01:
        return f"{v:.3g}"
    return f"{v:.4f}" if v >= 0.0001 else "<0.0001" if v > 0 else "0"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:.0f} %"


def _throttle(g: dict[str, Any]) -> str:
    reasons = g.get("throttled_hours_by_reason") or {}
    benign = {"gpu_idle", "applications_clocks", "sync_boost", "display_clock"}
    slow = sorted(((r, v) for r, v in reasons.items() if r not in benign), key=lambda kv: -kv[1])
    return ", ".join(f"{r} {_h(v)} h" for r, v in slow[:2]) or "–"


def _top_verdict(g: dict[str, Any]) -> str:
    shares = g.get("verdict_share") or {}
    if not shares:
        return "–"
    k, v = next(iter(shares.items()))
    return f"{k} {v * 100:.0f} %"


# -- text ------------------------------------------------------------------------------------------
def text(report: dict[str, Any], top: int = 15) -> str:
    """What the terminal shows: the fleet line, the range, then the groups ranked by money wasted."""
    cur, fl = report["currency"], report["fleet"]
    out = [fl["line"], f"{report['range']['start']} – {report['range']['end']}, by {report['by']}, "
           f"{fl['gpus']} GPUs, {report['queries']} queries in {report['query_seconds']:.1f} s "
           f"({report['source']} series)."]
    if fl["unobserved_gpu_hours"] > 0.0005:
        out.append(f"Unobserved: {_h(fl['unobserved_gpu_hours'])} GPU-hours of the range were not scraped "
                   "(gaps: not counted as idle, not priced).")
    header = f"{'group':<32} {'wasted':>12} {'cost':>12} {'alloc h':>9} {'used h':>9} {'idle h':>9} {'kWh':>8}"
    out += ["", header, "-" * len(header)]
    for g in report["groups"][:top]:
        out.append(f"{g['group'][:32]:<32} {_money(g['wasted_money'], cur):>12} {_money(g['cost'], cur):>12} "
                   f"{_h(g['allocated_gpu_hours']):>9} {_h(g['used_gpu_hours']):>9} {_h(g['idle_gpu_hours']):>9} "
                   f"{_h(g['energy_kwh']):>8}")
        out.append(f"    why: {g['why']}")
        out.append(f"    fix: {g['fix']}")
    if len(report["groups"]) > top:
        out.append(f"... {len(report['groups']) - top} more groups (--top, --csv, --json)")
    st = report.get("stragglers") or {}
    if st.get("stragglers"):
        out += ["", "Stragglers (a job's GPU slower than its peers):"]
        for x in st["stragglers"]:
            out.append(f"  {x['workload']}: GPU {x['gpu']} of {x['node']}: {x['cause']}: {x['evidence']}")
            out.append(f"    fix: {x['fix']}")
    return "\n".join(out) + "\n"


# -- CSV -------------------------------------------------------------------------------------------
_COLUMNS = ("group", "gpus", "observed_gpu_hours", "unobserved_gpu_hours", "allocated_gpu_hours",
            "unallocated_gpu_hours", "outside_kubernetes_gpu_hours", "used_gpu_hours", "idle_gpu_hours",
            "energy_kwh", "cost", "gpu_cost", "energy_cost", "wasted_money", "unallocated_money", "co2e_kg",
            "memory_headroom_ratio")


def csv_text(report: dict[str, Any]) -> str:
    """One row per group (ranked), the fleet last; throttling and verdicts as one column per reason and kind."""
    rows = report["groups"] + [{**report["fleet"], "group": "(fleet)"}]
    reasons = sorted({r for g in rows for r in g.get("throttled_hours_by_reason") or {}})
    kinds = sorted({k for g in rows for k in g.get("verdict_share") or {}})
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*_COLUMNS, *(f"throttled_hours_{r}" for r in reasons), *(f"verdict_share_{k}" for k in kinds),
                "why", "fix"])
    for g in rows:
        cells: list[Any] = [_cell(g.get(c)) for c in _COLUMNS]
        cells += [_cell((g.get("throttled_hours_by_reason") or {}).get(r, 0.0)) for r in reasons]
        cells += [_cell((g.get("verdict_share") or {}).get(k, 0.0)) for k in kinds]
        cells += [g.get("why", ""), g.get("fix", "")]
        w.writerow([_safe(c) for c in cells])
    return buf.getvalue()


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def _safe(v: Any) -> Any:
    """A text cell a spreadsheet would run as a formula (=, +, -, @ first) gets a ' in front."""
    if isinstance(v, str) and v[:1] in ("=", "+", "-", "@", "\t", "\r") and not _number(v):
        return "'" + v
    return v


def _number(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


# -- HTML ------------------------------------------------------------------------------------------
def _plots(report: dict[str, Any]) -> str:
    p = report.get("plots") or {}
    t = p.get("t_s") or []
    if not t:
        return ""
    t0, t1 = 0.0, float(report["range"]["seconds"])
    out = ["<h2>Over the range</h2>", '<p class="muted">Time since the range\'s start. Each point is the mean '
           "over its bucket; a gap is time no GPU was scraped.</p>"]

    def fig(caption: str, lines: list[Line], axis: Axis, fid: str) -> None:
        if not any(v is not None for ln in lines for v in ln.y):
            return
        legend = "".join(f'<span><span class="solid" style="border-color:{ln.color}"></span>{_e(ln.label)}</span>'
                         for ln in lines)
        out.append(f'<figure id="{fid}"><figcaption>{_e(caption)}</figcaption><div class="legend">{legend}</div>'
                   f"{panel(lines, t0, t1, axis, (), caption)}</figure>")

    gpus = [("observed", "GPUs observed", "#5b6475"), ("allocated", "allocated", "#0072b2"),
            ("used", "used (∫ SM activity)", "#009e73"), ("idle_allocated", "allocated but idle", "#d1343a")]
    fig("GPUs: observed, allocated, used and idle", [Line(label, c, t, p.get(k) or []) for k, label, c in gpus
                                                     if p.get(k)], Axis("GPUs", 1.0, 0.0, None, lambda v: f"{v:.3g}"),
        "plot-gpus")
    fig("Power of the fleet's GPUs", [Line("power", "#cc79a7", t, p.get("power") or [])],
        Axis("kW", 1e-3, 0.0, None, lambda v: f"{v:.3g}"), "plot-power")
    return "".join(out)


def _share_bar(g: dict[str, Any]) -> str:
    shares = g.get("verdict_share") or {}
    if not shares:
        return '<span class="muted">–</span>'
    spans = "".join(f'<span style="width:{v * 100:.2f}%;background:{VERDICT_COLORS.get(k, "#9aa0a8")}" '
                    f'title="{_e(k)} {v * 100:.0f} %"></span>' for k, v in shares.items())
    return f'<div class="sharebar">{spans}</div><span class="muted">{_e(_top_verdict(g))}</span>'


def _groups_table(report: dict[str, Any]) -> str:
    cur = report["currency"]
    heads = ["#", "group", "wasted", "cost", "GPUs", "GPU-h allocated", "used", "idle", "unallocated", "unobserved",
             "throttled", "kWh", "CO2e kg", "memory headroom", "verdicts"]
    out = [f"<h2>Groups by {_e(report['by'])}, ranked by money wasted</h2>",
           '<table id="groups"><thead><tr>' + "".join(f"<th>{h}</th>" for h in heads) + "</tr></thead><tbody>"]
    for i, g in enumerate(report["groups"], 1):
        out.append(
            f'<tr class="group"><td class=num>{i}</td><td><b>{_e(g["group"])}</b></td>'
            f"<td class=num>{_e(_money(g['wasted_money'], cur))}</td><td class=num>{_e(_money(g['cost'], cur))}</td>"
            f"<td class=num>{g['gpus']}</td><td class=num>{_h(g['allocated_gpu_hours'])}</td>"
            f"<td class=num>{_h(g['used_gpu_hours'])}</td><td class=num>{_h(g['idle_gpu_hours'])}</td>"
            f"<td class=num>{_h(g['unallocated_gpu_hours'])}</td><td class=num>{_h(g['unobserved_gpu_hours'])}</td>"
            f"<td>{_e(_throttle(g))}</td><td class=num>{_h(g['energy_kwh'])}</td><td class=num>{_h(g['co2e_kg'])}</td>"
            f"<td class=num>{_e(_pct(g['memory_headroom_ratio']))}</td><td>{_share_bar(g)}</td></tr>"
            f'<tr class="explain"><td></td><td colspan="{len(heads) - 1}"><span class="why">why: {_e(g["why"])}</span>'
            f'<br><span class="fix">fix: {_e(g["fix"])}</span></td></tr>')
    out.append("</tbody></table>")
    return "".join(out)


def _prices_text(pr: dict[str, Any]) -> str:
    per = ", ".join(f"{k} {v:.2f}" for k, v in pr["gpu_hour"].items()) or "none"
    return (f"{pr['source']}: per GPU-hour {per} {pr['currency']}; {pr['energy_per_kwh']:g} per kWh; "
            f"{pr['grid_kg_co2e_per_kwh']:g} kg CO2e per kWh")


def _summary(report: dict[str, Any]) -> str:
    fl, cur = report["fleet"], report["currency"]
    pr = report["prices"]
    rows = [("Range", f"{report['range']['start']} – {report['range']['end']}"),
            ("Server", report["server"]), ("GPUs", fl["gpus"]),
            ("GPU-hours observed", f"{_h(fl['observed_gpu_hours'])} (unobserved: {_h(fl['unobserved_gpu_hours'])})"),
            ("allocated / used / idle", f"{_h(fl['allocated_gpu_hours'])} / {_h(fl['used_gpu_hours'])} / "
                                        f"{_h(fl['idle_gpu_hours'])}"),
            ("unallocated", f"{_h(fl['unallocated_gpu_hours'])} GPU-hours, {_money(fl['unallocated_money'], cur)}"),
            ("Energy", f"{_h(fl['energy_kwh'])} kWh, {_h(fl['co2e_kg'])} kg CO2e"),
            ("Cost", f"{_money(fl['cost'], cur)} (GPU-hours {_money(fl['gpu_cost'], cur)}, energy "
                     f"{_money(fl['energy_cost'], cur)})"),
            ("Wasted", f"{_money(fl['wasted_money'], cur)} on allocated GPU-hours the SMs did not use"),
            ("Prices", _prices_text(pr)),
            ("Series", f"{report['source']}; scrape step per node: "
                       + ", ".join(f"{h} {s:.3g} s" for h, s in report["scrape_step_s"].items())),
            ("Not in the range", ", ".join(report.get("metrics_not_found") or []) or "–")]
    body = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in rows)
    return (f'<section class="card headline" id="headline">{_e(fl["line"])}</section>'
            f'<section class="card"><dl class="kv">{body}</dl></section>')


def _stragglers(report: dict[str, Any]) -> str:
    s = report.get("stragglers")
    if not s:
        return ""
    out = ["<h2>Stragglers</h2>"]
    rows = s.get("stragglers") or []
    if not rows:
        return out[0] + f'<p class="muted" id="stragglers">{_e(s.get("note"))}</p>'
    out.append('<p class="muted">GPUs of one job (the agents\' workload label) slower than their peers, and why.</p>'
               "<table id=stragglers><thead><tr><th>job</th><th>node</th><th>GPU</th><th>cause</th><th>evidence</th>"
               "<th>fix</th></tr></thead><tbody>")
    for r in rows:
        out.append(f"<tr><td>{_e(r.get('workload'))}</td><td>{_e(r.get('node'))}</td><td>{_e(r.get('gpu'))}</td>"
                   f"<td>{_e(r.get('cause'))}</td><td class=why>{_e(r.get('evidence'))}</td>"
                   f"<td class=fix>{_e(r.get('fix'))}</td></tr>")
    out.append("</tbody></table>")
    return "".join(out)


def render_html(report: dict[str, Any]) -> str:
    title = f"gpuscope fleet report by {report['by']}: {report['range']['start']} – {report['range']['end']}"
    parts = ["<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
             "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">",
             '<meta name=viewport content="width=device-width,initial-scale=1">',
             f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>",
             "<h1>gpuscope fleet report</h1>", _summary(report), _groups_table(report), _stragglers(report),
             _plots(report),
             f"<footer>gpuscope {_e(__version__)} · {report['queries']} queries in {report['query_seconds']:.1f} s · "
             "docs/FLEET.md says what each figure means</footer></main></body></html>\n"]
    return "".join(parts)
