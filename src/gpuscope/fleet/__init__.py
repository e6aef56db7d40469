"""Fleet answers over Prometheus: who holds GPUs they do not use, and what it costs.

    from gpuscope.fleet import report, load_prices, rules_yaml
    r = report("http://prometheus:9090", start_s, end_s, by="namespace")   # the --json document
    r["fleet"]["line"]   # '$X of $Y (Z %) went to GPUs that were idle or starved this week.'

Everything is read from a Prometheus-compatible server that scrapes the gpuscope agents; gpuscope adds no
store of its own. docs/FLEET.md says what each figure means and how it is computed.
"""

from __future__ import annotations

from typing import Any

from ._compute import NoFleetData, Progress
from ._prices import DEFAULT as DEFAULT_PRICES
from ._prices import Prices, PricesError
from ._prices import load as load_prices
from ._queries import DIMENSIONS, RECORDED
from ._tiles import rules_yaml

__all__ = ["DEFAULT_PRICES", "DIMENSIONS", "RECORDED", "NoFleetData", "Prices", "PricesError", "Progress",
           "load_prices", "report", "rules_yaml"]


def report(url: str, start_s: float, end_s: float, by: str = "namespace", prices: Prices | None = None, *,
           timeout: float = 120.0, progress: Progress | None = None, source: str = "auto",
           headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The fleet report over [start_s, end_s) from the server at `url`, grouped `by` one of DIMENSIONS;
    `source`: auto (the tiles of `fleet rules` where a complete record covers the range, else its recorded
    series where they cover it, else the raw ones), raw, recorded or tiles;
    `headers` go with every request (`{"Authorization": "Bearer ..."}` for a server behind a token)."""
    from ..promql import Client
    from ._compute import build

    return build(Client(url, timeout=timeout, headers=headers), start_s, end_s, by, prices or DEFAULT_PRICES,
                 progress=progress, source=source)
