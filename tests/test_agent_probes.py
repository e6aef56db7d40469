"""Kubernetes probes on an agent beyond loopback: a kubelet's httpGet probe sends no token, so /healthz and
/readyz answer GET and HEAD without it (and say nothing but alive/ready and a reason naming no file or
error), while every other path, and any other method on those two, still needs the token.

No address beyond loopback exists here, and every 127.x address counts as loopback (gpuscope.http.net
.is_loopback_host), so the agent binds 0.0.0.0, which turns the token rule on, and is asked on 127.0.0.1.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from test_agent import AgentProc, http
from test_agent_store_faults import stop_cleanly, wait_for


def _head(port: int, path: str) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="HEAD")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_probes_answer_without_the_token_beyond_loopback_and_nothing_else_does(tmp_path: Path) -> None:
    a = AgentProc(tmp_path, "--simulate", "healthy", "--gpus", "1", "--bind", "0.0.0.0")
    try:
        a.wait_ready()
        token = a.token()
        code, body = http(a.port, "/healthz")
        assert (code, json.loads(body)) == (200, {"alive": True})
        wait_for(lambda: http(a.port, "/readyz")[0] == 200, what="/readyz 200 without the token")
        code, body = http(a.port, "/readyz?verbose=1")
        assert (code, json.loads(body)) == (200, {"healthy": True, "reason": None})  # nothing more
        assert _head(a.port, "/healthz") == 200 and _head(a.port, "/readyz") == 200
        # with the token, /readyz keeps its details
        code, body = http(a.port, "/readyz", token)
        assert code == 200 and "last_flush_age_seconds" in json.loads(body)
        # everything else needs the token, and so do other methods and look-alike paths of the probes
        for path in ("/metrics", "/api/v1/status", "/api/v1/latest", "/", "/ui/", "/readyz/", "/healthz/x"):
            code, body = http(a.port, path)
            assert code == 401 and "token" in json.loads(body)["error"], (path, body)
        assert _head(a.port, "/metrics") == 401
        code, _ = http(a.port, "/readyz", method="POST", data=b"{}")
        assert code == 401
        code, _ = http(a.port, "/healthz", token="wrong-token-wrong-token", method="DELETE")
        assert code == 401
        assert http(a.port, "/metrics", token)[0] == 200 and http(a.port, "/api/v1/status", token)[0] == 200
    finally:
        err = stop_cleanly(a)
    assert len([x for x in err.splitlines() if "beyond loopback without TLS" in x]) == 1, err


def test_an_unready_agent_tells_a_probe_why_without_naming_its_files(tmp_path: Path) -> None:
    a = AgentProc(tmp_path, "--simulate", "healthy", "--gpus", "1", "--bind", "0.0.0.0")
    a.wait_ready()
    token = a.token()
    db = a.data / "store" / "gpuscope.db"
    wait_for(lambda: db.exists(), what="the store file")
    db.rename(db.with_name("moved.db"))  # the store's file replaced under it: unready, and its error names the file
    try:
        wait_for(lambda: http(a.port, "/readyz")[0] == 503, what="/readyz to say 503")
        code, body = http(a.port, "/readyz")
        public = json.loads(body)
        assert code == 503 and set(public) == {"healthy", "reason"} and public["healthy"] is False, public
        assert public["reason"].startswith("the store cannot write (for ") and "/api/v1/status" in public["reason"]
        text = body.decode()
        assert str(tmp_path) not in text and "gpuscope.db" not in text and "replaced" not in text, text
        code, body = http(a.port, "/readyz", token)  # the details, with the token
        assert code == 503 and "removed or replaced" in json.loads(body)["reason"] and str(db) in body.decode()
        code, body = http(a.port, "/healthz")
        assert (code, json.loads(body)) == (200, {"alive": True})  # alive all along
    finally:
        stop_cleanly(a)
