"""The alert state machine: inactive -> pending -> firing -> resolved, per rule and label set.

    engine = Engine(load_rules())
    notes = engine.evaluate(list(sampler.history))      # every few seconds; returns the transitions
    for n in notes: print(n.status, n.labels["alertname"], n.annotations["summary"])

- `for`: a condition must hold that long (pending) before the alert fires; a pending alert whose
  condition stops holding goes back to inactive silently.
- hysteresis: a firing metric alert resolves only when its value crosses `resolve_threshold`
  (not the firing threshold), and not before `keep_firing_for` has passed since it last held.
- dedup: one notification per transition (firing, resolved); a long-firing alert is notified again
  every `repeat_interval`. The state is keyed by a fingerprint of the alert's labels.

Times are wall-clock seconds (they leave the process as startsAt/endsAt); tests pass them explicitly.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import string
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._records import Snapshot
from ..catalog import split_series_key
from .rules import Rule

log = logging.getLogger("gpuscope.alerts")

__all__ = ["Alert", "Engine", "Notification", "Observation", "evaluate_metric", "evaluate_verdicts"]

#: The window of the verdicts exported as the `gpu_verdict` gauge (and of the built-in verdict rules).
VERDICT_WINDOW_S = 30.0


@dataclass
class Observation:
    """One label set's value at an evaluation: a metric's aggregate, or a verdict's confidence."""

    labels: dict[str, str]
    value: float
    annotations: dict[str, str] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)  # template fields (gpu, model, ...)


@dataclass
class Alert:
    rule: str
    fingerprint: str
    labels: dict[str, str]
    annotations: dict[str, str]
    state: str  # 'pending', 'firing' or 'resolved'
    value: float
    active_at: float  # when the condition first held (Prometheus's activeAt; startsAt when sent)
    last_held: float
    fired_at: float | None = None
    resolved_at: float | None = None
    last_sent: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "fingerprint": self.fingerprint, "state": self.state, "labels": self.labels,
                "annotations": self.annotations, "value": self.value, "active_at": self.active_at,
                "fired_at": self.fired_at, "resolved_at": self.resolved_at}


@dataclass(frozen=True)
class Notification:
    """What notifiers receive: one alert at one transition (or a repeat of a firing one)."""

    status: str  # 'firing' or 'resolved'
    fingerprint: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float
    ends_at: float | None  # set when resolved
    value: float
    generator_url: str = ""
    repeat: bool = False


def fingerprint(labels: dict[str, str]) -> str:
    h = hashlib.sha256("\x00".join(f"{k}\x01{v}" for k, v in sorted(labels.items())).encode())
    return h.hexdigest()[:16]


class _SafeFields(dict):  # type: ignore[type-arg]
    def __missing__(self, key: str) -> str:
        return ""


def render_template(text: str, fields: dict[str, Any]) -> str:
    """The rule's summary with {gpu}, {value:.1f} ... filled in; never raises (a bad spec is left as is)."""
    if not text:
        return ""
    try:
        return string.Formatter().vformat(text, (), _SafeFields(fields))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return text


# -- what a rule sees in the sampler's history ----------------------------------------------------

def _window(snaps: Sequence[Snapshot], window_s: float, cover: bool = False) -> Sequence[Snapshot]:
    """The snapshots of the last `window_s`; with `cover`, also the one before, so that the samples
    span the whole window (the diagnosis wants at least its minimum window between first and last)."""
    if not snaps:
        return snaps
    cutoff = snaps[-1].time_ns - int(window_s * 1e9)
    i = bisect.bisect_left(snaps, cutoff, key=lambda s: s.time_ns)
    return snaps[max(0, i - 1) if cover else i:]


def _aggregate(agg: str, points: list[tuple[float, float]], born_in_window: bool, t_start: float) -> float | None:
    if not points:
        return None
    vals = [v for _, v in points]
    if agg == "avg":
        return sum(vals) / len(vals)
    if agg == "max":
        return max(vals)
    if agg == "min":
        return min(vals)
    if agg == "last":
        return vals[-1]
    # increase / rate: a counter; a reset (value going down) restarts from zero, like PromQL.
    total, prev = 0.0, (0.0 if born_in_window else vals[0])
    if not born_in_window and len(vals) < 2:
        return None
    for v in (vals if born_in_window else vals[1:]):
        total += v - prev if v >= prev else v
        prev = v
    if agg == "increase":
        return total
    span = points[-1][0] - (t_start if born_in_window else points[0][0])
    return total / span if span > 0 else None


def evaluate_metric(rule: Rule, snaps: Sequence[Snapshot]) -> list[Observation]:
    """Per series (per GPU, plus the metric's own labels such as xid), the rule's aggregate over its window."""
    win = _window(snaps, rule.window_s)
    if not win:
        return []
    last = win[-1]
    t_start = win[0].time_ns / 1e9
    match = dict(rule.match)
    out: list[Observation] = []
    base = {"hostname": last.hostname}
    if last.simulated:
        base["simulated"] = last.simulated
    if rule.is_host:
        units: list[tuple[dict[str, str], dict[str, Any], Any]] = [
            (dict(base), {"gpu": "", "model": ""}, lambda s: s.host.values if s.host is not None else None)]
    else:
        units = []
        for pos, g in enumerate(last.gpus):
            ident = g.identity
            if match.get("gpu", ident.label) != ident.label:
                continue
            labels = {**base, "gpu": ident.label, "uuid": ident.uuid}
            units.append((labels, {"gpu": ident.label, "model": ident.name},
                          _gpu_values(ident.label, pos)))
    for labels, ctx, values_of in units:
        latest = values_of(last)
        if not latest:
            continue
        first_vals = values_of(win[0])
        for key in _keys(latest, rule.metric):
            _, own = split_series_key(key)
            if any(own.get(k) != v for k, v in match.items() if k != "gpu"):
                continue
            if rule.agg == "last":  # the key is in the latest snapshot: no need to walk the window
                value: float | None = latest[key]
            else:
                points = []
                for s in win:
                    vals = values_of(s)
                    v = vals.get(key) if vals else None
                    if v is not None:
                        points.append((s.time_ns / 1e9, v))
                born = bool(first_vals) and key not in first_vals
                value = _aggregate(rule.agg, points, born, t_start)
            if value is None:
                continue
            out.append(Observation({**labels, **own}, value, context={**ctx, **own}))
    return out


def _gpu_values(label: str, pos: int) -> Any:
    def get(s: Snapshot) -> dict[str, float] | None:
        gpus = s.gpus
        if pos < len(gpus) and gpus[pos].identity.label == label:  # GPUs keep their order between snapshots
            return gpus[pos].values
        for g in gpus:
            if g.identity.label == label:
                return g.values
        return None

    return get


def _keys(values: dict[str, float], metric: str) -> list[str]:
    if metric in values:
        return [metric]
    prefix = metric + "{"
    return [k for k in values if k.startswith(prefix)]


def evaluate_verdicts(snaps: Sequence[Snapshot], window_s: float) -> list[Any]:
    """The diagnosis over the last `window_s` of the history: a list of diagnose.Verdict."""
    from ..diagnose import diagnose, windows_from_snapshots

    win = _window(snaps, window_s, cover=True)
    return diagnose(windows_from_snapshots(win)) if win else []


def verdict_observations(rule: Rule, verdicts: Iterable[Any], last: Snapshot) -> list[Observation]:
    idents = {g.identity.label: g.identity for g in last.gpus}
    out = []
    for v in verdicts:
        if v.kind != rule.verdict or v.confidence < rule.min_confidence:
            continue
        ident = idents.get(v.gpu)
        labels = {"hostname": last.hostname, "gpu": v.gpu}
        if ident is not None:
            labels["uuid"] = ident.uuid
        if last.simulated:
            labels["simulated"] = last.simulated
        ann = {"verdict": v.summary}
        if v.recommendations:
            ann["recommendation"] = v.recommendations[0]
        out.append(Observation(labels, float(v.confidence), ann,
                               {"gpu": v.gpu, "model": ident.name if ident else "", "verdict": v.kind}))
    return out


# -- the state machine -------------------------------------------------------------------------------

class Engine:
    """Alert state for a set of rules. Not thread-safe: one evaluator thread drives it; readers take
    `active()` copies (plain lists of dicts are safe to hand to another thread)."""

    def __init__(self, rules: Sequence[Rule], *, generator_url: str = "", keep_resolved: int = 100) -> None:
        self.rules = list(rules)
        self.generator_url = generator_url
        self.alerts: dict[str, Alert] = {}
        self.resolved: deque[Alert] = deque(maxlen=keep_resolved)
        #: The latest diagnosis per verdict window (VERDICT_WINDOW_S always): exported as gpu_verdict.
        self.verdicts: dict[float, list[Any]] = {}

    def evaluate(self, snaps: Sequence[Snapshot], now: float | None = None) -> list[Notification]:
        """Evaluate every rule on the history; the notifications to send (transitions and repeats)."""
        now = time.time() if now is None else now
        notes: list[Notification] = []
        verdicts: dict[float, list[Any]] = {}
        if snaps:
            verdicts[VERDICT_WINDOW_S] = evaluate_verdicts(snaps, VERDICT_WINDOW_S)
        for rule in self.rules:
            try:
                if not snaps:
                    obs: list[Observation] = []
                elif rule.is_verdict:
                    if rule.window_s not in verdicts:
                        verdicts[rule.window_s] = evaluate_verdicts(snaps, rule.window_s)
                    obs = verdict_observations(rule, verdicts[rule.window_s], snaps[-1])
                else:
                    obs = evaluate_metric(rule, snaps)
            except Exception:  # noqa: BLE001 - one rule's failure must not stop the others
                log.exception("alert rule %s failed to evaluate", rule.name)
                continue
            notes.extend(self.step(rule, obs, now))
        self.verdicts = verdicts
        names = {r.name for r in self.rules}
        for fp, alert in list(self.alerts.items()):  # the rule was removed (set_rules): its alerts end
            if alert.rule not in names:
                del self.alerts[fp]
                if alert.state == "firing":
                    alert.state, alert.resolved_at = "resolved", now
                    self.resolved.append(alert)
                    notes.append(self._note(alert, "resolved", now))
        return notes

    def step(self, rule: Rule, observations: Iterable[Observation], now: float) -> list[Notification]:
        """Advance the rule's alerts by one evaluation at time `now` (seconds)."""
        notes: list[Notification] = []
        held_now: set[str] = set()
        for ob in observations:
            labels = {**ob.labels, **dict(rule.labels), "alertname": rule.name, "severity": rule.severity}
            fp = fingerprint(labels)
            alert = self.alerts.get(fp)
            firing = alert is not None and alert.state == "firing"
            held = ob.value >= rule.min_confidence if rule.is_verdict else rule.holds(ob.value, firing)
            if not held:
                continue
            held_now.add(fp)
            ann = self._annotations(rule, ob)
            if alert is None:
                alert = self.alerts[fp] = Alert(rule.name, fp, labels, ann, "pending", ob.value, now, now)
            alert.value, alert.last_held, alert.annotations = ob.value, now, ann
            if alert.state == "pending" and now - alert.active_at >= rule.for_s:
                alert.state, alert.fired_at = "firing", now
                notes.append(self._note(alert, "firing", now))
            elif (alert.state == "firing" and alert.last_sent is not None and rule.repeat_interval_s > 0
                  and now - alert.last_sent >= rule.repeat_interval_s):
                notes.append(self._note(alert, "firing", now, repeat=True))
        for fp, alert in list(self.alerts.items()):
            if alert.rule != rule.name or fp in held_now:
                continue
            if alert.state == "pending":
                del self.alerts[fp]  # never fired: nothing to tell anyone
            elif now - alert.last_held >= rule.keep_firing_for_s:
                alert.state, alert.resolved_at = "resolved", now
                del self.alerts[fp]
                self.resolved.append(alert)
                notes.append(self._note(alert, "resolved", now))
        return notes

    def set_rules(self, rules: Sequence[Rule]) -> None:
        """Replace the rules; alerts of rules that are gone resolve at the next evaluation."""
        self.rules = list(rules)

    def _annotations(self, rule: Rule, ob: Observation) -> dict[str, str]:
        fields = {"hostname": ob.labels.get("hostname", ""), "value": ob.value, "threshold": rule.threshold,
                  "rule": rule.name, "verdict": rule.verdict, "gpu": "", "model": "", **ob.context}
        ann = {"summary": render_template(rule.summary, fields) or f"{rule.name}: {rule.condition_text()}"}
        if rule.description:
            ann["description"] = render_template(rule.description, fields)
        if rule.runbook_url:
            ann["runbook_url"] = rule.runbook_url
        ann.update(ob.annotations)
        ann["value"] = f"{ob.value:.6g}"
        ann["condition"] = rule.condition_text()
        return ann

    def _note(self, alert: Alert, status: str, now: float, repeat: bool = False) -> Notification:
        alert.last_sent = now
        return Notification(status, alert.fingerprint, dict(alert.labels), dict(alert.annotations),
                            alert.active_at, now if status == "resolved" else None, alert.value,
                            self.generator_url, repeat)

    def active(self) -> list[Alert]:
        """Pending and firing alerts, firing first."""
        return sorted(self.alerts.values(), key=lambda a: (a.state != "firing", a.active_at))

    def firing(self) -> list[Notification]:
        """Every firing alert as a notification, without counting as a send (for Alertmanager's resends)."""
        return [Notification("firing", a.fingerprint, dict(a.labels), dict(a.annotations), a.active_at, None,
                             a.value, self.generator_url, True)
                for a in self.alerts.values() if a.state == "firing"]
