"""POST /api/v1/events on a real agent process: accepted events come back from GET /api/v1/events, and every bad
request is a 4xx with one sentence."""

from __future__ import annotations

import json
import re
import time

import pytest
from test_agent import AgentProc, http

from gpuscope.agent.events_api import MAX_EVENTS, RateLimiter, parse_events


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = AgentProc(tmp_path_factory.mktemp("agent"), "--simulate", "healthy", "--gpus", "1")
    a.wait_ready()
    yield a
    a.stop()


def event(**over: object) -> dict:
    ev: dict = {"kind": "guard", "type": "breaker_open", "severity": "critical", "message": "upstream circuit opened",
                "source": "test-guard", "labels": {"from": "closed", "to": "open"}}
    ev.update(over)
    return {k: v for k, v in ev.items() if v is not None}


def post(agent: AgentProc, body: object, token: str | None = "", raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    code, out = http(agent.port, "/api/v1/events", agent.token() if token == "" else token, "POST", data)
    return code, json.loads(out)


def guard_events(agent: AgentProc, wanted: int, message: str) -> list[dict]:
    """The agent's guard events with this message, once `wanted` of them are stored (the sampler's next tick and
    the store's next flush, about a second)."""
    deadline = time.monotonic() + 30
    while True:
        code, body = http(agent.port, "/api/v1/events?kind=guard&start=-1h")
        assert code == 200
        found = [e for e in json.loads(body)["events"] if e["message"] == message]
        if len(found) >= wanted or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_posted_events_are_stored_with_their_kind_and_fields(agent):
    t = time.time() - 5
    code, body = post(agent, event(message="one event", time=t, source="src-a"))
    assert (code, body) == (202, {"accepted": 1})
    code, body = post(agent, [event(message="two events", source="src-a", type="shed_started", severity="warning",
                                    labels={"class": "batch"}) for _ in range(2)])
    assert (code, body) == (202, {"accepted": 2})
    (one,) = guard_events(agent, 1, "one event")
    assert one["kind"] == "guard" and one["gpu"] is None
    assert one["time_ns"] == int(t * 1e9)
    assert one["data"] == {"type": "breaker_open", "severity": "critical", "source": "src-a",
                           "labels": {"from": "closed", "to": "open"}}
    two = guard_events(agent, 2, "two events")
    assert len(two) == 2 and all(e["data"]["labels"] == {"class": "batch"} for e in two)
    # without a time the agent stamps it now
    assert all(abs(e["time_ns"] / 1e9 - time.time()) < 120 for e in two)
    # the agent's own kinds are not mixed in, and GET with kind=xid does not return guard events
    code, body = http(agent.port, "/api/v1/events?kind=xid&start=-1h")
    assert code == 200 and not [e for e in json.loads(body)["events"] if e["kind"] == "guard"]
    # the dashboard's timeline marks them too (no GPU: on every GPU's chart)
    code, body = http(agent.port, "/ui/api/timeline?start=-1h&end=now")
    marks = [e for e in json.loads(body)["events"] if e["kind"] == "guard"]
    assert code == 200 and {"one event", "two events"} <= {e["message"] for e in marks}
    assert all(e["gpu_key"] is None for e in marks)


@pytest.mark.parametrize("token, status, needle", [
    (None, 401, "needs the token"),
    ("wrong-token", 401, "needs the token"),
])
def test_posting_needs_the_token(agent, token, status, needle):
    code, body = post(agent, event(), token=token)
    assert code == status and needle in body["error"]


LONG = "x" * 501


@pytest.mark.parametrize("body, needle", [
    ("not a list", "one event (a JSON object) or a list"),
    ([], "empty"),
    ([event(), 3], "events[1] must be a JSON object"),
    (event(kind="xid"), "kind must be 'guard'"),
    (event(kind=None), "kind must be 'guard'"),
    (event(type=""), "type must be a non-empty string"),
    (event(type="has space"), "type must be a name"),
    (event(type="t" * 65), "type is 65 characters long"),
    (event(severity="fatal"), "severity must be one of info, warning, critical"),
    (event(severity=None), "severity must be one of"),
    (event(message=LONG), "message is 501 characters long; at most 500"),
    (event(message=7), "message must be a non-empty string"),
    (event(source=None), "source must be a non-empty string"),
    (event(source="a\nb"), "source must not contain control characters"),
    (event(labels=["a"]), "labels must be an object of strings"),
    (event(labels={f"k{i}": "v" for i in range(17)}), "labels has 17 entries; at most 16"),
    (event(labels={"bad key": "v"}), "labels has the key 'bad key'"),
    (event(labels={"k": 1}), "labels.k must be a string"),
    (event(time="now"), "time must be a number of unix seconds"),
    (event(time=True), "time must be a number of unix seconds"),
    (event(time=time.time() + 3600), "s in the future; at most 300 s"),
    (event(time=time.time() * 1000), "in the future"),
    (event(time=1.0), "more than a day in the past"),
    (event(colour="red"), "colour is not an event field"),
    ([event(), event(severity="loud")], "events[1].severity must be one of"),
    ([event()] * (MAX_EVENTS + 1), f"{MAX_EVENTS + 1} events in one request is too many (at most {MAX_EVENTS})"),
])
def test_each_bad_field_is_a_400_naming_it(agent, body, needle):
    code, out = post(agent, body)
    assert code == 400, out
    assert needle in out["error"]
    assert not re.search(r"[.?!]\s+[A-Z]", out["error"]) and out["error"].endswith((".", ")", "?"))  # one sentence


def test_bad_json_and_too_big_bodies(agent):
    code, out = post(agent, None, raw=b"{not json")
    assert code == 400 and out["error"] == "The body is not valid JSON."
    code, out = post(agent, None, raw=b"\xff\xfe")
    assert code == 400 and out["error"] == "The body is not valid JSON."
    code, out = post(agent, None, raw=json.dumps([event(message="m" * 400)] * 100).encode() + b" " * 30_000)
    assert code == 413 and "at most 65536" in out["error"]


def test_a_flood_from_one_source_gets_429_and_other_sources_still_post(agent):
    batch = [event(source="flooder", message="flood")] * MAX_EVENTS
    codes = []
    for _ in range(4):
        code, out = post(agent, batch)
        codes.append(code)
        if code == 429:
            assert "Too many events from flooder" in out["error"]
            break
    assert codes[0] == 202 and codes[-1] == 429
    code, _ = post(agent, event(source="someone-else", message="still heard"))
    assert code == 202
    # the agent keeps serving
    assert http(agent.port, "/api/v1/status")[0] == 200


def test_rate_limiter_refills_and_is_all_or_nothing():
    now = [0.0]
    rl = RateLimiter(per_source=20, total=200, burst=100, clock=lambda: now[0])
    assert rl.take({"a": 100}) == 0.0
    assert rl.take({"a": 1}) == pytest.approx(1 / 20)
    assert rl.take({"b": 100, "a": 10}) == pytest.approx(10 / 20)  # refused whole: b's tokens untouched
    assert rl.take({"b": 100}) == 0.0
    now[0] = 1.0  # 20 tokens back for a
    assert rl.take({"a": 20}) == 0.0
    assert rl.take({"a": 1}) > 0


def test_parse_events_stamps_now_and_keeps_labels():
    (e,) = parse_events(event(labels=None), now_s=1000.0)
    assert e.time_ns == 1000 * 10**9 and e.kind == "guard" and e.data["labels"] == {}
