"""Records are merged as streams, never loaded whole: the workers' shards come out in intended-time order,
records.jsonl is their merge in (t_intended, worker) order, byte for byte what sorting them all gave, and the
report reads records.jsonl once, as a stream, into the same plots."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import orjson
import pytest
from loadtest_servers import LoadtestServer

from gpuscope.loadtest import schedule as S
from gpuscope.loadtest.records import RequestRecord, read_records
from gpuscope.loadtest.report import render
from gpuscope.loadtest.requests import Protocol
from gpuscope.loadtest.runner import collect_records, execute, merged_records, summarize
from gpuscope.loadtest.worker import WorkerConfig, shard_path

FIXTURE = Path(__file__).parent / "fixtures" / "loadtest" / "report_data.json"


def fixture_records(workers: int = 3, per_worker: int = 400, seed: int = 7) -> list[list[RequestRecord]]:
    """Per worker, records in intended-time order: some warm-up, failures of several classes, streams, a
    few intended times shared across workers (ties), two stages."""
    rng = random.Random(seed)
    shared = [round(rng.uniform(0.5, 9.5), 3) for _ in range(20)]
    out = []
    for w in range(workers):
        times = sorted([rng.uniform(0, 10) for _ in range(per_worker - len(shared))] + shared)
        recs = []
        for j, t in enumerate(times):
            sent = t + rng.expovariate(2000)
            err = rng.choice([None] * 12 + ["timeout", "http_5xx", "connect"])
            lat = rng.lognormvariate(-3, 0.6)
            r = RequestRecord(i=w * 10_000 + j, stage=0 if t < 5 else 1, worker=w, t_intended=t, t_sent=sent,
                              t_end=None if err in ("timeout", "connect") else sent + lat, status=200, error=err,
                              warmup=t < 0.3, tag=f"w{w}")
            if r.warmup:
                r.stage = -1
            if err is None and j % 3 == 0:
                chunks = [sent + lat * (k + 1) / 6 for k in range(rng.randint(1, 5))]
                r.chunk_times, r.t_first_token = chunks, chunks[0]
                r.output_tokens = len(chunks) + (j % 2)
            recs.append(r)
        out.append(recs)
    return out


def _old_collect(shards_in_completion_order: list[list[RequestRecord]]) -> bytes:
    """What records.jsonl was before the streams: every record loaded, sorted by (t_intended, worker)."""
    recs = [RequestRecord.from_json(orjson.loads(orjson.dumps(r.to_json()))) for s in shards_in_completion_order
            for r in s]
    recs.sort(key=lambda r: (r.t_intended, r.worker))
    out = []
    for n, r in enumerate(recs):
        r.i = n
        out.append(orjson.dumps(r.to_json()) + b"\n")
    return b"".join(out)


def _write_shards(out_dir: Path, per_worker: list[list[RequestRecord]]) -> None:
    for w, recs in enumerate(per_worker):
        Path(shard_path(out_dir, w)).write_bytes(b"".join(orjson.dumps(r.to_json()) + b"\n" for r in recs))


def test_streamed_merge_writes_what_sorting_everything_wrote(tmp_path: Path) -> None:
    per_worker = fixture_records()
    rng = random.Random(1)
    by_completion = []   # the order the former workers wrote their shards in: as answers came
    for recs in per_worker:
        recs = list(recs)
        rng.shuffle(recs)
        by_completion.append(sorted(recs, key=lambda r: r.t_end if r.t_end is not None else r.t_sent + 0.2))
    _write_shards(tmp_path, per_worker)
    assert collect_records(tmp_path, len(per_worker)) == sum(map(len, per_worker))
    assert (tmp_path / "records.jsonl").read_bytes() == _old_collect(by_completion)
    assert not list(tmp_path.glob(".records.w*"))      # the shards are gone


def test_merge_order_is_intended_time_then_worker() -> None:
    def rec(t: float, w: int, tag: str) -> RequestRecord:
        return RequestRecord(i=0, stage=0, worker=w, t_intended=t, t_sent=t, tag=tag)
    streams = [[rec(0.1, 0, "a"), rec(0.5, 0, "b"), rec(0.5, 0, "c")],
               [rec(0.0, 1, "d"), rec(0.5, 1, "e")],
               [rec(0.5, 2, "f"), rec(0.7, 2, "g")]]
    order = [r.tag for r in merged_records(streams[::-1])]   # the streams' own order does not matter
    assert order == ["d", "a", "b", "c", "e", "f", "g"]


def test_a_capacity_search_appends_each_trial_in_order(tmp_path: Path) -> None:
    # Two "trials" collected one after the other into one open file: numbered on, adjusted as they pass.
    per_worker = fixture_records(workers=2, per_worker=50)
    with open(tmp_path / "all.jsonl", "wb") as out:
        n = 0
        for k in range(2):
            _write_shards(tmp_path, per_worker)
            n += collect_records(tmp_path, 2, into=out, first=n,
                                 adjust=lambda r, k=k: setattr(r, "stage", k))  # noqa: B023
    recs = list(read_records(tmp_path / "all.jsonl"))
    assert [r.i for r in recs] == list(range(200)) and [r.stage for r in recs] == [0] * 100 + [1] * 100


def test_workers_write_their_shards_in_intended_order(tmp_path: Path) -> None:
    # /latency answers in 50 ms ± 5 ms: at 400 req/s many answers overtake an older request's.
    with LoadtestServer() as srv:
        cfg = WorkerConfig(url=srv.url("/latency"), proto=Protocol(), records_dir=str(tmp_path),
                           plan=S.plan([S.Stage(1.5, rate=400, arrival="constant")], seed=1))
        res = execute(cfg, 2)
    summary = summarize(cfg, res, url="u", protocol="http", stage_names=["s"])
    for w in range(2):
        shard = list(read_records(shard_path(tmp_path, w)))
        assert len(shard) == 300 and all(r.worker == w for r in shard)
        assert [r.t_intended for r in shard] == sorted(r.t_intended for r in shard)
    assert collect_records(tmp_path, 2) == summary["overall"]["requests"] == 600
    recs = list(read_records(tmp_path / "records.jsonl"))
    assert [(r.t_intended, r.worker) for r in recs] == sorted((r.t_intended, r.worker) for r in recs)
    assert [r.i for r in recs] == list(range(600))


def _summary() -> dict:
    return {"url": "http://x", "metrics_as": "vllm", "names": {"tpot_ms": "TPOT"}, "duration_s": 9.7,
            "stages": [{"index": 0, "name": "a", "start_s": 0.3, "end_s": 5.0, "target_rate": 100, "stats": {}},
                       {"index": 1, "name": "b", "start_s": 5.0, "end_s": 10.0, "target_rate": 200, "stats": {}}],
            "overall": {}}


def _data_block(html: str) -> dict:
    m = re.search(r"<script type='application/json' id='loadtest-data'>(.*?)</script>", html)
    assert m
    return json.loads(m.group(1).replace("<\\/", "</"))


def test_the_report_read_as_a_stream_plots_what_the_records_in_memory_plotted(tmp_path: Path) -> None:
    # FIXTURE is the data block the report wrote from these records held in memory (before the streams);
    # now records.jsonl is read once, as a stream, and must give the same plots, point for point.
    per_worker = fixture_records()
    _write_shards(tmp_path, per_worker)
    collect_records(tmp_path, len(per_worker))
    stream = read_records(tmp_path / "records.jsonl")
    html = render(_summary(), stream, [])
    with pytest.raises(StopIteration):
        next(stream)   # read once, to its end
    assert _data_block(html) == json.loads(FIXTURE.read_text())
    assert "· 1161 requests ·" in html    # 1200 less 39 warm-up records
    assert "<td>timeout</td>" in html and "<td>http_5xx</td>" in html and "<td>http_429</td>" not in html
