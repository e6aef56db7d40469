"""Text from outside is made valid UTF-8 where it enters (gpuscope._text.valid_text): process names, users and
command lines from psutil and from any host reader, event messages and labels posted to the agent. Then the
store, /metrics, the JSON API, the dashboard and `top --json` all get text they can encode."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from host_fakes import FakeHostReader

from gpuscope._hostproc import HostProcessReader, HostProcInfo
from gpuscope._text import valid_text
from gpuscope.agent.events_api import parse_events
from gpuscope.sources.procs import ProcessSource
from gpuscope.testing import healthy_gpus


def encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@pytest.mark.parametrize("raw, want", [
    ("python", "python"),
    ("café 数据", "café 数据"),  # valid text is left alone
    ("ev\udcffil", "ev\\xffil"),  # psutil's surrogate escape of the byte 0xff: shown as the byte
    ("\udcc3\udca9t\udce9", "ét\\xe9"),  # escaped bytes that are valid UTF-8 together are the character
    ("a\ud800b", "a\\ud800b"),  # a lone surrogate (JSON "\ud800"): its code point, escaped
    ("\ud83d", "\\ud83d"),
    ("", ""),
])
def test_valid_text_repairs_surrogates_and_leaves_valid_text_alone(raw: str, want: str) -> None:
    out = valid_text(raw)
    assert out == want and encodable(out)
    assert valid_text(out) == out  # once repaired, stays as it is


def test_valid_text_on_valid_text_returns_the_same_object() -> None:
    s = "a plain ascii name"
    assert valid_text(s) is s


def test_the_floor_module_imports_only_the_standard_library() -> None:
    code = ("import sys, gpuscope._text; bad = [m for m in ('numpy', 'aiohttp', 'psutil') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")})
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(sys.platform != "linux", reason="process names from /proc")
def test_a_process_with_a_non_utf8_name_and_argument_reads_as_valid_text(tmp_path: Path) -> None:
    # A real process: its executable is named b"ev\xffil" and its argument is b"--x=\xfe" (any local user
    # can start one).
    exe = os.path.join(os.fsencode(tmp_path), b"ev\xffil")
    os.symlink(sys.executable, exe)
    p = subprocess.Popen([exe, "-c", "import sys, time; print('ready', flush=True); time.sleep(30)", b"--x=\xfe"],
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        info = HostProcessReader().read(p.pid)
        assert info is not None
        assert info.name == "ev\\xffil"
        assert "--x=\\xfe" in info.cmdline and encodable(info.cmdline)
        assert encodable(info.user)
    finally:
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


def test_a_host_reader_handing_over_surrogates_gives_valid_process_records(open_devices) -> None:
    fake = healthy_gpus(1)
    pid = fake.gpus[0].processes[0].pid
    reader = FakeHostReader({pid: HostProcInfo(pid=pid, name="ev\udcffil", user="b\udcfeb", cmdline="run \udcff",
                                               container="c\udc80", pod="p\udc81", namespace="n\udc82",
                                               slurm_job="j\udc83", pod_uid="u\udc84")})
    nv, devs = open_devices(fake)
    events: list = []
    src = ProcessSource(nv, reader)
    src.collect(devs, events)
    fake.gpus[0].processes.append(type(fake.gpus[0].processes[0])(pid=pid + 1))
    reader.infos[pid + 1] = HostProcInfo(pid=pid + 1, name="\ud800x")
    (rec, rec2) = sorted(src.collect(devs, events), key=lambda r: r.pid)
    assert (rec.name, rec.user, rec.cmdline) == ("ev\\xffil", "b\\xfeb", "run \\xff")
    assert (rec.container, rec.pod, rec.namespace, rec.slurm_job, rec.pod_uid) == (
        "c\\x80", "p\\x81", "n\\x82", "j\\x83", "u\\x84")
    assert rec2.name == "\\ud800x"
    assert events and all(encodable(e.message) and encodable(str(e.data)) for e in events)


def test_posted_event_text_is_made_valid() -> None:
    ev = {"kind": "guard", "type": "breaker_open", "severity": "warning", "message": "bad \ud800 text",
          "source": "guard", "labels": {"route": "/v1/\udcff"}}
    (e,) = parse_events(ev, time.time())
    assert e.message == "bad \\ud800 text" and e.data["labels"] == {"route": "/v1/\\xff"}
