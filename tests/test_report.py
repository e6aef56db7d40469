"""The HTML run report: self-contained, one set of SVG panels per GPU, verdict bands of the right kinds,
the process table, everything from the user escaped, the SIMULATED banner; rendered by real Chromium."""

from __future__ import annotations

import subprocess
import zlib
from html.parser import HTMLParser

import pytest

from gpuscope.report import GpuTimeline, render_html, write_html
from gpuscope.report.htmlpage import VERDICT_COLORS
from gpuscope.runcmd import Segment, _summarise

EVIL = "python train.py --name '<script>alert(\"x\")</script>' & \"quoted\""


def _report(simulated: str | None = "mixed") -> dict:
    series = {}
    for gpu in ("0", "1"):
        tl = GpuTimeline(max_points=64)  # 600 samples: merged buckets, min-max bands drawn
        for i in range(600):
            t = i / 10
            tl.add(t, {"gpu_sm_active_ratio": 0.9 if t < 35 else 0.05, "gpu_tensor_active_ratio": 0.6,
                       "gpu_dram_active_ratio": 0.3, "gpu_utilization_ratio": 1.0,
                       "gpu_pcie_rx_bytes_per_second": 2e9 + 1e8 * (i % 7), "gpu_pcie_tx_bytes_per_second": 1e7,
                       "gpu_power_watts": 600.0 + i % 50, "gpu_memory_used_bytes": 40 * 2**30,
                       "gpu_sm_clock_hertz": 1.755e9, "gpu_temperature_celsius": 70.0,
                       "gpu_clock_event_reasons": 0x4 if gpu == "1" else 0x0})
        series[gpu] = tl.points()
    segs = [Segment("0", "compute_bound", 0, 35, "GPU 0 is compute-bound.", ["nothing"], "info", True,
                    {"sm_active": 0.9, "pcie_bytes_per_s": 2.1e9}),
            Segment("0", "input_starved", 35, 60, "GPU 0 waits <for> input & more.", ["DataLoader(num_workers=8)"],
                    "warning", True, {"idle_share": 0.8}),
            Segment("1", "transfer_bound", 0, 60, "GPU 1 is transfer-bound.", ["pin_memory=True"], "warning"),
            Segment("1", "power_capped", 10, 60, "GPU 1 runs at its power limit.", [], "info", False)]
    r = _summarise(segs, 60.0, {"0": 0.0, "1": 0.0}, {"0": 36000.0, "1": 30000.0}, 0, False, simulated)
    r.update({
        "command": EVIL, "started_at": 1.7e9, "hostname": "node<1>", "gpu_start_s": 2.5,
        "gpu_start_by_gpu": {"0": 2.5}, "series": series, "killed_by_signal": None,
        "gpus": [{"gpu": g, "name": "NVIDIA H200", "uuid": f"GPU-{g}", "memory_total_bytes": 141 * 2**30,
                  "power_limit_watts": 700.0, "sm_clock_max_hertz": 1.98e9} for g in ("0", "1")],
        "processes": [
            {"pid": 1234, "ours": True, "name": "python", "user": "me", "cmdline": EVIL, "gpu": None,
             "cpu_cores_mean": 0.1, "cpu_cores_max": 0.3, "thread_cpu_max_ratio": 0.2, "rss_max_bytes": 1e8},
            {"pid": 1240, "ours": True, "name": "pt_data_worker", "user": "me", "cmdline": "python -c <worker>",
             "gpu": "0", "gpu_first_seen_s": 2.5, "gpu_memory_max_bytes": 2e10, "sm_ratio_mean": 0.8,
             "cpu_cores_mean": 1.0, "cpu_cores_max": 1.0, "thread_cpu_max_ratio": 1.0, "rss_max_bytes": 4e9},
            {"pid": 999, "ours": False, "name": "jupyter", "user": "other", "cmdline": "jupyter lab",
             "gpu": "1", "gpu_first_seen_s": 0.0, "gpu_memory_max_bytes": 1e9, "sm_ratio_mean": None,
             "cpu_cores_mean": None, "cpu_cores_max": None, "thread_cpu_max_ratio": None, "rss_max_bytes": None},
        ],
    })
    return r


class _Page(HTMLParser):
    """Tags with attributes, and for each GPU section the SVGs and bands inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.section: str | None = None
        self.svgs: dict[str, int] = {}
        self.bands: dict[str, set[str]] = {}
        self.band_titles: list[str] = []
        self._in_band_title = False
        self._in_band = False
        self.cells: list[str] = []
        self._td = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "section" and (a.get("id") or "").startswith("gpu-"):
            self.section = a["id"][4:]
        if tag == "svg" and self.section is not None:
            self.svgs[self.section] = self.svgs.get(self.section, 0) + 1
        if tag == "rect" and a.get("class") == "band":
            self.bands.setdefault(self.section or "", set()).add(a.get("fill") or "")
            self._in_band = True
        if tag == "title" and self._in_band:
            self._in_band_title = True
        if tag == "td":
            self._td = True
            self.cells.append("")

    def handle_endtag(self, tag):
        if tag == "section":
            self.section = None
        if tag == "rect":
            self._in_band = False
        if tag == "title":
            self._in_band_title = False
        if tag == "td":
            self._td = False

    def handle_data(self, data):
        self.text.append(data)
        if self._in_band_title:
            self.band_titles.append(data)
        if self._td:
            self.cells[-1] += data


def test_panels_per_gpu_bands_processes_and_escaping():
    page = render_html(_report())
    p = _Page()
    p.feed(page)
    assert p.svgs["0"] >= 6 and p.svgs["1"] >= 6  # activity, PCIe, power, memory, clock, temperature
    assert p.svgs["1"] == p.svgs["0"] + 1  # GPU 1 also gets the clock-event strip (power cap)
    assert p.bands["0"] == {VERDICT_COLORS["compute_bound"], VERDICT_COLORS["input_starved"]}
    assert p.bands["1"] == {VERDICT_COLORS["transfer_bound"]}
    assert any(t.startswith("input_starved: 35 s – 60 s") for t in p.band_titles)
    text = "".join(p.text)
    # The parser unescapes text: the user's strings arrive intact, as text, never as markup.
    assert EVIL in text and "node<1>" in text and "waits <for> input & more." in text
    assert "<script>" not in page and "&lt;script&gt;" in page and not any(t == "script" for t, _ in p.tags)
    assert "SIMULATED" in text and "scenario 'mixed'" in text
    # Summary: share per verdict, energy, what to change first with its advice.
    assert "compute_bound 58 %" in text and "input_starved 42 %" in text and "66.0 kJ" in text
    assert "transfer_bound" in text and "pin_memory=True" in text
    # Verdict timeline with evidence, side verdicts marked.
    assert "2.10 GB/s" in text and "idle_share" in text and "side" in p.cells[3 * 6 + 3]
    # Process table: the run's processes first, ours marked, other users' after.
    pids = [c for c in p.cells if c in ("1234", "1240", "999")]
    assert pids == ["1234", "1240", "999"]
    assert "this run" in p.cells and "other" in p.cells and "18.6 GiB" in text and "80.0 %" in text


def test_self_contained_no_network_and_no_banner_on_real_gpus():
    page = render_html(_report(simulated=None))
    p = _Page()
    p.feed(page)
    assert "SIMULATED" not in page
    for tag, a in p.tags:
        assert tag not in ("script", "link", "img", "iframe", "object", "embed")
        assert "src" not in a and not (a.get("href") or "").startswith(("http", "//"))
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert "url(" not in page and "@import" not in page


def test_empty_run_still_renders():
    r = _summarise([], 0.4, {}, {}, 5, False, "healthy")
    r.update(command="false", started_at=1.7e9, hostname="h", gpu_start_s=None, gpu_start_by_gpu={},
             series={"0": {"t": []}}, processes=[], killed_by_signal=None,
             gpus=[{"gpu": "0", "name": "NVIDIA H200 (simulated)"}])
    page = render_html(r)
    assert "No samples." in page and "No verdicts." in page and "never" in page


def test_write_html_is_atomic_and_reports_failures(tmp_path):
    path = tmp_path / "r.html"
    write_html(_report(), str(path))
    assert path.read_text().startswith("<!DOCTYPE html>")
    with pytest.raises(OSError):
        write_html(_report(), str(tmp_path / "missing" / "r.html"))

    def broken(_r):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_html(_report(), str(path), render=broken)
    assert [f.name for f in tmp_path.iterdir()] == ["r.html"]  # no temporary file left behind


def _png_pixels(data: bytes) -> bytes:
    """The decompressed scanlines of a PNG (filter bytes included): enough to tell blank from not."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    i, idat = 8, b""
    while i < len(data):
        n = int.from_bytes(data[i:i + 4], "big")
        kind = data[i + 4:i + 8]
        if kind == b"IDAT":
            idat += data[i + 8:i + 8 + n]
        i += 12 + n
    return zlib.decompress(idat)


def test_real_chromium_renders_the_svgs(tmp_path, chromium):
    exe = chromium
    path = tmp_path / "r.html"
    write_html(_report(), str(path))
    base = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(base + ["--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    p = _Page()
    p.feed(dom.stdout)
    assert p.svgs["0"] >= 6 and p.svgs["1"] >= 6 and p.bands["0"]
    assert sum(1 for t, a in p.tags if t == "polyline" and a.get("class") == "series") >= 20
    shot = tmp_path / "shot.png"
    run = subprocess.run(base + ["--window-size=1100,1400", f"--screenshot={shot}", path.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    pixels = _png_pixels(shot.read_bytes())
    assert len(set(pixels)) > 64  # text, lines and coloured bands: far from a blank page
