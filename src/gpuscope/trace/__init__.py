"""Traces of what a process did on the CPU and the GPUs: load one (Kineto JSON), analyse it.

    >>> from gpuscope.trace import load
    >>> from gpuscope.trace.analyze import analyze
    >>> report = analyze(load("tests/fixtures/traces/launch_bound.pt.trace.json.gz"))
    >>> round(report.temporal[0].idle_ratio, 2)
    0.89
"""

from .kineto import load
from .model import COLUMNS, EventKind, Trace, TraceError

__all__ = ["COLUMNS", "EventKind", "Trace", "TraceError", "load"]
