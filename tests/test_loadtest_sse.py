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


@pytest.mark.parametrize("metrics_as", ["vllm", "aiperf"])
@pytest.mark.parametrize("kind", ["openai-completions", "openai-chat"])
def test_scripted_sse_server(metrics_as: str, kind: str) -> None:
    slo = {"ttft": 0.15, "tpot": 0.0105}
    with LoadtestServer() as srv:
        cfg = WorkerConfig(
            url=srv.url("/"), proto=Protocol(kind=kind, max_tokens=9), metrics_as=metrics_as, slo=slo,
            plan=S.plan([S.Stage(2.0, rate=5, arrival="constant")], seed=1), keep_records=True)
        res = execute(cfg, 1)
        summary = summarize(cfg, res, url="u", protocol=kind, stage_names=["s"])
        server = srv.sse_applied()
    o = summary["overall"]
    assert o["errors"] == {} and o["completed"] == 10 == len(server)
    assert o["output_tokens"] == 10 * SSE_TOKENS["completion_tokens"]
    assert all(r.tokens_from == "usage" and len(r.chunk_times) == 5 for r in res.records)
    # hand-computed from the script; the tolerance is the server's own timer jitter plus loopback (ms)
    ttft = SSE_CHUNKS_S[0] * 1e3
    e2e = (SSE_CHUNKS_S[-1] if metrics_as == "vllm" else SSE_USAGE_S) * 1e3
    tpot = (e2e - ttft) / (SSE_TOKENS["completion_tokens"] - 1)
    assert o["ttft_ms"]["p50"] == pytest.approx(ttft, abs=3)
    assert o["ttst_ms"]["p50"] == pytest.approx(20, abs=3)
    assert o["chunk_gap_ms"]["mean"] == pytest.approx(20, abs=1)
    assert o["e2e_ms"]["p50"] == pytest.approx(e2e, abs=3)
    assert o["tpot_ms"]["mean"] == pytest.approx(tpot, abs=0.5)
    # goodput: TPOT is 10 ms as vLLM computes it (meets 10.5 ms) but 11.25 ms as AIPerf does (misses it)
    assert o["slo_attainment"] == (1.0 if metrics_as == "vllm" else 0.0)
    assert summary["names"]["tpot_ms"] == ("TPOT" if metrics_as == "vllm" else "ITL")
    assert summary["names"]["chunk_gap_ms"] == ("ITL" if metrics_as == "vllm" else "ICL")
    # each figure also matches, to HDR precision, what the records themselves say
    recs = res.records
    exact = sorted(request_metrics(r, metrics_as)["tpot"] for r in recs)
    assert o["tpot_ms"]["mean"] == pytest.approx(sum(exact) / len(exact) * 1e3, rel=1e-9)
    assert o["tpot_ms"]["max"] == pytest.approx(exact[-1] * 1e3, rel=1e-9)
