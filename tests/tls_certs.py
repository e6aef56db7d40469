"""Real certificates for the TLS tests, made by the `openssl` command: a test CA and server certificates it
signs (for localhost and 127.0.0.1), valid now, expired or not yet valid.

    pki = Pki(tmp_path)                         # the CA: pki.ca_cert
    cert, key = pki.issue("a", cn="agent-a")    # valid for two days
    old, old_key = pki.issue("old", start="20200101000000Z", end="20200102000000Z")
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import pytest

_CA_CONFIG = """\
[ca]
default_ca = test_ca
[test_ca]
database = {db}/index.txt
new_certs_dir = {db}
serial = {db}/serial
default_md = sha256
policy = any_name
copy_extensions = copy
unique_subject = no
[any_name]
commonName = supplied
"""


def need_openssl() -> str:
    path = shutil.which("openssl")
    if path is None:
        pytest.skip("the openssl command is not installed (Debian: apt-get install openssl)")
    return path


class Pki:
    """A CA in `root` and the certificates it issues (EC P-256 keys)."""

    def __init__(self, root: Path) -> None:
        self.openssl = need_openssl()
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.ca_key, self.ca_cert = root / "ca.key", root / "ca.pem"
        self._run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                  "-keyout", self.ca_key, "-out", self.ca_cert, "-days", "30", "-subj", "/CN=gpuscope test CA")
        self._n = 0

    def _run(self, *args: object) -> None:
        subprocess.run([self.openssl, *map(str, args)], check=True, capture_output=True, timeout=60)

    def issue(self, name: str, *, cn: str = "localhost", start: str | None = None, end: str | None = None,
              key: Path | None = None) -> tuple[Path, Path]:
        """A certificate for `cn`, localhost and 127.0.0.1 signed by the CA, and its key (a new one, or
        `key`); valid for two days from now unless `start`/`end` (YYYYMMDDHHMMSSZ) say otherwise."""
        self._n += 1
        db = self.root / f"db{self._n}"
        db.mkdir()
        (db / "index.txt").write_text("")
        (db / "serial").write_text(f"{self._n:02X}\n")
        conf = db / "ca.cnf"
        conf.write_text(_CA_CONFIG.format(db=db))
        cert, csr = self.root / f"{name}.pem", db / "req.csr"
        new_key = key is None
        key = key or self.root / f"{name}.key"
        self._run("req", "-new", *(("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", key)
                                   if new_key else ("-key", key)),
                  "-out", csr, "-subj", f"/CN={cn}", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1")
        dates = (("-startdate", start) if start else ()) + (("-enddate", end) if end else ("-days", "2"))
        self._run("ca", "-batch", "-notext", "-config", conf, "-cert", self.ca_cert, "-keyfile", self.ca_key,
                  "-in", csr, "-out", cert, *dates)
        return cert, key

    def client_context(self) -> ssl.SSLContext:
        """A client that trusts this CA only and checks the host name."""
        return ssl.create_default_context(cafile=str(self.ca_cert))
