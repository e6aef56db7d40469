"""NVML event sets: XID and ECC events are pushed by a thread, counted per code, and drained by the
sampler at each tick. Repeats count again; nothing is sticky."""

import threading
import time

import pynvml
import pytest

from gpuscope.sources.events import EventSource
from gpuscope.testing import healthy_gpus

XID = pynvml.nvmlEventTypeXidCriticalError
SBE = pynvml.nvmlEventTypeSingleBitEccError
DBE = pynvml.nvmlEventTypeDoubleBitEccError


def xid_key(code):
    return f'gpu_xid_events_total{{xid="{code}"}}'


@pytest.fixture
def rig(open_devices):
    """An EventSource on two fake GPUs, with a short wait so that stop() is quick."""
    fake = healthy_gpus(2)
    nv, devs = open_devices(fake)
    src = EventSource(nv, devs, wait_ms=20)
    src.start()
    yield fake, src, devs
    src.stop()


def drain_until(src, devs, pred, timeout=2.0):
    """Drain repeatedly (as the sampler's ticks do) until pred(all events so far) holds."""
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        src.drain(devs, got)
        if pred(got):
            return got
        time.sleep(0.005)
    return got


def n_xid(events, code):
    return sum(e.count for e in events if e.kind == "xid" and e.data.get("xid") == code)


def test_xid_events_are_counted_per_code(rig):
    fake, src, devs = rig
    fake.inject_event(fake.gpus[0], XID, 79)
    fake.inject_event(fake.gpus[0], XID, 13)
    fake.inject_event(fake.gpus[0], XID, 13)
    events = drain_until(src, devs, lambda ev: n_xid(ev, 13) == 2 and n_xid(ev, 79) == 1)
    assert {e.kind for e in events} == {"xid"}
    assert all(e.gpu == "0" for e in events)
    assert n_xid(events, 79) == 1 and n_xid(events, 13) == 2
    assert devs[0].values[xid_key(13)] == 2
    assert devs[0].values[xid_key(79)] == 1
    assert not any(k.startswith("gpu_xid_events_total") for k in devs[1].values)
    e79 = next(e for e in events if e.data["xid"] == 79)
    assert "XID 79" in e79.message and "fallen off the bus" in e79.message
    assert e79.time_ns > 0


def test_repeats_are_counted_not_sticky(rig):
    fake, src, devs = rig
    fake.inject_event(fake.gpus[0], XID, 13)
    drain_until(src, devs, lambda ev: n_xid(ev, 13) == 1)
    assert devs[0].values[xid_key(13)] == 1
    # a drain with nothing new: no event again, the count stays
    quiet = []
    time.sleep(0.05)
    src.drain(devs, quiet)
    assert quiet == []
    assert devs[0].values[xid_key(13)] == 1
    for expected in (2, 3):
        fake.inject_event(fake.gpus[0], XID, 13)
        again = drain_until(src, devs, lambda ev: n_xid(ev, 13) == 1)
        assert n_xid(again, 13) == 1
        assert devs[0].values[xid_key(13)] == expected


def test_identical_events_in_one_drain_are_folded(rig):
    fake, src, devs = rig
    for _ in range(5):
        fake.inject_event(fake.gpus[1], XID, 43)
    time.sleep(0.1)  # let the event thread queue all five before one drain
    events = []
    src.drain(devs, events)
    assert len(events) == 1
    assert events[0].count == 5 and events[0].gpu == "1"
    assert devs[1].values[xid_key(43)] == 5


def test_ecc_events(rig):
    fake, src, devs = rig
    fake.inject_event(fake.gpus[1], SBE)
    fake.inject_event(fake.gpus[1], SBE)
    fake.inject_event(fake.gpus[1], DBE)
    events = drain_until(src, devs, lambda ev: sum(e.count for e in ev if e.kind == "ecc") == 3)
    kinds = {(e.data["type"], e.count) for e in events if e.kind == "ecc"}
    assert kinds == {("corrected", 2), ("uncorrected", 1)}
    assert devs[1].values['gpu_ecc_events_total{type="corrected"}'] == 2
    assert devs[1].values['gpu_ecc_events_total{type="uncorrected"}'] == 1


def test_unknown_xid_points_to_the_catalog(rig):
    fake, src, devs = rig
    fake.inject_event(fake.gpus[0], XID, 999)
    events = drain_until(src, devs, lambda ev: n_xid(ev, 999) == 1)
    assert "XID catalog" in events[0].message


def test_registration_and_capabilities(rig):
    fake, src, devs = rig
    assert set(src.registered) == {"0", "1"}
    for d in devs:
        assert d.caps["gpu_xid_events_total"].supported
        assert d.caps["gpu_ecc_events_total"].supported


def test_events_unsupported_on_a_gpu(open_devices):
    fake = healthy_gpus(2)
    fake.gpus[1].errors["nvmlDeviceGetSupportedEventTypes"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    nv, devs = open_devices(fake)
    src = EventSource(nv, devs, wait_ms=20)
    src.start()
    try:
        assert set(src.registered) == {"0"}
        cap = devs[1].caps["gpu_xid_events_total"]
        assert not cap.supported and "not supported" in cap.reason
    finally:
        src.stop()


def test_stop_ends_the_event_thread(open_devices):
    fake = healthy_gpus(1)
    nv, devs = open_devices(fake)
    src = EventSource(nv, devs, wait_ms=20)
    src.start()
    assert any(t.name == "gpuscope-events" and t.is_alive() for t in threading.enumerate())
    src.stop()
    assert not any(t.name == "gpuscope-events" and t.is_alive() for t in threading.enumerate())


def test_events_reach_the_sampler_within_a_tick(make_sampler):
    fake = healthy_gpus(2)
    s = make_sampler(fake, events=True)
    s.sample_once()
    assert s.capabilities()["0"]["gpu_xid_events_total"].supported
    fake.inject_event(fake.gpus[0], XID, 79)
    fake.inject_event(fake.gpus[0], XID, 13)
    fake.inject_event(fake.gpus[0], XID, 13)
    snaps = []
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        time.sleep(0.02)
        snaps.append(s.sample_once())
        if snaps[-1].gpus[0].values.get(xid_key(13)) == 2 and snaps[-1].gpus[0].values.get(xid_key(79)):
            break
    last = snaps[-1]
    xids = [e for sn in snaps for e in sn.events if e.kind == "xid"]
    assert xids and all(e.gpu == "0" for e in xids)
    assert n_xid(xids, 13) == 2 and n_xid(xids, 79) == 1
    assert last.gpus[0].values[xid_key(13)] == 2
    assert last.gpus[0].values[xid_key(79)] == 1
    assert xid_key(13) not in last.gpus[1].values
    assert n_xid(list(s.events_history), 13) == 2
    # a new injection counts again
    fake.inject_event(fake.gpus[0], XID, 13)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and s.latest().gpus[0].values.get(xid_key(13)) != 3:
        time.sleep(0.02)
        s.sample_once()
    assert s.latest().gpus[0].values[xid_key(13)] == 3
