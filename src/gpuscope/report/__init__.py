"""Reports of a `gpuscope run`: the whole run's series in bounded memory (`GpuTimeline`), the run's
processes (`RunProcesses`) and the self-contained HTML page (`render_html`, `write_html`).

    gpuscope run --simulate launch_bound --html report.html -- sleep 12
"""

from .htmlpage import render_html, write_html
from .processes import RunProcesses
from .timeline import GpuTimeline

__all__ = ["GpuTimeline", "RunProcesses", "render_html", "write_html"]
