"""The agent's store under bad text and a full disk, on a real agent process: /api/v1/status, /readyz and the
agent's own series on /metrics say when the store cannot write, and SIGTERM ends cleanly whatever happened."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from test_agent import AgentProc, http

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def status(a: AgentProc) -> dict:
    code, body = http(a.port, "/api/v1/status")
    assert code == 200
    return json.loads(body)


def self_metric(a: AgentProc, name: str) -> float:
    code, body = http(a.port, "/metrics")
    assert code == 200
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", body.decode(), re.M)
    assert m, f"{name} is not on /metrics"
    return float(m.group(1))


def wait_for(pred, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def stop_cleanly(a: AgentProc) -> str:
    code = a.stop()
    err = a.proc.stderr.read()
    assert code == 0, err
    assert "Traceback" not in err, err
    return err


def test_a_posted_lone_surrogate_is_stored_repaired_and_the_store_stays_healthy(tmp_path: Path) -> None:
    a = AgentProc(tmp_path, "--simulate", "healthy", "--gpus", "1")
    try:
        a.wait_ready()
        raw = b'{"kind": "guard", "type": "t", "severity": "info", "message": "x\\ud800y", "source": "s", ' \
              b'"labels": {"k": "\\udcff"}}'
        code, body = http(a.port, "/api/v1/events", a.token(), "POST", raw)
        assert code == 202, body

        def stored() -> list:
            code, body = http(a.port, "/api/v1/events?kind=guard&start=-1h")
            return json.loads(body)["events"] if code == 200 else []

        (ev,) = wait_for(stored, what="the posted event in the store")
        assert ev["message"] == "x\\ud800y" and ev["data"]["labels"] == {"k": "\\xff"}
        # the store keeps flushing: its health and its own series say so
        ticks = status(a)["store"]["writer"]["flushes"]
        wait_for(lambda: status(a)["store"]["writer"]["flushes"] > ticks + 2, what="more flushes")
        st = status(a)
        assert st["healthy"] is True and st["store"]["health"]["write_errors"] == 0, st["store"]["health"]
        code, body = http(a.port, "/readyz")
        assert code == 200 and json.loads(body)["healthy"] is True
        code, body = http(a.port, "/healthz")
        assert code == 200
        assert self_metric(a, "gpuscope_store_healthy") == 1.0
        assert self_metric(a, "gpuscope_store_write_errors_total") == 0.0
        assert 0.0 <= self_metric(a, "gpuscope_store_last_flush_age_seconds") < 60
    finally:
        stop_cleanly(a)


@pytest.mark.skipif(not hasattr(__import__("resource"), "prlimit"), reason="prlimit is Linux")
def test_a_full_disk_under_the_agent_shows_on_status_readyz_and_metrics_and_recovers(tmp_path: Path) -> None:
    import resource

    a = AgentProc(tmp_path, "--simulate", "healthy", "--gpus", "1")
    try:
        a.wait_ready()
        wait_for(lambda: status(a)["store"]["writer"]["flushes"] >= 2, what="first flushes")
        soft, hard = resource.prlimit(a.proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(a.proc.pid, resource.RLIMIT_FSIZE, (0, hard))  # no file of the agent may grow: disk full
        try:
            def unready() -> dict | None:
                code, body = http(a.port, "/readyz")
                return json.loads(body) if code == 503 else None

            ready = wait_for(unready, what="/readyz to say 503")
            assert ready["healthy"] is False and "cannot write" in ready["reason"] and ready["last_error"]
            st = status(a)
            assert st["healthy"] is False and st["store"]["health"]["write_errors"] >= 1
            assert self_metric(a, "gpuscope_store_healthy") == 0.0
            assert self_metric(a, "gpuscope_store_write_errors_total") >= 1
            age = self_metric(a, "gpuscope_store_last_flush_age_seconds")
            wait_for(lambda: self_metric(a, "gpuscope_store_last_flush_age_seconds") > age, what="the age to grow")
            code, _ = http(a.port, "/healthz")
            assert code == 200  # alive all along: liveness is not readiness
        finally:
            resource.prlimit(a.proc.pid, resource.RLIMIT_FSIZE, (soft, hard))  # space again
        wait_for(lambda: http(a.port, "/readyz")[0] == 200, what="/readyz to recover")
        st = status(a)
        assert st["healthy"] is True and st["store"]["health"]["samples_dropped"] == 0
        ticks = st["sampler"]["ticks"]
    finally:
        err = stop_cleanly(a)
    assert len(re.findall(r"store cannot write", err)) == 1, err
    # (a line for flushes that were merely slow on a busy machine says '0 failed' and is not this one)
    assert len(re.findall(r"store recovered: a flush succeeded [0-9.]+ s after .* \([1-9][0-9]* failed", err)) == 1, err
    from gpuscope.store import Store

    with Store(a.data / "store", readonly=True) as r:  # nothing the sampler produced before the stop is missing
        (res,) = r.query("gpu_power_watts", 0, 2**62, 10**9, agg="count", labels={"gpu": "0"})
    assert int(res.values.sum()) >= ticks


def test_sigterm_with_a_store_that_cannot_write_ends_cleanly_with_one_sentence(tmp_path: Path) -> None:
    a = AgentProc(tmp_path, "--simulate", "healthy", "--gpus", "1")
    a.wait_ready()
    db = a.data / "store" / "gpuscope.db"
    wait_for(lambda: db.exists(), what="the store file")
    db.rename(db.with_name("moved.db"))  # removed from under the running agent
    try:
        wait_for(lambda: http(a.port, "/readyz")[0] == 503, what="/readyz to say 503")
        code, body = http(a.port, "/readyz")
        assert "removed or replaced" in json.loads(body)["reason"]
    finally:
        err = stop_cleanly(a)
    assert len([x for x in err.splitlines() if "store closed while it could not write" in x]) == 1, err
