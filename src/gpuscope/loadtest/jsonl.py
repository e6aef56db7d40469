"""JSON Lines files a user hands the load tester (replay captures, request files, a run's own records):
read once, with one sentence for every way the file can be bad."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from .._files import MAX_LINE_BYTES, read_lines


def json_lines(path: str | Path, what: str, error: type[Exception],
               max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line, read as a stream (a run's records need not fit
    in memory; each line may be at most `max_line_bytes`). `what` names the file in the sentences ("the
    replay file x.jsonl"); an unreadable file, a line too long, text that is not UTF-8 or a line that is
    not JSON raises `error` with one sentence."""
    for n, line in read_lines(path, what, max_line_bytes=max_line_bytes, error=error):
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                raise error(f"{what[:1].upper()}{what[1:]} is not UTF-8 text.") from None
            if "depth limit" in str(e):
                raise error(f"Line {n} of {what} is nested too deep (more than 1024 levels).") from None
            if "infinity" in str(e):  # orjson reads a number it cannot hold as a double
                raise error(f"Line {n} of {what} holds a number too large to use.") from None
            raise error(f"Line {n} of {what} is not valid JSON.") from None
        yield n, value
