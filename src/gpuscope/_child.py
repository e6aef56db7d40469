"""The command gpuscope supervises (`gpuscope run`, `gpuscope trace run`): check it, start it, pass
signals on to it, and never leave it or what it started running behind.

Decisions this module holds:

- The child inherits our stdin, stdout and stderr (no pipes): its output goes where ours goes without
  passing through us, so a child that writes hundreds of MB as fast as it can costs us no memory and no
  CPU, and a slow reader slows the child, never our sampling (tests/test_child.py).
- It stays in our process group: a terminal's Ctrl-C reaches it directly, as it would without
  gpuscope in front. A signal sent to gpuscope alone is forwarded (`Forwarder`).
- Exit codes are a shell's: 127 for a command that is not there, 126 for one that cannot run, 2 for
  no command at all; 128 + N when signal N ended the child (`exit_code`).
- Every wait for an ending process is bounded (`TERM_GRACE_S`, then SIGKILL).

Standard library only, also inside functions (tests/test_architecture.py): the processes a child
started are the caller's to find (psutil, in runcmd and trace run) and come in as handles (`Proc`, which
psutil.Process and subprocess.Popen both are). Their errors are the library's own (psutil.NoSuchProcess
is no OSError), so a call on a handle that raises counts as "gone" (signals) or "not ended yet" (waits).

>>> check(["no-such-command-here"])
Traceback (most recent call last):
    ...
gpuscope._child.RunError: Command not found: no-such-command-here.
>>> import sys
>>> child = start([sys.executable, "-c", "raise SystemExit(3)"])
>>> exit_code(child.wait())
3
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from .errors import UserError

__all__ = ["TERM_GRACE_S", "Forwarder", "Proc", "RunError", "check", "exit_code", "reap", "reap_all", "start"]

TERM_GRACE_S = 5.0  # after SIGTERM, this long before SIGKILL


class Proc(Protocol):
    """A process handle: psutil.Process (which checks that the pid was not reused) or subprocess.Popen."""

    pid: Any

    def send_signal(self, sig: int) -> Any: ...

    def terminate(self) -> Any: ...

    def kill(self) -> Any: ...

    def wait(self, timeout: float | None = None) -> Any: ...


class RunError(UserError, RuntimeError):
    """One sentence for the user (the command could not be started). `code` is the exit code."""

    def __init__(self, message: str, code: int = 127) -> None:
        super().__init__(message)
        self.code = self.exit_code = code


def check(cmd: list[str]) -> None:
    """Refuse, before anything else is touched (GPUs, files), a command that cannot run: a typo gets
    its sentence at once, not after the sampler opened. Not executable (126) is found by `start`."""
    if not cmd:
        raise RunError("Nothing to run: give a command after --, e.g. gpuscope run -- python train.py.", 2)
    if not cmd[0].strip():  # `run -- "$UNSET_VAR"`: which('') is None and the message read "Command not found: ."
        raise RunError("The command to run is an empty string; give one after --, e.g. gpuscope run -- python "
                       "train.py.", 2)
    if os.sep not in cmd[0] and shutil.which(cmd[0]) is None:
        raise RunError(f"Command not found: {cmd[0]}.", 127)
    if os.sep in cmd[0] and not os.path.exists(cmd[0]):
        raise RunError(f"Command not found: {cmd[0]} does not exist.", 127)
    if os.sep in cmd[0] and os.path.isdir(cmd[0]):
        raise RunError(f"Cannot run {cmd[0]}: it is a directory.", 126)


def start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `cmd` with our stdin/stdout/stderr and process group (see the module's decisions); `env`
    None is ours. A command that cannot be executed is a RunError with exit code 126."""
    try:
        return subprocess.Popen(cmd, env=env)
    except PermissionError:
        raise RunError(f"Cannot run {cmd[0]}: permission denied (is it executable?).", 126) from None
    except OSError as e:
        raise RunError(f"Cannot run {cmd[0]}: {(e.strerror or str(e)).rstrip('.')}.", 126) from None


def exit_code(returncode: int | None) -> int:
    """The exit code gpuscope ends with for a child's `returncode`, as a shell says it: the child's own,
    128 + N when signal N ended it, 1 when it has none."""
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode


def _terminal_reaches(pgrp: int) -> bool:
    """True when a terminal's Ctrl-C reaches process group `pgrp` by itself (it is the foreground group
    of our controlling terminal), so forwarding would deliver the signal twice."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == pgrp
    except OSError:
        return False
    finally:
        os.close(fd)


class Forwarder:
    """The SIGINT/SIGTERM handler while a command runs under gpuscope (`run`, `trace`): a signal sent
    to gpuscope alone goes to the command and every process it started (as a terminal's Ctrl-C would;
    not again when the terminal already delivered it); a second one terminates the command, and
    `kill_if_overdue` kills it when it is still there a grace period later.

    `descendants(child)` lists the processes the command started (`Proc` handles); it is asked at each
    signal, as the tree changes while the command runs. The handler never raises: an exception from a
    signal handler would surface at whatever line the main thread was on. One process gone meanwhile
    (or a listing that failed because the command just ended) is skipped, and the others still get it.
    """

    def __init__(self, descendants: Callable[[subprocess.Popen[bytes]], Iterable[Proc]]) -> None:
        self.descendants = descendants
        self.child: subprocess.Popen[bytes] | None = None
        self.interrupts = 0
        self._old: dict[int, Any] = {}
        self._terminated_at: float | None = None

    def __call__(self, signum: int, _frame: Any) -> None:
        self.interrupts += 1
        child = self.child
        if child is None or child.poll() is not None:
            return
        try:
            if self.interrupts >= 2:
                child.terminate()
                return
            if signum == signal.SIGINT and _terminal_reaches(os.getpgid(child.pid)):
                return
            # The tree is listed before the child is signalled: a child that exits on the signal at once
            # leaves its children to init, and they would no longer be found as its descendants.
            tree = list(self.descendants(child))
            child.send_signal(signum)
        except Exception:  # the command ended meanwhile; its processes are reaped by the caller's clean-up
            return
        for p in tree:
            _quietly(p.send_signal, signum)

    def install(self) -> None:
        """Take SIGINT and SIGTERM over (from the main thread) until `restore`."""
        self._old = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def kill_if_overdue(self, grace_s: float) -> None:
        """Called from the supervising loop at each turn: once a second signal terminated the command,
        SIGKILL it if it still runs `grace_s` later (`run`: 5 s; `trace`: 30 s to write its traces)."""
        if self.interrupts < 2 or self.child is None:
            return
        now = time.monotonic()
        if self._terminated_at is None:
            self._terminated_at = now
        elif now - self._terminated_at > grace_s:
            self.child.kill()


def _quietly(call: Callable[..., Any], *args: Any) -> bool:
    """`call(*args)`; False when it raised (a handle's own error: gone, not ours any more, timed out)."""
    try:
        call(*args)
    except Exception:
        return False
    return True


def reap(child: subprocess.Popen[bytes], grace_s: float = TERM_GRACE_S) -> None:
    """We are leaving: never leave the child behind. SIGTERM, `grace_s` to end, then SIGKILL."""
    if child.poll() is not None:
        return
    try:
        child.terminate()
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    except ProcessLookupError:
        child.wait()


def reap_all(procs: Sequence[Proc], grace_s: float = TERM_GRACE_S) -> None:
    """End every one of `procs`, which need not be our children (orphans reparented to init): SIGTERM
    to all, `grace_s` for all together, SIGKILL to those still there, then at most 1 s more for them.
    One already gone is skipped; the whole takes at most `grace_s` + 1 s."""
    for p in procs:
        _quietly(p.terminate)
    end = time.monotonic() + grace_s
    alive = [p for p in procs if not _quietly(p.wait, max(0.0, end - time.monotonic()))]
    for p in alive:
        _quietly(p.kill)
    end = time.monotonic() + 1.0
    for p in alive:
        _quietly(p.wait, max(0.0, end - time.monotonic()))
