"""Notifiers against real HTTP servers on loopback (aiohttp, started here): the payloads, credentials,
retries with back-off, and that a slow or dead receiver never blocks or raises."""

from __future__ import annotations

import base64
import logging
import time

from servers import WebhookReceiver, free_port

from gpuscope.alerts import (
    AlertmanagerNotifier,
    Dispatcher,
    LogNotifier,
    Notification,
    SlackNotifier,
    WebhookNotifier,
    redact_url,
)


def note(status: str = "firing", gpu: str = "0", t: float = 1_800_000_000.0) -> Notification:
    labels = {"alertname": "GpuHot", "severity": "warning", "gpu": gpu, "hostname": "n1"}
    return Notification(status, f"fp{gpu}", labels, {"summary": f"GPU {gpu} at 90 C", "recommendation": "cool it"},
                        t, t + 60 if status == "resolved" else None, 90.0, "http://n1:9471/api/v1/alerts")


def test_webhook_posts_alertmanager_webhook_json_with_headers():
    with WebhookReceiver() as rx:
        d = Dispatcher([WebhookNotifier(rx.url + "/hook", headers={"X-Token": "abc"})])
        d.submit([note("firing", "0"), note("resolved", "1")])
        assert d.flush(10)
        d.stop()
        [(path, headers, body)] = rx.received
    assert path == "/hook" and headers["X-Token"] == "abc" and headers["Content-Type"] == "application/json"
    assert body["version"] == "4" and body["status"] == "firing"
    assert body["commonLabels"] == {"alertname": "GpuHot", "severity": "warning", "hostname": "n1"}
    a0, a1 = body["alerts"]
    assert (a0["status"], a0["labels"]["gpu"], a0["endsAt"]) == ("firing", "0", "0001-01-01T00:00:00Z")
    assert (a1["status"], a1["startsAt"], a1["endsAt"]) == ("resolved", "2027-01-15T08:00:00.000Z",
                                                            "2027-01-15T08:01:00.000Z")
    assert a0["generatorURL"] == "http://n1:9471/api/v1/alerts" and a0["annotations"]["summary"] == "GPU 0 at 90 C"


def test_slack_payload_has_text_and_blocks():
    with WebhookReceiver() as rx:
        d = Dispatcher([SlackNotifier(rx.url + "/services/T0/B0/XYZ")])
        d.submit([note("firing"), note("resolved", "1")])
        assert d.flush(10)
        d.stop()
        [body] = rx.bodies()
    assert body["text"].startswith(":red_circle: *FIRING* `GpuHot` (warning, hostname n1, gpu 0)")
    assert "GPU 0 at 90 C" in body["text"] and "> cool it" in body["text"] and ":large_green_circle: *RESOLVED*" in body["text"]
    assert [b["type"] for b in body["blocks"]] == ["section", "section"]
    assert body["blocks"][1]["text"]["type"] == "mrkdwn" and "RESOLVED" in body["blocks"][1]["text"]["text"]


def test_alertmanager_payload_resolved_ends_in_the_past_firing_in_the_future():
    am = AlertmanagerNotifier("http://am:9093/", resend_interval=60.0)
    assert am.url == "http://am:9093/api/v2/alerts"
    firing, resolved = am.payload([note("firing"), note("resolved")], now=1_800_000_100.0)
    assert firing["endsAt"] == "2027-01-15T08:05:40.000Z"  # now + 4 resend intervals
    assert resolved["endsAt"] == "2027-01-15T08:01:00.000Z" and set(firing) == {
        "labels", "annotations", "startsAt", "endsAt", "generatorURL"}


def test_credentials_in_the_url_become_basic_auth_and_never_reach_the_log(caplog):
    with WebhookReceiver(fail_first=1) as rx:
        url = rx.url.replace("http://", "http://alice:s3cret@") + "/hook?token=abc"
        d = Dispatcher([WebhookNotifier(url)], backoff=(0.05, 0.1))
        with caplog.at_level(logging.INFO, logger="gpuscope.alerts"):
            d.submit([note()])
            assert d.flush(10)
        d.stop()
        [(_, headers, _)] = rx.received
    assert headers["Authorization"] == "Basic " + base64.b64encode(b"alice:s3cret").decode()
    assert "answered 500" in caplog.text and "s3cret" not in caplog.text and "token=abc" not in caplog.text
    assert redact_url(url) in caplog.text


def test_failures_are_retried_with_back_off_and_delivered_once():
    with WebhookReceiver(fail_first=3) as rx:
        d = Dispatcher([WebhookNotifier(rx.url)], backoff=(0.05, 0.2))
        t0 = time.monotonic()
        d.submit([note()])
        rx.wait_for(lambda b: len(b) == 1)
        elapsed = time.monotonic() - t0
        assert d.flush(5)
        st = d.stats()["webhook"]
        d.stop()
        assert rx.attempts == 4 and len(rx.received) == 1
    assert st["failures"] == 3 and st["sent"] == 1 and st["last_error"] == ""
    assert elapsed >= 0.8 * (0.05 + 0.1 + 0.2)  # three growing waits (with up to 20 % jitter below)


def test_a_slow_or_dead_receiver_never_blocks_or_raises():
    # The slow receiver answers after 30 s: a submit or a stop that waited on it would take that long, so the
    # bounds below hold on any machine that is not 30 s behind.
    with WebhookReceiver(delay=30.0) as slow:
        dead = f"http://127.0.0.1:{free_port()}/hook"
        d = Dispatcher([WebhookNotifier(slow.url), WebhookNotifier(dead), LogNotifier()], backoff=(0.05, 0.1))
        t0 = time.monotonic()
        for i in range(10):
            d.submit([note(gpu=str(i))])
        assert time.monotonic() - t0 < slow.delay / 2  # submit only queues
        deadline = time.monotonic() + slow.delay / 2
        while time.monotonic() < deadline:
            st = d.stats()
            if st["webhook-2"]["failures"] >= 2 and st["log"]["sent"] == 10:
                break
            time.sleep(0.02)
        assert st["webhook"]["sent"] == 0  # still waiting on its first answer
        assert st["webhook-2"]["failures"] >= 2 and "cannot be reached" in st["webhook-2"]["last_error"]
        assert st["log"]["sent"] == 10  # the others went on meanwhile
        t1 = time.monotonic()
        d.stop(timeout=1.0)
        assert time.monotonic() - t1 < slow.delay / 2  # gives up on the slow receiver at its timeout


def test_a_long_outage_keeps_a_bounded_queue():
    d = Dispatcher([WebhookNotifier(f"http://127.0.0.1:{free_port()}/hook")], backoff=(5.0, 5.0), queue_size=3)
    for i in range(10):
        d.submit([note(gpu=str(i))])
    st = d.stats()["webhook"]
    d.stop()
    assert st["queued"] <= 3 and st["dropped"] >= 6  # the oldest made room; the first is in flight


def test_a_notifier_that_raises_anything_is_contained(caplog):
    class Broken:
        name = "broken"

        def send(self, notes):
            raise KeyError("bug")

    d = Dispatcher([Broken()], backoff=(0.01, 0.02), give_up_after=0.1)
    with caplog.at_level(logging.WARNING, logger="gpuscope.alerts"):
        d.submit([note()])
        time.sleep(0.4)
    d.stop()
    st = d.stats()["broken"]
    assert st["failures"] >= 2 and st["dropped"] == 1 and "KeyError" in st["last_error"]
    assert "gave up on 1 notification" in caplog.text


def test_alertmanager_gets_every_firing_alert_again_each_resend_interval():
    with WebhookReceiver() as rx:
        d = Dispatcher([AlertmanagerNotifier(rx.url, resend_interval=60.0), WebhookNotifier(rx.url + "/hook")])
        firing = [note("firing", "0"), note("firing", "1")]
        d.submit([firing[0]], firing, now=0.0)  # a transition plus the other firing alert
        d.submit([], firing, now=10.0)  # nothing new, not yet time to resend
        d.submit([], firing, now=61.0)  # resend
        assert d.flush(10)
        d.stop()
        am = rx.bodies("/api/v2/alerts")
        hook = rx.bodies("/hook")
    assert [[a["labels"]["gpu"] for a in b] for b in am] == [["0", "1"], ["0", "1"]]
    assert [[a["labels"]["gpu"] for a in b["alerts"]] for b in hook] == [["0"]]  # transitions only


def test_log_notifier(caplog):
    with caplog.at_level(logging.INFO, logger="gpuscope.alerts"):
        LogNotifier().send([note("firing"), note("resolved", "1")])
    assert "alert firing GpuHot (warning) gpu=0 hostname=n1: GPU 0 at 90 C" in caplog.text
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]


def test_redact_url():
    assert redact_url("https://hooks.slack.com/services/T0/B0/XYZ") == "https://hooks.slack.com/services/***"
    assert redact_url("http://u:p@am:9093") == "http://u:***@am:9093"
    assert redact_url("http://am:9093/api/v2/alerts?x=1") == "http://am:9093/api/***?x=***"
