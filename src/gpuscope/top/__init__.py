"""`gpuscope top`: the live terminal view of GPUs, verdicts and processes.

    gpuscope top                         # reads the local agent; samples here when there is none
    gpuscope top --simulate mixed --gpus 8 --processes 100
    gpuscope top --once --json           # one overview (gpuscope.viewmodel's shape) for scripts
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from typing import Any

from .._nvml import NvmlUnavailable
from ..agent.client import BadArgument, ClientError
from ..errors import Unavailable
from ..sampler import Sampler, SamplerConfig
from .feed import AgentFeed, Feed, LocalFeed, StaticFeed
from .model import plain

__all__ = ["AgentFeed", "Feed", "LocalFeed", "StaticFeed", "open_feed", "run"]

SAMPLER_INTERVAL_S = 0.1


class NoSource(Unavailable):
    """Neither an agent nor a GPU nor --simulate: one sentence."""


def open_feed(url: str, token: str | None, refresh: float, simulate: str | None = None,
              gpus: int | None = None, processes: int | None = None,
              local: Callable[[], Any] | None = None) -> Feed:
    """A simulated node when asked for; else the agent at `url`; else (no agent, or it refused) this
    process's own sampler of the real GPUs, with a note saying why. `local` makes that sampler (tests)."""
    if simulate is not None:
        return LocalFeed(Sampler(SamplerConfig(interval=SAMPLER_INTERVAL_S), simulate=simulate, gpus=gpus,
                                 processes=processes), refresh)
    agent = AgentFeed(url, token, refresh)
    try:
        agent.probe()
        return agent
    except BadArgument:  # a token that cannot be sent is the user's to fix, not a reason to sample here
        raise
    except ClientError as e:
        why = str(e).rstrip(".")
    sampler = (local or (lambda: Sampler(SamplerConfig(interval=SAMPLER_INTERVAL_S))))()
    try:
        sampler.open()
    except NvmlUnavailable:
        raise NoSource(f"{why}; and there is no NVIDIA GPU here to sample instead "
                       "(try 'gpuscope top --simulate mixed').") from None
    feed = LocalFeed(sampler, refresh)
    feed.note = f"{why}; sampling this machine's GPUs instead."
    return feed


def run(feed: Feed, refresh: float, once: bool = False, as_json: bool = False) -> int:
    """Start the feed, then show the TUI until q (or print one overview with `once`)."""
    feed.start()
    try:
        if once:
            ov = feed.wait_first(10.0)
            if isinstance(feed, LocalFeed):  # rates (GPM, PCIe) need a second sample a window later
                time.sleep(1.0)
                ov = feed.latest()
            if ov is None:
                raise ClientError(feed.error or "No data came within 10 s.")
            ov = {**ov, "errors": ov["errors"] + ([feed.note] if feed.note else [])}
            print(json.dumps(ov, indent=1) if as_json else plain(ov, shutil.get_terminal_size().columns))
            return 0
        from .app import TopApp

        TopApp(feed, refresh).run()
        return 0
    finally:
        feed.stop()
