"""Alerts inside the agent: evaluate the rules on the sampler's in-memory history every few seconds on
a thread of their own, hand notifications to the dispatcher, and serve the state to the HTTP side.

    svc = AlertService(sampler, load_rules(files), [LogNotifier()], interval=5.0).start()
    svc.alerts()          # {"firing": [...], "pending": [...], "resolved": [...]}
    svc.stop()

Nothing here runs on the sampler's thread and nothing raises into it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from ..catalog import series_key
from .engine import Engine
from .notifiers import Dispatcher, Notifier
from .rules import Rule, _fmt_duration

log = logging.getLogger("gpuscope.alerts")

__all__ = ["AlertService"]


class AlertService:
    def __init__(self, sampler: Any, rules: Sequence[Rule], notifiers: Sequence[Notifier], *,
                 interval: float = 5.0, generator_url: str = "", dispatcher: Dispatcher | None = None) -> None:
        self.sampler = sampler
        self.engine = Engine(rules, generator_url=generator_url)
        self.dispatcher = dispatcher or Dispatcher(notifiers)
        self.interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._verdict_series: dict[str, float] = {}
        self._errors = 0
        self._last_error = ""

    def start(self) -> AlertService:
        self._thread = threading.Thread(target=self._run, name="alerts", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.dispatcher.flush(2.0)
        self.dispatcher.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.tick()

    def tick(self, now: float | None = None) -> None:
        """One evaluation; never raises."""
        try:
            snaps = list(self.sampler.history)
            with self._lock:
                notes = self.engine.evaluate(snaps, now)
                firing = self.engine.firing()
                self._verdict_series = _verdict_series(self.engine.verdicts)
            self.dispatcher.submit(notes, firing)
        except Exception as e:  # noqa: BLE001 - alerts must never take the agent down
            self._errors += 1
            msg = f"{type(e).__name__}: {e}"
            if msg != self._last_error:
                log.exception("alert evaluation failed")
            self._last_error = msg

    # -- what the HTTP side reads ----------------------------------------------------------------
    def alerts(self) -> dict[str, Any]:
        with self._lock:
            active = [a.to_dict() for a in self.engine.active()]
            resolved = [a.to_dict() for a in reversed(self.engine.resolved)]
            rules = [{"name": r.name, "condition": r.condition_text(), "for_s": r.for_s, "severity": r.severity,
                      "source": r.source} for r in self.engine.rules]
        return {"firing": [a for a in active if a["state"] == "firing"],
                "pending": [a for a in active if a["state"] == "pending"],
                "resolved": resolved, "rules": rules, "evaluation_interval_s": self.interval,
                "notifiers": self.dispatcher.stats()}

    def self_metrics(self) -> dict[str, float]:
        """gpu_verdict{gpu,kind,window} (confidence) for each verdict that holds, and the alerts' own counters."""
        out: dict[str, float] = {}
        with self._lock:
            out.update(self._verdict_series)
            firing = sum(1 for a in self.engine.alerts.values() if a.state == "firing")
            pending = len(self.engine.alerts) - firing
        out[series_key("gpuscope_alerts", state="firing")] = float(firing)
        out[series_key("gpuscope_alerts", state="pending")] = float(pending)
        out["gpuscope_alert_evaluation_errors_total"] = float(self._errors)
        for name, st in self.dispatcher.stats().items():
            out[series_key("gpuscope_alert_notifications_total", notifier=name)] = float(st["sent"])
            out[series_key("gpuscope_alert_notification_failures_total", notifier=name)] = float(st["failures"])
        return out


def _verdict_series(verdicts: dict[float, list[Any]]) -> dict[str, float]:
    """gpu_verdict{gpu,kind,window} = confidence, built once per evaluation rather than per scrape."""
    out: dict[str, float] = {}
    for window, vs in verdicts.items():
        w = _fmt_duration(window)
        for v in vs:
            out[series_key("gpu_verdict", gpu=v.gpu, kind=v.kind, window=w)] = float(v.confidence)
    return out
