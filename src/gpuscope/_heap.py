"""The C heap of a process that runs for months (the agent): glibc's malloc tuned so that RSS follows what is in
use, and free pages handed back after the big allocations.

Two glibc defaults make a long-running Python process with numpy grow without leaking (measured in the soak,
benchmarks/soak.py --heap: 90 -> 160 MB free *inside* the heap after 25 minutes, most of the RSS growth):
- the mmap threshold is dynamic: once a large block was freed, blocks up to 32 MB come from the heap instead of
  their own mapping, and a heap fragments around the long-lived small objects placed between them;
- every thread may get its own arena (up to 8 per core), each fragmenting on its own.
`tune_for_long_runs()` fixes the threshold (blocks of 1 MiB and more get their own mapping, given back whole on
free) and caps the arenas at 2, unless the user set either through the environment (MALLOC_MMAP_THRESHOLD_,
MALLOC_ARENA_MAX, GLIBC_TUNABLES), which wins. Elsewhere than glibc (musl, macOS) both functions do nothing.
Standard library only.
"""

from __future__ import annotations

import os
from typing import Any

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 1 << 20
ARENA_MAX = 2

_libc: Any = None


def _glibc() -> Any:
    global _libc
    if _libc is None:
        try:
            import ctypes

            lib = ctypes.CDLL("libc.so.6")
            _libc = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
        except (OSError, AttributeError):
            _libc = False
    return _libc


def tune_for_long_runs(environ: dict[str, str] | None = None) -> dict[str, int]:
    """Set the mmap threshold and the arena cap (before the threads start); returns what was set, {} where
    nothing was (no glibc, or the user's environment already says)."""
    env = os.environ if environ is None else environ
    libc = _glibc()
    if not libc:
        return {}
    tunables = env.get("GLIBC_TUNABLES", "")
    done: dict[str, int] = {}
    if "MALLOC_MMAP_THRESHOLD_" not in env and "mmap_threshold" not in tunables:
        if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1:
            done["mmap_threshold_bytes"] = MMAP_THRESHOLD_BYTES
    if "MALLOC_ARENA_MAX" not in env and "arena_max" not in tunables:
        if libc.mallopt(M_ARENA_MAX, ARENA_MAX) == 1:
            done["arena_max"] = ARENA_MAX
    return done


def give_back() -> int:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim), after a large allocation was freed, so
    that RSS follows what is in use rather than the highest it ever was. The bytes RSS fell by; 0 without glibc
    or /proc."""
    libc = _glibc()
    if not libc:
        return 0
    before = rss_bytes()
    libc.malloc_trim(0)
    return max(0, before - rss_bytes())


def rss_bytes() -> int:
    """This process's resident set (/proc/self/statm), 0 where there is none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
