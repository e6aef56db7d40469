"""The Textual app of `gpuscope top`. It draws a few plain text widgets and repaints one only when its
text changed, so a refresh costs little and nothing flickers over SSH.
"""

from __future__ import annotations

import os
import time
from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Button, Input, Static

from . import kill, model
from .feed import Feed

MIN_W, MIN_H = 80, 24
_SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": ""}


class Lines(Widget):
    """Text that repaints only when it changes."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.text = Text()

    def show(self, text: Text) -> None:
        if text != self.text:
            self.text = text
            self.refresh()

    def render(self) -> Text:
        return self.text


class ProcTable(Lines, can_focus=True):
    """The process rows, drawing only those that fit; a cursor row that, once moved, follows its process
    (until then it stays on the first row, so the biggest users stay in sight as the order changes)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.head = ""
        self.rows: list[tuple[str, dict[str, Any]]] = []
        self.now_s: float | None = None  # the overview's time, for ELAPSED
        self.cursor = 0
        self.top = 0
        self._selected_key: str | None = None  # set by the user's first move

    def set_rows(self, head: str, rows: list[tuple[str, dict[str, Any]]], now_s: float | None = None) -> None:
        self.head, self.rows, self.now_s = head, rows, now_s
        keys = [p["key"] for _, p in rows]
        if self._selected_key in keys:
            self.cursor = keys.index(self._selected_key)
        self.cursor = max(0, min(self.cursor, len(rows) - 1))
        self.redraw()

    def move(self, delta: int) -> None:
        self.cursor = max(0, min(self.cursor + delta, len(self.rows) - 1))
        if self.rows:
            self._selected_key = self.rows[self.cursor][1]["key"]
        self.redraw()

    @property
    def page(self) -> int:
        return max(1, self.size.height - 1)

    def selected(self) -> dict[str, Any] | None:
        return self.rows[self.cursor][1] if self.rows else None

    def redraw(self) -> None:
        width, page = self.size.width or MIN_W, self.page
        # No empty page below the last row: when a filter shrinks the list, an offset left over from a
        # scrolled-down table would hide every match but the last.
        self.top = min(self.top, max(0, len(self.rows) - page))
        self.top = min(max(self.top, self.cursor - page + 1), self.cursor)
        # Appended, not Text(head, style=...): that style is the whole text's base, and it reversed every row
        # (the cursor's row could not be told from the others).
        text = Text()
        text.append(self.head.ljust(width) + "\n", style="bold reverse")
        for i in range(self.top, min(self.top + page, len(self.rows))):
            prefix, p = self.rows[i]
            text.append(model.proc_line(prefix, p, width, self.now_s) + "\n", style="reverse" if i == self.cursor else "")
        if not self.rows:
            text.append("(no process on any GPU matches)" if self.head else "")
        self.show(text)

    def on_resize(self) -> None:
        self.redraw()


class ConfirmKill(ModalScreen[int | None]):
    """Asks before signalling a process; the answer is the signal number, or None."""

    BINDINGS = [Binding("y", "answer('term')", "SIGTERM"), Binding("K", "answer('kill')", "SIGKILL"),
                Binding("n,escape", "answer('cancel')", "cancel")]
    DEFAULT_CSS = """
    ConfirmKill { align: center middle; }
    #dialog { width: 70; height: auto; border: thick $error; background: $surface; padding: 1 2; }
    #buttons { height: auto; margin-top: 1; }
    """

    def __init__(self, proc: dict[str, Any]) -> None:
        super().__init__()
        self.proc = proc

    def compose(self) -> ComposeResult:
        p = self.proc
        with Vertical(id="dialog"):
            # Plain text: a command line like "[/x]" is Textual markup, which crashed the app here.
            yield Static(f"Send SIGTERM to process {p['pid']} ({model.printable(p['user'])}) on GPU "
                         f"{model.printable(p['gpu'])}?\n{model.printable(p['command'] or p['name'])[:200]}",
                         markup=False)
            with Horizontal(id="buttons"):
                yield Button("SIGTERM (y)", id="term", variant="warning")
                yield Button("SIGKILL (K)", id="kill", variant="error")
                yield Button("Cancel (n)", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_answer(event.button.id or "cancel")

    def action_answer(self, which: str) -> None:
        self.dismiss(kill.SIGNALS.get(which))


class TopApp(App[None]):
    """`gpuscope top`: reads `feed.latest()` every `refresh` seconds and shows what changed."""

    TITLE = "gpuscope top"
    AUTO_FOCUS = "#procs"  # not the hidden filter box, or the first key typed would become a filter
    CSS = """
    Screen { layout: vertical; overflow: hidden; }
    #header { height: 2; }
    #gpus { height: 1; }
    #host { height: 1; }
    #procs { height: 1fr; }
    #footer { height: 1; }
    #filter { height: 1; border: none; padding: 0 1; display: none; }
    #small { display: none; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"), Binding("s", "sort", "sort"), Binding("r", "reverse", "reverse"),
        Binding("slash", "filter", "filter"), Binding("escape", "clear_filter", "clear filter", show=False),
        Binding("t", "tree", "tree"), Binding("k", "kill", "kill"),
        Binding("up", "move(-1)", show=False), Binding("down", "move(1)", show=False),
        Binding("pageup", "move(-1000001)", show=False), Binding("pagedown", "move(1000001)", show=False),
        Binding("home", "move(-1000000000)", show=False), Binding("end", "move(1000000000)", show=False),
    ]

    def __init__(self, feed: Feed, refresh: float = 0.25, uid: int | None = None) -> None:
        super().__init__()
        self.feed, self.refresh_s = feed, refresh
        self.uid = os.geteuid() if uid is None else uid
        self.rings = model.Rings()
        self.sort_index, self.reverse, self.filter_text, self.tree_view = 0, False, "", False
        self.status, self.status_until = "", 0.0
        self._ov: dict[str, Any] | None = None
        self._rows_dirty = True
        self._gpu_height = 0

    def compose(self) -> ComposeResult:
        with Vertical(id="main"):
            yield Lines(id="header")
            yield Lines(id="gpus")
            yield Lines(id="host")
            yield ProcTable(id="procs")
            yield Input(placeholder="filter: type a substring of pid, user, command, container; Enter keeps, Esc clears",
                        id="filter")
            yield Lines(id="footer")
        yield Lines(id="small")

    def on_mount(self) -> None:
        self.set_interval(self.refresh_s, self.tick)
        self.tick()

    # -- drawing -----------------------------------------------------------------------------------
    def tick(self) -> None:
        ov = self.feed.latest()
        if ov is not self._ov:
            self._ov = ov
            self._rows_dirty = True
            if ov is not None:
                self.rings.push(ov["gpus"])
        self.draw()

    def on_resize(self) -> None:
        self._rows_dirty = True
        self.draw()

    def draw(self) -> None:
        try:
            self._draw()
        except NoMatches:  # a tick that lands while the app tears its screen down: nothing to draw on
            return

    def _draw(self) -> None:
        w, h = self.size.width, self.size.height
        small = w < MIN_W or h < MIN_H
        main, note = self.query_one("#main"), self.query_one("#small", Lines)
        if main.display == small:
            main.display, note.display = not small, small
        if small:
            note.show(Text(f"terminal too small (need {MIN_W}x{MIN_H}, have {w}x{h})"))
            return
        ov = self._ov
        self.query_one("#header", Lines).show(self._header(ov, w))
        if ov is not None:
            self._draw_gpus(ov, w, h)
            line = model.host_line(ov.get("host_values") or {}, w)
            host = self.query_one("#host", Lines)
            if host.display != (line is not None):
                host.display = line is not None
            host.show(Text(line or ""))
            if self._rows_dirty:
                self._rows_dirty = False
                sort = model.SORT_KEYS[self.sort_index]
                rows = model.ordered(ov["processes"], sort, self.reverse, self.filter_text,
                                     self.tree_view and self.feed.local_pids)
                self.query_one("#procs", ProcTable).set_rows(model.proc_head(w, sort, self.reverse), rows,
                                                             ov["time_ns"] / 1e9)
        self.query_one("#footer", Lines).show(self._footer(ov, w))

    def _footer(self, ov: dict[str, Any] | None, w: int) -> Text:
        text = Text()
        if self.filter_text:  # on the one line drawn whatever else the header has to say
            shown = len(self.query_one("#procs", ProcTable).rows)
            text.append(f" filter '{model.printable(self.filter_text)}': {shown} of "
                        f"{len((ov or {}).get('processes', ()))} processes (Esc clears) ", style="bold black on cyan")
        text.append(f" q quit  s sort ({model.SORT_KEYS[self.sort_index].title})  r reverse  / filter  t tree"
                    f"{' (on)' if self.tree_view else ''}  k kill  ↑↓ PgUp PgDn select", style="dim")
        text.truncate(w, overflow="ellipsis")
        return text

    def _header(self, ov: dict[str, Any] | None, w: int) -> Text:
        text = Text(" gpuscope top ", style="bold")
        if ov is not None and ov.get("simulated"):
            text.append(f" SIMULATED '{model.printable(ov['simulated'])}' ", style="bold black on yellow")
        if ov is not None:
            host = model.printable(ov["gpus"][0]["host"]) if ov["gpus"] else ""
            text.append(f" {len(ov['gpus'])} GPUs │ {len(ov['processes'])} processes │ "
                        f"{time.strftime('%H:%M:%S', time.localtime(ov['time_ns'] / 1e9))} │ {host}")
        text.append(f" │ {model.printable(self.feed.describe)}")
        text.truncate(w, overflow="ellipsis")
        text.append("\n")
        text.append_text(self._second_line(ov, w))
        return text

    def _second_line(self, ov: dict[str, Any] | None, w: int) -> Text:
        if self.status and time.monotonic() < self.status_until:
            return Text(model.clip(f" {model.printable(self.status)}", w, words=True), style="bold")
        errors = (ov or {}).get("errors") or ([self.feed.error] if self.feed.error else [])
        if errors:
            return Text(model.clip(f" {model.printable(errors[0])}", w, words=True), style="bold red")
        if ov is None:
            return Text(model.clip(" waiting for the first sample ...", w, words=True))
        if self.feed.note:
            return Text(model.clip(f" {model.printable(self.feed.note)}", w, words=True), style="yellow")
        firing, pending = len(ov["alerts"]["firing"]), len(ov["alerts"]["pending"])
        bits = [f"alerts: {firing} firing, {pending} pending" if firing or pending else "no alert firing"]
        bits.append("* NVML util = share of time any kernel ran, not how busy the SMs are")
        return Text(model.clip(" " + "  │  ".join(bits), w, words=True), style="red" if firing else "dim")

    def _draw_gpus(self, ov: dict[str, Any], w: int, h: int) -> None:
        gpus = ov["gpus"]
        room = h - 2 - 1 - 1 - 6  # header, host line, footer, and at least a table head and five process rows
        panels = w >= 120 and 3 * len(gpus) <= room
        text = Text()
        if panels:
            for g in gpus:
                style = _SEVERITY_STYLE[model.severity(g)]
                for i, line in enumerate(model.panel_lines(g, w, self.rings.get(g["key"]))):
                    text.append(line + "\n", style=("bold " + style) if i == 0 else style if not g["healthy"] else "")
        else:
            text.append(model.dense_head(w) + "\n", style="bold")
            shown = gpus if len(gpus) + 1 <= room else gpus[:max(0, room - 2)]
            for g in shown:
                text.append(model.dense_line(g, w) + "\n", style=_SEVERITY_STYLE[model.severity(g)])
            if len(shown) < len(gpus):
                text.append(f"... {len(gpus) - len(shown)} more GPUs: enlarge the terminal to see them\n", style="dim")
        text.rstrip()
        height = len(text.plain.split("\n"))
        gpu_lines = self.query_one("#gpus", Lines)
        if height != self._gpu_height:
            self._gpu_height = height
            gpu_lines.styles.height = height
        gpu_lines.show(text)

    # -- keys ------------------------------------------------------------------------------------
    def _changed(self) -> None:
        self._rows_dirty = True
        self.draw()

    def action_sort(self) -> None:
        self.sort_index = (self.sort_index + 1) % len(model.SORT_KEYS)
        self.reverse = False
        self._changed()

    def action_reverse(self) -> None:
        self.reverse = not self.reverse
        self._changed()

    def action_tree(self) -> None:
        if not self.feed.local_pids:
            self.say("The tree needs each process's parent, which only this machine's processes have.")
        self.tree_view = not self.tree_view
        self._changed()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.value = self.filter_text
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        box.display = False
        self.filter_text = ""
        self.query_one("#procs").focus()
        self._changed()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self._changed()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.input.display = False  # the footer shows the filter that holds
        self.query_one("#procs").focus()

    def action_move(self, delta: int) -> None:
        table = self.query_one("#procs", ProcTable)
        if abs(delta) == 1000001:  # a page
            delta = table.page if delta > 0 else -table.page
        table.move(delta)

    def action_kill(self) -> None:
        proc = self.query_one("#procs", ProcTable).selected()
        if proc is None:
            self.say("No process is selected.")
            return
        why = kill.refusal(proc, self._ov or {}, self.feed.local_pids, uid=self.uid)
        if why:
            self.say(why)
            return

        def answer(sig: int | None) -> None:
            if sig is None:
                return
            # Again at the answer: the process may have ended, and its pid gone to another, while the
            # dialog stood open.
            why = kill.refusal(proc, self._ov or {}, self.feed.local_pids, uid=self.uid)
            self.say(why or kill.send(proc["pid"], sig))

        self.push_screen(ConfirmKill(proc), answer)

    def say(self, message: str) -> None:
        """A message on the header's second line for 8 s."""
        self.status, self.status_until = message, time.monotonic() + 8.0
        self.draw()
