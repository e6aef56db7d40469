"""The container: one SQLite database in WAL mode (readers in other processes never block the writer
and see each commit whole), plus an OS lock file so that a directory has one writer at a time.

Tables:
  meta(key, value)                      format version, watermarks, node (hostname, scenario, GPUs),
                                        series.next / layouts.next (ids are never reused) and
                                        series.deleted (how many series retention has deleted)
  series(id, key, metric, labels)       labels as sorted JSON; key = metric{labels} canonical text
  layouts(id, sids)                     the series of one staging row, as int64 bytes
  staging(id, layout, t_min, t_max, n, data)   rows of each flush not yet sealed into chunks
  late(id, layout, t_min, t_max, n, data)      rows stamped before the sealed block end (the clock stepped
                                        back), one per raw block, until that block's late chunks are written
  timelines(id, tier, hash, t_min, t_max, n, nbytes, data)  encoded time stamps, shared by chunks
  chunks(id, tier, series_id, t_min, t_max, n, timeline, nbytes, data)  one series, one block
  events(id, time_ns, kind, gpu, message, data, count)
  latest(series_id, time_ns, value)     the last value of every series, for latest()
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path
from typing import IO

from ._errors import StoreError, StoreLocked

FORMAT = 1
DB_NAME = "gpuscope.db"
LOCK_NAME = "writer.lock"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS series (id INTEGER PRIMARY KEY, key TEXT NOT NULL UNIQUE, metric TEXT NOT NULL,
    labels TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS series_metric ON series (metric);
CREATE TABLE IF NOT EXISTS layouts (id INTEGER PRIMARY KEY, sids BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS staging (id INTEGER PRIMARY KEY AUTOINCREMENT, layout INTEGER NOT NULL, t_min INTEGER NOT NULL,
    t_max INTEGER NOT NULL, n INTEGER NOT NULL, data BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS staging_time ON staging (t_max);
CREATE INDEX IF NOT EXISTS staging_layout ON staging (layout, id);
CREATE TABLE IF NOT EXISTS late (id INTEGER PRIMARY KEY AUTOINCREMENT, layout INTEGER NOT NULL, t_min INTEGER NOT NULL,
    t_max INTEGER NOT NULL, n INTEGER NOT NULL, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS timelines (id INTEGER PRIMARY KEY AUTOINCREMENT, tier INTEGER NOT NULL, hash BLOB NOT NULL,
    t_min INTEGER NOT NULL, t_max INTEGER NOT NULL, n INTEGER NOT NULL, nbytes INTEGER NOT NULL,
    data BLOB NOT NULL);
CREATE UNIQUE INDEX IF NOT EXISTS timelines_hash ON timelines (tier, hash);
CREATE INDEX IF NOT EXISTS timelines_age ON timelines (tier, t_max, nbytes);
CREATE TABLE IF NOT EXISTS chunks (id INTEGER PRIMARY KEY, tier INTEGER NOT NULL, series_id INTEGER NOT NULL,
    t_min INTEGER NOT NULL, t_max INTEGER NOT NULL, n INTEGER NOT NULL, timeline INTEGER NOT NULL,
    nbytes INTEGER NOT NULL, data BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS chunks_series ON chunks (series_id, tier, t_min);
CREATE INDEX IF NOT EXISTS chunks_age ON chunks (tier, t_max, nbytes, n);
CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY, time_ns INTEGER NOT NULL, kind TEXT NOT NULL,
    gpu TEXT, message TEXT NOT NULL, data TEXT NOT NULL, count INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS events_time ON events (time_ns);
CREATE TABLE IF NOT EXISTS latest (series_id INTEGER PRIMARY KEY, time_ns INTEGER NOT NULL, value REAL)
    WITHOUT ROWID;
"""


WRITER_CACHE_KIB = 16_000
READER_CACHE_KIB = 4_000


def _connect(uri: str, *, readonly: bool) -> sqlite3.Connection:
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False, timeout=10.0)
    conn.execute("PRAGMA busy_timeout = 10000")
    if not readonly:
        conn.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: a commit survives kill -9
        conn.execute("PRAGMA journal_size_limit = 16777216")  # the WAL shrinks back after bursts
    # SQLite's page cache, per connection: the writer's holds the hot pages of the tables it updates every
    # flush; a reader (one per query thread) re-reads chunks the OS keeps cached anyway. 32 MB for each made
    # an agent's RSS grow with its store by up to 32 MB per query thread.
    conn.execute(f"PRAGMA cache_size = {-WRITER_CACHE_KIB if not readonly else -READER_CACHE_KIB}")
    return conn


def open_writer_db(path: Path) -> sqlite3.Connection:
    db = path / DB_NAME
    fresh = not db.exists()
    try:
        conn = _connect(db.resolve().as_uri(), readonly=False)
        if fresh:
            conn.execute("PRAGMA page_size = 4096")
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # retention gives space back to the OS
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise StoreError(f"SQLite refused WAL mode on {db} (journal mode is {mode}); use a local disk.")
        conn.executescript(_SCHEMA)
        row = conn.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
        if row is None:
            conn.execute("INSERT INTO meta VALUES ('format', ?)", (str(FORMAT),))
        elif int(row[0]) > FORMAT:
            raise StoreError(f"{db} was written by a newer gpuscope (format {row[0]}); upgrade gpuscope to open it.")
        # A write now: SQLite opens a file it may not write read-only without a word, and every flush would fail.
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('writer.pid', ?)", (str(os.getpid()),))
        return conn
    except sqlite3.DatabaseError as e:
        if "readonly" in str(e) or "read-only" in str(e):
            raise StoreError(f"{db} cannot be written ({e}); make it and its -wal and -shm files writable, "
                             "or only read it (`gpuscope query --data-dir`, `gpuscope export --data-dir`).") from e
        raise StoreError(f"{db} is not a gpuscope store or is damaged ({e}).") from e


def open_reader_db(path: Path) -> sqlite3.Connection:
    db = path / DB_NAME
    if not db.is_file():
        raise StoreError(f"There is no gpuscope store in {path} (no {DB_NAME}); start a writer there first.")
    try:
        conn = _connect(db.resolve().as_uri() + "?mode=ro", readonly=True)
        row = conn.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{db} is not a gpuscope store or is damaged ({e}).") from e
    if row is None:
        raise StoreError(f"{db} is not a gpuscope store (no format marker).")
    if int(row[0]) > FORMAT:
        raise StoreError(f"{db} was written by a newer gpuscope (format {row[0]}); upgrade gpuscope to open it.")
    return conn


def prepare_dir(path: Path) -> None:
    """Create the data directory, or say in one sentence why it cannot be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"Cannot create the data directory {path}: {e.strerror or e}.") from e
    if not path.is_dir():
        raise StoreError(f"The data directory {path} is not a directory.")
    probe = path / f".write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise StoreError(f"The data directory {path} is not writable ({e.strerror or e}).") from e


class WriterLock:
    """An exclusive flock on <dir>/writer.lock holding the writer's pid. The kernel drops it when the
    process dies, kill -9 included, so a crashed writer never leaves the directory locked."""

    def __init__(self, path: Path) -> None:
        self.path = path / LOCK_NAME
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no OS lock available; one writer is then up to the user
            return
        try:
            f = open(self.path, "a+", encoding="ascii")  # noqa: SIM115 - held open while we write
        except OSError as e:
            raise StoreError(f"Cannot open the lock file {self.path}: {e.strerror or e}; make it writable.") from e
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise StoreLocked(
                    f"The data directory {self.path.parent} is already open for writing by process {holder}; "
                    "stop it first (readers, such as `gpuscope query --data-dir`, may share it).") from None
            raise StoreError(f"Cannot lock {self.path}: {e.strerror or e}.") from e
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the flock
            self._file = None
