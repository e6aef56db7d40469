"""Where alerts go: the log, a generic JSON webhook, a Slack-compatible webhook, Alertmanager's API v2.

A notifier is one object with `name` and `send(notes)` (raise NotifyError on failure). The
Dispatcher gives each notifier its own thread and queue, retries failures with exponential back-off
and never blocks or raises into its caller: a dead webhook delays nothing else.

    d = Dispatcher([LogNotifier(), AlertmanagerNotifier("http://alertmanager:9093")])
    d.submit(engine.evaluate(history))

URLs are shown redacted everywhere (credentials, query values and all but the first path segment:
a Slack webhook's secret is in its path).
"""

from __future__ import annotations

import base64
import json
import logging
import queue
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, Protocol

from .._redact import redact_url
from .engine import Notification

log = logging.getLogger("gpuscope.alerts")

__all__ = ["AlertmanagerNotifier", "Dispatcher", "LogNotifier", "Notifier", "NotifyError", "SlackNotifier",
           "WebhookNotifier", "redact_url"]


class NotifyError(RuntimeError):
    """A notification could not be delivered; the message names the (redacted) URL and why."""


class Notifier(Protocol):
    name: str

    def send(self, notes: Sequence[Notification]) -> None:
        """Deliver the notifications or raise NotifyError (the dispatcher retries)."""


def iso(t: float) -> str:
    """RFC 3339 in UTC with milliseconds, as Alertmanager writes it."""
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def post_json(url: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 10.0) -> bytes:
    """POST `body` as JSON; credentials in the URL become a Basic Authorization header."""
    shown = redact_url(url)
    p = urllib.parse.urlsplit(url)
    hdrs = {"Content-Type": "application/json", "User-Agent": "gpuscope-alerts"}
    if p.username is not None:
        cred = f"{urllib.parse.unquote(p.username)}:{urllib.parse.unquote(p.password or '')}"
        hdrs["Authorization"] = "Basic " + base64.b64encode(cred.encode()).decode()
        netloc = p.hostname or ""
        if ":" in netloc:
            netloc = f"[{netloc}]"
        url = urllib.parse.urlunsplit((p.scheme, netloc + (f":{p.port}" if p.port else ""), p.path, p.query, ""))
    hdrs.update(headers or {})
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=hdrs, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:200].decode(errors="replace").strip()
        raise NotifyError(f"{shown} answered {e.code}" + (f": {detail}" if detail else "")) from None
    except urllib.error.URLError as e:
        raise NotifyError(f"{shown} cannot be reached: {e.reason}") from None
    except (TimeoutError, OSError) as e:
        raise NotifyError(f"{shown} did not answer: {e}") from None


def _summary(n: Notification) -> str:
    return n.annotations.get("summary") or n.labels.get("alertname", "alert")


class LogNotifier:
    """One log line per notification (logger gpuscope.alerts): WARNING when firing, INFO when resolved."""

    name = "log"

    def send(self, notes: Sequence[Notification]) -> None:
        for n in notes:
            where = " ".join(f"{k}={n.labels[k]}" for k in ("gpu", "hostname") if n.labels.get(k))
            log.log(logging.WARNING if n.status == "firing" else logging.INFO, "alert %s%s %s (%s) %s: %s",
                    n.status, " (repeat)" if n.repeat else "", n.labels.get("alertname"), n.labels.get("severity"),
                    where, _summary(n), extra={"f_event": "alert", "f_status": n.status,
                                               "f_alertname": n.labels.get("alertname"), "f_labels": n.labels})


def _alert_json(n: Notification) -> dict[str, Any]:
    """The alert as Alertmanager's webhook receiver writes it (so receivers built for it work)."""
    return {"status": n.status, "labels": n.labels, "annotations": n.annotations, "startsAt": iso(n.starts_at),
            "endsAt": iso(n.ends_at) if n.ends_at is not None else "0001-01-01T00:00:00Z",
            "generatorURL": n.generator_url, "fingerprint": n.fingerprint, "value": n.value}


class WebhookNotifier:
    """POSTs Alertmanager's webhook JSON (version 4): status, alerts, commonLabels, externalURL."""

    name = "webhook"

    def __init__(self, url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> None:
        self.url, self.headers, self.timeout = url, dict(headers or {}), timeout

    def payload(self, notes: Sequence[Notification]) -> dict[str, Any]:
        common = dict(notes[0].labels) if notes else {}
        for n in notes[1:]:
            common = {k: v for k, v in common.items() if n.labels.get(k) == v}
        return {"version": "4", "receiver": "gpuscope", "status": "firing" if any(
                    n.status == "firing" for n in notes) else "resolved",
                "alerts": [_alert_json(n) for n in notes], "groupLabels": {}, "commonLabels": common,
                "commonAnnotations": {}, "externalURL": notes[0].generator_url if notes else "",
                "groupKey": "gpuscope", "truncatedAlerts": 0}

    def send(self, notes: Sequence[Notification]) -> None:
        post_json(self.url, self.payload(notes), self.headers, self.timeout)


class SlackNotifier:
    """A Slack incoming webhook (Mattermost and Rocket.Chat accept the same): `text` for clients
    that show only that, and one `blocks` section per alert."""

    name = "slack"
    MAX_BLOCKS = 20

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url, self.timeout = url, timeout

    @staticmethod
    def line(n: Notification) -> str:
        icon = ":red_circle:" if n.status == "firing" else ":large_green_circle:"
        sev = n.labels.get("severity", "")
        where = ", ".join(f"{k} {n.labels[k]}" for k in ("hostname", "gpu") if n.labels.get(k))
        text = f"{icon} *{n.status.upper()}*{' (repeat)' if n.repeat else ''} `{n.labels.get('alertname')}` " \
               f"({sev}{', ' + where if where else ''})\n{_summary(n)}"
        if n.status == "firing" and n.annotations.get("recommendation"):
            text += f"\n> {n.annotations['recommendation']}"
        return text

    def payload(self, notes: Sequence[Notification]) -> dict[str, Any]:
        lines = [self.line(n) for n in notes]
        blocks: list[dict[str, Any]] = [{"type": "section", "text": {"type": "mrkdwn", "text": t[:2900]}}
                                        for t in lines[: self.MAX_BLOCKS]]
        if len(lines) > self.MAX_BLOCKS:
            blocks.append({"type": "context", "elements": [
                {"type": "mrkdwn", "text": f"and {len(lines) - self.MAX_BLOCKS} more alert(s)"}]})
        return {"text": "\n".join(lines)[:3900], "blocks": blocks}

    def send(self, notes: Sequence[Notification]) -> None:
        post_json(self.url, self.payload(notes), None, self.timeout)


class AlertmanagerNotifier:
    """Alertmanager's API v2: POST /api/v2/alerts. Firing alerts carry endsAt a few resend intervals
    ahead and are sent again every `resend_interval` (as Prometheus does), so Alertmanager resolves
    them by itself if this agent dies; a resolved alert is sent once with endsAt in the past."""

    name = "alertmanager"

    def __init__(self, url: str, timeout: float = 10.0, resend_interval: float = 60.0,
                 headers: dict[str, str] | None = None) -> None:
        base = url.rstrip("/")
        self.url = base if base.endswith("/api/v2/alerts") else base + "/api/v2/alerts"
        self.timeout, self.resend_interval, self.headers = timeout, resend_interval, dict(headers or {})

    def payload(self, notes: Sequence[Notification], now: float | None = None) -> list[dict[str, Any]]:
        now = time.time() if now is None else now
        out = []
        for n in notes:
            ends = n.ends_at if n.ends_at is not None else now + 4 * self.resend_interval
            out.append({"labels": n.labels, "annotations": n.annotations, "startsAt": iso(n.starts_at),
                        "endsAt": iso(ends), "generatorURL": n.generator_url})
        return out

    def send(self, notes: Sequence[Notification]) -> None:
        post_json(self.url, self.payload(notes), self.headers, self.timeout)


class _Worker:
    def __init__(self, notifier: Notifier, maxsize: int, backoff: tuple[float, float], give_up_after: float) -> None:
        self.notifier = notifier
        self.q: queue.Queue[list[Notification]] = queue.Queue(maxsize)
        self.backoff, self.give_up_after = backoff, give_up_after
        self.sent = self.failures = self.dropped = 0
        self.last_error = ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"alerts-{notifier.name}", daemon=True)
        self.thread.start()

    def put(self, batch: list[Notification]) -> None:
        while True:
            try:
                self.q.put_nowait(batch)
                return
            except queue.Full:
                try:
                    self.q.get_nowait()  # the oldest batch makes room: a long outage must not grow memory
                    self.dropped += 1
                except queue.Empty:
                    pass

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                batch = self.q.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._deliver(batch)
            finally:
                self.q.task_done()

    def _deliver(self, batch: list[Notification]) -> None:
        delay, first = self.backoff[0], time.monotonic()
        while True:
            try:
                self.notifier.send(batch)
            except Exception as e:  # noqa: BLE001 - a notifier never raises into the agent
                self.failures += 1
                msg = str(e) if isinstance(e, NotifyError) else f"{type(e).__name__}: {e}"
                if msg != self.last_error:
                    log.warning("alert notifier %s failed: %s; retrying with back-off", self.notifier.name, msg)
                self.last_error = msg
                if time.monotonic() - first + delay > self.give_up_after:
                    log.error("alert notifier %s gave up on %d notification(s) after %.0f s: %s",
                              self.notifier.name, len(batch), time.monotonic() - first, msg)
                    self.dropped += 1
                    return
                if self.stop.wait(delay * (0.8 + 0.4 * random.random())):
                    return
                delay = min(delay * 2, self.backoff[1])
                continue
            self.sent += len(batch)
            if self.last_error:
                log.info("alert notifier %s delivers again", self.notifier.name)
                self.last_error = ""
            return


class Dispatcher:
    """Each notifier on its own thread with a bounded queue; `submit` never blocks and never raises."""

    def __init__(self, notifiers: Sequence[Notifier], *, backoff: tuple[float, float] = (1.0, 60.0),
                 give_up_after: float = 3600.0, queue_size: int = 1000) -> None:
        self.workers = [_Worker(n, queue_size, backoff, give_up_after) for n in notifiers]
        self._last_resend: dict[int, float] = {}

    @property
    def notifiers(self) -> list[Notifier]:
        return [w.notifier for w in self.workers]

    def submit(self, notes: Sequence[Notification], firing: Sequence[Notification] = (),
               now: float | None = None) -> None:
        """Queue `notes` for every notifier; notifiers with a `resend_interval` (Alertmanager) also get
        every `firing` alert when their interval has passed."""
        now = time.monotonic() if now is None else now
        for i, w in enumerate(self.workers):
            try:
                batch = list(notes)
                every = getattr(w.notifier, "resend_interval", None)
                if every and firing and now - self._last_resend.get(i, -1e18) >= every:
                    have = {n.fingerprint for n in batch}
                    batch.extend(n for n in firing if n.fingerprint not in have)
                    self._last_resend[i] = now
                if batch:
                    w.put(batch)
            except Exception:  # noqa: BLE001
                log.exception("queueing alerts for %s failed", w.notifier.name)

    def stats(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for w in self.workers:
            key, k = w.notifier.name, 2
            while key in out:
                key, k = f"{w.notifier.name}-{k}", k + 1
            out[key] = {"sent": w.sent, "failures": w.failures, "dropped": w.dropped,
                        "queued": w.q.qsize(), "last_error": w.last_error}
        return out

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queue is empty and nothing is in flight (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(w.q.unfinished_tasks == 0 for w in self.workers):
                return True
            time.sleep(0.02)
        return False

    def stop(self, timeout: float = 2.0) -> None:
        for w in self.workers:
            w.stop.set()
        for w in self.workers:
            w.thread.join(timeout)
