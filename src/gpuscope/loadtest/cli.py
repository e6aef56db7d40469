"""`gpuscope loadtest URL`: open- and closed-loop load with stages, measured without coordinated omission."""

from __future__ import annotations

import argparse
import re

HELP = "load-test an HTTP or OpenAI-compatible service, open loop, with the GPU's side of the story"

DESCRIPTION = """\
Send requests at intended times (open loop: constant, Poisson or gamma arrivals) or with a fixed number in
flight (closed loop), in stages, and measure every latency from the time the request was *meant* to be sent
(no coordinated omission) as well as from the time it was sent. Requests sent late are counted; when the
figures are not the server's (the client was the bottleneck, or answers were lost) the run is marked
invalid and says why.

Writes DIR/records.jsonl (one line per request), DIR/summary.json and DIR/report.html (with GPU panels when
GPUs could be read: the agent at $GPUSCOPE_URL or http://127.0.0.1:9471, else this host's GPUs)."""

EPILOG = """\
examples:
  # 50 req/s, Poisson arrivals, for 1 minute, after 10 s of warm-up
  gpuscope loadtest http://127.0.0.1:8000/health --rate 50 --duration 1m --warmup 10s
  # a step ladder of rates, 30 s each; bursty arrivals (gamma, burstiness 0.5)
  gpuscope loadtest http://host:8000/ --stages 10,20,40,80 --stage-duration 30s --arrival gamma --burstiness 0.5
  # closed loop: 32 requests in flight for 2 minutes; or ramped from 1 to 64 in flight over 5 minutes
  gpuscope loadtest http://host:8000/ --concurrency 32 --duration 2m
  gpuscope loadtest http://host:8000/ --closed-loop --ramp linear:1:64 --duration 5m
  # ramps and spikes; a stage file (YAML/JSON list of {duration, rate|concurrency, arrival, ramp_to};
  # ramp_to is the rate, or the concurrency, at the stage's end)
  gpuscope loadtest http://host:8000/ --ramp exp:1:200 --duration 5m
  gpuscope loadtest http://host:8000/ --spike 20:200:60s:10s --duration 3m
  gpuscope loadtest http://host:8000/ --stage-file stages.yaml
  # POST with a body template ({seq}, {rand_int:1:100}, {choice:a|b}, {uuid}) and headers
  gpuscope loadtest http://host:8000/items -X POST -H 'Authorization: Bearer T' --body '{"id": {seq}}'
  # an OpenAI-compatible LLM server, streaming, with SLOs (goodput) and vLLM's metric names
  gpuscope loadtest http://host:8000 --openai chat --model m --prompt-tokens 512 --max-tokens 128 \\
      --rate 4 --duration 2m --slo ttft=200ms,tpot=50ms --metrics-as vllm
  # the highest rate that holds the SLOs (each trial a --stage-duration long)
  gpuscope loadtest http://host:8000 --openai completions --slo ttft=500ms,e2e=5s --find-capacity
  # replay a capture at twice its speed
  gpuscope loadtest http://host:8000 --replay capture.jsonl --speed 2

metrics (--metrics-as): chunk gaps are vLLM's "ITL" and AIPerf's "ICL"; (E2E-TTFT)/(tokens-1) per request
is vLLM's "TPOT" and AIPerf's "ITL". Throughput divides by the stage's wall time (vllm) or by last
response - first request (aiperf). Token counts come from the server's usage field, else one content
chunk = one token (marked tokens_from="estimate" in records.jsonl).

HTTP/1.1 as servers speak it: connections are kept alive unless the server's answer or your own
-H 'Connection: close' says otherwise (then each request gets a connection of its own); a request that
fails on a kept-alive connection before any byte of answer (the server closed it as the request went out)
is sent once more on a fresh connection and counted as retried, not as an error, when it is safe to send
twice: GET, HEAD, OPTIONS, TRACE, PUT, DELETE, or any request carrying an Idempotency-Key header (a POST
without one is recorded as a disconnect, never sent twice). A body with neither Content-Length nor
chunking ends when the server closes (HTTP/1.0, SSE without chunking). 1xx answers (100 Continue, 103)
are skipped, so -H 'Expect: 100-continue' works (the body is sent at once, as RFC 9110 allows); a 101 is
an error; trailers are read and dropped. Bad answers are counted by class, with a sentence each in
report.html: malformed (bad status line, status outside 100-599, headers over 64 KiB, a body longer than
its Content-Length), disconnect (shorter), timeout (a server that stalls, mid-body included).

exit status: 0 run done and valid; 1 run done but invalid: its figures are not the server's (the client
was the bottleneck: p99 send lag over 5 ms, over 10 % of requests sent late, a worker over 90 % CPU; or the
client failed requests itself; or over 1 % of a stage's requests got no complete answer: timeout,
disconnect, malformed); 2 bad input or the URL did not answer before the start."""

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("url", nargs="?", help="the URL to load (http:// or https://); with --openai, the server's base URL")
    g = p.add_argument_group("load shape")
    g.add_argument("--rate", type=float, help="open loop: requests per second (default 10)")
    g.add_argument("--concurrency", type=int, help="closed loop: requests kept in flight")
    g.add_argument("--duration", default=None, help="how long (30s, 2m; default 30s), or use --requests")
    g.add_argument("--requests", type=int, help="stop after this many requests")
    g.add_argument("--stages", help="a step ladder: comma-separated rates (concurrencies with --closed-loop)")
    g.add_argument("--stage-duration", default="30s",
                   help="length of each --stages step and capacity trial (a slow trial is stretched to send "
                        "~100 requests, at most 4x)")
    g.add_argument("--closed-loop", action="store_true", help="--stages and --ramp are concurrencies, not rates")
    g.add_argument("--ramp", metavar="linear|exp:FROM:TO", help="ramp the rate (the concurrency with --closed-loop) from FROM to TO over --duration")
    g.add_argument("--spike", metavar="BASE:PEAK:AT:LENGTH", help="base rate with one spike, e.g. 20:200:60s:10s")
    g.add_argument("--stage-file", help="YAML or JSON list of {duration, rate|concurrency, arrival, ramp_to, ...}")
    g.add_argument("--arrival", default="poisson", choices=("constant", "poisson", "gamma"),
                   help="open-loop arrival process (default poisson)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape b: 1 = Poisson, <1 burstier, >1 smoother (gaps' CV = 1/sqrt(b))")
    g.add_argument("--warmup", default=None, help="send at the first stage's load for this long first, not counted")
    g.add_argument("--seed", type=int, help="make the schedule (and random body values) reproducible")
    g.add_argument("--replay", help="replay a capture (JSON lines with t, method, path, body...) at its offsets")
    g.add_argument("--speed", type=float, default=1.0, help="replay speed factor (2 = twice as fast)")
    h = p.add_argument_group("requests")
    h.add_argument("-X", "--method", default=None, help="HTTP method (default GET, POST with a body)")
    h.add_argument("-H", "--header", action="append", default=[], help="'Name: value' (repeatable)")
    h.add_argument("--body", help="request body template: {seq} {rand_int:1:100} {rand_float:0:1} {choice:a|b} {uuid}")
    h.add_argument("--body-file", help="read the body template from a file")
    h.add_argument("--request-file", help="JSON lines of {method, path, headers, body, tag}, sent round-robin")
    h.add_argument("--openai", choices=("completions", "chat"), help="OpenAI-compatible streaming requests")
    h.add_argument("--model", default="default", help="model name for --openai (default 'default')")
    h.add_argument("--prompt-tokens", type=int, default=128, help="generated prompt length in tokens (about)")
    h.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each --openai request")
    h.add_argument("--prompt-file", help="prompts, one per line (or JSON lines with \"prompt\"), used in turn")
    m = p.add_argument_group("measurement")
    m.add_argument("--slo", help="SLOs for goodput, e.g. ttft=200ms,tpot=50ms,e2e=2s")
    m.add_argument("--metrics-as", default="vllm", choices=("vllm", "aiperf"),
                   help="name and compute LLM figures as vLLM or AIPerf do (default vllm)")
    m.add_argument("--timeout", default="60s", help="per-request timeout, counted from the intended send time (default 60s)")
    m.add_argument("--insecure", action="store_true", help="do not verify the server's TLS certificate")
    m.add_argument("--max-connections", type=int, default=0,
                   help="connections per worker (default: as many as needed: a true open loop)")
    m.add_argument("--late-threshold", default="5ms", help="a request sent later than this is counted late")
    m.add_argument("--workers", type=int, default=None, help="client processes (default: one per core)")
    m.add_argument("--max-rate-per-worker", type=float, default=None,
                   help="refuse rates above this per worker (default 20000 HTTP, 1500 streaming)")
    o = p.add_argument_group("output")
    o.add_argument("--out", help="output directory (default ./gpuscope-loadtest-<time>)")
    o.add_argument("--json", action="store_true", help="print summary.json to stdout")
    o.add_argument("--no-html", dest="html", action="store_false", help="do not write report.html")
    o.add_argument("--gpu", metavar="AGENT_URL", help="read GPUs from this agent (default $GPUSCOPE_URL or local)")
    o.add_argument("--no-gpu", action="store_true", help="do not read GPUs")
    o.add_argument("--gpus", metavar="IDS", type=_gpu_ids,
                   help="read only these GPUs, e.g. 0 or 0,1 or 0/mig1 (default all; the service's GPUs, so idle ones "
                        "do not dilute SM activity or add to joules per token); with --report-from, recompute the "
                        "page's GPU figures for these")
    o.add_argument("--find-capacity", action="store_true", help="search the highest rate that holds --slo")
    o.add_argument("--capacity-start", type=float, default=1.0, help="first rate of the search (req/s)")
    o.add_argument("--capacity-max", type=float, default=10_000.0, help="highest rate tried (req/s)")
    o.add_argument("--capacity-trials", type=int, default=12, help="most trials of the search (default 12)")
    o.add_argument("--quiet", action="store_true", help="no live progress line")
    o.add_argument("--report-from", metavar="DIR",
                   help="send nothing: write DIR/report.html again from a run's output directory (summary.json, "
                        "records.jsonl, gpu.jsonl), e.g. for a run made where the chart library was missing")


def _gpu_ids(text: str) -> list[str]:
    """--gpus: GPU labels as gpuscope names them: an index, or index/migN for a MIG instance."""
    ids = [t.strip() for t in text.split(",") if t.strip()]
    if not ids or not all(re.fullmatch(r"\d+(/mig\d+)?", t) for t in ids):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of GPU indices such as 0 or 0,1 or 0/mig1")
    return ids


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from . import job

    if args.report_from:
        from .rerender import RerenderError, rerender

        try:
            print(f"wrote {rerender(args.report_from, gpus=args.gpus)}")
        except RerenderError as e:
            raise UsageError(str(e)) from None
        return 0
    if not args.url:
        raise UsageError("Say which URL to load: gpuscope loadtest URL (see 'gpuscope loadtest --help').")
    try:
        return job.execute(job.build(args), args)
    except job.SetupError as e:
        raise UsageError(str(e)) from None
