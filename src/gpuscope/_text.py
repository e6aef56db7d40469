"""Text from outside, made valid UTF-8 once, where it enters (process names and command lines, posted
event messages and labels), so that every consumer (the store, /metrics, the JSON API, the dashboard,
`top --json`) can encode it without fixing it again.

psutil hands over names and arguments that are not valid UTF-8 with surrogate escapes (PEP 383: the
byte 0xff becomes '\\udcff'), and JSON may carry a lone surrogate ("\\ud800"). Neither can be encoded
as UTF-8: SQLite, an HTTP body or a terminal raise on it. `valid_text` shows an escaped byte as the
four characters \\xff and any other surrogate as \\ud800; valid text comes back unchanged (the same
object, at the cost of one `isascii()` for the usual ASCII name).

    >>> valid_text("ev\\udcffil"), valid_text("a\\ud800b"), valid_text("café")
    ('ev\\\\xffil', 'a\\\\ud800b', 'café')
"""

from __future__ import annotations

import re

__all__ = ["valid_text"]

# Surrogates that are not PEP 383 escapes of a byte (U+DC80..U+DCFF).
_LONE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def valid_text(s: str) -> str:
    """`s` where it is valid UTF-8, else with each surrogate shown as a backslash escape."""
    if s.isascii():
        return s
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        pass
    else:
        return s
    s = _LONE.sub(lambda m: f"\\u{ord(m.group()):04x}", s)
    # The escaped bytes back to bytes; a run of them that is valid UTF-8 is the character it spells.
    return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
