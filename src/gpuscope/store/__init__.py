"""gpuscope.store: the node's embedded time-series store.

    >>> import tempfile
    >>> from gpuscope import Sampler
    >>> from gpuscope.store import Store
    >>> with Sampler(simulate="compute_bound") as s, Store(tempfile.mkdtemp()) as store:
    ...     for _ in range(3):
    ...         store.append(s.sample_once())
    ...     store.flush()
    ...     t = store.latest().time_ns
    ...     r = store.query("gpu_power_watts", t - 10**9, t + 1, step_s=0.5, agg="max")
    >>> r[0].labels["gpu"], len(r[0].values) >= 1
    ('0', True)

With a running sampler: `sampler.subscribe(store.append)`.

Data flow: `append(snapshot)` only queues the snapshot (O(1), no I/O); a flush thread turns the
queue into rows per *layout* (a GPU's values, a process's numbers, the host) and commits them
every `flush_interval` to a SQLite database in WAL mode (`<dir>/gpuscope.db`), which readers in
other processes query while the writer writes. The last 10 minutes (and everything not yet sealed)
also stay in memory at full rate, the *hot window*, for the writer's own queries.

On disk:
- `staging`: each flush's rows per layout (float64, zlib level 1) until their 10-minute block ends;
- `chunks`: per series and per block, the raw samples (10-minute blocks) and the 1 s (one chunk
  per hour, rewritten every 10 minutes), 1 min (6 h) and 1 h (7 days) rollups of count, min, max,
  sum and last (a bucket is sealed only once complete); the columns are
  quantised (below), delta or delta-of-delta coded, zigzagged, packed at the narrowest integer width
  and zlib-compressed; time stamps live in `timelines`, shared by every series sampled at the same
  instants (all of a snapshot's GPUs share one);
- `events`, `series`, `layouts`, `latest` (last value per series) and `meta` (format, the
  watermarks up to which each tier is complete, hostname, simulated scenario, GPU identities).
Each tier has its own retention by age, and all of them a size cap (oldest blocks first, finest
tier first), see Retention. A series whose data retention has removed from every tier (a process that
ended long ago) is deleted with it; a pid that comes back gets a new series (ids are never reused).

Faults. Samples older than the last sealed block (a clock stepped back by more than ~10 minutes, or
back from a jump ahead) are kept: staged in `late`, then written as extra chunks into the blocks they
belong to once those are complete (readers merge overlapping chunks; rollups merge exactly), so none is
lost and queries stay in time order; they are visible to queries once their block is written. Retention
measures ages from the newest stamp, but for a live store never past its own clock (the wall clock at
open moved on by the monotonic clock): a host clock that jumps ahead and back deletes nothing early.
A flush that fails (disk full, I/O error) keeps its rows in memory and the next flush retries them;
text SQLite cannot encode (surrogates) is stored valid, a record the writer cannot store is dropped,
both counted; `Store.health()` says whether it can write, since when not, and why, and the flush thread
never stops. kill -9 loses at most what was appended since the last flush; the store reopens cleanly
(SQLite's WAL recovery, and the kernel drops the writer's flock). A power loss may lose the last
commits too (synchronous=NORMAL).

Precision kept per unit (the metric catalog gives each metric's unit): ratio and cores 1e-4;
watts and joules 1e-3 (NVML's milliwatts and millijoules); celsius 1e-2; seconds 1e-6; hertz,
bytes and bytes/s exact (whole units); unitless counters exact (whole events), unitless gauges 1e-4;
metrics not in the catalog, and any block with values that are not finite or not representable,
lossless float64. Time stamps, counts and sums of quantised values are exact.

Percentiles (agg='p99' ...) are exact on raw samples (numpy's 'inverted_cdf'); where only rollups
cover a range they are the count-weighted percentile of the bucket means, which under-estimates
spikes shorter than a bucket (use agg='max' for the worst case).
"""

from ._config import TIERS, Retention, Tier
from ._errors import CorruptChunk, QueryError, StoreError, StoreLocked
from ._read import MAX_POINTS, SeriesResult
from ._store import Store

__all__ = [
    "MAX_POINTS",
    "TIERS",
    "CorruptChunk",
    "QueryError",
    "Retention",
    "SeriesResult",
    "Store",
    "StoreError",
    "StoreLocked",
    "Tier",
]
