"""Errors a user of the store can cause. Each message is one sentence they can act on."""

from __future__ import annotations

from ..errors import UsageError


class StoreError(UsageError):
    """Base class of every error the store raises on purpose."""


class StoreLocked(StoreError):
    """Another process holds the data directory for writing."""


class QueryError(StoreError, ValueError):
    """A query parameter is out of range: unknown metric, inverted range, absurd step, unknown agg."""


class CorruptChunk(StoreError):
    """A stored block failed its checksum or could not be decoded (queries skip it and log once)."""
