"""Alert rules: the built-in set and the user's TOML or YAML files, validated with one sentence per error.

A rule watches either a metric (a condition over a windowed aggregate, per GPU) or a verdict (the
diagnosis names that bottleneck on a GPU). Every error names the file, the rule and the key.

    rules = load_rules(["gpu-alerts.toml"])        # built-ins, then the file's rules and overrides

The file (TOML shown; YAML has the same keys, `rules:` a list of mappings):

    disable = ["GpuIdleAllocated"]               # built-in rules to drop, by name
    [[rules]]
    name = "GpuHot"
    metric = "gpu_temperature_celsius"
    agg = "max"                # avg (default for gauges), max, min, last, increase, rate (counters)
    window = "1m"
    condition = "> 85"
    resolve_threshold = 80     # hysteresis: once firing, it stays firing until the value is <= 80
    for = "2m"
    keep_firing_for = "1m"
    severity = "warning"       # info, warning, critical
    labels = { team = "ml" }
    summary = "GPU {gpu} on {hostname} is at {value:.0f} C"

    [[rules]]
    name = "GpuThrottled"
    verdict = "throttled"
    for = "1m"
"""

from __future__ import annotations

import math
import os
import re
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .._choices import did_you_mean
from .._files import load_toml, load_yaml, shown
from ..catalog import CATALOG, Kind
from ..errors import UsageError
from ..timeparse import TimeError, parse_duration

__all__ = ["AGGS", "BUILTIN_RULES", "OPS", "VERDICT_KINDS", "Rule", "RuleError", "load_rules", "parse_rules"]


class RuleError(UsageError, ValueError):
    """One sentence saying what is wrong with a rule file, naming the file, the rule and the key."""


OPS = (">=", "<=", "==", "!=", ">", "<")
GAUGE_AGGS = ("avg", "max", "min", "last")
COUNTER_AGGS = ("increase", "rate", "last")
AGGS = GAUGE_AGGS + ("increase", "rate")
SEVERITIES = ("info", "warning", "critical")
#: Sources whose series are per GPU (in GpuRecord.values) or per host (HostRecord.values).
_GPU_SOURCES = ("nvml", "gpm", "events")
_HOST_SOURCES = ("host",)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONDITION = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*$")
#: Labels the engine sets itself; a rule may not set them.
RESERVED_LABELS = ("alertname", "severity", "gpu", "hostname", "uuid", "simulated")
#: Fields a summary or description may use, e.g. "GPU {gpu} at {value:.0f} C".
TEMPLATE_FIELDS = ("gpu", "hostname", "value", "threshold", "rule", "verdict", "model")

#: Verdict kinds the diagnosis produces (see gpuscope.diagnose.rules.ADVICE).
VERDICT_KINDS = ("compute_bound", "healthy", "tensor_cores_unused", "memory_bound", "memory_access_bound",
                 "transfer_bound", "launch_or_sync_bound", "input_starved", "idle_allocated", "idle",
                 "underutilized", "throttled", "power_capped", "memory_growth", "hardware", "gpu_lost",
                 "imbalance")

_KEYS = ("name", "metric", "verdict", "agg", "window", "condition", "resolve_threshold", "match",
         "min_confidence", "for", "keep_firing_for", "repeat_interval", "severity", "labels", "summary",
         "description", "runbook_url")
_TOP_KEYS = ("rules", "disable", "builtins")


@dataclass(frozen=True)
class Rule:
    """One alert rule. Durations in seconds; `labels` and `match` as sorted (key, value) pairs."""

    name: str
    metric: str = ""  # a metric rule ...
    verdict: str = ""  # ... or a verdict rule
    agg: str = "avg"
    window_s: float = 60.0
    op: str = ">"
    threshold: float = 0.0
    resolve_threshold: float | None = None
    match: tuple[tuple[str, str], ...] = ()
    min_confidence: float = 0.0
    for_s: float = 0.0
    keep_firing_for_s: float = 0.0
    repeat_interval_s: float = 4 * 3600.0  # re-notify a long-firing alert this often (Alertmanager's default)
    severity: str = "warning"
    labels: tuple[tuple[str, str], ...] = ()
    summary: str = ""
    description: str = ""
    runbook_url: str = ""
    source: str = "built-in"

    @property
    def is_verdict(self) -> bool:
        return bool(self.verdict)

    @property
    def is_host(self) -> bool:
        return bool(self.metric) and CATALOG[self.metric].source in _HOST_SOURCES

    def holds(self, value: float, firing: bool = False) -> bool:
        """The condition on one value; a firing alert is held until the resolve threshold is crossed."""
        limit = self.resolve_threshold if firing and self.resolve_threshold is not None else self.threshold
        return _compare(value, self.op, limit)

    def condition_text(self) -> str:
        if self.is_verdict:
            return f"verdict {self.verdict}" + (f" with confidence >= {self.min_confidence:g}"
                                                if self.min_confidence else "")
        sel = ",".join(f'{k}="{v}"' for k, v in self.match)
        return f"{self.agg}({self.metric}{{{sel}}}[{_fmt_duration(self.window_s)}]) {self.op} {self.threshold:g}"


def _compare(v: float, op: str, limit: float) -> bool:
    if v != v:  # NaN never holds
        return False
    if op == ">":
        return v > limit
    if op == ">=":
        return v >= limit
    if op == "<":
        return v < limit
    if op == "<=":
        return v <= limit
    if op == "==":
        return v == limit
    return v != limit


def _fmt_duration(s: float) -> str:
    """Prometheus duration text: 90 -> '1m30s', 0.5 -> '500ms'."""
    ms = int(round(s * 1000))
    if ms == 0:
        return "0s"
    out = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        if ms >= size:
            out.append(f"{ms // size}{unit}")
            ms %= size
    return "".join(out)


def _r(name: str, **kw: Any) -> Rule:
    return Rule(name=name, **kw)


#: The default set: hardware faults page at once; performance problems once they have lasted.
BUILTIN_RULES: tuple[Rule, ...] = (
    _r("GpuLost", metric="gpu_healthy", agg="last", window_s=30.0, op="<", threshold=1.0, severity="critical",
       summary="GPU {gpu} on {hostname} fell off the bus: NVML cannot reach it",
       description="Its processes are dead; it needs a reset (nvidia-smi -r) or a reboot."),
    _r("GpuXidErrors", metric="gpu_xid_events_total", agg="increase", window_s=300.0, op=">", threshold=0.0,
       severity="critical", keep_firing_for_s=0.0,
       summary="GPU {gpu} on {hostname} reported {value:.0f} XID event(s) in 5 min",
       description="See the xid label and dmesg; XIDs 48, 63, 64, 74, 79, 94, 95 usually mean a hardware fault."),
    _r("GpuEccUncorrected", metric="gpu_ecc_uncorrected_errors_total", agg="increase", window_s=300.0, op=">",
       threshold=0.0, severity="critical",
       summary="GPU {gpu} on {hostname} had {value:.0f} uncorrected ECC error(s) in 5 min",
       description="Uncorrected memory errors corrupt results: drain the GPU and check it (nvidia-smi -q -d ECC)."),
    _r("GpuRowRemapFailure", metric="gpu_row_remap_failure", agg="last", window_s=60.0, op=">", threshold=0.0,
       severity="critical", summary="GPU {gpu} on {hostname} failed to remap a memory row",
       description="The GPU has run out of spare rows: it should be replaced (RMA)."),
    _r("GpuRowRemapPending", metric="gpu_row_remap_pending", agg="last", window_s=60.0, op=">", threshold=0.0,
       severity="warning", summary="GPU {gpu} on {hostname} has a row remap waiting for a GPU reset",
       description="Reset the GPU (nvidia-smi -r) when its jobs allow."),
    _r("GpuThrottled", verdict="throttled", window_s=30.0, for_s=60.0, severity="warning",
       summary="GPU {gpu} on {hostname} is throttled by temperature or a hardware slowdown",
       description="Check cooling, airflow and the power supply (nvidia-smi -q -d PERFORMANCE)."),
    _r("GpuIdleAllocated", verdict="idle_allocated", window_s=30.0, for_s=1800.0, severity="warning",
       summary="GPU {gpu} on {hostname} has held memory with nothing running for 30 min",
       description="Someone reserved the GPU and does not use it: end the notebook kernel or job."),
    _r("GpuMemoryGrowth", verdict="memory_growth", window_s=120.0, for_s=60.0, severity="warning",
       summary="GPU {gpu} on {hostname} memory grows steadily: out of memory within an hour at this rate",
       description="Look for tensors kept across steps (losses appended without .item()), growing caches."),
)


# -- parsing ---------------------------------------------------------------------------------------

def _unknown(where: str, what: str, word: str, choices: Iterable[str], listing: str | None = None) -> RuleError:
    """'WHERE: unknown WHAT 'x'; did you mean 'y'?' or, with nothing close, the list of choices."""
    choices = list(choices)
    return RuleError(f"{where}: unknown {what} {word!r}; "
                     + did_you_mean(word, choices, listing or f"choose one of {', '.join(choices)}."))


def _duration(v: Any, where: str, allow_zero: bool = True) -> float:
    """Seconds from a number or a duration string (the agent's forms: 250ms, 30s, 5m, 1h, 7d, 1w)."""
    s: float | None = None
    if isinstance(v, str):
        try:
            s = parse_duration(v, where, allow_zero=True)
        except TimeError:
            pass
    elif isinstance(v, int | float) and not isinstance(v, bool):
        s = float(v)
    if s is None:
        raise RuleError(f"{where} must be a duration such as \"30s\", \"5m\" or \"1h\", not {shown(v)}.")
    if not math.isfinite(s) or s < 0 or (s == 0 and not allow_zero):
        raise RuleError(f"{where} must be a {'non-negative' if allow_zero else 'positive'} duration, not {shown(v)}.")
    return s


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(float(v)):
        raise RuleError(f"{where} must be a number, not {shown(v)}.")
    return float(v)


def _string(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise RuleError(f"{where} must be a string, not {shown(v)}.")
    return v


def _string_table(v: Any, where: str, what: str) -> dict[str, str]:
    if not isinstance(v, dict):
        raise RuleError(f"{where} must be a table of {what}, such as {{ team = \"ml\" }}, not {shown(v)}.")
    out = {}
    for k, val in v.items():
        if not isinstance(k, str) or not _NAME.match(k) or k.startswith("__"):
            raise RuleError(f"{where}: {k!r} is not a label name (letters, digits and _, not starting with __).")
        if isinstance(val, bool) or not isinstance(val, str | int | float):
            raise RuleError(f"{where}: the value of {k!r} must be a string, not {shown(val)}.")
        out[k] = str(val)
    return out


def _template(v: Any, where: str) -> str:
    text = _string(v, where)
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
    except ValueError as e:
        raise RuleError(f"{where} is not a valid template ({e}); write literal braces as {{{{ and }}}}.") from None
    for n in names:
        base = re.split(r"[.\[]", n, maxsplit=1)[0]
        if base not in TEMPLATE_FIELDS:
            raise _unknown(where, "field", n, TEMPLATE_FIELDS,
                           f"the fields are {', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)}.")
    return text


def _metric_name(v: Any, where: str) -> str:
    name = _string(v, where)
    m = CATALOG.get(name)
    if m is None:
        raise _unknown(where, "metric", name, CATALOG,
                       "'gpuscope doctor --json' lists this machine's GPU metrics.")
    if m.source not in _GPU_SOURCES + _HOST_SOURCES:
        raise RuleError(f"{where}: {name} is a per-{'process' if m.source == 'processes' else m.source} series; "
                        "alert rules watch GPU and host metrics.")
    return name


def parse_rule(raw: Any, where: str) -> Rule:
    """One rule from a mapping; `where` is 'FILE: rule NAME' for the messages."""
    if not isinstance(raw, dict):
        raise RuleError(f"{where} must be a table of keys (name, metric or verdict, condition, ...), not {shown(raw)}.")
    for k in raw:
        if k not in _KEYS:
            raise _unknown(where, "key", str(k), _KEYS, f"the keys are {', '.join(_KEYS)}.")
    if "name" not in raw:
        raise RuleError(f"{where} has no name; every rule needs name = \"SomeName\".")
    name = _string(raw["name"], f"{where}: name")
    if not _NAME.match(name):
        raise RuleError(f"{where}: name {name!r} must be letters, digits and _ (a Prometheus alert name), "
                        "such as \"GpuHot\".")
    kw: dict[str, Any] = {"name": name}
    if ("metric" in raw) == ("verdict" in raw):
        raise RuleError(f"{where} needs exactly one of metric = \"...\" or verdict = \"...\".")
    if "metric" in raw:
        metric = _metric_name(raw["metric"], f"{where}: metric")
        counter = CATALOG[metric].kind == Kind.COUNTER
        kw["metric"] = metric
        agg = _string(raw.get("agg", "increase" if counter else "avg"), f"{where}: agg")
        allowed = COUNTER_AGGS if counter else GAUGE_AGGS
        if agg not in allowed:
            why = (f"{metric} is a counter: use increase, rate or last" if counter and agg in GAUGE_AGGS
                   else f"{metric} is a gauge: use avg, max, min or last" if agg in COUNTER_AGGS
                   else f"agg must be one of {', '.join(allowed)}, not {agg!r}")
            raise RuleError(f"{where}: {why}.")
        kw["agg"] = agg
        if "condition" not in raw:
            raise RuleError(f"{where} needs a condition such as condition = \"> 0.9\".")
        cond = _string(raw["condition"], f"{where}: condition")
        m = _CONDITION.match(cond)
        if not m or not math.isfinite(float(m.group(2))):
            raise RuleError(f"{where}: condition {cond!r} must be an operator ({', '.join(OPS)}) and a number, "
                            "such as \"> 85\".")
        kw["op"], kw["threshold"] = m.group(1), float(m.group(2))
        if "match" in raw:
            match = _string_table(raw["match"], f"{where}: match", "label values")
            allowed_labels = ("gpu",) + CATALOG[metric].labels if not CATALOG[metric].source == "host" \
                else CATALOG[metric].labels
            for k in match:
                if k not in allowed_labels:
                    raise RuleError(f"{where}: match: {metric} has no label {k!r}; its labels are "
                                    f"{', '.join(allowed_labels) or 'none'}.")
            kw["match"] = tuple(sorted(match.items()))
        if "resolve_threshold" in raw:
            rt = _number(raw["resolve_threshold"], f"{where}: resolve_threshold")
            op, th = kw["op"], kw["threshold"]
            if op in ("==", "!="):
                raise RuleError(f"{where}: resolve_threshold needs a condition with >, >=, < or <=, not {op}.")
            if (op in (">", ">=") and rt > th) or (op in ("<", "<=") and rt < th):
                side = "at or below" if op in (">", ">=") else "at or above"
                raise RuleError(f"{where}: resolve_threshold {rt:g} must be {side} the threshold {th:g} "
                                "(it is where a firing alert resolves).")
            kw["resolve_threshold"] = rt
        for k in ("min_confidence",):
            if k in raw:
                raise RuleError(f"{where}: {k} applies to verdict rules only.")
    else:
        verdict = _string(raw["verdict"], f"{where}: verdict")
        if verdict not in VERDICT_KINDS:
            raise _unknown(where, "verdict", verdict, VERDICT_KINDS)
        kw["verdict"] = verdict
        for k in ("agg", "condition", "resolve_threshold", "match"):
            if k in raw:
                raise RuleError(f"{where}: {k} applies to metric rules only; a verdict rule fires while the "
                                "verdict holds.")
        if "min_confidence" in raw:
            c = _number(raw["min_confidence"], f"{where}: min_confidence")
            if not 0 <= c <= 1:
                raise RuleError(f"{where}: min_confidence must be between 0 and 1, not {c:g}.")
            kw["min_confidence"] = c
        kw["window_s"] = 30.0
    if "window" in raw:
        kw["window_s"] = _duration(raw["window"], f"{where}: window", allow_zero=False)
        if kw.get("verdict") and kw["window_s"] < 5.0:
            raise RuleError(f"{where}: window must be at least 5s for a verdict rule (a shorter window is no "
                            "steady state).")
    for key, attr in (("for", "for_s"), ("keep_firing_for", "keep_firing_for_s"),
                      ("repeat_interval", "repeat_interval_s")):
        if key in raw:
            kw[attr] = _duration(raw[key], f"{where}: {key}")
    if "severity" in raw:
        sev = _string(raw["severity"], f"{where}: severity")
        if sev not in SEVERITIES:
            raise RuleError(f"{where}: severity must be one of {', '.join(SEVERITIES)}, not {shown(sev)}.")
        kw["severity"] = sev
    if "labels" in raw:
        labels = _string_table(raw["labels"], f"{where}: labels", "label values")
        for k in labels:
            if k in RESERVED_LABELS:
                hint = " (use the severity key)" if k == "severity" else ""
                raise RuleError(f"{where}: labels: {k!r} is set by gpuscope itself{hint}; choose another name.")
        kw["labels"] = tuple(sorted(labels.items()))
    for k in ("summary", "description"):
        if k in raw:
            kw[k] = _template(raw[k], f"{where}: {k}")
    if "runbook_url" in raw:
        kw["runbook_url"] = _string(raw["runbook_url"], f"{where}: runbook_url")
    return Rule(**kw)


def _read(path: Path) -> dict[str, Any]:
    what = f"the rule file {path}"
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        doc = load_yaml(path, what, error=RuleError)
    elif suffix == ".toml":
        doc = load_toml(path, what, error=RuleError)
    else:
        raise RuleError(f"The rule file {path} must end in .toml, .yaml or .yml.")
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise RuleError(f"The rule file {path} must hold a table with rules = [...], not a {type(doc).__name__}.")
    return doc


def parse_rules(doc: dict[str, Any], source: str) -> tuple[list[Rule], list[str], bool]:
    """(rules, names to disable, keep built-ins) from one parsed file."""
    for k in doc:
        if k not in _TOP_KEYS:
            hint = (" Write each rule as [[rules]] (TOML) or an item of rules: (YAML)." if k in _KEYS or k == "rule"
                    else "")
            raise RuleError(f"{source}: unknown top-level key {k!r}; the keys are {', '.join(_TOP_KEYS)}.{hint}")
    raw_rules = doc.get("rules", [])
    if not isinstance(raw_rules, list):
        raise RuleError(f"{source}: rules must be a list of tables ([[rules]] in TOML, a list in YAML).")
    out: list[Rule] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_rules, 1):
        nm = raw.get("name") if isinstance(raw, dict) else None
        where = f"{source}: rule {nm!r}" if isinstance(nm, str) else f"{source}: rule #{i}"
        rule = replace(parse_rule(raw, where), source=source)
        if rule.name in seen:
            raise RuleError(f"{where}: another rule in this file has the same name; names must be unique.")
        seen.add(rule.name)
        out.append(rule)
    disable = doc.get("disable", [])
    if not isinstance(disable, list) or not all(isinstance(d, str) for d in disable):
        raise RuleError(f"{source}: disable must be a list of rule names, such as [\"GpuIdleAllocated\"].")
    builtins = doc.get("builtins", True)
    if not isinstance(builtins, bool):
        raise RuleError(f"{source}: builtins must be true or false, not {shown(builtins)}.")
    return out, list(disable), builtins


def load_rules(paths: Sequence[str | os.PathLike[str]] = (), builtins: bool = True) -> list[Rule]:
    """The built-in rules, then each file's rules in order: a rule with a built-in's (or an earlier
    file's) name replaces it; `disable` drops rules by name; `builtins = false` in a file drops them all."""
    rules: dict[str, Rule] = {r.name: r for r in BUILTIN_RULES} if builtins else {}
    for p in paths:
        path = Path(os.path.expanduser(os.fspath(p)))
        new, disable, keep = parse_rules(_read(path), str(path))
        if not keep:
            rules = {n: r for n, r in rules.items() if r.source != "built-in"}
        for name in disable:
            if name not in rules and name not in {r.name for r in BUILTIN_RULES}:
                raise _unknown(f"{path}: disable", "rule", name, sorted(set(rules) | {r.name for r in BUILTIN_RULES}))
            rules.pop(name, None)
        for r in new:
            if r.name in disable:
                raise RuleError(f"{path}: rule {r.name!r} is both defined and disabled in this file.")
            rules[r.name] = r
    return list(rules.values())
