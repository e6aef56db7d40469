"""JSON Lines files a user hands the load tester (replay captures, request files, a run's own records):
read once, with one sentence for every way the file can be bad."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson


def json_lines(path: str | Path, what: str, error: type[Exception]) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line, read as a stream (a run's records need not fit
    in memory). `what` names the file in the sentences ("the replay file x.jsonl"); an unreadable file,
    text that is not UTF-8 or a line that is not JSON raises `error` with one sentence."""
    try:
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    value = orjson.loads(line)
                except orjson.JSONDecodeError:
                    try:
                        line.decode("utf-8")
                    except UnicodeDecodeError:
                        raise error(f"{what[:1].upper()}{what[1:]} is not UTF-8 text.") from None
                    raise error(f"Line {n} of {what} is not valid JSON.") from None
                yield n, value
    except OSError as e:
        raise error(f"Cannot read {what}: {e.strerror or e}.") from None
