"""Signalling a process from `gpuscope top`: only this machine's real processes, only your own unless
you are root, and never a pid that now names a different process."""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

import psutil

SIGNALS = {"term": int(signal.SIGTERM), "kill": int(signal.SIGKILL)}


def refusal(proc: dict[str, Any], overview: dict[str, Any], local_pids: bool, uid: int | None = None) -> str | None:
    """Why `proc` may not be signalled, in one sentence; None when it may. `uid` is the caller's
    effective uid (default this process's)."""
    pid = proc["pid"]
    if overview.get("simulated"):
        return f"Process {pid} is simulated; there is nothing to signal."
    if not local_pids or proc.get("host") not in (None, "", socket.gethostname()):
        return (f"Process {pid} runs on {proc.get('host') or 'another machine'}, whose data came from an agent; "
                "gpuscope top only signals processes of this machine that it samples itself or reads from a local agent.")
    uid = os.geteuid() if uid is None else uid
    try:
        p = psutil.Process(pid)
        owner = p.uids().real
        created = p.create_time()
    except psutil.NoSuchProcess:
        return f"Process {pid} has already exited."
    except psutil.Error as e:
        return f"Cannot inspect process {pid} ({e}); not signalling it."
    if uid != 0 and owner != uid:
        return f"Process {pid} belongs to another user (uid {owner}); you can only signal your own processes unless root."
    started = proc.get("started_at")
    if started is None:  # e.g. a process in another pid namespace: this pid may be someone else here
        return f"The start time of process {pid} is unknown, so gpuscope cannot tell that the pid still names it; not signalling it."
    if abs(created - float(started)) > 2.0:
        return f"Pid {pid} now names a different process than the one listed; not signalling it."
    return None


def send(pid: int, sig: int) -> str:
    """Send `sig` to `pid`; what happened, as one sentence for the status line."""
    name = signal.Signals(sig).name
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return f"Process {pid} had already exited."
    except PermissionError:
        return f"Not allowed to send {name} to process {pid}."
    except OSError as e:
        return f"Sending {name} to process {pid} failed: {e.strerror or e}."
    return f"Sent {name} to process {pid}."
