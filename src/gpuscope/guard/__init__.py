"""GPU-aware admission control for inference services: priority buckets, adaptive limits, a breaker.

    >>> from gpuscope.guard import Guard, RequestInfo, load_config
    >>> # guard = Guard(load_config("guard.yaml")); d = guard.acquire(RequestInfo(path=..., headers=..., body=...))

See docs/guard.md for the configuration, the algorithms and their thresholds.
"""

from ._classify import RequestInfo, estimate_tokens
from ._config import GuardConfig, GuardConfigError
from ._config import load as load_config
from ._config import parse as parse_config
from ._core import Decision, Guard
from ._limit import GpuSignal

__all__ = ["Decision", "GpuSignal", "Guard", "GuardConfig", "GuardConfigError", "RequestInfo", "estimate_tokens",
           "load_config", "parse_config"]
