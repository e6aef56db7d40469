"""Alerts: built-in and user rules on metrics and verdicts, with `for`, hysteresis and dedup, sent to
the log, a webhook, Slack or Alertmanager, and exported as a Prometheus rule file.

    from gpuscope import Sampler
    from gpuscope.alerts import Engine, LogNotifier, load_rules
    with Sampler(simulate="throttled") as s:
        snaps = [s.sample_once() for _ in range(100)]
    engine = Engine(load_rules())                       # the built-in rules; add your files as a list
    for n in engine.evaluate(snaps):
        print(n.status, n.labels["alertname"], n.annotations["summary"])

The agent runs this every `[alerts] evaluation_interval` (see `AlertService`); `gpuscope alerts check`
validates a rule file and `gpuscope alerts export-rules` writes the Prometheus version.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .engine import Alert, Engine, Notification, Observation
from .notifiers import (
    AlertmanagerNotifier,
    Dispatcher,
    LogNotifier,
    Notifier,
    NotifyError,
    SlackNotifier,
    WebhookNotifier,
    redact_url,
)
from .promrules import to_prometheus
from .rules import BUILTIN_RULES, Rule, RuleError, load_rules
from .service import AlertService

__all__ = ["BUILTIN_RULES", "Alert", "AlertService", "AlertmanagerNotifier", "Dispatcher", "Engine", "LogNotifier",
           "Notification", "Notifier", "NotifyError", "Observation", "Rule", "RuleError", "SlackNotifier",
           "WebhookNotifier", "build_notifiers", "load_rules", "redact_url", "to_prometheus"]


def build_notifiers(section: Any) -> list[Notifier]:
    """The notifiers an agent config's [alerts] section asks for."""
    out: list[Notifier] = []
    if section.log:
        out.append(LogNotifier())
    out.extend(WebhookNotifier(u, section.webhook_headers or None) for u in section.webhook_urls)
    out.extend(SlackNotifier(u) for u in section.slack_urls)
    out.extend(AlertmanagerNotifier(u) for u in section.alertmanager_urls)
    return out


def describe_notifiers(notifiers: Sequence[Notifier]) -> str:
    """'log, alertmanager http://am:9093/api/***' with every URL redacted, for the log."""
    parts = []
    for n in notifiers:
        url = getattr(n, "url", None)
        parts.append(n.name + (f" {redact_url(url)}" if url else ""))
    return ", ".join(parts) or "none"
