"""JSON Lines files a user hands the load tester (replay captures, request files, a run's own records):
read once, with one sentence for every way the file can be bad."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson


def json_lines(path: str | Path, what: str, error: type[Exception]) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line. `what` names the file in the sentences
    ("the replay file x.jsonl"); an unreadable file, text that is not UTF-8 or a line that is not JSON
    raises `error` with one sentence."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise error(f"Cannot read {what}: {e.strerror or e}.") from None
    except UnicodeDecodeError:
        raise error(f"{what[:1].upper()}{what[1:]} is not UTF-8 text.") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield n, orjson.loads(line)
        except orjson.JSONDecodeError:
            raise error(f"Line {n} of {what} is not valid JSON.") from None
