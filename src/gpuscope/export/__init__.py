"""Getting gpuscope's series into the tools people already run: the Prometheus text exposition
(`/metrics`, canonical or DCGM-compatible names) and Prometheus remote write.

    >>> from gpuscope.export import render, RemoteWriter
"""

from .exposition import CONTENT_TYPE, Exposition, render
from .remote_write import RemoteWriter

__all__ = ["CONTENT_TYPE", "Exposition", "RemoteWriter", "render"]
