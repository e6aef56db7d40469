"""`gpuscope top` without a terminal: the row logic, the app under Textual's Pilot, the data sources and
`--once --json`."""

from __future__ import annotations

import asyncio
import getpass
import http.server
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from gpuscope import Sampler, SamplerConfig, viewmodel
from gpuscope.cli import main
from gpuscope.testing import healthy_gpus
from gpuscope.top import LocalFeed, StaticFeed, kill, model, open_feed
from gpuscope.top.app import ConfirmKill, ProcTable, TopApp

HOST = socket.gethostname()


def proc(pid: int, *, gpu: str = "0", user: str = "alice", command: str = "python train.py", sm: float = 0.1,
         mem: float = 1 << 30, ppid: int | None = None, started_at: float | None = None) -> dict[str, Any]:
    return {"key": f"{HOST}/{pid}/{gpu}", "host": HOST, "gpu_key": f"{HOST}/{gpu}", "gpu": gpu, "pid": pid,
            "user": user, "name": command.split()[0], "command": command, "gpu_memory_bytes": mem,
            "sm_ratio": sm, "cpu_cores": 0.5, "rss_bytes": 2 << 30, "container": "", "pod": "", "namespace": "",
            "started_at": started_at, "ppid": ppid}


def overview(procs: list[dict[str, Any]], simulated: str | None = None, healthy: bool = True) -> dict[str, Any]:
    values: dict[str, float | None] = {m: 0.5 for m in viewmodel.GPU_METRICS}
    gpu = {"key": f"{HOST}/0", "host": HOST, "gpu": "0", "uuid": "GPU-0", "name": "Test GPU", "healthy": healthy,
           "simulated": simulated, "values": values, "throttle": [], "verdict": None, "side": []}
    return {"source": "local", "simulated": simulated, "time_ns": time.time_ns(), "gpus": [gpu],
            "processes": procs, "alerts": {"firing": [], "pending": []}, "errors": []}


def pilot(app: TopApp, body: Callable[[Any], Any], size: tuple[int, int] = (120, 40)) -> None:
    async def go() -> None:
        async with app.run_test(size=size) as p:
            await p.pause()
            await body(p)

    asyncio.run(go())


def rows(app: TopApp) -> list[int]:
    return [p["pid"] for _, p in app.query_one("#procs", ProcTable).rows]


def screen_text(app: TopApp) -> str:
    return "\n".join(app.query_one(f"#{w}").text.plain for w in ("header", "gpus", "procs"))


async def until(p: Any, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await p.pause(0.05)


# -- rows --------------------------------------------------------------------------------------

def test_sort_filter_and_tree_order():
    ps = [proc(10, sm=0.2, user="bob"), proc(11, sm=0.9, ppid=10, command="worker a"),
          proc(12, sm=0.5, ppid=10, command="worker b"), proc(13, sm=0.1, ppid=12, command="grandchild")]
    by_sm = model.SORT_KEYS[0]
    assert [p["pid"] for _, p in model.ordered(ps, by_sm)] == [11, 12, 10, 13]
    assert [p["pid"] for _, p in model.ordered(ps, by_sm, reverse=True)] == [13, 10, 12, 11]
    assert [p["pid"] for _, p in model.ordered(ps, by_sm, text="WORKER")] == [11, 12]
    assert [p["pid"] for _, p in model.ordered(ps, by_sm, text="bob")] == [10]
    tree = model.ordered(ps, by_sm, tree=True)
    assert [(pre, p["pid"]) for pre, p in tree] == [("", 10), ("├─ ", 11), ("└─ ", 12), ("   └─ ", 13)]
    # A child whose parent is filtered out becomes a root.
    assert [(pre, p["pid"]) for pre, p in model.ordered(ps, by_sm, text="grandchild", tree=True)] == [("", 13)]


def test_rows_that_show_the_same_figure_stay_in_pid_order_whatever_order_they_come_in():
    import itertools

    # 8.31 % and 8.29 % both show as 8 %: the pid decides, not the noise below what is shown.
    ps = [proc(30, sm=0.0831, mem=3.04 * 2**30), proc(10, sm=0.0829, mem=3.01 * 2**30),
          proc(20, sm=0.08, mem=2.96 * 2**30), proc(40, sm=0.5, mem=1 << 30)]
    by_sm, by_mem = model.SORT_KEYS[0], model.SORT_KEYS[1]
    assert [p["pid"] for _, p in model.ordered(ps, by_sm)] == [40, 10, 20, 30]
    assert [p["pid"] for _, p in model.ordered(ps, by_sm, reverse=True)] == [10, 20, 30, 40]
    assert [p["pid"] for _, p in model.ordered(ps, by_mem)] == [10, 20, 30, 40]  # all '3.0 GiB' but 40
    for sort, reverse in itertools.product(model.SORT_KEYS, (False, True)):
        orders = {tuple(p["key"] for _, p in model.ordered(list(perm), sort, reverse))
                  for perm in itertools.permutations(ps)}
        assert len(orders) == 1, (sort.name, reverse, orders)


# -- the app -----------------------------------------------------------------------------------

def test_keys_sort_filter_and_tree_the_table():
    ps = [proc(10, sm=0.2, mem=5 << 30), proc(11, sm=0.9, mem=1 << 30, ppid=10, command="worker a"),
          proc(12, sm=0.5, mem=3 << 30, ppid=10, command="worker b")]
    app = TopApp(StaticFeed(overview(ps), local_pids=True))

    async def body(p: Any) -> None:
        assert rows(app) == [11, 12, 10]
        await p.press("s")  # GPU memory, biggest first
        assert rows(app) == [10, 12, 11] and "GPU-MEM▼" in screen_text(app)
        await p.press("r")
        assert rows(app) == [11, 12, 10] and "GPU-MEM▲" in screen_text(app)
        await p.press("slash")
        await p.pause()
        await p.press("w", "o", "r", "k", "e", "r", " ", "b")
        assert rows(app) == [12]
        await p.press("escape")
        assert rows(app) == [11, 12, 10]
        await p.press("t")
        assert [pre for pre, _ in app.query_one("#procs", ProcTable).rows] == ["", "├─ ", "└─ "]
        assert "└─ worker" in screen_text(app)

    pilot(app, body)


def test_a_filter_from_the_bottom_of_a_long_table_shows_every_match_and_names_itself():
    ps = [proc(100 + i, command=f"python {'needle' if i % 20 == 7 else 'hay'}.py {i}") for i in range(100)]
    app = TopApp(StaticFeed(overview(ps)))
    needles = [p["pid"] for p in ps if "needle" in p["command"]]

    async def body(p: Any) -> None:
        await p.press("end")
        table = app.query_one("#procs", ProcTable)
        assert table.top > 0  # scrolled: the first rows are off the page
        await p.press("slash")
        await p.pause()
        await p.press(*"needle")
        drawn = [int(ln.split()[0]) for ln in table.text.plain.splitlines()[1:] if ln.strip()]
        assert sorted(drawn) == needles
        await p.press("enter")
        await p.pause()
        assert not app.query_one("#filter").display
        assert "filter 'needle': 5 of 100 processes" in app.query_one("#footer").text.plain

    pilot(app, body)


def test_a_line_too_long_ends_in_an_ellipsis_between_words_never_mid_number():
    g = overview([])["gpus"][0]
    g["verdict"] = {"kind": "transfer_bound", "severity": "warning", "confidence": 0.9,
                    "summary": "GPU 0 is transfer-bound: PCIe moves 8.0 GB/s while the SMs are 0.4 % busy."}
    full = f"GPU 0 Test GPU  {model.verdict_text(g)}"
    for width in range(20, len(full)):
        line = model.panel_lines(g, width, [])[0]
        assert len(line) <= width and line.endswith("…"), line
        shown = line[:-1]
        assert full.startswith(shown) and full[len(shown)] == " ", line  # cut where a word ends
    assert model.panel_lines(g, len(full), [])[0] == full
    assert model.clip("0123456789", 5) == "0123…" and model.clip("0123", 5) == "0123"
    assert model.clip("… [sw_thermal,hw_thermal]", 10, words=True) == "…"  # one ellipsis, not two
    row = model.proc_line("", proc(1, command="python " + "x" * 200), 100)
    assert len(row) == 100 and row.endswith("x…")
    row = model.proc_line("", proc(1, user="averylongusername", gpu="0/mig3"), 100)
    assert " averylo… 0/m… " in row  # a cell cut to its column says so too


def test_every_memory_figure_is_gib_with_one_decimal():
    ov = overview([proc(1, mem=113 << 20)])
    g = ov["gpus"][0]
    g["values"].update(gpu_memory_used_bytes=3.25 * 2**30, gpu_memory_total_bytes=140.4 * 2**30)
    assert "mem 3.2/140.4 GiB" in model.panel_lines(g, 200, [])[2]
    assert " 3.2/140.4 " in model.dense_line(g, 120) and "mem GiB" in model.dense_head(120)
    row = model.proc_line("", ov["processes"][0], 120)
    assert "    0.1 GiB " in row and "  2.0 GiB " in row  # GPU memory 113 MiB, RSS 2 GiB
    assert "M " not in row and "G " not in row


def test_elapsed_counts_from_the_start_of_the_process_to_the_overview():
    ov = overview([proc(1, started_at=1_000_000.0), proc(2, started_at=None)])
    ov["time_ns"] = int((1_000_000 + 3725) * 1e9)
    for width in (80, 120):
        assert "ELAPSED" in model.proc_head(width, model.SORT_KEYS[0], False)
    text = model.plain(ov, 120)
    assert " 1:02:05 " in next(ln for ln in text.splitlines() if ln.startswith("      1 "))
    assert "       - " in next(ln for ln in text.splitlines() if ln.startswith("      2 "))
    app = TopApp(StaticFeed(ov))

    async def body(p: Any) -> None:
        assert " 1:02:05 " in app.query_one("#procs").text.plain

    pilot(app, body)


def test_the_host_line_shows_cpu_and_memory_bars_from_the_samplers_host_record():
    with Sampler(SamplerConfig(interval=0.1), simulate="mixed", gpus=2) as s:
        snap = s.sample_once()
    assert snap.host is not None
    hv = viewmodel.from_snapshot(snap, source="local")["host_values"]
    assert set(hv) == set(viewmodel.HOST_METRICS)
    assert hv["host_memory_total_bytes"] == 512 * 2**30 and hv["host_memory_used_bytes"] == 96 * 2**30
    assert 0 < hv["host_cpu_ratio"] <= 1 and hv["host_load1"] is not None
    line = model.host_line({**hv, "host_cpu_ratio": 0.25}, 120)
    assert len(line) <= 120 and "  25%" in line and "  19% 96.0/512.0 GiB" in line and "load " in line
    cpu_bar, mem_bar = (seg.split("]")[0] for seg in line.split("[")[1:])
    assert len(cpu_bar) == len(mem_bar) and cpu_bar.count("█") == len(cpu_bar) // 4
    assert model.host_line({m: None for m in viewmodel.HOST_METRICS}, 120) is None

    ov = overview([proc(1)])
    ov["host_values"] = {**hv, "host_cpu_ratio": 0.5}
    app = TopApp(StaticFeed(ov))

    async def body(p: Any) -> None:
        shown = app.query_one("#host").text.plain
        assert shown.startswith(" CPU [") and "  50%" in shown and "96.0/512.0 GiB" in shown

    pilot(app, body)
    bare = TopApp(StaticFeed(overview([proc(1)])))  # a source without host numbers: no empty bars

    async def none(p: Any) -> None:
        assert not bare.query_one("#host").display

    pilot(bare, none)


def test_the_table_stays_on_its_first_row_until_the_cursor_is_moved_then_follows_the_process():
    before = [proc(100 + i, sm=0.9 - i / 100) for i in range(60)]  # 100 first, 159 last
    feed = StaticFeed(overview(before))
    app = TopApp(feed, refresh=0.05)

    async def body(p: Any) -> None:
        procs = app.query_one("#procs", ProcTable)
        assert rows(app)[0] == 100 and procs.cursor == 0
        feed._publish(overview([{**q, "sm_ratio": 1 - q["sm_ratio"]} for q in before]))  # the order turns over
        await until(p, lambda: rows(app)[0] == 159)
        assert procs.cursor == 0 and procs.top == 0  # not dragged down to wherever pid 100 went
        assert procs.text.plain.splitlines()[1].lstrip().startswith("159 ")
        await p.press("down")  # now the user picked pid 158: it is followed
        feed._publish(overview(before))
        await until(p, lambda: rows(app)[0] == 100)
        assert procs.selected()["pid"] == 158 and procs.cursor == 58
        assert procs.top <= 58 < procs.top + procs.page

    pilot(app, body)


def test_only_the_head_and_the_cursor_row_are_drawn_reversed():
    from rich.console import Console

    app = TopApp(StaticFeed(overview([proc(100 + i, sm=0.9 - i / 100) for i in range(10)])))

    async def body(p: Any) -> None:
        await p.press("down", "down")
        console = Console()
        lines = app.query_one("#procs", ProcTable).text.split("\n")
        reversed_ = [i for i, ln in enumerate(lines) if ln.plain and ln.get_style_at_offset(console, 0).reverse]
        assert reversed_ == [0, 3]  # the head, and the third row where the cursor is

    pilot(app, body)


def test_a_nan_in_the_history_is_a_gap_not_a_crash():
    assert model.sparkline([0.5, float("nan"), float("inf"), None, 1.0], 5) == "▄···█"


def test_kill_asks_first_then_terminates_the_users_own_process():
    child = subprocess.Popen(["sleep", "60"])
    try:
        me = proc(child.pid, user=getpass.getuser(), command="sleep 60",
                  started_at=psutil.Process(child.pid).create_time())
        app = TopApp(StaticFeed(overview([me]), local_pids=True))

        async def body(p: Any) -> None:
            await p.press("k")
            await p.pause()
            assert isinstance(app.screen, ConfirmKill)
            assert child.poll() is None  # nothing sent before the answer
            await p.press("y")
            await p.pause()
            assert child.wait(timeout=10) == -15
            assert f"Sent SIGTERM to process {child.pid}" in screen_text(app)

        pilot(app, body)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_kill_is_cancelled_by_n():
    child = subprocess.Popen(["sleep", "60"])
    try:
        me = proc(child.pid, user=getpass.getuser(), started_at=psutil.Process(child.pid).create_time())
        app = TopApp(StaticFeed(overview([me]), local_pids=True))

        async def body(p: Any) -> None:
            await p.press("k")
            await p.pause()
            assert isinstance(app.screen, ConfirmKill)
            await p.press("n")
            await p.pause()
            assert not isinstance(app.screen, ConfirmKill)

        pilot(app, body)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("case", ["simulated", "remote", "other_user"])
def test_kill_refuses_with_a_sentence(case):
    child = subprocess.Popen(["sleep", "60"])
    try:
        target = proc(1 if case == "other_user" else child.pid)
        ov = overview([target], simulated="mixed" if case == "simulated" else None)
        # As a non-root user (uid 65534 'nobody' owns neither pid 1 nor the child).
        app = TopApp(StaticFeed(ov, local_pids=case != "remote"), uid=65534)
        expected = {"simulated": "is simulated", "remote": "only signals processes of this machine",
                    "other_user": "belongs to another user"}[case]

        async def body(p: Any) -> None:
            await p.press("k")
            await p.pause()
            assert not isinstance(app.screen, ConfirmKill)
            assert expected in screen_text(app)

        pilot(app, body)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_kill_refuses_a_reused_pid_and_reports_a_gone_one():
    me = proc(os.getpid(), started_at=psutil.Process().create_time() - 100)
    assert "different process" in kill.refusal(me, overview([me]), True)
    child = subprocess.Popen(["true"])
    child.wait()
    assert "already exited" in kill.refusal(proc(child.pid), overview([]), True)
    assert "already exited" in kill.send(child.pid, 15)


def test_kill_refuses_a_pid_whose_start_time_is_unknown():
    me = proc(os.getpid(), user=getpass.getuser(), started_at=None)
    assert "start time of process" in kill.refusal(me, overview([me]), True)


def test_kill_checks_the_pid_again_when_the_answer_comes():
    child = subprocess.Popen(["sleep", "60"])
    try:
        me = proc(child.pid, user=getpass.getuser(), command="sleep 60",
                  started_at=psutil.Process(child.pid).create_time())
        app = TopApp(StaticFeed(overview([me]), local_pids=True))

        async def body(p: Any) -> None:
            await p.press("k")
            await p.pause()
            assert isinstance(app.screen, ConfirmKill)
            me["started_at"] -= 100  # while the dialog stands open, the pid comes to name another process
            await p.press("y")
            await p.pause()
            assert "different process" in screen_text(app)

        pilot(app, body)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_the_gpu_lost_scenario_shows_lost_and_the_view_keeps_running():
    sampler = Sampler(SamplerConfig(interval=0.1), simulate="gpu_lost")
    sampler.nvml.lib.t0 -= 11.0  # the scenario loses GPU 1 ten seconds in; start past that
    feed = LocalFeed(sampler, 0.05).start()
    try:
        app = TopApp(feed, refresh=0.05)

        async def body(p: Any) -> None:
            await until(p, lambda: "LOST" in screen_text(app))
            first = app.query_one("#header").text.plain
            assert "SIMULATED 'gpu_lost'" in first
            await until(p, lambda: app.query_one("#header").text.plain != first)  # still updating

        pilot(app, body)
    finally:
        feed.stop()


HOSTILE = "python -c '[bold]x[/bold] [/nope] \x1b]0;owned\x07\x1b[31mRED\x1b[0m\nSECOND\u202eLINE'"


def test_escape_codes_and_markup_in_a_command_line_show_literally():
    """A command line is anyone's text: terminal escapes and newlines are drawn as escapes, Textual/Rich
    markup as the brackets it is, in the table, the kill dialog and --once."""
    me = proc(os.getpid(), user=getpass.getuser(), command=HOSTILE, sm=0.9,  # the first row, selected
              started_at=psutil.Process().create_time())
    ov = overview([me, proc(2, command="other")])
    ov["gpus"][0]["name"] = "GPU\x1b[2J"
    app = TopApp(StaticFeed(ov, local_pids=True))

    async def body(p: Any) -> None:
        shown = screen_text(app)
        assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown
        assert "[/nope] \\x1b]0;owned\\x07\\x1b[31mRED" in shown and "GPU\\x1b[2J" in shown
        table = app.query_one("#procs", ProcTable).text.plain.splitlines()
        assert len(table) == 3  # head and two rows: the newline did not start a row of its own
        await p.press("k")  # the dialog once raised MarkupError on '[/nope]' and took the app down
        await p.pause()
        assert isinstance(app.screen, ConfirmKill)
        from textual.widgets import Static

        dialog = str(app.screen.query(Static).first().render())
        assert "[bold]x[/bold] [/nope] \\x1b]0;owned" in dialog and "\x1b" not in dialog
        await p.press("n")

    pilot(app, body, size=(200, 40))
    text = model.plain(ov, 200)
    assert "\x1b" not in text and "\\x1b[31mRED" in text


def test_too_small_terminal_says_so():
    app = TopApp(StaticFeed(overview([proc(10)])))

    async def body(p: Any) -> None:
        assert app.query_one("#small").text.plain == "terminal too small (need 80x24, have 70x20)"
        assert not app.query_one("#main").display

    pilot(app, body, size=(70, 20))


def test_a_screenshot_of_the_simulated_mixed_node_says_it_is_simulated():
    """The README's picture: the TUI on `--simulate mixed --gpus 8 --processes 100`, once every GPU has a
    verdict. Set GPUSCOPE_RECORD_DIR to keep it (docs/img/top-simulated-mixed.svg is one)."""
    feed = LocalFeed(Sampler(SamplerConfig(interval=0.1), simulate="mixed", gpus=8, processes=100), 0.25).start()
    try:
        app = TopApp(feed, refresh=0.25)
        svg: list[str] = []

        async def body(p: Any) -> None:
            await until(p, lambda: screen_text(app).count("GPU ") >= 8 and "gathering" not in screen_text(app)
                        and app.query_one("#host").display)
            svg.append(app.export_screenshot(title="gpuscope top --simulate mixed (SIMULATED data, not real GPUs)"))

        pilot(app, body, size=(140, 44))
    finally:
        feed.stop()
    import html

    text = html.unescape(svg[0]).replace("\u00a0", " ")
    for needle in ("SIMULATED", "SIMULATED 'mixed'", "CPU", "MEM", "ELAPSED", "GiB", "transfer_bound"):
        assert needle in text, needle
    if os.environ.get("GPUSCOPE_RECORD_DIR"):
        out = os.path.join(os.environ["GPUSCOPE_RECORD_DIR"], "top-simulated-mixed.svg")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write(svg[0])


# -- sources -------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_nvml_sampler() -> Sampler:
    return Sampler(SamplerConfig(interval=0.1), nvml=healthy_gpus())


def test_no_agent_falls_back_to_sampling_here_and_says_so():
    url = f"http://127.0.0.1:{free_port()}"
    feed = open_feed(url, None, 0.1, local=fake_nvml_sampler)
    assert isinstance(feed, LocalFeed)
    assert f"No gpuscope agent answers at {url}" in feed.note and "sampling this machine" in feed.note
    feed.start()
    try:
        app = TopApp(feed, refresh=0.1)

        async def body(p: Any) -> None:
            await until(p, lambda: "No gpuscope agent answers" in app.query_one("#header").text.plain)
            await until(p, lambda: "GPU 0" in screen_text(app))

        pilot(app, body)
    finally:
        feed.stop()


class _Refusing(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps({"error": "This request needs the agent's token."}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def refusing_agent():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_wrong_token_is_a_clear_message(refusing_agent, capsys):
    feed = open_feed(refusing_agent, "wrong", 0.1, local=fake_nvml_sampler)
    assert "answered 401: This request needs the agent's token" in feed.note
    feed.sampler.stop()
    # Without a GPU to fall back on: exit 1 and one sentence that says both.
    assert main(["top", "--once", "--url", refusing_agent, "--token", "wrong"]) == 1
    err = capsys.readouterr().err.strip()
    assert "answered 401" in err and "no NVIDIA GPU here" in err and "--simulate mixed" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("url", ["http://[::1", "http://[nope]:80", "http://h:99999", "ftp://agent", "agent:9471"])
def test_a_malformed_url_is_a_usage_error_not_a_fallback(url, capsys):
    # exit 2 before anything else: a typo in --url must not quietly sample the local GPUs instead
    assert main(["top", "--once", "--url", url]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpuscope: ") and "--url" in err and len(err.splitlines()) == 1


def test_once_json_prints_one_overview(capsys):
    assert main(["top", "--simulate", "mixed", "--gpus", "8", "--processes", "100", "--once", "--json"]) == 0
    ov = json.loads(capsys.readouterr().out)
    assert ov["simulated"] == "mixed" and ov["source"] == "local"
    assert len(ov["gpus"]) == 8 and len(ov["processes"]) == 100
    assert set(ov["gpus"][0]["values"]) == set(viewmodel.GPU_METRICS)


def test_once_plain_text(capsys):
    assert main(["top", "--simulate", "mixed", "--gpus", "2", "--once"]) == 0
    out = capsys.readouterr().out
    assert "SIMULATED node" in out and "NVML util*" in out and "PID USER" in out


@pytest.mark.parametrize("args, needle", [
    (["--refresh", "0.01"], "--refresh must be between"),
    (["--refresh", "0"], "must be positive"),
    (["--refresh", "soon"], "--refresh"),
    (["--json"], "add --once"),
    (["--simulate", "mixed", "--url", "http://x:1"], "give one"),
    (["--gpus", "2"], "add --simulate"),
])
def test_bad_flags_are_one_sentence_and_exit_2(args, needle, capsys):
    assert main(["top", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_the_cheap_snapshot_dict_gives_the_same_overview_as_asdict():
    from gpuscope.top.feed import snapshot_dict

    with Sampler(SamplerConfig(interval=0.1), simulate="mixed", gpus=8, processes=100) as s:
        s.sample_once()
        time.sleep(0.05)
        snap = s.sample_once()
    assert viewmodel.from_snapshot(snapshot_dict(snap), source="local") == viewmodel.from_snapshot(snap, source="local")
