"""Reading the files a user hands gpuscope (config, alert rules, guard config, stage and replay files):
a size cap, a nesting cap, and one sentence for every way such a file can be bad.

A parser meets more than its own errors: a number of 5,000 digits is Python's ValueError (int max str
digits), a list nested 100,000 deep a RecursionError, a 5 MB YAML file half a minute of parsing. Here each
of them is one sentence that names the file, raised as `error` (a UsageError by default: exit 2).

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "c.toml")
    >>> _ = open(p, "w").write("[agent]\\nport = " + "9" * 5000 + "\\n")
    >>> load_toml(p, "the config file c.toml")
    Traceback (most recent call last):
    ...
    gpuscope._files.InputFileError: The config file c.toml holds a number of more than 4300 digits.

Standard library only (PyYAML is imported inside `parse_yaml`, when a YAML file is read).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from .errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "MAX_LINE_BYTES", "InputFileError", "kind_of", "load_json", "load_toml",
           "load_yaml", "parse_json", "parse_toml", "parse_yaml", "read_bytes", "read_lines", "read_text", "shown"]

#: The largest config, rule, guard or stage file: real ones are a few kB; 1 MiB of YAML already takes
#: seconds to parse in pure Python.
MAX_FILE_BYTES = 1 << 20
#: The deepest nesting of lists and tables: gpuscope's own files need 5 levels.
MAX_DEPTH = 64
#: The longest line of a JSON-lines file (a replayed request with a long prompt is a few hundred kB).
MAX_LINE_BYTES = 16 << 20
#: Whole numbers must fit in 64 bits, as TOML itself requires.
_INT_BOUND = 1 << 63


class InputFileError(UsageError, ValueError):
    """A file the user gave cannot be used: one sentence naming it."""


def kind_of(value: Any) -> str:
    """What a value read from JSON, TOML or YAML is, in the formats' words rather than Python's type names
    (a sentence says "not a list", never "not list" or "not NoneType").

    >>> kind_of([1]), kind_of({}), kind_of("x"), kind_of(5), kind_of(True), kind_of(None)
    ('a list', 'a mapping', 'a string', 'a number', 'true or false', 'null')
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return "a date or time" if hasattr(value, "isoformat") else "a value of another kind"  # TOML/YAML dates


def shown(value: Any) -> str:
    """A value read from a file, written back as the user wrote it: true, false and null rather than Python's
    True, False and None (strings and numbers as repr shows them, quoted as the rest of a sentence quotes).

    >>> shown(True), shown(None), shown("1s"), shown(5)
    ('true', 'null', "'1s'", '5')
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)


def _cap(what: str) -> str:
    return what[:1].upper() + what[1:]


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB" if n >= 2**10 else f"{n} bytes"


def _open(path: str | os.PathLike[str], what: str, error: type[Exception]) -> Any:
    """The file opened for reading bytes; a missing, unreadable file or a bad name raises `error`."""
    try:
        return open(path, "rb")  # noqa: SIM115 - the callers close it
    except FileNotFoundError:
        raise error(f"{_cap(what)} does not exist.") from None
    except IsADirectoryError:
        raise error(f"{_cap(what)} is a directory, not a file.") from None
    except OSError as e:
        raise error(f"{_cap(what)} cannot be read: {e.strerror or e}.") from None
    except ValueError:  # a path with a NUL byte
        raise error(f"{_cap(what)} cannot be read: its name holds a NUL byte.") from None


def read_bytes(path: str | os.PathLike[str], what: str, *, max_bytes: int = MAX_FILE_BYTES,
               error: type[Exception] = InputFileError) -> bytes:
    """The file's bytes, at most `max_bytes`; a missing, unreadable or larger file raises `error`.

    `what` names the file in the sentence: "the rule file rules.yaml"."""
    f = _open(path, what, error)
    try:
        data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{_cap(what)} cannot be read: {e.strerror or e}.") from None
    finally:
        f.close()
    if len(data) > max_bytes:
        raise error(f"{_cap(what)} is larger than {_size(max_bytes)}, the most such a file may be.")
    return data


def read_text(path: str | os.PathLike[str], what: str, *, max_bytes: int = MAX_FILE_BYTES,
              error: type[Exception] = InputFileError) -> str:
    """`read_bytes` decoded as UTF-8 (a leading byte-order mark is dropped); other bytes raise `error`."""
    data = read_bytes(path, what, max_bytes=max_bytes, error=error)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{_cap(what)} is not UTF-8 text (byte {e.start} is not).") from None


def _checked(doc: Any, what: str, max_depth: int, error: type[Exception]) -> Any:
    """`doc` if no list or table in it is nested deeper than `max_depth` and every whole number fits in
    64 bits. Iterative, and each container is looked at once (YAML aliases share them)."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, bool):
            continue
        if isinstance(node, int):
            if not -_INT_BOUND <= node < _INT_BOUND:
                raise error(f"{_cap(what)} holds a whole number too large to use (they must fit in 64 bits).")
            continue
        if isinstance(node, dict):
            children: Any = [*node.keys(), *node.values()]
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        if depth >= max_depth:
            raise error(f"{_cap(what)} is nested too deep (more than {max_depth} levels of lists or tables).")
        stack.extend((c, depth + 1) for c in children)
    return doc


def _too_deep(what: str, max_depth: int, error: type[Exception]) -> Exception:
    return error(f"{_cap(what)} is nested too deep (more than {max_depth} levels of lists or tables).")


def _number(e: ValueError, what: str, error: type[Exception]) -> Exception | None:
    """The sentence for Python's int max-str-digits ValueError, or None for another ValueError."""
    if "integer string conversion" not in str(e):
        return None
    limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300
    return error(f"{_cap(what)} holds a number of more than {limit} digits.")


def parse_toml(text: str, what: str, *, max_depth: int = MAX_DEPTH,
               error: type[Exception] = InputFileError) -> dict[str, Any]:
    """A TOML document; any problem with it raises `error` with one sentence."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{_cap(what)} is not valid TOML: {e}.") from None
    except ValueError as e:
        raise (_number(e, what, error) or error(f"{_cap(what)} is not valid TOML: {e}.")) from None
    except RecursionError:  # arrays nested thousands deep: no parser error, a Python one
        raise _too_deep(what, max_depth, error) from None
    return _checked(doc, what, max_depth, error)


def parse_json(text: str | bytes, what: str, *, max_depth: int = MAX_DEPTH,
               error: type[Exception] = InputFileError) -> Any:
    """A JSON document; any problem with it raises `error` with one sentence."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{_cap(what)} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}.") from None
    except RecursionError:
        raise _too_deep(what, max_depth, error) from None
    except ValueError as e:
        raise (_number(e, what, error) or error(f"{_cap(what)} is not valid JSON: {e}.")) from None
    return _checked(doc, what, max_depth, error)


def parse_yaml(text: str, what: str, *, max_depth: int = MAX_DEPTH,
               error: type[Exception] = InputFileError) -> Any:
    """A YAML document (safe_load: plain data only); any problem with it raises `error` with one sentence."""
    import yaml  # type: ignore[import-untyped]

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser when there: 10x faster
    try:
        doc = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as e:
        if "nesting depth" in str(getattr(e, "problem", "")):  # libyaml's own cap (1,000 levels)
            raise _too_deep(what, max_depth, error) from None
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or (str(e).splitlines() or ["unreadable"])[0]
        raise error(f"{_cap(what)} is not valid YAML{at}: {problem}.") from None
    except RecursionError:
        raise _too_deep(what, max_depth, error) from None
    except ValueError as e:  # a number of thousands of digits; also a date such as 2024-13-45
        raise (_number(e, what, error) or error(f"{_cap(what)} is not valid YAML: {e}.")) from None
    except (TypeError, OverflowError) as e:  # a value PyYAML's constructors cannot build
        raise error(f"{_cap(what)} is not valid YAML: {e}.") from None
    return _checked(doc, what, max_depth, error)


def load_toml(path: str | os.PathLike[str], what: str, *, max_bytes: int = MAX_FILE_BYTES,
              max_depth: int = MAX_DEPTH, error: type[Exception] = InputFileError) -> dict[str, Any]:
    """`read_text` then `parse_toml`."""
    return parse_toml(read_text(path, what, max_bytes=max_bytes, error=error), what, max_depth=max_depth,
                      error=error)


def load_yaml(path: str | os.PathLike[str], what: str, *, max_bytes: int = MAX_FILE_BYTES,
              max_depth: int = MAX_DEPTH, error: type[Exception] = InputFileError) -> Any:
    """`read_text` then `parse_yaml`."""
    return parse_yaml(read_text(path, what, max_bytes=max_bytes, error=error), what, max_depth=max_depth,
                      error=error)


def load_json(path: str | os.PathLike[str], what: str, *, max_bytes: int = MAX_FILE_BYTES,
              max_depth: int = MAX_DEPTH, error: type[Exception] = InputFileError) -> Any:
    """`read_text` then `parse_json`."""
    return parse_json(read_text(path, what, max_bytes=max_bytes, error=error), what, max_depth=max_depth,
                      error=error)


def read_lines(path: str | os.PathLike[str], what: str, *, max_line_bytes: int = MAX_LINE_BYTES,
               error: type[Exception] = InputFileError) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank line, read as a stream: the file as a whole has no cap (a
    run's records need not fit in memory), each line has `max_line_bytes`. Missing, unreadable files and a
    longer line raise `error`."""
    f = _open(path, what, error)  # closed in the finally below, also when the caller stops early
    try:
        n = 0
        while True:
            try:
                line = f.readline(max_line_bytes + 1)
            except OSError as e:
                raise error(f"{_cap(what)} cannot be read: {e.strerror or e}.") from None
            if not line:
                return
            n += 1
            if len(line) > max_line_bytes and not line.endswith(b"\n"):
                raise error(f"Line {n} of {what} is longer than {_size(max_line_bytes)}, the most one line "
                            "may be.")
            if line.strip():
                yield n, line
    finally:
        f.close()
