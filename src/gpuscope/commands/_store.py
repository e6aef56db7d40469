"""Opening the agent's on-disk store read-only, for the verbs that read it directly (export, diagnose)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..errors import Unavailable


def with_store(data_dir: str | None, use: Callable[[Any], Any], elsewhere: str = "") -> Any:
    """`use(store)` on the agent's store, opened read-only (the agent may be writing meanwhile).

    A store error (corrupt, locked, unknown metric) is a `StoreError`, itself a `UsageError`."""
    from .._paths import default_data_dir
    from ..store import Store

    path = os.path.join(os.path.expanduser(data_dir) if data_dir else str(default_data_dir()), "store")
    if not os.path.isdir(path):
        raise Unavailable(f"No gpuscope store at {path}; point --data-dir at the agent's data directory{elsewhere}.")
    store = Store(path, readonly=True)
    try:
        return use(store)
    finally:
        store.close()
