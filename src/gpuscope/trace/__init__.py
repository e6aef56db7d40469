"""Traces of what a process did on the CPU and the GPUs: load one (Kineto JSON), analyse it.

    >>> from gpuscope.trace import load, analyze
    >>> report = analyze(load("rank0.pt.trace.json.gz"))  # doctest: +SKIP
"""

from .kineto import load
from .model import COLUMNS, EventKind, Trace, TraceError

__all__ = ["COLUMNS", "EventKind", "Trace", "TraceError", "load"]
