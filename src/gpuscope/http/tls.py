"""HTTPS for a gpuscope server: a certificate and key pair checked at start, and re-read when the files
change, into the context the server listens with (standard library only).

    tls = ServerTls("agent.pem", "agent.key")   # TlsError (exit 2), one sentence, for a pair it cannot serve
    served = await start(app, "0.0.0.0", 9471, tls=tls)      # https://; tls.watch() runs while it serves
    print(tls.describe())                                    # "CN=gpu-node-7, valid until 2027-03-01 00:00 UTC"

At start the pair must be usable: both files exist, are readable regular PEM files (the key unencrypted),
the key is the certificate's, and the certificate is valid now. Each is proved by what a client would do:
a TLS handshake in memory against a client that takes the certificate as its trust anchor (so a
certificate signed by any CA is checked for its dates and purpose, without its CA).

While serving, the files' identity (inode, size, mtime) is looked at every `poll_s` seconds and on SIGHUP;
a changed pair is read once, checked as at start, and loaded into the live context: new connections get
the new certificate, open ones keep theirs. A pair that cannot be used leaves the old one in place and is
said in one log line: at once on SIGHUP, and when polled once the files have stayed as they are for one
poll (a rotation that writes the certificate, then the key, is not a failure in between).

Kubernetes Secret volumes, cert-manager and `mv` replace the files atomically; either way works.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import ssl
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._files import read_bytes
from ..errors import UsageError
from .net import is_loopback_host

__all__ = ["TLS_POLL_S", "ServerTls", "TlsError", "add_tls_args", "tls_from_args", "warn_clear_text"]

log = logging.getLogger("gpuscope.http")

#: how often a serving process looks at its certificate and key files (seconds)
TLS_POLL_S = 5.0
#: a certificate chain is a few kB; a PEM file past this is not one
MAX_PEM_BYTES = 1 << 20
#: OpenSSL's X509_V_FLAG_NO_CHECK_TIME: read an expired certificate's dates for the sentence
_NO_CHECK_TIME = 0x200000
_EXPIRED, _NOT_YET_VALID = 10, 9  # X509_V_ERR_CERT_HAS_EXPIRED, X509_V_ERR_CERT_NOT_YET_VALID
_MISMATCH = {"KEY_VALUES_MISMATCH", "NO_CERTIFICATE_ASSIGNED", "X509_CHECK_PRIVATE_KEY"}


class TlsError(UsageError):
    """The certificate or key cannot be served: one sentence naming the file (exit 2)."""


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    """--tls-cert FILE and --tls-key FILE."""
    g = parser.add_argument_group("TLS (HTTPS)")
    g.add_argument("--tls-cert", metavar="FILE",
                   help="serve HTTPS with this PEM certificate (the server's first, then any intermediates); "
                        f"re-read when it changes (looked at every {TLS_POLL_S:g}s) or on SIGHUP")
    g.add_argument("--tls-key", metavar="FILE", help="the certificate's PEM private key, unencrypted")


def tls_from_args(args: argparse.Namespace, poll_s: float | None = TLS_POLL_S) -> ServerTls | None:
    """The ServerTls of --tls-cert and --tls-key (None when neither is given); TlsError when one is missing
    or the pair cannot be served."""
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if not cert and not key:
        return None
    if not cert or not key:
        raise TlsError("--tls-cert and --tls-key go together: give both files, or neither.")
    return ServerTls(cert, key, poll_s=poll_s)


def warn_clear_text(host: str, tls: ServerTls | None, how: str) -> bool:
    """One warning line when `host` is beyond loopback and no TLS is served; `how` says how to turn it on."""
    if tls is not None or is_loopback_host(host):
        return False
    log.warning("listening on %s beyond loopback without TLS: requests and answers, and any token in them, "
                "cross the network in clear text; serve HTTPS with %s", host, how)
    return True


def _file_id(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@contextlib.contextmanager
def _as_files(*blobs: bytes) -> Iterator[list[str]]:
    """Paths OpenSSL can read `blobs` from, gone afterwards: memory files where Linux has them (the key
    never touches a disk), else a private temporary folder."""
    fds: list[int] = []
    try:
        if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
            try:
                for blob in blobs:
                    fds.append(os.memfd_create("gpuscope-tls", os.MFD_CLOEXEC))
                    os.write(fds[-1], blob)
            except OSError:  # a sandbox may refuse memfd_create: the folder below
                pass
            else:
                yield [f"/proc/self/fd/{fd}" for fd in fds]
                return
    finally:
        for fd in fds:
            os.close(fd)
    with tempfile.TemporaryDirectory(prefix="gpuscope-tls-") as d:  # mode 0700
        paths = []
        for i, blob in enumerate(blobs):
            p = os.path.join(d, f"{i}.pem")
            with open(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(blob)
            paths.append(p)
        yield paths


def _new_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def _handshake(server_ctx: ssl.SSLContext, cert_pem: bytes, flags: int = 0) -> dict[str, Any]:
    """A TLS handshake in memory between `server_ctx` and a client that trusts the certificates of
    `cert_pem`; the certificate the client verified (its dates, subject). Raises what the client or the
    server raises."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False  # which names it serves is the user's business, not a reason to refuse it
    client.load_verify_locations(cadata=cert_pem.decode("ascii", "replace"))
    client.verify_flags = client.verify_flags | ssl.VERIFY_X509_PARTIAL_CHAIN | flags
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client.wrap_bio(c_in, c_out)
    s = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = [False, False]
    for _ in range(8):  # TLS 1.3 takes 2 round trips, 1.2 takes 3
        for i, (obj, out, peer) in enumerate(((c, c_out, s_in), (s, s_out, c_in))):
            if not done[i]:
                try:
                    obj.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
            data = out.read()
            if data:
                peer.write(data)
        if all(done):
            return c.getpeercert() or {}
    raise ssl.SSLError("the handshake did not complete")


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _subject(cert: dict[str, Any]) -> str:
    parts = [f"{'CN' if k == 'commonName' else k}={v}" for rdn in cert.get("subject", ()) for k, v in rdn]
    return ", ".join(parts) or "(no subject)"


def _utc(cert_time: str) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ssl.cert_time_to_seconds(cert_time)))
    except ValueError:
        return cert_time


class ServerTls:
    """A server-side SSLContext (TLS 1.2 at least) over a certificate and key pair, re-read when the files
    change. `cert_name`/`key_name` say where the user gave each file (a flag, a config key) in sentences."""

    def __init__(self, cert: str | os.PathLike[str], key: str | os.PathLike[str], *, cert_name: str = "--tls-cert",
                 key_name: str = "--tls-key", poll_s: float | None = TLS_POLL_S) -> None:
        self.cert_path = Path(os.path.expanduser(cert))
        self.key_path = Path(os.path.expanduser(key))
        self.cert_name, self.key_name = cert_name, key_name
        self.poll_s = poll_s
        self.context = _new_context()
        self.reloads = 0  # new pairs loaded since start
        self.reload_failures = 0  # changed pairs that could not be used (each said once)
        self.polls = 0
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sighup = False
        self._pem = b"", b""
        ident = self._ident()
        cert_pem, key_pem = self._read()
        self.peer = self._load(self.context, cert_pem, key_pem)
        self._loaded = ident
        self._failed: tuple[Any, ...] | None = None  # the files' identity at the last failure
        self._said: tuple[Any, ...] | None = None  # the failure that was logged
        self.loaded_at = time.time()

    # -- what it serves ------------------------------------------------------------------------------------
    @property
    def subject(self) -> str:
        return _subject(self.peer)

    @property
    def not_after_s(self) -> float:
        """When the served certificate expires (unix seconds)."""
        return float(ssl.cert_time_to_seconds(self.peer["notAfter"]))

    def describe(self) -> str:
        return f"{self.subject}, valid until {_utc(self.peer['notAfter'])}"

    def status(self) -> dict[str, Any]:
        """The `tls` section of a status page (no file names: those are in the server's log)."""
        return {"subject": self.subject, "not_after": _utc(self.peer["notAfter"]), "not_after_s": self.not_after_s,
                "loaded_at": self.loaded_at, "reloads": self.reloads, "reload_failures": self.reload_failures}

    # -- reading and checking a pair -----------------------------------------------------------------------
    def _what(self, which: str) -> str:
        path, name = (self.cert_path, self.cert_name) if which == "cert" else (self.key_path, self.key_name)
        return f"the TLS {'certificate' if which == 'cert' else 'key'} {path} ({name})"

    def _ident(self) -> tuple[Any, ...]:
        return _file_id(self.cert_path), _file_id(self.key_path)

    def _read(self) -> tuple[bytes, bytes]:
        out = []
        for which, path in (("cert", self.cert_path), ("key", self.key_path)):
            try:
                st = os.stat(path)
            except (OSError, ValueError):
                st = None  # read_bytes says why
            if st is not None and not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
                raise TlsError(f"{_cap(self._what(which))} is not a regular file; name a PEM file.")
            out.append(read_bytes(path, self._what(which), max_bytes=MAX_PEM_BYTES, error=TlsError))
        return out[0], out[1]

    def _load(self, ctx: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> dict[str, Any]:
        """Check the pair in a context of its own, then load the same bytes into `ctx`; the certificate as a
        client sees it. TlsError with the sentence when it cannot be served."""
        cert, key = self._what("cert"), self._what("key")
        if b"-----BEGIN CERTIFICATE-----" not in cert_pem:
            raise TlsError(f"{_cap(cert)} is not a PEM certificate (it has no '-----BEGIN CERTIFICATE-----' "
                           "line); convert a DER one with 'openssl x509 -inform der -in FILE -out FILE.pem'.")
        if b"PRIVATE KEY-----" not in key_pem:
            raise TlsError(f"{_cap(key)} is not a PEM private key (it has no line such as '-----BEGIN PRIVATE "
                           "KEY-----').")
        if b"ENCRYPTED PRIVATE KEY-----" in key_pem or b"Proc-Type: 4,ENCRYPTED" in key_pem:
            raise TlsError(f"{_cap(key)} is encrypted; give the key unencrypted (openssl pkey -in KEY -out "
                           "PLAIN), readable only by the user this server runs as.")
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=cert_pem.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError, ValueError):
            raise TlsError(f"{_cap(cert)} holds a certificate block that is not a valid certificate.") from None
        trial = _new_context()
        with _as_files(cert_pem, key_pem) as (cert_file, key_file):
            try:
                trial.load_cert_chain(cert_file, key_file, password=lambda: b"")  # never a prompt on the terminal
            except ssl.SSLError as e:
                if e.reason in _MISMATCH:
                    raise TlsError(f"{_cap(key)} is not the private key of {cert}; give the key the "
                                   "certificate was made for.") from None
                raise TlsError(f"{_cap(key)} holds no private key OpenSSL can read.") from None
            peer = self._verified(trial, cert_pem)
            ctx.load_cert_chain(cert_file, key_file, password=lambda: b"")  # the same bytes: it loads
        self._pem = cert_pem, key_pem
        return peer

    def _verified(self, trial: ssl.SSLContext, cert_pem: bytes) -> dict[str, Any]:
        cert = self._what("cert")
        try:
            return _handshake(trial, cert_pem)
        except ssl.SSLCertVerificationError as e:
            if e.verify_code in (_EXPIRED, _NOT_YET_VALID):
                try:
                    dates = _handshake(trial, cert_pem, _NO_CHECK_TIME)
                except (ssl.SSLError, OSError):
                    dates = {}
                if e.verify_code == _EXPIRED:
                    raise TlsError(f"{_cap(cert)} expired on {_utc(dates.get('notAfter', '?'))}; "
                                   "renew it.") from None
                raise TlsError(f"{_cap(cert)} is not valid before {_utc(dates.get('notBefore', '?'))}; "
                               "check this machine's clock.") from None
            raise TlsError(f"{_cap(cert)} cannot serve TLS: {e.verify_message}.") from None
        except (ssl.SSLError, OSError) as e:
            why = (getattr(e, "reason", None) or str(e)).lower().replace("_", " ")
            raise TlsError(f"{_cap(cert)} and its key cannot make a TLS connection: {why}.") from None

    # -- re-reading ----------------------------------------------------------------------------------------
    def check(self, *, say_now: bool = False) -> bool:
        """Load the pair again if either file changed; True when a new pair was loaded. A pair that cannot
        be used keeps the old one and is said in one log line (`say_now`: at once, else once the files have
        stayed the same for one check)."""
        self.polls += 1
        ident = self._ident()
        if ident == self._loaded:
            self._failed = None
            return False
        old = self._pem
        try:
            cert_pem, key_pem = self._read()  # changed again while read: the next check loads it once more
            peer = self._load(self.context, cert_pem, key_pem)
        except ssl.SSLError:  # the live context refused bytes a trial context took: put the old pair back
            with _as_files(*old) as (cert_file, key_file):
                self.context.load_cert_chain(cert_file, key_file, password=lambda: b"")
            self._pem = old
            raise
        except TlsError as e:
            settled = say_now or ident == self._failed
            self._failed = ident
            if settled and self._said != ident:
                self._said = ident
                self.reload_failures += 1
                log.warning("TLS: the changed certificate and key cannot be used, so the previous pair stays "
                            "in use (%s): %s", self.describe(), e)
            return False
        self.peer, self._loaded, self._failed, self._said = peer, ident, None, None
        self.loaded_at = time.time()
        self.reloads += 1
        log.info("TLS: new certificate loaded from %s: %s", self.cert_path, self.describe())
        return True

    def watch(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Check every `poll_s` seconds on `loop` (the server's), and at once on SIGHUP when this is the main
        thread. The context is only ever changed on that loop, between its handshakes."""
        self._loop = loop = loop or asyncio.get_running_loop()
        if self.poll_s:
            self._timer = loop.call_later(self.poll_s, self._tick)
        try:
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
            self._sighup = True
        except (NotImplementedError, RuntimeError, ValueError, AttributeError):  # not the main thread; Windows
            pass

    def unwatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._sighup and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_signal_handler(signal.SIGHUP)
            self._sighup = False

    def _tick(self) -> None:
        try:
            self.check()
        except Exception:  # noqa: BLE001 - a reload must never stop the server; the old pair stays
            log.exception("TLS: checking the certificate files failed")
        if self._loop is not None and self.poll_s:
            self._timer = self._loop.call_later(self.poll_s, self._tick)

    def _on_sighup(self) -> None:
        log.info("TLS: SIGHUP: looking at the certificate files")
        try:
            if not self.check(say_now=True) and self._failed is None:
                log.info("TLS: the certificate files are unchanged: %s", self.describe())
        except Exception:  # noqa: BLE001
            log.exception("TLS: checking the certificate files failed")
