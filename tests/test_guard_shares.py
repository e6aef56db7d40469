"""The classes' guaranteed shares never take admitted concurrency past the limit: the rounding of shares into
reserved slots (a property test against its stated bounds), `guard check` on shares over 100 %, and the real
proxy on loopback in front of an upstream that holds every request until the test lets it answer, so that
what is asserted is what the guard and the upstream recorded (their high-water marks, the order in which
the upstream received the queued requests), never how long anything took."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from test_guard_proxy_http11 import BOUND_S, OK, Scripted, _metric, _proxy

from gpuscope.cli import main
from gpuscope.guard import GpuSignal
from gpuscope.guard._shares import reserved_slots


# ---- the rounding ------------------------------------------------------------------------------------------
@st.composite
def _shares(draw: Any) -> list[float]:
    raw = draw(st.lists(st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0]),
                        min_size=1, max_size=5))
    total = sum(raw)
    return [s / total for s in raw] if total > 1 else raw  # shares sum to at most 1, as the config requires


@settings(max_examples=500, deadline=None)
@given(shares=_shares(), limit=st.one_of(st.integers(1, 300).map(float), st.floats(1.0, 300.0)))
def test_reserved_slots_never_add_up_past_the_limit_and_give_each_share_a_slot_when_they_can(shares, limit):
    r = reserved_slots(shares, limit)
    slots = math.floor(limit + 1e-9)
    assert len(r) == len(shares) and all(x >= 0 for x in r)
    assert sum(r) <= slots <= limit + 1e-9
    with_share = [i for i, s in enumerate(shares) if s > 0]
    if slots >= len(with_share):
        assert all(r[i] >= 1 for i in with_share)
    else:  # fewer slots than classes with a share: every slot reserved, one class each
        assert sum(r) == slots and max(r) <= 1
    assert all(r[i] == 0 for i, s in enumerate(shares) if s == 0)
    if all(s * limit >= 1 for s in shares if s > 0):  # no class needed its one slot made up: proportional
        assert all(math.floor(s * limit + 1e-9) <= x <= math.ceil(s * limit - 1e-9) for s, x in zip(shares, r, strict=True))


def test_shares_over_100_percent_are_one_sentence_from_guard_check(tmp_path, capsys):
    p = tmp_path / "guard.yaml"
    p.write_text("classes:\n  - {name: a, share: 0.7}\n  - {name: b, share: 0.2}\n  - {name: c, share: 0.15}\n")
    assert main(["guard", "check", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "add up to 1.05; they must not exceed 1" in err and len(err.splitlines()) == 1 and "Traceback" not in err
    p.write_text("classes:\n  - {name: a, share: 0.7}\n  - {name: b, share: 0.2}\n  - {name: c, share: 0.1}\n")
    assert main(["guard", "check", str(p)]) == 0  # 1.0 in floating point is 0.9999999999999999: not over


# ---- the real proxy ------------------------------------------------------------------------------------------
class Held:
    """An upstream (tests' Scripted) that answers each request only when the test calls `answer(path)`; it
    records the paths in the order it received them and the most it held at once."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.holding = 0
        self.max_holding = 0
        self.gates: dict[str, asyncio.Event] = {}
        self.up = Scripted(self._script)

    async def _script(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            head = await self.up.read_request(r)
            path = head.split(b" ", 2)[1].decode()
            self.order.append(path)
            self.holding += 1
            self.max_holding = max(self.max_holding, self.holding)
            try:
                await self.gates.setdefault(path, asyncio.Event()).wait()
            finally:
                self.holding -= 1
            w.write(OK)
            await w.drain()

    def answer(self, path: str) -> None:
        self.gates.setdefault(path, asyncio.Event()).set()

    async def until_received(self, n: int) -> None:
        await _until(lambda: len(self.order) >= n)


async def _until(cond, bound_s: float = BOUND_S) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + bound_s
    while not cond():
        assert loop.time() < end, "the proxy never got there"
        await asyncio.sleep(0.01)


async def _request(port: int, path: str, klass: str) -> int:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(f"GET {path} HTTP/1.1\r\nHost: proxy\r\nx-priority: {klass}\r\nConnection: close\r\n\r\n".encode())
        await w.drain()
        got = await asyncio.wait_for(r.read(), BOUND_S)
        return int(got.split(b" ", 2)[1])
    finally:
        w.close()


TWO = {"classes": [{"name": "high", "share": 0.5, "queue_timeout_s": 30}, {"name": "low", "share": 0.5,
                                                                            "queue_timeout_s": 30}],
       "classify": {"header": "x-priority", "default": "low"},
       "controller": {"mode": "fixed", "min_limit": 1, "initial_limit": 4, "max_limit": 4},
       "breaker": {"min_requests": 1000, "timeout_s": 30}}


def test_a_class_under_its_share_waits_for_a_freed_slot_instead_of_going_over_the_limit():
    """Limit 4, shares 0.5 / 0.5 (2 reserved slots each). Low takes all 4 (borrowing high's); then 3 high and 2 low
    arrive. Before, high ran at once under its share, 6 in flight; now they wait, and each freed slot goes to a
    waiting class under its reserved slots first: high, high (up to its 2), then low (back under its 2), low,
    then high again."""
    held = Held()

    async def scenario() -> dict:
        async with held.up, _proxy(held.up.url, TWO) as (px, guard):
            first = [asyncio.ensure_future(_request(px.port, f"/low{i}", "low")) for i in range(4)]
            await held.until_received(4)
            late = [asyncio.ensure_future(_request(px.port, f"/high{i}", "high")) for i in range(3)]
            await _until(lambda: guard.queued_total == 3)
            late += [asyncio.ensure_future(_request(px.port, f"/low{i}", "low")) for i in range(4, 6)]
            await _until(lambda: guard.queued_total == 5)
            queued_with = (guard.inflight_total, len(held.order))
            for path, n in (("/low0", 5), ("/low1", 6), ("/low2", 7), ("/low3", 8), ("/high0", 9)):
                held.answer(path)
                await held.until_received(n)
            for p in list(held.order):
                held.answer(p)
            statuses = await asyncio.gather(*first, *late)
            return {"queued_with": queued_with, "order": held.order[4:], "statuses": statuses,
                    "peak": guard.inflight_total_peak, "class_peaks": list(guard.inflight_peak),
                    "upstream_max": held.max_holding, "reserved": list(guard.reserved()),
                    "shown": _metric(px, "gpuscope_guard_inflight_all_max"),
                    "shown_reserved": _metric(px, "gpuscope_guard_reserved_slots", **{"class": "high"})}

    out = asyncio.run(scenario())
    assert out["queued_with"] == (4, 4)  # all five waited: the limit was full, whatever their shares
    assert out["order"] == ["/high0", "/high1", "/low4", "/low5", "/high2"]
    assert out["statuses"] == [200] * 9
    assert out["peak"] == 4 and out["upstream_max"] == 4 and out["shown"] == 4  # never over the limit
    assert out["class_peaks"] == [2, 4]  # low borrowed high's slots while high had no traffic
    assert out["reserved"] == [2, 2] and out["shown_reserved"] == 2


def test_when_the_limit_falls_the_reserved_slots_fall_with_it_and_the_total_stays_under_it():
    """Three classes (shares 0.5, 0.3, 0.2) and an AIMD limit of 10 that a GPU signal (memory nearly full) backs
    off to its minimum of 2 before traffic comes. share x limit is then 1, 0.6 and 0.4: before, each class
    counted as under its share with one slot, so one request of each ran: 3 in flight at a limit of 2. Now
    the reserved slots are 1, 1 and 0, and the third request waits for a freed slot."""
    cfg = {"classes": [{"name": "high", "share": 0.5, "queue_timeout_s": 30},
                       {"name": "mid", "share": 0.3, "queue_timeout_s": 30},
                       {"name": "low", "share": 0.2, "queue_timeout_s": 30}],
           "classify": {"header": "x-priority", "default": "low"},
           "controller": {"mode": "aimd", "min_limit": 2, "initial_limit": 10, "max_limit": 10},
           "signals": {"interval_s": 600, "backoff_ratio": 0.5},  # the reading stays fresh: no growth meanwhile
           "breaker": {"min_requests": 1000, "timeout_s": 30}}
    held = Held()

    async def scenario() -> dict:
        async with held.up, _proxy(held.up.url, cfg) as (px, guard):
            reserved_before = list(guard.reserved())
            for _ in range(4):
                guard.observe_gpu(GpuSignal(time_s=guard.now(), memory_free_ratio=0.01))
            limit = guard.limiter.limit
            reqs = [asyncio.ensure_future(_request(px.port, f"/{k}", k)) for k in ("low", "mid", "high")]
            await held.until_received(2)
            await _until(lambda: guard.queued_total == 1)
            mid_state = (guard.inflight_total, sorted(held.order))
            held.answer(held.order[0])
            await held.until_received(3)
            for p in list(held.order):
                held.answer(p)
            statuses = await asyncio.gather(*reqs)
            return {"before": reserved_before, "limit": limit, "reserved": list(guard.reserved()),
                    "mid": mid_state, "statuses": statuses, "peak": guard.inflight_total_peak,
                    "upstream_max": held.max_holding, "final_limit": guard.limiter.limit}

    out = asyncio.run(scenario())
    assert out["before"] == [5, 3, 2] and out["limit"] == 2.0
    assert out["reserved"] == [1, 1, 0] and sum(out["reserved"]) <= out["final_limit"]
    assert out["mid"][0] == 2 and len(out["mid"][1]) == 2  # two ran, the third waited
    assert out["statuses"] == [200, 200, 200]
    assert out["peak"] == 2 and out["upstream_max"] == 2
