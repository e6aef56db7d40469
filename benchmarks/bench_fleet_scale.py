"""The fleet report at scale (issue 20): 64 nodes x 8 GPUs x 7 days backfilled into a real Prometheus,
`gpuscope fleet report` timed against the obvious peer, both checked against the data's known truths.

1. Writes the week the agents would have exported (benchmarks/fleet_scale_data.py: sim.PROFILES'
   signatures, pods that come and go, a node powered off, a node not scraped), one OpenMetrics file
   per 2 h block, each backfilled with `promtool tsdb create-blocks-from openmetrics` and deleted (the
   week as text is ~30 GB; promtool re-reads a file once per 2 h block it spans, so one file per block).
2. Starts `prometheus` on 127.0.0.1 over those blocks (retention 10 years, query limits raised for the
   peer, its query log on, --query.lookback-delta = the scrape step: see LOOKBACK), waits until it has
   compacted them (as a server holding a week of history would have).
3. Runs `python -m gpuscope fleet report --prometheus URL --since 7d --until END --by D --json F` for
   each --by dimension, as a child: wall time and peak RSS (os.wait4's ru_maxrss of that child), and
   from Prometheus's query log the server time of each of its queries.
4. Runs the peer the same way (benchmarks/fleet_scale_peer.py): query_range of the raw series at the
   scrape step, one query per metric and node, summed client-side into the same per-group figures.
5. Prints both, the ratio, and every figure where the report, the peer and the truths differ by more
   than 1 %; exit 1 if any does.
6. With --rules: writes `gpuscope fleet rules`, backfills the recorded series over the week with
   `promtool tsdb create-blocks-from rules` (what a user with history does), restarts Prometheus with
   them loaded and runs the report again (it reads the recorded series instead of subqueries).
7. With --tiles: the same for the tile group alone (`gpuscope fleet rules --tile`, default 1h: a week is 168
   tiles; with --rules, the tiles come with the whole rule file), and the report with --source tiles,
   checked against the truths and the raw report's figures.

    python benchmarks/bench_fleet_scale.py                                  # 64 x 8 x 7 d at 60 s
    python benchmarks/bench_fleet_scale.py --nodes 4 --days 1 --settle 0    # the quick check (~15 s)
    python benchmarks/bench_fleet_scale.py --data /tmp/fleet --rules --json out.json   # keep, reuse the TSDB
    python benchmarks/bench_fleet_scale.py --nodes 4 --days 1 --settle 0 --tiles       # the tiles, quickly

LOOKBACK: a Prometheus that scrapes an agent writes a staleness marker when a series leaves the scrape (a
pod ended) or a scrape fails, so an instant vector stops seeing the series one scrape later. Backfilled
text cannot carry those markers (OpenMetrics has no stale NaN): with the default 5-minute lookback the
peer's query_range would see each ended pod's series for 5 more minutes. A lookback of one step is what
the markers would do. The report is not affected (it reads last_over_time over 1.5 steps, never the lookback).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))

import fleet_scale_data as data  # noqa: E402

FIGURES = data.FIGURES


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SystemExit(f"{name} is not installed (Debian: apt-get install prometheus)")
    return path


def run_child(cmd: list[str]) -> tuple[int, float, float, str]:
    """Run `cmd`: its exit status, wall seconds, peak RSS in MB (its own ru_maxrss) and its output's tail."""
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        tail = out.read()[-4000:].decode(errors="replace")
    return p.returncode, wall, ru.ru_maxrss / 1024, tail


# ---- 1 + 2: write, backfill, serve ----
def backfill(fleet: data.Fleet, work: Path) -> tuple[data.Truth, dict[str, Any]]:
    dbdir = work / "data"
    dbdir.mkdir(parents=True)
    values, truth = data.Values(fleet), data.Truth(fleet)
    promtool = binary("promtool")
    pending: tuple[subprocess.Popen[bytes], Path] | None = None
    stats: dict[str, Any] = {"samples": 0, "text_bytes": 0, "write_s": 0.0, "files": 0}
    t_all = time.perf_counter()

    def finish(p: tuple[subprocess.Popen[bytes], Path]) -> None:
        out, _ = p[0].communicate()
        if p[0].returncode:
            raise SystemExit(f"promtool failed on {p[1].name}:\n{out.decode(errors='replace')[-2000:]}")
        p[1].unlink()

    for i, (k0, k1) in enumerate(data.blocks(fleet)):
        t = time.perf_counter()
        chunk = values.chunk(k0, k1)
        truth.add(chunk, values.mem_total)
        path = work / f"block-{i:04d}.om"
        with open(path, "w", buffering=1 << 22) as out:
            stats["samples"] += data.write_block(fleet, chunk, values.mem_total, out, set(data.ALL_FAMILIES))
            out.write("# EOF\n")
        stats["text_bytes"] += path.stat().st_size
        stats["write_s"] += time.perf_counter() - t
        if pending is not None:  # one promtool at a time, reading a block while the next one is written
            finish(pending)
        pending = (subprocess.Popen([promtool, "tsdb", "create-blocks-from", "openmetrics", "-q", str(path),
                                     str(dbdir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT), path)
        stats["files"] += 1
        if i % 12 == 11:
            log(f"  block {i + 1}: {stats['samples'] / 1e6:.1f} M samples, {stats['text_bytes'] / 1e9:.2f} GB of text")
    if pending is not None:
        finish(pending)
    stats["backfill_s"] = time.perf_counter() - t_all
    stats["tsdb_bytes"] = _du(dbdir)
    return truth, stats


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Prometheus:
    """A real Prometheus on 127.0.0.1 over `work`/data, no scrape jobs, its query log in `work`/query.log."""

    def __init__(self, work: Path, step_s: int, rule_files: list[Path] | None = None, db: str = "data") -> None:
        self.work = work
        self.query_log = work / "query.log"
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        conf: dict[str, Any] = {"global": {"scrape_interval": f"{step_s}s", "evaluation_interval": f"{step_s}s",
                                           "query_log_file": str(self.query_log)}}
        if rule_files:
            conf["rule_files"] = [str(p) for p in rule_files]
        cfg = work / "prometheus.yml"
        cfg.write_text(json.dumps(conf))  # JSON is YAML
        self.log = open(work / "prometheus.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary("prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={work / db}",
             "--storage.tsdb.retention.time=3650d", f"--web.listen-address=127.0.0.1:{self.port}",
             "--query.max-samples=500000000", "--query.timeout=10m", f"--query.lookback-delta={step_s}s",
             "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"prometheus exited at start:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"prometheus not ready in 300 s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return (self.work / "prometheus.log").read_text(errors="replace")[-3000:]

    def own_metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith(("prometheus_tsdb_compactions_total ", "prometheus_tsdb_blocks_loaded ",
                                "prometheus_tsdb_compactions_failed_total ", "process_cpu_seconds_total ")):
                name, v = line.rsplit(" ", 1)
                out[name] = float(v)
        return out

    def settle(self, max_s: float) -> dict[str, float]:
        """Wait out the compaction of the blocks (the first one starts a minute after start): at least 70 s,
        then until Prometheus used under 5 % of a core for 20 s, or max_s."""
        t0 = time.monotonic()
        cpu: list[tuple[float, float]] = []
        m: dict[str, float] = {}
        while time.monotonic() - t0 < max_s:
            m = self.own_metrics()
            now = time.monotonic()
            cpu.append((now, m.get("process_cpu_seconds_total", 0.0)))
            old = [c for c in cpu if now - c[0] >= 20]
            if now - t0 > 70 and old and (cpu[-1][1] - old[-1][1]) / (now - old[-1][0]) < 0.05:
                break
            time.sleep(2)
        m["settle_s"] = time.monotonic() - t0
        return m

    def log_offset(self) -> int:
        return self.query_log.stat().st_size if self.query_log.exists() else 0

    def queries_since(self, offset: int) -> list[dict[str, Any]]:
        """The query log's entries from `offset` on: the expression, its kind and the server's seconds."""
        if not self.query_log.exists():
            return []
        with open(self.query_log, "rb") as f:
            f.seek(offset)
            lines = f.read().splitlines()
        out = []
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            params, timings = e.get("params", {}), e.get("stats", {}).get("timings", {})
            out.append({"query": params.get("query", ""), "range": bool(params.get("step")),
                        "eval_s": float(timings.get("evalTotalTime", 0.0)),
                        "queue_s": float(timings.get("execQueueTime", 0.0))})
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


# ---- 3: the report ----
def run_report(prom: Prometheus, work: Path, dim: str, days: float, end_s: int, tag: str) -> dict[str, Any]:
    """The report as a child, `--source tag` (raw, recorded, tiles: each insists on its source)."""
    out = work / f"report-{tag}-{dim}.json"
    offset = prom.log_offset()
    load = os.getloadavg()[0]  # the machine is shared: what else ran says how far a wall time can be trusted
    rc, wall, rss, tail = run_child([sys.executable, "-m", "gpuscope", "fleet", "report", "--prometheus", prom.url,
                                     "--since", f"{days:g}d", "--until", str(end_s), "--by", dim, "--json", str(out),
                                     "--source", tag])
    time.sleep(0.5)  # the query log is written as each query ends
    queries = prom.queries_since(offset)
    rep: dict[str, Any] = {"rc": rc, "wall_s": wall, "peak_rss_mb": rss, "load_avg_1m": load,
                           "server_s": sum(q["eval_s"] for q in queries), "queries": len(queries),
                           "slowest": sorted(queries, key=lambda q: -q["eval_s"])[:5]}
    if rc:
        rep["output"] = tail
    else:
        answer = json.loads(out.read_text())
        rep["source"] = answer.get("source")
        rep["source_note"] = answer.get("source_note")
        rep["tiles"] = answer.get("tiles")
        rep["query_seconds"] = answer.get("query_seconds")
        rep["groups"] = report_groups(answer)
        rep["fleet"] = {f: answer["fleet"].get(f) for f in ("observed_gpu_hours", "allocated_gpu_hours",
                                                             "used_gpu_hours", "idle_gpu_hours", "energy_kwh",
                                                             "line")}
    log(f"report {tag} --by {dim}: rc {rc}, {wall:.2f} s, {rss:.0f} MB peak RSS, {len(queries)} queries, "
        f"{rep['server_s']:.2f} s of server time" + (f", source {rep.get('source')}" if not rc else f":\n{tail}"))
    return rep


def report_groups(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The report's --json groups in the truths' terms."""
    out = {}
    for g in answer["groups"]:
        row: dict[str, Any] = {f: float(g.get(f) or 0.0) for f in FIGURES if f != "throttled_hours"}
        row["throttled_hours"] = sum((g.get("throttled_hours_by_reason") or {}).values())
        head = g.get("memory_headroom_ratio")
        row["memory_used_ratio_max"] = None if head is None else 1.0 - head
        row["verdict_share"] = g.get("verdict_share") or {}
        out[g["group"]] = row
    return out


# ---- 5: compare ----
def rel(a: float, b: float) -> float:
    return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b))


def compare(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]], tol: float,
            floor: float = 1.0) -> list[dict[str, Any]]:
    """The figures where `got` and `want` differ by more than `tol` (relative; below `floor` hours or kWh on
    both sides, by more than floor x tol), and groups only one side has (with a figure past `floor`)."""
    bad = []
    for grp in sorted(set(got) | set(want)):
        g, w = got.get(grp), want.get(grp)
        if g is None or w is None:
            size = max(float((g or w or {}).get(f, 0.0)) for f in FIGURES)
            if size > floor:
                bad.append({"group": grp, "figure": "(group)", "got": g is not None, "want": w is not None,
                            "size": size})
            continue
        for f in FIGURES:
            a, b = float(g.get(f, 0.0)), float(w.get(f, 0.0))
            off = abs(a - b) > floor * tol if max(abs(a), abs(b)) < floor else rel(a, b) > tol
            if off:
                bad.append({"group": grp, "figure": f, "got": a, "want": b, "rel": rel(a, b)})
    return bad


def compare_extras(got: dict[str, dict[str, Any]], truth: dict[str, dict[str, Any]], tol: float) -> list[dict[str, Any]]:
    """Memory headroom and verdict shares (report vs truths), within `tol` as an absolute share."""
    bad = []
    for grp in sorted(set(got) & set(truth)):
        g, t = got[grp], truth[grp]
        if g.get("memory_used_ratio_max") is not None and abs(g["memory_used_ratio_max"] - t["memory_used_ratio_max"]) > tol:
            bad.append({"group": grp, "figure": "memory_headroom", "got": 1 - g["memory_used_ratio_max"],
                        "want": 1 - t["memory_used_ratio_max"]})
        seen = t["observed_gpu_hours"]
        if seen <= 0:
            continue
        for kind in set(g["verdict_share"]) | {k for k, v in t["verdict_hours"].items() if v > 0}:
            a, b = float(g["verdict_share"].get(kind, 0.0)), t["verdict_hours"].get(kind, 0.0) / seen
            if abs(a - b) > tol:
                bad.append({"group": grp, "figure": f"verdict_share[{kind}]", "got": a, "want": b})
    return bad


def summarize(bad: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: how many groups differ and the worst (relative) difference, with its group."""
    out: dict[str, Any] = {}
    for b in bad:
        s = out.setdefault(b["figure"], {"groups": 0, "worst": None})
        s["groups"] += 1
        if s["worst"] is None or b.get("rel", 0) > s["worst"].get("rel", 0):
            s["worst"] = b
    return out


def largest(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]], floor: float = 1.0) -> float:
    """The largest relative difference over the groups both have and the figures past `floor`."""
    out = 0.0
    for grp in set(got) & set(want):
        for f in FIGURES:
            a, b = float(got[grp].get(f, 0.0)), float(want[grp].get(f, 0.0))
            if max(abs(a), abs(b)) >= floor:
                out = max(out, rel(a, b))
    return out


# ---- 6: recording rules ----
def rules_run(prom: Prometheus, work: Path, meta: dict[str, Any], step_s: int, tiles_only: bool = False,
              tile: str = "1h") -> tuple[Prometheus, dict[str, Any]]:
    """The recorded series over the whole week, backfilled into a copy of the TSDB (`work`/data-recorded,
    reused when it is there), and Prometheus restarted on it with the rules loaded. `tiles_only`: the tile
    group alone (`work`/data-tiles), of tiles `tile` long."""
    name = f"tiles-{tile}" if tiles_only else f"recorded-{tile}"
    rules, stats_path, db = work / f"rules-{name}.yml", work / f"rules-{name}.json", work / f"data-{name}"
    if db.is_dir() and stats_path.exists():
        stats = json.loads(stats_path.read_text())
        log(f"reusing the recorded series in {db}")
    else:
        rc, _, _, tail = run_child([sys.executable, "-m", "gpuscope", "fleet", "rules", "--scrape-interval",
                                    f"{step_s}s", "--tile", tile, "-o", str(rules)])
        if rc:
            raise SystemExit(f"gpuscope fleet rules failed:\n{tail}")
        if tiles_only:  # the tile group alone
            import yaml

            doc = yaml.safe_load(rules.read_text())
            doc["groups"] = [g for g in doc["groups"] if g["name"] == "gpuscope-fleet-tiles"]
            rules.write_text(yaml.safe_dump(doc, sort_keys=False, width=1 << 20))
        rc, _, _, tail = run_child([binary("promtool"), "check", "rules", str(rules)])
        if rc:
            raise SystemExit(f"promtool check rules failed:\n{tail}")
        out = work / "rule-blocks"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        offset = prom.log_offset()
        rc, wall, rss, tail = run_child([binary("promtool"), "tsdb", "create-blocks-from", "rules",
                                         f"--start={meta['t0_s']}", f"--end={meta['end_s']}", f"--url={prom.url}",
                                         f"--output-dir={out}", f"--eval-interval={step_s}s", "-q", str(rules)])
        if rc:
            raise SystemExit(f"promtool tsdb create-blocks-from rules failed:\n{tail}")
        queries = prom.queries_since(offset)
        stats = {"backfill_s": wall, "promtool_peak_rss_mb": rss, "queries": len(queries),
                 "server_s": sum(q["eval_s"] for q in queries), "bytes": _du(out),
                 "load_avg_1m": os.getloadavg()[0]}
        log(f"recorded series backfilled in {wall:.0f} s ({len(queries)} queries, {stats['server_s']:.0f} s of "
            f"server time, {stats['bytes'] / 1e6:.0f} MB)")
        prom.stop()
        shutil.rmtree(db, ignore_errors=True)
        shutil.copytree(work / "data", db, ignore=shutil.ignore_patterns("wal", "chunks_head", "lock", "queries.active"))
        for block in out.iterdir():
            shutil.move(str(block), str(db / block.name))
        out.rmdir()
        stats_path.write_text(json.dumps(stats))
    prom.stop()
    return Prometheus(work, step_s, rule_files=[rules], db=db.name), stats


# ---- the run ----
def load_or_build(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fleet's parameters and truths: read from `work` when it holds this fleet, else written there."""
    want = {"nodes": args.nodes, "gpus": args.gpus, "days": args.days, "step_s": args.step, "seed": args.seed}
    meta_path, truth_path = work / "fleet.json", work / "truth.json"
    if meta_path.exists() and truth_path.exists():
        meta = json.loads(meta_path.read_text())
        if all(meta.get(k) == v for k, v in want.items()) and (work / "data").is_dir():
            log(f"reusing the fleet's TSDB in {work} (written {time.ctime(meta['written_at'])})")
            return meta, json.loads(truth_path.read_text())
        raise SystemExit(f"{work} holds another fleet ({meta_path}); name an empty directory")
    end_s = int(time.time()) // data.BLOCK_S * data.BLOCK_S
    fleet = data.Fleet(args.nodes, args.gpus, args.days, args.step, end_s, seed=args.seed)
    log(f"{args.nodes} nodes x {args.gpus} GPUs x {args.days:g} d at {args.step} s: {fleet.steps} steps, "
        f"{len(fleet.segs)} GPU segments, {fleet.series_count} GPU label sets; in {work}")
    truth, stats = backfill(fleet, work)
    log(f"backfilled {stats['samples'] / 1e6:.1f} M samples ({stats['text_bytes'] / 1e9:.2f} GB of text, "
        f"TSDB {stats['tsdb_bytes'] / 1e6:.0f} MB) in {stats['backfill_s']:.0f} s")
    meta = {**want, "end_s": end_s, "start_s": fleet.start_s, "t0_s": fleet.t0_s, "segments": len(fleet.segs),
            "gpu_label_sets": fleet.series_count, "backfill": stats, "written_at": time.time()}
    truths = {dim: truth.groups(dim) for dim in data.DIMS}
    truth_path.write_text(json.dumps(truths, default=float))
    meta_path.write_text(json.dumps(meta, default=float))
    return meta, truths


#: Where the report's verdict shares and memory headroom can be checked: gpu_verdict names only the GPU
#: (hostname, gpu), so in any other dimension a group gets its GPUs' shares spread by observed time, and
#: --by user spreads a GPU's memory headroom, energy and throttling over its users by time (the report's
#: design, docs/FLEET.md); those are compared for the record, not counted as failures.
EXTRAS_EXACT = ("node", "model")


def check(result: dict[str, Any], name: str, got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]],
          tol: float, extras: str | None = None) -> None:
    bad = compare(got, want, tol)
    more = compare_extras(got, want, tol) if extras else []
    entry = {"disagreements": len(bad), "by_figure": summarize(bad), "largest": largest(got, want)}
    if extras in EXTRAS_EXACT:
        bad += more
        entry["disagreements"] = len(bad)
        entry["by_figure"] = summarize(bad)
    elif more:
        entry["spread_extras"] = summarize(more)
    result["checks"][name] = entry
    if bad:
        result["failures"].append(name)


def _code() -> dict[str, str]:
    """The commit measured, and whether the report's sources differ from it."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "fleet_dirty": git("status", "--short", "src/gpuscope/fleet", "src/gpuscope/promql.py")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--step", type=int, default=60, help="scrape interval, seconds (divides 2 h; default 60)")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--by", default=",".join(data.DIMS), help="the --by dimensions to run the report with")
    ap.add_argument("--raw-by", default=None,
                    help="the --by dimensions to run the report over raw series with (default: --by's)")
    ap.add_argument("--settle", type=float, default=900.0,
                    help="longest wait for Prometheus to compact the blocks, seconds (0: none)")
    ap.add_argument("--no-report", action="store_true", help="steps 1, 2 and 4 only")
    ap.add_argument("--no-peer", action="store_true", help="skip the peer (and the checks against it)")
    ap.add_argument("--rules", action="store_true", help="also the run over recorded series (step 6)")
    ap.add_argument("--tiles", action="store_true", help="also the run over tiles (step 7)")
    ap.add_argument("--tile", default="1h", help="the tiles' length (gpuscope fleet rules --tile; default 1h)")
    ap.add_argument("--data", default=None,
                    help="keep the TSDB and truths in this directory and reuse them on the next run")
    ap.add_argument("--json", dest="json_out", default=None, help="write every figure to this file")
    ap.add_argument("--tolerance", type=float, default=0.01)
    args = ap.parse_args(argv)
    keep = args.data is not None
    work = Path(args.data) if keep else Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    prom: Prometheus | None = None
    result: dict[str, Any] = {"checks": {}, "failures": [], "report": {}, "report_recorded": {}, "report_tiles": {},
                              "code": _code()}
    try:
        meta, truths = load_or_build(args, work)
        result.update(fleet=meta, truth_fleet={f: sum(g[f] for g in truths["node"].values()) for f in FIGURES})
        prom = Prometheus(work, args.step)
        if args.settle:
            result["prometheus"] = prom.settle(args.settle)
            log(f"prometheus settled after {result['prometheus']['settle_s']:.0f} s: "
                f"{result['prometheus'].get('prometheus_tsdb_blocks_loaded', 0):.0f} blocks")
        dims = [] if args.no_report else args.by.split(",")
        for dim in dims if args.raw_by is None else [d for d in args.raw_by.split(",") if d and not args.no_report]:
            result["report"][dim] = run_report(prom, work, dim, args.days, meta["end_s"], "raw")
        if not args.no_peer:
            out = work / "peer.json"
            load = os.getloadavg()[0]
            rc, wall, rss, tail = run_child([sys.executable, str(HERE / "fleet_scale_peer.py"), prom.url,
                                             str(meta["start_s"]), str(meta["end_s"]), str(args.step), str(out)])
            if rc:
                raise SystemExit(f"the peer failed:\n{tail}")
            p = json.loads(out.read_text())
            result["peer"] = {"wall_s": wall, "peak_rss_mb": rss, "queries": p["queries"], "fetch_s": p["fetch_s"],
                              "load_avg_1m": load}
            log(f"peer: {wall:.2f} s ({p['queries']} query_range calls, fetching {p['fetch_s']:.1f} s), "
                f"{rss:.0f} MB peak RSS")
            for dim in data.DIMS:
                check(result, f"peer vs truth --by {dim}", p["groups"][dim], truths[dim], args.tolerance)
        for dim, rep in result["report"].items():
            if "groups" in rep:
                check(result, f"report vs truth --by {dim}", rep["groups"], truths[dim], args.tolerance, extras=dim)
                if "peer" in result:
                    check(result, f"report vs peer --by {dim}", rep["groups"], p["groups"][dim], args.tolerance)
                    rep["ratio"] = result["peer"]["wall_s"] / rep["wall_s"]
            else:
                result["failures"].append(f"report --by {dim} exited {rep['rc']}")
        if (args.rules or args.tiles) and dims:
            prom, result["rules"] = rules_run(prom, work, meta, args.step, tiles_only=not args.rules, tile=args.tile)
            if args.settle:
                result["rules"]["settle"] = prom.settle(args.settle)
            for dim in dims if args.tiles else ():
                rep = result["report_tiles"][dim] = run_report(prom, work, dim, args.days, meta["end_s"], "tiles")
                if "groups" not in rep:
                    result["failures"].append(f"report (tiles) --by {dim} exited {rep['rc']}")
                    continue
                check(result, f"report (tiles) vs truth --by {dim}", rep["groups"], truths[dim], args.tolerance,
                      extras=dim)
                if "groups" in result["report"].get(dim, {}):
                    check(result, f"report (tiles) vs report (raw) --by {dim}", rep["groups"],
                          result["report"][dim]["groups"], args.tolerance)
                if "peer" in result:
                    rep["ratio"] = result["peer"]["wall_s"] / rep["wall_s"]
            for dim in dims if args.rules else ():
                rep = result["report_recorded"][dim] = run_report(prom, work, dim, args.days, meta["end_s"], "recorded")
                if "groups" in rep:
                    check(result, f"report (recorded) vs truth --by {dim}", rep["groups"], truths[dim],
                          args.tolerance, extras=dim)
                    if "peer" in result:
                        rep["ratio"] = result["peer"]["wall_s"] / rep["wall_s"]
                else:
                    result["failures"].append(f"report (recorded) --by {dim} exited {rep['rc']}")
    finally:
        if prom is not None:
            prom.stop()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    print_summary(result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1, default=float))
    return 1 if result["failures"] else 0


def print_summary(r: dict[str, Any]) -> None:
    m = r["fleet"]
    print(f"\ncode {r['code']['commit']}" + (" (src/gpuscope/fleet modified)" if r["code"]["fleet_dirty"] else ""))
    print(f"{m['nodes']} nodes x {m['gpus']} GPUs x {m['days']:g} d at {m['step_s']} s scrapes: "
          f"{m['backfill']['samples'] / 1e6:.1f} M samples, {m['gpu_label_sets']} GPU label sets")
    print("truth, fleet-wide: " + ", ".join(f"{k} {v:,.1f}" for k, v in r["truth_fleet"].items()))
    peer = r.get("peer")
    if peer:
        print(f"peer: {peer['wall_s']:.2f} s, {peer['peak_rss_mb']:.0f} MB peak RSS, {peer['queries']} queries")
    for tag, reps in (("raw", r["report"]), ("recorded", r["report_recorded"]), ("tiles", r.get("report_tiles", {}))):
        for dim, rep in reps.items():
            ratio = f", {rep['ratio']:.1f}x faster than the peer" if "ratio" in rep else ""
            print(f"report ({tag}) --by {dim}: {rep['wall_s']:.2f} s, {rep['peak_rss_mb']:.0f} MB peak RSS{ratio}; "
                  f"server {rep['server_s']:.2f} s over {rep['queries']} queries, slowest "
                  f"{rep['slowest'][0]['eval_s'] if rep['slowest'] else 0:.2f} s")
    for name, c in r["checks"].items():
        status = "agree" if not c["disagreements"] else f"{c['disagreements']} figures differ"
        print(f"  {name}: {status} (largest difference {c['largest'] * 100:.3f} %)")
        for fig, s in c["by_figure"].items():
            w = s["worst"]
            got, want = w.get("got"), w.get("want")
            detail = f"{got:.3f} vs {want:.3f}" if isinstance(got, float) and isinstance(want, float) else str(w)
            print(f"      {fig}: {s['groups']} groups, worst {w['group']}: {detail}")


if __name__ == "__main__":
    sys.exit(main())
