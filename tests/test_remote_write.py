"""Remote write: the wire format (decoded here independently), headers, retry with backoff, the
bounded queue, and delivery into a real VictoriaMetrics and a real Prometheus."""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import cramjam
import pytest
from servers import PrometheusServer, VictoriaMetricsServer, free_port

from gpuscope import Sampler, SamplerConfig
from gpuscope._records import GpuIdentity, GpuRecord, ProcessRecord, Snapshot
from gpuscope.export.remote_write import RemoteWriter, encode_write_request

# ---- an independent protobuf decoder for WriteRequest ------------------------------------------


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, object]]:
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(buf, i)
            yield num, wt, v
        elif wt == 1:
            yield num, wt, buf[i:i + 8]
            i += 8
        elif wt == 2:
            n, i = _varint(buf, i)
            yield num, wt, buf[i:i + n]
            i += n
        else:
            raise AssertionError(f"unexpected wire type {wt}")


def decode_write_request(body: bytes) -> list[tuple[list[tuple[str, str]], list[tuple[float, int]]]]:
    out = []
    for num, _, ts in _fields(body):
        assert num == 1
        labels, samples = [], []
        for fnum, _, data in _fields(ts):  # type: ignore[arg-type]
            if fnum == 1:
                lab = {n: bytes(d).decode() for n, _, d in _fields(data)}  # type: ignore[arg-type]
                labels.append((lab.get(1, ""), lab.get(2, "")))
            elif fnum == 2:
                value, stamp = 0.0, 0
                for n, _, d in _fields(data):  # type: ignore[arg-type]
                    if n == 1:
                        value = struct.unpack("<d", d)[0]  # type: ignore[arg-type]
                    elif n == 2:
                        stamp = d  # type: ignore[assignment]
                samples.append((value, stamp))
        out.append((labels, samples))
    return out


class Receiver:
    """A loopback remote-write endpoint that answers with scripted status codes and keeps what it got."""

    def __init__(self, statuses: list[int] | None = None, delay: float = 0.0) -> None:
        self.statuses = list(statuses or [])
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.times: list[float] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.times.append(time.monotonic())
                if delay:
                    time.sleep(delay)
                status = outer.statuses.pop(0) if outer.statuses else 204
                if status < 300:
                    outer.requests.append((dict(self.headers), body))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/api/v1/write"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def decoded(self) -> list[tuple[list[tuple[str, str]], list[tuple[float, int]]]]:
        out = []
        for _, body in self.requests:
            out += decode_write_request(bytes(cramjam.snappy.decompress_raw(body)))
        return out

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(*a, **kw) -> Receiver:
        r = Receiver(*a, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def snap(t_s: float, power: float = 300.0, *, procs: int = 1, name: str = "python") -> Snapshot:
    ident = GpuIdentity(index=0, uuid="GPU-abc", name="NVIDIA H200", driver_version="580.1")
    rec = GpuRecord(ident, int(t_s * 1e9), {"gpu_power_watts": power, "gpu_energy_joules_total": power * t_s})
    ps = [ProcessRecord(pid=10 + i, gpu="0", gpu_uuid="GPU-abc", type="compute", name=name, user="u",
                        gpu_memory_bytes=1e9) for i in range(procs)]
    return Snapshot(int(t_s * 1e9), [rec], ps, None, [], None, "node-a")


def wait(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# ---- wire format -----------------------------------------------------------------------------


def test_encoder_round_trips_through_an_independent_decoder():
    series = [([("__name__", "up"), ("job", "x")], [(1.0, 1_700_000_000_000), (0.5, 1_700_000_001_000)]),
              ([("__name__", "t"), ("name", "ünï\"q\n")], [(float("inf"), 1), (-2.25, 300)])]
    assert decode_write_request(encode_write_request(series)) == series


def test_request_headers_labels_and_samples(receiver):
    rx = receiver()
    w = RemoteWriter(rx.url, interval=0.1, resolution=0.0, headers={"Authorization": "Bearer t0k"},
                     external_labels={"cluster": "c1"}, extra=lambda: {"gpuscope_sampler_ticks_total": 7.0})
    w.add(snap(1000.0, 300.0))
    w.add(snap(1001.0, 310.0))
    w.stop()
    assert rx.requests, w.stats()
    headers, _ = rx.requests[0]
    assert headers["Content-Encoding"] == "snappy"
    assert headers["Content-Type"] == "application/x-protobuf"
    assert headers["X-Prometheus-Remote-Write-Version"] == "0.1.0"
    assert headers["Authorization"] == "Bearer t0k"
    by_name = {}
    for labels, samples in rx.decoded():
        assert [k for k, _ in labels] == sorted(k for k, _ in labels), labels  # sorted, as the spec requires
        d = dict(labels)
        by_name.setdefault(d["__name__"], []).append((d, samples))
    (power_labels, power_samples), = by_name["gpu_power_watts"]
    assert power_labels == {"__name__": "gpu_power_watts", "gpu": "0", "uuid": "GPU-abc", "model": "NVIDIA H200",
                            "hostname": "node-a", "cluster": "c1"}
    assert power_samples == [(300.0, 1_000_000), (310.0, 1_001_000)]  # one series, both samples, ms stamps
    assert by_name["gpu_info"][0][0]["driver"] == "580.1"
    assert by_name["gpu_process_memory_used_bytes"][0][0]["pid"] == "10"
    assert by_name["gpuscope_sampler_ticks_total"][0][1][0][0] == 7.0
    st = w.stats()
    assert st["samples_sent"] == sum(len(s) for _, s in rx.decoded()) and st["samples_failed"] == 0


def test_resolution_keeps_one_snapshot_per_period(receiver):
    rx = receiver()
    w = RemoteWriter(rx.url, interval=0.1, resolution=1.0)
    for i in range(50):
        w.add(snap(2000.0 + i * 0.1))  # 5 s of 10 Hz ticks
    w.stop()
    power = [s for labels, s in rx.decoded() if ("__name__", "gpu_power_watts") in labels]
    assert sum(len(s) for s in power) == 5


# ---- failures ------------------------------------------------------------------------------


def test_retries_5xx_and_429_with_backoff_then_delivers(receiver):
    rx = receiver([503, 500, 429])
    w = RemoteWriter(rx.url, interval=0.05, resolution=0.0, max_backoff=1.0)
    w.add(snap(3000.0))
    wait(lambda: rx.requests)
    w.stop()
    st = w.stats()
    assert st["retries"] == 3 and st["request_failures"] == 3 and st["samples_failed"] == 0
    assert len(rx.times) == 4
    gaps = [b - a for a, b in zip(rx.times, rx.times[1:], strict=False)]
    # 0.5 s, doubling, capped at max_backoff, +-20 % jitter.
    assert 0.4 <= gaps[0] <= 0.7 and 0.8 <= gaps[1] <= 1.3 and 0.8 <= gaps[2] <= 1.3, gaps
    assert "HTTP 429" in st["last_error"]


def test_4xx_is_not_retried_and_is_counted(receiver):
    rx = receiver([400])
    w = RemoteWriter(rx.url, interval=0.05, resolution=0.0)
    w.add(snap(4000.0))
    wait(lambda: w.stats()["samples_failed"] > 0)
    w.stop()
    st = w.stats()
    assert len(rx.times) == 1 and st["retries"] == 0 and st["samples_sent"] == 0
    assert "HTTP 400" in st["last_error"]


def test_unreachable_receiver_drops_oldest_never_raises_and_stops_in_bounded_time():
    url = f"http://127.0.0.1:{free_port()}/api/v1/write"  # nothing listens there
    per_snap = 2 + 1 + 7 * 1  # add()'s estimate: power, energy, gpu_info, 7 per process
    w = RemoteWriter(url, interval=0.05, resolution=0.0, max_queue_samples=10 * per_snap, timeout=0.5,
                     max_backoff=0.2)
    for i in range(100):
        w.add(snap(5000.0 + i))  # never raises, whatever the sender is doing
    st = w.stats()
    assert st["queued_samples"] <= 10 * per_snap
    assert st["samples_dropped"] >= 80 * per_snap
    t0 = time.monotonic()
    w.stop(timeout=1.0)
    assert time.monotonic() - t0 < 4.0
    st = w.stats()
    assert st["samples_sent"] == 0 and st["request_failures"] >= 1 and "connection failed" in st["last_error"]
    assert st["samples_failed"] > 0 and st["queued_samples"] == 0
    assert st["snapshots_dropped"] >= 90
    w.add(snap(9999.0))  # after stop: ignored, no error
    m = w.self_metrics()
    assert m["gpuscope_remote_write_dropped_samples_total"] == st["samples_dropped"]


def test_add_survives_a_broken_extra_callable(receiver):
    rx = receiver()

    def broken() -> dict[str, float]:
        raise RuntimeError("boom")

    w = RemoteWriter(rx.url, interval=0.05, resolution=0.0, extra=broken)
    w.add(snap(6000.0))  # must not raise into the sampler thread
    w.stop()


def test_bad_settings_are_refused_in_one_sentence():
    with pytest.raises(ValueError, match="http:// or https://"):
        RemoteWriter("ftp://example/write")
    with pytest.raises(ValueError, match="http:// or https://"):
        RemoteWriter("not a url")
    with pytest.raises(ValueError, match="interval"):
        RemoteWriter("http://127.0.0.1:1/w", interval=0)


# ---- real receivers ------------------------------------------------------------------------------


def _run_sampler_into(writer: RemoteWriter, scenario: str, seconds: float) -> Sampler:
    s = Sampler(SamplerConfig(interval=0.1), simulate=scenario)
    s.subscribe(writer.add)
    s.start()
    time.sleep(seconds)
    s.stop()
    writer.stop()
    return s


def test_remote_write_lands_in_victoria_metrics(tmp_path):
    with VictoriaMetricsServer(tmp_path) as vm:
        w = RemoteWriter(vm.write_url, interval=0.5, resolution=0.2)
        s = _run_sampler_into(w, "healthy", 2.0)
        st = w.stats()
        assert st["samples_sent"] > 0 and st["samples_failed"] == 0 and st["samples_dropped"] == 0, st
        r = vm.wait_for('gpu_power_watts{simulated="healthy"}', lambda r: len(r) == 1)
        m = r[0]["metric"]
        assert m == {"__name__": "gpu_power_watts", "gpu": "0", "uuid": s.devices[0].identity.uuid,
                     "model": "NVIDIA H200 (simulated)", "hostname": s.hostname, "simulated": "healthy"}
        assert 400 < float(r[0]["value"][1]) < 1000
        n = vm.wait_for('count_over_time(gpu_energy_joules_total{simulated="healthy"}[1m])',
                        lambda r: len(r) == 1 and float(r[0]["value"][1]) >= 5)
        assert float(n[0]["value"][1]) >= 5
        procs = vm.query("gpu_process_memory_used_bytes")
        assert procs and procs[0]["metric"]["pid"] and procs[0]["metric"]["user"] == "sim"


def test_remote_write_lands_in_prometheus_receiver(tmp_path):
    with PrometheusServer(tmp_path, remote_write_receiver=True) as prom:
        w = RemoteWriter(prom.write_url, interval=0.5, resolution=0.2)
        _run_sampler_into(w, "compute_bound", 1.5)
        st = w.stats()
        assert st["samples_sent"] > 0 and st["samples_failed"] == 0, st
        r = prom.wait_for('gpu_sm_active_ratio{simulated="compute_bound"}', lambda r: len(r) == 1)
        assert float(r[0]["value"][1]) > 0.5
        assert prom.query('gpu_throttle_seconds_total{reason="sw_power_cap"}')
