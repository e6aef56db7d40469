"""gpuscope._heap: glibc's malloc tuned for a process that runs for months, shown in fresh interpreters (whose heap
is known; this one's depends on the tests run before)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuscope import _heap

SRC = str(Path(_heap.__file__).resolve().parents[1])

# After a large block was freed, glibc raises its mmap threshold (up to 32 MB): the next blocks of that size come
# from the heap, where they fragment it. Tuned, a 4 MB block always gets its own mapping and goes back whole.
PROBE = """
import ctypes, json, os, sys
sys.path.insert(0, sys.argv[1])
from gpuscope import _heap
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MI
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
done = _heap.tune_for_long_runs() if sys.argv[2] == "tuned" else {}
libc.free(libc.malloc(8 << 20))  # frees a mapped block: glibc's dynamic threshold rises to 8 MB
before = libc.mallinfo2().hblkhd
b = libc.malloc(4 << 20)
print(json.dumps({"done": done, "mapped_delta": libc.mallinfo2().hblkhd - before}))
"""


def run_probe(mode: str, **env: str) -> dict:
    import os

    out = subprocess.run([sys.executable, "-c", PROBE, SRC, mode], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))} | env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_tuned_large_blocks_get_their_own_mapping():
    plain, tuned = run_probe("plain"), run_probe("tuned")
    assert plain["mapped_delta"] == 0  # untuned: the 4 MB block came from the heap (the threshold had risen)
    assert tuned["done"] == {"mmap_threshold_bytes": 1 << 20, "arena_max": 2}
    assert tuned["mapped_delta"] >= 4 << 20  # tuned: its own mapping, returned whole on free


def test_the_users_environment_wins():
    got = run_probe("tuned", MALLOC_ARENA_MAX="4", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536")
    assert got["done"] == {}
    assert _heap.tune_for_long_runs({"MALLOC_MMAP_THRESHOLD_": "1", "MALLOC_ARENA_MAX": "1"}) == {}


def test_give_back_and_rss_are_numbers():
    assert _heap.rss_bytes() > 0
    assert _heap.give_back() >= 0
