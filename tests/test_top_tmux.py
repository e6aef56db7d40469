"""`gpuscope top` in a real terminal: a private tmux server runs it at a fixed size, keys go in with
send-keys and the screen comes back with capture-pane."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import pytest

if shutil.which("tmux") is None:
    if os.environ.get("CI"):
        raise RuntimeError("tmux is needed for tests/test_top_tmux.py in CI (.ci/run installs it).")
    pytest.skip("tmux is not installed; the real-terminal tests of gpuscope top need it", allow_module_level=True)

TOP = [sys.executable, "-m", "gpuscope.cli", "top", "--simulate", "mixed", "--gpus", "8", "--processes", "100"]


class Tmux:
    """One private tmux server (its own socket) with one window of a fixed size."""

    def __init__(self, width: int, height: int, command: list[str]) -> None:
        self.socket = f"gpuscope-test-{uuid.uuid4().hex[:8]}"
        shell = f"{shlex.join(command)}; echo TOP-EXITED $?; sleep 600"
        env = {**os.environ, "TERM": "xterm-256color"}
        self._tmux("new-session", "-d", "-x", str(width), "-y", str(height), "sh", "-c", shell, env=env)

    def _tmux(self, *args: str, env: dict[str, str] | None = None) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True,
                              timeout=10, env=env).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p")

    def reversed_lines(self) -> list[tuple[str, bool]]:
        """Each line of the screen, and whether it starts in reverse video (SGR 7), from capture-pane -e."""
        out, reverse = [], False
        for line in self._tmux("capture-pane", "-p", "-e").splitlines():
            plain, starts = "", None
            for i, part in enumerate(re.split(r"\x1b\[([0-9;]*)m", line)):
                if i % 2 == 0:
                    if part and starts is None:
                        starts = reverse
                    plain += part
                    continue
                params = [int(x) if x else 0 for x in part.split(";")]
                j = 0
                while j < len(params):
                    if params[j] in (38, 48):  # a colour: 5;N or 2;R;G;B follow, not attributes
                        j += 3 if params[j + 1 : j + 2] == [5] else 5
                        continue
                    reverse = {0: False, 7: True, 27: False}.get(params[j], reverse)
                    j += 1
            out.append((plain, bool(starts)))
        return out

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", *keys)

    def wait(self, check: Callable[[str], bool], what: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if check(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the screen was:\n{screen}")
            time.sleep(0.2)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def tmux_factory():
    made: list[Tmux] = []

    def make(width: int, height: int, command: list[str] = TOP) -> Tmux:
        t = Tmux(width, height, command)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def _all_gpus(screen: str) -> bool:
    return "SIMULATED 'mixed'" in screen and all(f"GPU {i} " in screen for i in range(8))


def _dense_gpus(screen: str) -> bool:
    lines = screen.splitlines()
    return "SIMULATED 'mixed'" in screen and all(any(ln.startswith(f"{i}   ") for ln in lines) for i in range(8))


def _proc_rows(screen: str) -> list[str]:
    lines = screen.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("PID USER"))
    return [ln for ln in lines[head + 1:] if ln[:7].strip().isdigit()]


def test_top_at_120x40_shows_every_gpu_sorts_filters_and_quits_cleanly(tmux_factory):
    t = tmux_factory(120, 40)
    screen = t.wait(_all_gpus, "8 GPU panels and the SIMULATED marker")
    assert "NVML util (any kernel running)" in screen
    assert "SM%▼" in screen
    t.keys("s")  # next sort column: GPU memory, biggest first
    screen = t.wait(lambda s: "GPU-MEM▼" in s, "the table sorted by GPU memory")
    rows = _proc_rows(screen)
    assert rows and rows[0].split()[1] == "sim"

    t.keys("/")
    t.wait(lambda s: "filter: type a substring" in s, "the filter box")
    t.keys("g", "p", "u", "5")
    screen = t.wait(lambda s: _proc_rows(s) and all(r.split()[2] == "5" for r in _proc_rows(s)),
                    "only GPU 5's processes after filtering for 'gpu5'")
    t.keys("Enter")
    t.keys("Escape")
    # The first 12 rows by GPU memory are GPU 5's (the biggest); two pages down (a page is at least
    # six rows here) the cursor's row is another GPU's.
    t.wait(lambda s: "filter '" not in s, "the filter gone after Escape")
    t.keys("PageDown", "PageDown")
    t.wait(lambda s: any(r.split()[2] != "5" for r in _proc_rows(s)), "other GPUs' processes after Escape")

    t.keys("q")
    screen = t.wait(lambda s: "TOP-EXITED" in s, "gpuscope top to exit")
    assert "TOP-EXITED 0" in screen
    assert "gpuscope top" not in screen  # the alternate screen is gone: the shell's screen is back


def _once_json() -> dict:
    """The same simulated node as TOP, as one --once --json overview: what the screen should list."""
    out = subprocess.run([*TOP, "--once", "--json"], capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


def test_a_filter_lists_every_match_even_from_the_bottom_of_the_table_and_stays_shown(tmux_factory):
    gpu3 = sorted(p["pid"] for p in _once_json()["processes"] if p["gpu"] == "3")
    assert len(gpu3) > 1
    t = tmux_factory(160, 48)
    t.wait(lambda s: _all_gpus(s) and len(_proc_rows(s)) >= 10, "the panels and a full process table")
    t.keys("End")  # scrolled to the last of 100 rows
    t.wait(lambda s: "4070011" in s and "4060000" not in s, "the table scrolled to its end")
    t.keys("/")
    t.wait(lambda s: "filter: type a substring" in s, "the filter box")
    t.keys("g", "p", "u", "3")
    listed = lambda s: sorted(int(r.split()[0]) for r in _proc_rows(s))  # noqa: E731
    t.wait(lambda s: listed(s) == gpu3, f"all {len(gpu3)} processes of GPU 3 listed")
    t.keys("Enter")
    shown = f"filter 'gpu3': {len(gpu3)} of 100 processes"
    screen = t.wait(lambda s: shown in s and "filter: type a substring" not in s, "the filter named once applied")
    assert listed(screen) == gpu3
    t.keys("Escape")
    screen = t.wait(lambda s: len({r.split()[2] for r in _proc_rows(s)}) > 1, "every GPU's processes after Escape")
    assert "filter '" not in screen


def test_a_verdict_too_long_for_the_line_ends_in_an_ellipsis(tmux_factory):
    t = tmux_factory(120, 40)
    titles = lambda s: [ln for ln in s.splitlines() if ln.startswith("GPU ") and "(simulated)" in ln]  # noqa: E731
    screen = t.wait(lambda s: len(titles(s)) == 8 and not any("gathering" in ln for ln in titles(s)),
                    "a verdict on every GPU panel")
    cut = [ln for ln in titles(screen) if len(ln) >= 120]
    assert cut, "no verdict was longer than 120 columns"
    # A full-width title is a cut one (a summary ends in '.', which an exact fit keeps).
    assert all(ln.endswith(("…", ".")) for ln in cut), cut
    assert any(ln.endswith("…") for ln in cut), cut


_ROW = re.compile(r"^ *\d+ \S+ +\S+ +\d+\.\d GiB ")  # pid, user, GPU, then GPU memory in GiB


def test_memory_is_gib_with_one_decimal_everywhere(tmux_factory):
    wide, small = tmux_factory(160, 48), tmux_factory(80, 24)
    screen = wide.wait(lambda s: _all_gpus(s) and len(_proc_rows(s)) >= 10, "the panels and a process table")
    mems = re.findall(r" mem (\S+ \S+)", screen)
    assert len(mems) == 8 and all(re.fullmatch(r"\d+\.\d/\d+\.\d GiB", m) for m in mems), mems
    assert all(_ROW.match(r) for r in _proc_rows(screen)), _proc_rows(screen)
    assert not re.search(r"\d[KMGT]\b", screen)  # no '231.4M' or '8.0G' beside a GiB figure
    # (waited for with every GPU's SM figure in: on a loaded machine the first frames still show '-')
    screen = small.wait(lambda s: _dense_gpus(s) and len(_proc_rows(s)) >= 5
                        and sum(bool(re.match(r"\d +\d+%", ln)) for ln in s.splitlines()) == 8, "the dense view")
    assert "mem GiB" in screen
    dense = [ln for ln in screen.splitlines() if re.match(r"\d +\d+%", ln)]
    assert len(dense) == 8 and all(re.search(r"│ +(\d+%|-) +\d+\.\d/\d+\.\d ", ln) for ln in dense), dense
    assert all(_ROW.match(r) for r in _proc_rows(screen)) and not re.search(r"\d[KMGT]\b", screen)


def test_rows_that_show_the_same_figure_keep_pid_order_across_refreshes(tmux_factory):
    """Sorted by SM % and then by CPU %: on every frame, rows showing the same figure in the sort column
    are in pid order (they swapped on the noise below the shown figure, refresh after refresh)."""
    t = tmux_factory(160, 48)
    screen = t.wait(lambda s: _all_gpus(s) and len(_proc_rows(s)) >= 10, "the panels and a process table")
    for column, title in ((5, "SM%▼"), (6, "CPU%▼")):
        if title == "CPU%▼":
            t.keys("s", "s")  # GPU memory, then CPU %
            screen = t.wait(lambda s: "CPU%▼" in s, "the table sorted by CPU %")
        for _ in range(6):  # six frames, each a refresh apart (the sparklines and the clock move)
            screen = t.wait(lambda s, before=screen, title=title: s != before and title in s, "the next frame")
            rows = [r.split() for r in _proc_rows(screen)]
            assert len(rows) >= 10
            for a, b in zip(rows, rows[1:], strict=False):
                if a[column] == b[column]:
                    assert int(a[0]) < int(b[0]), f"{title}: {a[0]} before {b[0]}, both {a[column]}\n{screen}"


def test_each_process_shows_how_long_it_has_run(tmux_factory):
    launched = time.monotonic()  # before the simulated node (and its processes) start
    t = tmux_factory(160, 48)
    screen = t.wait(lambda s: _all_gpus(s) and len(_proc_rows(s)) >= 10, "the panels and a process table")
    assert "RSS  ELAPSED CONTAINER/POD" in screen

    def seconds(screen: str) -> list[int]:
        shown = [r.split()[9] for r in _proc_rows(screen)]  # pid user gpu mem GiB sm cpu rss GiB ELAPSED
        assert all(re.fullmatch(r"\d\d:\d\d", e) for e in shown), shown
        return [int(e[:2]) * 60 + int(e[3:]) for e in shown]

    first = seconds(screen)
    assert len(first) >= 10 and max(first) <= time.monotonic() - launched + 1
    screen = t.wait(lambda s: min(seconds(s)) >= max(first) + 2, "the elapsed times to count on")
    assert max(seconds(screen)) <= time.monotonic() - launched + 1


_HOST = re.compile(r"^ CPU \[([^\]]+)\] +(\d+)% +MEM \[([^\]]+)\] +(\d+)% 96\.0/512\.0 GiB +load \d+\.\d$")
_EIGHTHS = {c: i + 1 for i, c in enumerate("▏▎▍▌▋▊▉")} | {"█": 8, " ": 0}


def test_a_host_line_shows_cpu_and_memory_bars(tmux_factory):
    """The simulated host has 96 of 512 GiB in use; each bar is as full as the percentage beside it."""
    for t in (tmux_factory(160, 48), tmux_factory(80, 24)):
        screen = t.wait(lambda s: any(_HOST.match(ln) for ln in s.splitlines()), "the host line")
        found = next(m for m in map(_HOST.match, screen.splitlines()) if m)
        for cells, shown in ((found[1], found[2]), (found[3], found[4])):
            filled = sum(_EIGHTHS[c] for c in cells) / 8
            assert abs(filled / len(cells) - int(shown) / 100) <= 1 / len(cells) + 0.01, found[0]
        assert int(found[4]) == 19  # 96 / 512


def test_the_table_shows_its_first_rows_until_the_cursor_is_moved(tmux_factory):
    """The first row is the biggest SM user's (rank 0 of its GPU: a GPU's processes show one SM figure and
    tie to the pid), after the order changed in the first seconds; the cursor did not drag the page down."""
    t = tmux_factory(160, 48)
    titles = lambda s: [ln for ln in s.splitlines() if ln.startswith("GPU ") and "(simulated)" in ln]  # noqa: E731
    screen = t.wait(lambda s: len(titles(s)) == 8 and not any("gathering" in ln for ln in titles(s)),
                    "a verdict on every GPU panel (5 s of samples)")
    first = _proc_rows(screen)[0]
    assert first.endswith("--rank 0"), screen


def test_only_the_table_head_and_the_cursor_row_are_in_reverse_video(tmux_factory):
    t = tmux_factory(120, 40)
    t.wait(lambda s: _all_gpus(s) and len(_proc_rows(s)) >= 10, "the panels and a process table")
    t.keys("Down")
    t.wait(lambda s: len(_proc_rows(s)) >= 10, "the table after a move")
    lines = t.reversed_lines()
    head = next(i for i, (ln, _) in enumerate(lines) if ln.lstrip().startswith("PID USER"))
    assert lines[head][1], "the table head is not in reverse video"
    rows = [(ln, rev) for ln, rev in lines[head + 1:] if ln[:7].strip().isdigit()]
    assert len(rows) >= 10 and sum(rev for _, rev in rows) == 1, [ln[:8] for ln, rev in rows if rev]


def test_top_at_80x24_compacts_to_one_line_per_gpu(tmux_factory):
    t = tmux_factory(80, 24)
    # The first frames may come before the process table has its height: wait for the whole layout.
    screen = t.wait(lambda s: _dense_gpus(s) and len(_proc_rows(s)) >= 5,
                    "one line per GPU for all 8 GPUs and a table of processes")
    assert "NVML util*" in screen and "PID USER" in screen
    assert all(len(ln) <= 80 for ln in screen.splitlines())
    t.keys("r")  # ascending SM%
    t.wait(lambda s: "SM%▲" in s, "the sort direction reversed")
    t.keys("q")
    assert "TOP-EXITED 0" in t.wait(lambda s: "TOP-EXITED" in s, "gpuscope top to exit")


def test_top_below_80x24_says_the_terminal_is_too_small(tmux_factory):
    t = tmux_factory(60, 20)
    screen = t.wait(lambda s: "terminal too small" in s, "the too-small message")
    assert "terminal too small (need 80x24, have 60x20)" in screen
    assert "PID USER" not in screen
    t.keys("q")
    assert "TOP-EXITED 0" in t.wait(lambda s: "TOP-EXITED" in s, "gpuscope top to exit")
