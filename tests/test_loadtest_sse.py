"""OpenAI-compatible streaming: TTFT, TTST, TPOT, chunk gaps, E2E, goodput, as vLLM and as AIPerf compute them."""

from __future__ import annotations

import pytest
from loadtest_servers import SSE_CHUNKS_S, SSE_TOKENS, SSE_USAGE_S, LoadtestServer

from gpuscope.loadtest import schedule as S
from gpuscope.loadtest.openai import SseReader
from gpuscope.loadtest.records import RequestRecord
from gpuscope.loadtest.requests import Protocol
from gpuscope.loadtest.runner import execute, summarize
from gpuscope.loadtest.stats import Acc, request_metrics
from gpuscope.loadtest.worker import WorkerConfig


def _record() -> RequestRecord:
    # sent at 1.0; chunks at +100, +120, +150, +160 ms; last byte (usage + [DONE]) at +200 ms; 7 tokens
    return RequestRecord(i=0, stage=0, worker=0, t_intended=0.99, t_sent=1.0, t_end=1.2,
                         t_first_token=1.1, chunk_times=[1.1, 1.12, 1.15, 1.16], input_tokens=5, output_tokens=7,
                         tokens_from="usage")


def test_metrics_by_hand_vllm_and_aiperf() -> None:
    v, a = request_metrics(_record(), "vllm"), request_metrics(_record(), "aiperf")
    assert v["ttft"] == pytest.approx(0.100) and a["ttft"] == pytest.approx(0.100)
    assert v["ttst"] == pytest.approx(0.020)
    assert v["e2e"] == pytest.approx(0.160)          # vLLM: last content chunk
    assert a["e2e"] == pytest.approx(0.200)          # AIPerf: final response
    assert v["tpot"] == pytest.approx((0.160 - 0.100) / 6)
    assert a["tpot"] == pytest.approx((0.200 - 0.100) / 6)


def test_stats_by_hand_with_goodput() -> None:
    slo = {"ttft": 0.15, "tpot": 0.011}
    for metrics_as, good in (("vllm", 1), ("aiperf", 0)):   # tpot 10 ms (vLLM) vs 16.7 ms (AIPerf)
        acc = Acc()
        acc.add(_record(), metrics_as=metrics_as, late_s=0.005, slo=slo)
        s = acc.stats(metrics_as=metrics_as, wall_s=2.0, slo=slo)
        assert s["late"] == 1                                   # sent 10 ms after its intended time
        assert s["chunk_gap_ms"]["mean"] == pytest.approx(60 / 3)
        assert s["chunk_gap_ms"]["max"] == pytest.approx(30)
        assert s["ttft_ms"]["p50"] == pytest.approx(100, rel=1e-3)
        assert s["output_tokens"] == 7 and s["input_tokens"] == 5
        dur = 2.0 if metrics_as == "vllm" else 0.2              # wall time vs last response - first send
        assert s["duration_s"] == pytest.approx(dur)
        assert s["output_throughput"] == pytest.approx(7 / dur)
        assert s["total_token_throughput"] == pytest.approx(12 / dur)
        assert s["goodput"] == pytest.approx(good / dur) and s["slo_attainment"] == good


def test_sse_reader_splits_events_across_reads_and_estimates_without_usage() -> None:
    rec = RequestRecord(i=0, stage=0, worker=0, t_intended=0.0, t_sent=0.0)
    r = SseReader(rec, prompt_words=11)
    assert r(b'data: {"choices":[{"text":"a"}]}\r\n\r\ndata: {"choi', 0.1) is None
    assert r(b'ces":[{"text":"b"}]}\n\n: keep-alive\n\ndata: [DONE]\n\n', 0.2) is None
    rec.t_end = 0.2
    assert r.finish() is None
    assert rec.chunk_times == [0.1, 0.2] and rec.t_first_token == 0.1
    assert (rec.output_tokens, rec.input_tokens, rec.tokens_from) == (2, 11, "estimate")
    bad = SseReader(RequestRecord(i=0, stage=0, worker=0, t_intended=0.0, t_sent=0.0))
    assert bad(b"data: {oops\n\n", 0.1) == "malformed"


def _dominated(early: list[float], late: list[float]) -> bool:
    """Some pairing of the two lists has every `early` value at or before its `late` one (sorted, pairwise)."""
    return len(early) == len(late) and all(e <= x for e, x in zip(sorted(early), sorted(late), strict=True))


def _between_order_stats(value: float, values: list[float], q: float) -> bool:
    """`value` (an HDR percentile, 0.1 % precision) lies between the order statistics around quantile q."""
    v = sorted(values)
    k = q * len(v)
    lo, hi = v[max(int(k - 0.5), 0)], v[min(int(k + 0.5), len(v) - 1)]
    return lo * (1 - 1e-3) <= value <= hi * (1 + 1e-3)


@pytest.mark.parametrize("metrics_as", ["vllm", "aiperf"])
@pytest.mark.parametrize("kind", ["openai-completions", "openai-chat"])
def test_scripted_sse_server(metrics_as: str, kind: str) -> None:
    """The figures are checked against what the server and the client recorded on one clock (perf_counter is
    CLOCK_MONOTONIC in both processes), never against a tolerance a loaded machine can break: nothing arrives
    before the server wrote it, so every figure is at least the script's, and the summary is what the records
    say."""
    slo = {"ttft": 0.15, "tpot": 0.0105}
    with LoadtestServer() as srv:
        cfg = WorkerConfig(
            url=srv.url("/"), proto=Protocol(kind=kind, max_tokens=9), metrics_as=metrics_as, slo=slo,
            plan=S.plan([S.Stage(2.0, rate=5, arrival="constant")], seed=1), keep_records=True)
        res = execute(cfg, 1)
        summary = summarize(cfg, res, url="u", protocol=kind, stage_names=["s"])
        server = srv.sse_applied()   # per request: [arrival, writes of chunk 0..4 and of usage + [DONE] began]
    o, recs = summary["overall"], res.records
    assert o["errors"] == {} and o["completed"] == 10 == len(server) == len(recs)
    assert o["output_tokens"] == 10 * SSE_TOKENS["completion_tokens"]
    assert all(r.tokens_from == "usage" and len(r.chunk_times) == 5 and r.t_first_token == r.chunk_times[0]
               for r in recs)
    # the server kept its script: no write went out before its offset from the request's arrival
    offsets = [*SSE_CHUNKS_S, SSE_USAGE_S]
    assert all(w - s[0] >= at - 1e-6 for s in server for w, at in zip(s[1:], offsets, strict=True))
    # causality on the run's clock: sent before the server saw it, each chunk (and the end) read after it was written
    t0 = res.clock["mono_s"]
    assert _dominated([r.t_sent for r in recs], [s[0] - t0 for s in server])
    for k in range(len(SSE_CHUNKS_S)):
        assert _dominated([s[1 + k] - t0 for s in server], [r.chunk_times[k] for r in recs]), k
    assert _dominated([s[-1] - t0 for s in server], [r.t_end for r in recs])
    # so no figure can come out below the script's (a TTFT taken at the response headers would, at ~0 ms)
    m = [request_metrics(r, metrics_as) for r in recs]
    e2e_script = SSE_CHUNKS_S[-1] if metrics_as == "vllm" else SSE_USAGE_S
    assert min(x["ttft"] for x in m) >= SSE_CHUNKS_S[0] - 1e-6
    assert min(x["e2e"] for x in m) >= e2e_script - 1e-6
    assert all(r.chunk_times[k] - r.t_sent >= at - 1e-6 for r in recs for k, at in enumerate(SSE_CHUNKS_S))
    # vLLM's E2E ends at the last content chunk, AIPerf's at the last byte, as the records say
    ends = [r.chunk_times[-1] if metrics_as == "vllm" else r.t_end for r in recs]
    assert [x["e2e"] for x in m] == [e - r.t_sent for e, r in zip(ends, recs, strict=True)]
    # each figure of the summary matches, to HDR precision, what the records themselves say
    ms = {k: [x[k] * 1e3 for x in m] for k in ("ttft", "ttst", "e2e", "tpot")}
    for k in ("ttft", "ttst", "e2e"):
        assert _between_order_stats(o[f"{k}_ms"]["p50"], ms[k], 0.5), (k, o[f"{k}_ms"], sorted(ms[k]))
    gaps = [(b - a) * 1e3 for r in recs for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    assert len(gaps) == 40 and o["chunk_gap_ms"]["mean"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-9)
    assert o["tpot_ms"]["mean"] == pytest.approx(sum(ms["tpot"]) / len(ms["tpot"]), rel=1e-9)
    assert o["tpot_ms"]["max"] == pytest.approx(max(ms["tpot"]), rel=1e-9)
    assert all(x["tpot"] == pytest.approx((x["e2e"] - x["ttft"]) / (SSE_TOKENS["completion_tokens"] - 1))
               for x in m)
    # goodput counts the requests whose own figures meet every SLO; on an idle machine that is all of them as
    # vLLM computes TPOT (10 ms) and none as AIPerf does (11.25 ms), but a late chunk may move either
    good = sum(x["ttft"] <= slo["ttft"] and x["tpot"] <= slo["tpot"] for x in m)
    assert o["slo_attainment"] == good / 10 and o["goodput"] == pytest.approx(good / o["duration_s"])
    assert summary["names"]["tpot_ms"] == ("TPOT" if metrics_as == "vllm" else "ITL")
    assert summary["names"]["chunk_gap_ms"] == ("ITL" if metrics_as == "vllm" else "ICL")
