"""What the agent's HTTP side (server.py, events_api.py, trace_api.py) needs of a running agent, as a
Protocol: gpuscope.agent.Agent is one, and a test can pass any object that has these. The dashboard's
half of it (sampler, store, alerts) is gpuscope.web.local.AgentView."""

from __future__ import annotations

from typing import Any, Protocol

from ..web.local import AgentView


class AgentFace(AgentView, Protocol):
    """A running agent as its HTTP server sees it."""

    cfg: Any  # gpuscope.agent.config.Config (the trace API reads cfg.data_path)
    baselines: Any  # gpuscope.diagnose.baseline.Tracker, or None when baselines are off
    naming: str  # 'canonical', 'dcgm' or 'canonical,dcgm' (both): the default names on /metrics
    loopback_only: bool  # bound to a loopback address: no token needed for reads
    token: str | None
    token_path: Any  # where the token is kept (logged, never sent to a client)

    def render_metrics(self, mode: str) -> bytes:
        """The Prometheus exposition of the latest snapshot, in `mode` naming."""
        ...

    def status(self) -> dict[str, Any]:
        """/api/v1/status: sampler overhead, store statistics and health."""
        ...
