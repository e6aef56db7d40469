"""Where gpuscope keeps its files by default (standard library only).

The agent's data directory holds the store, the API token and the tracing requests; every verb that
looks for them (query, export, top, trace run --on-demand, guard) starts from the same default.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_data_dir"]


def default_data_dir() -> Path:
    """/var/lib/gpuscope for root (a service), else $XDG_DATA_HOME/gpuscope or ~/.local/share/gpuscope."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return Path("/var/lib/gpuscope")
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "gpuscope"
