"""The consumer's settings (what ``ledger-cdc consume`` takes as options)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from ledger_cdc.admin.health import Thresholds
from ledger_cdc.errors import SpillError
from ledger_cdc.fold import Reducers
from ledger_cdc.names import DEFAULT_PUBLICATION, DEFAULT_SLOT, RUNS_CHANNEL
from ledger_cdc.settings import DAY, check_ranges

__all__ = ["RANGES", "ConsumerConfig", "check_spill_dir"]

# setting → (least, most): what Consumer takes (ConsumerConfig.check; FoldConfig.check takes
# the same for the settings it shares); NaN is in no range
RANGES: dict[str, tuple[float, float]] = {
    "batch_size": (1, 2**31),
    "max_delay": (0, 3600),
    "snapshot_every": (0, 2**31),
    "status_interval": (0.01, DAY),
    "memory_limit": (1, 2**62),
    "reconnect_base": (0.001, 3600),
    "reconnect_cap": (0.001, DAY),
    "health_interval": (0.1, DAY),
    "lease_watch_interval": (0.1, DAY),
    "vacuum_interval": (0.1, DAY),
    "partition_ensure_interval": (0.1, DAY),
    "partitions_ahead": (0, 120),
    "standby_poll": (0.1, 3600),  # each try is a connection: not a storm of them
    "sink_idle_timeout": (0.001, DAY),
}
# periodic tasks 0 turns off (else from their least: a denormal interval is a busy loop)
_OFF = ("health_interval", "lease_watch_interval", "vacuum_interval", "partition_ensure_interval")


@dataclass
class ConsumerConfig:
    dsn: str
    slot: str = DEFAULT_SLOT
    publication: str = DEFAULT_PUBLICATION
    target_dsn: str | None = None
    create_slot: bool = False
    failover: bool = False  # a slot the consumer creates is a failover slot (PostgreSQL 17+)
    batch_size: int = 20000
    max_delay: float = 0.05  # (a backlog's batch may wait longer: consumer/policy.py)
    snapshot_every: int = 100
    heartbeat_interval: float | None = None
    status_interval: float = 2.0
    proto_version: int = 2
    streaming: bool = True
    # bytes for what grows with the data: buffered transactions (35 %), the session cache
    # (15 %), the batch in hand (15 %) and what sealing a batch adds for a moment
    memory_limit: int = 512 * 1024 * 1024
    # where what passes memory_limit goes (buffered transactions, a large transaction sorted by
    # session); None: the system's temporary directory (TMPDIR)
    spill_dir: str | None = None
    reconnect_base: float = 0.1
    reconnect_cap: float = 5.0
    on_slot_lost: str = "resync"  # or "exit"
    health_interval: float = 10.0
    notify_channel: str = RUNS_CHANNEL  # NOTIFY channel for runs ready to lease
    lease_watch_interval: float = 1.0  # seconds between looks for expired leases (0: off)
    # seconds between VACUUMs of the projections (rewritten by every batch, their dead versions
    # pile up faster than autovacuum's one-minute naptime returns them; 0: leave it to autovacuum)
    vacuum_interval: float = 2.0
    partition_ensure_interval: float = 3600.0  # partitioned ledgers: create partitions ahead
    partitions_ahead: int = 3
    standby_poll: float = 0.5  # seconds between tries for a slot another consumer holds
    sink_idle_timeout: float = 10.0  # server ends a sink transaction left idle this long
    # "async": sink transactions commit without waiting for their WAL flush (visible sooner,
    # no fsync per batch); the slot is confirmed only past what is flushed. "sync": each waits.
    sink_commit: str = "async"
    sinks: tuple[str, ...] = ()  # extra sinks: nats://host:port[,…] (PostgreSQL is always on)
    # False (consume --publish-only): events go to the sinks, PostgreSQL keeps only the
    # checkpoint; `ledger-cdc fold --from nats://…` workers build the projections
    fold: bool = True
    notify_sessions: bool = True  # NOTIFY ledger_sessions '<session>:<position>' per change
    thresholds: Thresholds = field(default_factory=Thresholds)
    progress: Callable[[int, int], None] | None = None  # bootstrap progress (done, total)
    reducers: Reducers | None = None  # None: the process's default reducers

    def check(self) -> None:
        """Raise ConfigError for a value out of range (a NaN, a wait too long for the
        platform's clock, a batch of no events), or a spill directory that cannot take a file
        (SpillError): ``Consumer`` checks its config before it starts anything, so a bad value
        is said at once instead of killing a thread later."""
        ranges = dict(RANGES)
        if self.heartbeat_interval is not None:  # (None, or 0: no heartbeat)
            ranges["heartbeat_interval"] = (0.1, DAY)
        check_ranges("consumer settings", self, ranges, (*_OFF, "heartbeat_interval"))
        if self.spill_dir is not None:
            check_spill_dir(self.spill_dir)


_PROBE = b"\0" * 65536


def check_spill_dir(path: str) -> None:
    """SpillError if ``path`` cannot take a spill file: a temporary file is made there and
    64 kB written to it (root writes past any permission bits: only trying tells)."""
    try:
        with tempfile.TemporaryFile(prefix="ledger-cdc-probe-", dir=path) as f:
            f.write(_PROBE)
            f.flush()
    except OSError as e:
        raise SpillError(path, e, "checked at start") from e
