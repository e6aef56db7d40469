"""HTTPS through the HTTP kit (gpuscope.http.tls): real certificates made by openssl, real servers on
127.0.0.1, clients that verify them with the test CA.

- the kit's server and a real agent process serve TLS (1.2 at least) that a client with the CA verifies;
- rotation: replaced files are loaded for new connections while open ones keep their certificate (by
  check(), by the poll timer, and on the agent by SIGHUP); a bad new pair keeps the old one, said in one
  line; a rotation that writes the certificate, then the key, is never said to have failed;
- every bad pair (missing, unreadable, not a regular file, not PEM, encrypted, mismatched, expired, not yet
  valid) is one sentence naming the file, and the commands end with it, exit 2, before starting anything;
- beyond loopback without TLS, one warning line at start.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from tls_certs import Pki

from gpuscope.http.limits import Limits
from gpuscope.http.serve import start
from gpuscope.http.tls import ServerTls, TlsError

ROOT = Path(__file__).resolve().parents[1]
GPUSCOPE = [sys.executable, "-m", "gpuscope.cli"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def _install(pair: tuple[Path, Path], cert: Path, key: Path) -> None:
    """Put a pair in place the way Kubernetes and cert-manager do: each file replaced in one rename."""
    for src, dst in zip(pair, (cert, key), strict=True):
        tmp = dst.with_name(dst.name + ".new")
        tmp.write_bytes(src.read_bytes())
        os.replace(tmp, dst)


def _cn(peer: dict[str, Any]) -> str:
    return dict(rdn[0] for rdn in peer["subject"])["commonName"]


# -- the kit's server, in this process ---------------------------------------------------------------
def _app() -> web.Application:
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"secure": request.secure})

    app = web.Application()
    app.router.add_get("/", hello)
    return app


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str = "/") -> tuple[int, bytes]:
    """One HTTP/1.1 request on a kept-alive connection."""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    length = next(int(x.split(":", 1)[1]) for x in lines if x.lower().startswith("content-length:"))
    return int(lines[0].split()[1]), await reader.readexactly(length)


async def _connect(port: int, ctx: ssl.SSLContext) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1")
    return reader, writer, _cn(writer.get_extra_info("peercert"))


def test_the_kit_serves_https_that_a_client_with_the_ca_verifies(pki: Pki) -> None:
    cert, key = pki.issue("kit", cn="kit-a")
    tls = ServerTls(cert, key, poll_s=None)
    assert tls.context.minimum_version == ssl.TLSVersion.TLSv1_2 and tls.describe().startswith("CN=kit-a, valid")

    async def main() -> None:
        served = await start(_app(), "127.0.0.1", 0, tls=tls)
        try:
            assert served.url == f"https://127.0.0.1:{served.port}"
            reader, writer, cn = await _connect(served.port, pki.client_context())
            assert cn == "kit-a" and writer.get_extra_info("ssl_object").version() in ("TLSv1.2", "TLSv1.3")
            assert await _get(reader, writer) == (200, b'{"secure": true}')
            writer.close()
            # a client that does not trust the CA refuses the server
            with pytest.raises(ssl.SSLCertVerificationError):
                await asyncio.open_connection("127.0.0.1", served.port, ssl=ssl.create_default_context())
            # a client that speaks plain HTTP to the TLS port gets no answer, and the server keeps serving
            r, w = await asyncio.open_connection("127.0.0.1", served.port)
            w.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert not (await asyncio.wait_for(r.read(), 30)).startswith(b"HTTP/")
            w.close()
            reader, writer, _ = await _connect(served.port, pki.client_context())
            assert (await _get(reader, writer))[0] == 200
            writer.close()
        finally:
            await served.close()

    asyncio.run(main())


def test_a_client_that_stalls_in_the_handshake_is_closed_after_the_header_timeout(pki: Pki) -> None:
    """asyncio's own handshake deadline is 60 s: the kit holds a stalled handshake to header_timeout."""
    cert, key = pki.issue("stall")

    async def main() -> float:
        served = await start(_app(), "127.0.0.1", 0, tls=ServerTls(cert, key, poll_s=None),
                             limits=Limits(header_timeout_s=0.5))
        try:
            r, w = await asyncio.open_connection("127.0.0.1", served.port)
            t0 = time.monotonic()
            assert await asyncio.wait_for(r.read(), 45) == b""  # closed by the server, nothing said
            w.close()
            return time.monotonic() - t0
        finally:
            await served.close()

    assert asyncio.run(main()) < 45  # (60 s without the kit's deadline; 0.5 s with it on an idle machine)


def test_replaced_files_serve_new_connections_while_open_ones_keep_their_certificate(pki: Pki, tmp_path: Path,
                                                                                        caplog: Any) -> None:
    a, b = pki.issue("rot-a", cn="agent-a"), pki.issue("rot-b", cn="agent-b")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _install(a, cert, key)
    tls = ServerTls(cert, key, poll_s=None)
    caplog.set_level(logging.INFO, logger="gpuscope.http")

    async def main() -> None:
        served = await start(_app(), "127.0.0.1", 0, tls=tls)
        ctx = pki.client_context()
        try:
            r1, w1, cn1 = await _connect(served.port, ctx)
            assert cn1 == "agent-a" and (await _get(r1, w1))[0] == 200
            assert tls.check() is False  # nothing changed
            _install(b, cert, key)
            assert tls.check() is True and tls.reloads == 1 and tls.subject == "CN=agent-b"
            _, w2, cn2 = await _connect(served.port, ctx)
            assert cn2 == "agent-b"
            w2.close()
            # the connection opened before keeps working, with the certificate it began with
            assert (await _get(r1, w1))[0] == 200 and _cn(w1.get_extra_info("peercert")) == "agent-a"
            w1.close()
        finally:
            await served.close()

    asyncio.run(main())
    loaded = [r.getMessage() for r in caplog.records if "new certificate loaded" in r.getMessage()]
    assert len(loaded) == 1 and "CN=agent-b" in loaded[0], loaded


def test_a_bad_new_pair_keeps_the_old_one_and_is_said_in_one_line(pki: Pki, tmp_path: Path, caplog: Any) -> None:
    a, b, c = pki.issue("bad-a", cn="agent-a"), pki.issue("bad-b", cn="agent-b"), pki.issue("bad-c", cn="agent-c")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _install(a, cert, key)
    tls = ServerTls(cert, key, poll_s=None)
    caplog.set_level(logging.INFO, logger="gpuscope.http")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    async def main() -> None:
        served = await start(_app(), "127.0.0.1", 0, tls=tls)
        ctx = pki.client_context()
        try:
            _install((b[0], a[1]), cert, key)  # b's certificate with a's key: no pair
            assert tls.check() is False and warnings() == []  # just changed: maybe half a rotation
            assert tls.check() is False and len(warnings()) == 1  # still so one check later: said
            for _ in range(3):
                assert tls.check() is False
            (line,) = warnings()
            assert "previous pair stays in use (CN=agent-a" in line and "is not the private key of" in line
            assert str(key) in line and tls.reload_failures == 1
            _, w, cn = await _connect(served.port, ctx)
            assert cn == "agent-a"  # still served
            w.close()
            # a rotation that writes the certificate, then the key: the half-way state is not a failure
            cert.write_bytes(c[0].read_bytes())
            assert tls.check() is False
            key.write_bytes(c[1].read_bytes())
            assert tls.check() is True and tls.subject == "CN=agent-c"
            assert len(warnings()) == 1 and tls.reload_failures == 1
            _, w, cn = await _connect(served.port, ctx)
            assert cn == "agent-c"
            w.close()
            # a file that goes away: the same (it is not loaded, and said once it stays away)
            key.unlink()
            assert tls.check() is False and tls.check() is False
            assert len(warnings()) == 2 and "does not exist" in warnings()[1]
            _, w, cn = await _connect(served.port, ctx)
            assert cn == "agent-c"
            w.close()
        finally:
            await served.close()

    asyncio.run(main())


def test_the_poll_timer_loads_a_replaced_pair(pki: Pki, tmp_path: Path) -> None:
    a, b = pki.issue("poll-a", cn="agent-a"), pki.issue("poll-b", cn="agent-b")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _install(a, cert, key)
    tls = ServerTls(cert, key, poll_s=0.05)

    async def main() -> None:
        served = await start(_app(), "127.0.0.1", 0, tls=tls)
        try:
            polls = tls.polls
            deadline = time.monotonic() + 30
            while tls.polls < polls + 2 and time.monotonic() < deadline:  # the timer runs
                await asyncio.sleep(0.05)
            assert tls.polls >= polls + 2 and tls.reloads == 0
            _install(b, cert, key)
            while tls.reloads == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            _, w, cn = await _connect(served.port, pki.client_context())
            assert cn == "agent-b"
            w.close()
        finally:
            await served.close()
        polls = tls.polls
        await asyncio.sleep(0.3)
        assert tls.polls == polls  # stopped with the server

    asyncio.run(main())


# -- one sentence for every pair that cannot be served ---------------------------------------------------
@pytest.fixture(scope="module")
def bad(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("bad")
    good, other = pki.issue("good"), pki.issue("other")
    expired = pki.issue("expired", start="20200101000000Z", end="20200102000000Z")
    future = pki.issue("future", start="20400101000000Z", end="20400102000000Z")
    der = d / "cert.der"
    subprocess.run(["openssl", "x509", "-in", good[0], "-outform", "der", "-out", der], check=True, capture_output=True)
    enc = d / "enc.key"
    subprocess.run(["openssl", "pkey", "-in", good[1], "-aes128", "-passout", "pass:secret", "-out", enc], check=True,
                   capture_output=True)
    cut = d / "cut.key"
    cut.write_bytes(good[1].read_bytes()[:60])
    empty = d / "empty.pem"
    empty.write_bytes(b"")
    fifo = d / "fifo"
    os.mkfifo(fifo)
    return {"missing cert": (d / "nope.pem", good[1]), "missing key": (good[0], d / "nope.key"),
            "cert is a directory": (d, good[1]), "key is a FIFO": (good[0], fifo), "DER cert": (der, good[1]),
            "empty cert": (empty, good[1]), "key given as the cert": (good[1], good[1]),
            "cert given as the key": (good[0], good[0]), "encrypted key": (good[0], enc), "cut key": (good[0], cut),
            "mismatched": (good[0], other[1]), "expired": expired, "not yet valid": future}


WORDS = {"missing cert": "does not exist", "missing key": "does not exist", "cert is a directory": "is a directory",
         "key is a FIFO": "is not a regular file", "DER cert": "is not a PEM certificate",
         "empty cert": "is not a PEM certificate", "key given as the cert": "is not a PEM certificate",
         "cert given as the key": "is not a PEM private key", "encrypted key": "is encrypted",
         "cut key": "holds no private key OpenSSL can read", "mismatched": "is not the private key of",
         "expired": "expired on 2020-01-02 00:00 UTC", "not yet valid": "is not valid before 2040-01-01 00:00 UTC"}


@pytest.mark.parametrize("case", sorted(WORDS))
def test_every_pair_that_cannot_be_served_is_one_sentence(bad: dict[str, tuple[Path, Path]], case: str) -> None:
    cert, key = bad[case]
    with pytest.raises(TlsError) as e:
        ServerTls(cert, key, cert_name="--tls-cert", key_name="--tls-key")
    msg = str(e.value)
    assert WORDS[case] in msg, msg
    assert msg.startswith("The TLS ") and msg.endswith(".") and ". " not in msg and "\n" not in msg, msg
    named = key if "key" in case and case != "key given as the cert" else cert
    assert f"{named} (--tls-" in msg, msg
    assert e.value.exit_code == 2


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of mode 000")
def test_an_unreadable_key_is_one_sentence(pki: Pki, tmp_path: Path) -> None:
    cert, key = pki.issue("unreadable")
    key.chmod(0)
    with pytest.raises(TlsError) as e:
        ServerTls(cert, key)
    assert str(e.value) == f"The TLS key {key} (--tls-key) cannot be read: Permission denied."


# -- the commands: flags, config keys, exit 2 before anything starts ----------------------------------------
def _run(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUSCOPE, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=_env())


def test_the_commands_end_with_one_sentence_and_exit_2_for_a_bad_pair(bad: dict[str, tuple[Path, Path]],
                                                                      tmp_path: Path) -> None:
    cert, key = bad["expired"]
    data = tmp_path / "data"
    out = _run("agent", "--simulate", "healthy", "--gpus", "1", "--data-dir", data, "--tls-cert", cert,
               "--tls-key", key)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "expired on" in out.stderr, out.stderr
    assert not data.exists()  # nothing was started or written
    (tmp_path / "a.toml").write_text('[agent]\ntls_cert = "nope.pem"\ntls_key = "nope.key"\n')
    out = _run("agent", "--simulate", "healthy", "--config", tmp_path / "a.toml", "--data-dir", data)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"The TLS certificate {tmp_path / 'nope.pem'} ({tmp_path / 'a.toml'}: [agent] tls_cert) does not" \
           in out.stderr  # relative to the config file, named by its key
    (tmp_path / "b.toml").write_text('[agent]\ntls_cert = "a.pem"\n')
    out = _run("agent", "--simulate", "healthy", "--config", tmp_path / "b.toml", "--data-dir", data)
    assert out.returncode == 2 and "tls_cert and tls_key go together" in out.stderr, out.stderr
    guard_config = tmp_path / "guard.yaml"
    guard_config.write_text("classes:\n  - name: all\n    share: 1.0\n")
    for verb in (["agent", "--simulate", "healthy"], ["dashboard", "--prometheus", "http://127.0.0.1:9"],
                 ["guard", "proxy", "--config", guard_config, "--upstream", "http://127.0.0.1:9", "--listen",
                  "127.0.0.1:0"]):
        out = _run(*verb, "--tls-cert", cert)
        assert out.returncode == 2 and "--tls-cert and --tls-key go together" in out.stderr, (verb, out.stderr)
        out = _run(*verb, "--tls-cert", bad["mismatched"][0], "--tls-key", bad["mismatched"][1])
        assert out.returncode == 2 and out.stderr.count("\n") == 1, (verb, out.stderr)
        assert "is not the private key of" in out.stderr and "Traceback" not in out.stderr, (verb, out.stderr)
    assert not data.exists()


# -- a real agent over TLS ---------------------------------------------------------------------------------
class TlsAgent:
    def __init__(self, tmp: Path, *args: str | Path, ctx: ssl.SSLContext) -> None:
        self.port, self.ctx, self.data = _free_port(), ctx, tmp / "data"
        self.proc = subprocess.Popen(
            [*GPUSCOPE, "agent", "--simulate", "healthy", "--gpus", "1", "--interval", "100ms", "--port",
             str(self.port), "--data-dir", str(self.data), *map(str, args)],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def connect(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=self.ctx, timeout=10)

    def get(self, conn: http.client.HTTPSConnection, path: str) -> tuple[int, bytes]:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()

    def served_cn(self) -> str:
        conn = self.connect()
        try:
            conn.connect()
            return _cn(conn.sock.getpeercert())
        finally:
            conn.close()

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                if self.get(self.connect(), "/readyz")[0] == 200:
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError("agent did not come up")

    def stop(self) -> tuple[int, str, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        return self.proc.returncode, out, err


def _wait(pred: Any, what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_real_agent_serves_tls_from_its_config_and_rotates_on_sighup(pki: Pki, tmp_path: Path) -> None:
    a, b = pki.issue("agent-a", cn="agent-a"), pki.issue("agent-b", cn="agent-b")
    certs = tmp_path / "certs"
    certs.mkdir()
    cert, key = certs / "tls.crt", certs / "tls.key"
    _install(a, cert, key)
    conf = tmp_path / "agent.toml"
    conf.write_text('[agent]\ntls_cert = "certs/tls.crt"\ntls_key = "certs/tls.key"\n')  # relative to the file
    agent = TlsAgent(tmp_path, "--config", conf, ctx=pki.client_context())
    try:
        agent.wait_ready()
        old = agent.connect()  # a kept-alive connection opened before the rotation
        code, body = agent.get(old, "/api/v1/status")
        st = json.loads(body)
        assert code == 200 and st["tls"]["subject"] == "CN=agent-a" and st["tls"]["reloads"] == 0
        assert str(certs) not in body.decode()  # the status names no certificate file
        assert _cn(old.sock.getpeercert()) == "agent-a"
        with pytest.raises(ssl.SSLCertVerificationError):  # a client without the CA refuses it
            urllib_ctx = ssl.create_default_context()
            with socket.create_connection(("127.0.0.1", agent.port), timeout=10) as s:
                urllib_ctx.wrap_socket(s, server_hostname="127.0.0.1")

        _install(b, cert, key)
        agent.proc.send_signal(signal.SIGHUP)
        _wait(lambda: agent.served_cn() == "agent-b", "new connections to get agent-b's certificate")
        code, body = agent.get(old, "/api/v1/status")  # the old connection keeps working, with its certificate
        assert code == 200 and json.loads(body)["tls"]["reloads"] == 1 and _cn(old.sock.getpeercert()) == "agent-a"

        _install((a[0], b[1]), cert, key)  # a bad pair: b's key under a's certificate
        agent.proc.send_signal(signal.SIGHUP)
        _wait(lambda: json.loads(agent.get(agent.connect(), "/api/v1/status")[1])["tls"]["reload_failures"] == 1,
              "the failed reload to be counted")
        assert agent.served_cn() == "agent-b"
        agent.proc.send_signal(signal.SIGHUP)  # the same bad pair again: no second line
        _wait(lambda: agent.get(old, "/metrics")[0] == 200, "a scrape on the old connection")
        old.close()
    finally:
        code, out, err = agent.stop()
    assert code == 0 and "Traceback" not in err, err
    assert f"https://127.0.0.1:{agent.port}/metrics" in out and "TLS:             CN=agent-a, valid until" in out
    assert len([x for x in err.splitlines() if "new certificate loaded" in x and "CN=agent-b" in x]) == 1, err
    assert len([x for x in err.splitlines() if "TLS: SIGHUP: looking at the certificate files" in x]) == 3, err
    failed = [x for x in err.splitlines() if "cannot be used" in x]
    assert len(failed) == 1 and "previous pair stays in use (CN=agent-b" in failed[0], err
    assert "beyond loopback" not in err


def test_beyond_loopback_without_tls_one_warning_line_and_none_with_it(pki: Pki, tmp_path: Path) -> None:
    cert, key = pki.issue("wide")
    quiet = TlsAgent(tmp_path / "q", "--bind", "0.0.0.0", "--tls-cert", cert, "--tls-key", key,
                     ctx=pki.client_context())
    try:
        quiet.wait_ready()  # (its probes answer without the token: tests/test_agent_probes.py)
    finally:
        code, _, err = quiet.stop()
    assert code == 0 and "without TLS" not in err, err
    port = _free_port()
    loud = subprocess.Popen([*GPUSCOPE, "agent", "--simulate", "healthy", "--gpus", "1", "--bind", "0.0.0.0",
                             "--port", str(port), "--data-dir", str(tmp_path / "l")],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def serving() -> bool:  # (the line is written before the first request can be answered)
        assert loud.poll() is None, "the agent exited"
        try:
            token = (tmp_path / "l" / "token").read_text().strip()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/status",
                                         headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        _wait(serving, "the agent to answer", timeout=60)
    finally:
        loud.send_signal(signal.SIGTERM)
        _, err = loud.communicate(timeout=30)
    lines = [x for x in err.splitlines() if "without TLS" in x]
    assert len(lines) == 1 and "listening on 0.0.0.0 beyond loopback" in lines[0], err
    assert "--tls-cert and --tls-key (or [agent] tls_cert and tls_key)" in lines[0]


def test_the_guard_proxy_serves_tls(pki: Pki, tmp_path: Path) -> None:
    from gpuscope.guard import Guard, parse_config
    from gpuscope.guard.proxy import serve

    cert, key = pki.issue("guard", cn="guard-a")
    tls = ServerTls(cert, key, poll_s=None)

    async def main() -> None:
        upstream = web.AppRunner(_app())
        await upstream.setup()
        site = web.TCPSite(upstream, "127.0.0.1", 0)
        await site.start()
        up_port = upstream.addresses[0][1]
        proxy = await serve(Guard(parse_config({"classes": [{"name": "all", "share": 1.0}]})),
                            f"http://127.0.0.1:{up_port}", "127.0.0.1", 0, ssl=tls.context)
        try:
            assert proxy.url.startswith("https://")
            reader, writer, cn = await _connect(proxy.port, pki.client_context())
            assert cn == "guard-a"
            assert await _get(reader, writer) == (200, b'{"secure": false}')  # plain HTTP to the upstream
            assert (await _get(reader, writer))[0] == 200  # kept alive
            writer.close()
        finally:
            await proxy.close(grace_s=1)
            await upstream.cleanup()

    asyncio.run(main())
