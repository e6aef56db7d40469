"""`gpuscope profile`: GPU time by launching stack, merged across the processes and nodes of a fleet."""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .._args import check_data_dir, check_writable
from ..errors import EXIT_OK, Unavailable, UsageError

HELP = "GPU time by launching stack from many agents, merged into pprof or speedscope"
DESCRIPTION = (
    "Asks every agent (--agents, or the targets a Prometheus server scrapes in its gpuscope job, or the local agent) "
    "for the GPU time of the traces its processes wrote in the last --since, charged to the Python stack that "
    "launched each kernel, and merges them into one profile: pprof (sample types gpu_time in ns and launches; what "
    "go tool pprof, Pyroscope, Parca and Cloud Profiler read) or speedscope JSON. An agent that does not answer, or "
    "answers something that is not a profile, is named on stderr and left out. Exit status: 0 every agent merged, "
    "1 none could be, 2 bad usage, 3 written without the agents named.")
EPILOG = """examples:
  gpuscope profile --since 1h --agents http://node1:9471 http://node2:9471 --out gpu.pb.gz
  gpuscope profile --since 6h --job slurm/4242 --prometheus http://prometheus:9090 --out job.pb.gz
  gpuscope profile --format speedscope --out gpu.speedscope.json      # the local agent
  go tool pprof -sample_index=gpu_time -top gpu.pb.gz"""

EXIT_PARTIAL = 3
MAX_ANSWER_BYTES = 256 << 20  # one agent's folded profile (json) at most
DEFAULT_TIMEOUT_S = 30.0
MAX_AGENTS = 4096
PARALLEL = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--since", default="1h", metavar="DURATION",
                   help="the traces that ended within this long ago (default 1h)")
    p.add_argument("--job", metavar="JOB", help="only this job's processes, as the agents name it: slurm/ID, "
                   "torchrun/RUN_ID or k8s/NAMESPACE/OWNER")
    p.add_argument("--agents", nargs="+", metavar="URL", default=[],
                   help="the agents to ask, e.g. http://node1:9471 (default: the local agent)")
    p.add_argument("--prometheus", metavar="URL",
                   help="find the agents among the targets this Prometheus-compatible server scrapes")
    p.add_argument("--prometheus-job", default="gpuscope", metavar="NAME",
                   help="with --prometheus: the scrape job of the agents (default gpuscope)")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the merged profile")
    p.add_argument("--format", choices=("pprof", "speedscope", "json"), default=None,
                   help="pprof (default; gzip-compressed profile.proto), speedscope, or json (gpuscope's folded "
                        "form); default from --out: .json -> speedscope")
    p.add_argument("--token", default=None,
                   help="the agents' bearer token (default $GPUSCOPE_TOKEN, else the token file in --data-dir)")
    p.add_argument("--data-dir", default=None, help="the local agent's data directory, where its token is")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"per agent (default {DEFAULT_TIMEOUT_S:g})")


def run(args: argparse.Namespace) -> int:
    from ..agent.client import default_url
    from ..http.auth import find_token
    from ..http.net import parse_upstream
    from ..timeparse import parse_duration
    from ..trace.profile import NoProtobuf, merge

    check_data_dir(args.data_dir)
    check_writable("--out", args.out)
    since_s = parse_duration(args.since, "--since")
    if not since_s > 0:
        raise UsageError(f"--since must be a positive duration, not {args.since!r}.")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, not {args.timeout:g}.")
    fmt = args.format or ("speedscope" if args.out.endswith(".json") else "pprof")
    agents = [parse_upstream(u, "--agents", "http://node1:9471") for u in args.agents]
    if args.prometheus:
        agents += agents_from_prometheus(parse_upstream(args.prometheus, "--prometheus", "http://prometheus:9090"),
                                         args.prometheus_job, args.timeout)
    if not args.agents and not args.prometheus:
        agents = [default_url()]
    agents = list(dict.fromkeys(a.rstrip("/") for a in agents))
    if len(agents) > MAX_AGENTS:
        raise UsageError(f"{len(agents)} agents is more than the {MAX_AGENTS} one merge asks.")
    token = find_token(args.token, args.data_dir)
    if token is not None and not (token.isprintable() and token.isascii()):
        raise UsageError("The token holds a line break or another character that cannot go in an HTTP header; "
                         "check --token, $GPUSCOPE_TOKEN or the token file.")
    params = {"since": f"{since_s:g}s", "format": "json", **({"job": args.job} if args.job else {})}

    profiles, missing = [], []
    with concurrent.futures.ThreadPoolExecutor(min(PARALLEL, len(agents))) as pool:
        for url, (profile, why) in zip(agents, pool.map(lambda u: fetch(u, params, token, args.timeout), agents),
                                       strict=True):
            if profile is None:
                missing.append(url)
                print(f"gpuscope profile: {why}", file=sys.stderr)
            else:
                profiles.append(profile)
    if not profiles:
        raise Unavailable(f"No agent's profile could be merged (of {len(agents)} asked); nothing written.")
    merged = merge(profiles)
    try:
        body = (merged.pprof() if fmt == "pprof" else
                json.dumps(merged.speedscope() if fmt == "speedscope" else merged.to_json()).encode())
    except NoProtobuf as e:
        raise Unavailable(str(e)) from None
    _write(args.out, body)
    print(f"{args.out}: {merged.summary()}, from {len(profiles)} of {len(agents)} agent(s)")
    if missing:
        print(f"gpuscope profile: written without {len(missing)} agent(s): {', '.join(missing)}", file=sys.stderr)
        return EXIT_PARTIAL
    return EXIT_OK


def fetch(url: str, params: dict[str, str], token: str | None, timeout: float) -> tuple[Any, str]:
    """(the agent's folded profile, '') or (None, one sentence why not); never raises."""
    from ..trace.profile import Profile, ProfileError

    full = url + "/api/v1/profile?" + urllib.parse.urlencode(params)
    headers = {"Accept": "application/json", "User-Agent": "gpuscope"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(full, headers=headers), timeout=timeout) as r:
            raw = r.read(MAX_ANSWER_BYTES + 1)
    except urllib.error.HTTPError as e:
        return None, f"the agent at {url} answered HTTP {e.code}: {_error_of(e)}."
    except urllib.error.URLError as e:
        why = getattr(e.reason, "strerror", None) or e.reason
        return None, f"no agent answers at {url} ({why})."
    except (TimeoutError, OSError) as e:
        return None, f"the agent at {url} did not answer within {timeout:g} s ({type(e).__name__})."
    except (http.client.HTTPException, ValueError) as e:
        return None, f"{url} broke off its answer or does not speak HTTP ({type(e).__name__})."
    if len(raw) > MAX_ANSWER_BYTES:
        return None, f"the agent at {url} answered more than {MAX_ANSWER_BYTES >> 20} MiB; left out."
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None, f"{url} answered with something that is not JSON (cut short?); is it a gpuscope agent?"
    try:
        return Profile.from_json(doc), ""
    except ProfileError as e:
        return None, f"the answer of {url} is not a usable profile: {e}."
    except RecursionError:
        return None, f"the answer of {url} is not a usable profile: nested too deep."


def _error_of(e: urllib.error.HTTPError) -> str:
    try:
        msg = json.loads(e.read(65536)).get("error")
    except (ValueError, AttributeError, RecursionError, OSError):
        msg = None
    text = msg if isinstance(msg, str) else str(e.reason)
    return " ".join(text.split())[:300].rstrip(".")


def agents_from_prometheus(url: str, job: str, timeout: float) -> list[str]:
    """The base URLs of the targets `url` scrapes in scrape job `job` (its /api/v1/targets)."""
    from ..promql import Client

    data = Client(url, timeout=timeout).api("/api/v1/targets", [("state", "active")], post=False)
    targets = data.get("activeTargets") if isinstance(data, dict) else None
    found = []
    for t in targets if isinstance(targets, list) else []:
        labels = t.get("labels") if isinstance(t, dict) else None
        scrape = t.get("scrapeUrl") if isinstance(t, dict) else None
        if not isinstance(labels, dict) or labels.get("job") != job or not isinstance(scrape, str):
            continue
        parts = urllib.parse.urlsplit(scrape)
        if parts.scheme in ("http", "https") and parts.netloc:
            found.append(f"{parts.scheme}://{parts.netloc}")
    if not found:
        raise Unavailable(f"{Client(url).shown} scrapes no target in job {job!r}; name the agents' job with "
                          "--prometheus-job or the agents with --agents.")
    return found


def _write(path: str, body: bytes) -> None:
    """Through a temporary file renamed into place: a failed run leaves no half-written profile."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".gpuscope-profile-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise Unavailable(f"--out {path} could not be written: {e.strerror or e}.") from None
