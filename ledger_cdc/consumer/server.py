"""What the consumer loop asks of the ledger's server besides the stream and the sink: the
:class:`LedgerServer` protocol.

Two implement it. :class:`PgLedgerServer` is the ledger database of a :class:`ConsumerConfig`:
checks before streaming, the periodic tasks, rows the stream skipped, rebuilds of unusable
projections, the slot's fit, drop and final advance, the bootstrap's snapshot, the projections'
divergence from a promoted server. :class:`NoLedgerServer` is none at all, for a loop over a sink
and a stream that need no server (a :class:`~ledger_cdc.sink.memory.MemorySink` and prepared
bytes): nothing to check, no tasks, no rows to read back. The loop calls both alike; which one it
has is the composition root's choice (:func:`ledger_cdc.consumer.compose.build_consumer`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, Protocol

import psycopg
from psycopg import sql

from ledger_cdc.admin.schema import drop_slot, slot_misfit
from ledger_cdc.client.read import load_events
from ledger_cdc.client.recovery import rebuild_context
from ledger_cdc.consumer import divergence
from ledger_cdc.consumer.config import ConsumerConfig
from ledger_cdc.consumer.metrics import Metrics
from ledger_cdc.consumer.resync import connected, preflight
from ledger_cdc.consumer.tasks import (
    VACUUM_TICK,
    Periodic,
    SlotGuard,
    heartbeat,
    lease_watch,
    partition_keeper,
    vacuum,
)
from ledger_cdc.errors import ConfigError, LedgerError
from ledger_cdc.events import LedgerEvent, Rejected
from ledger_cdc.fold import CompletedModel, CompletedTool, SessionContext
from ledger_cdc.lsn import format_lsn
from ledger_cdc.stream.transport import SlotError

__all__ = ["LedgerServer", "MemoRow", "NoLedgerServer", "PgLedgerServer"]

log = logging.getLogger(__name__)

MemoRow = tuple[uuid.UUID, int, CompletedTool | CompletedModel]
"""An ``agent_memo`` row: session, the position of the event completing the call, the call."""


class LedgerServer(Protocol):
    slot_lost: threading.Event  # set by the slot check when the server invalidated the slot

    def preflight(self) -> str | None:
        """What no retry cures, said at once (ConfigError, SlotError); RefusedError or
        RetryableError when the server cannot be asked now. Returns the ledger table's schema
        (None: not known)."""
        ...

    def start_tasks(self, stop: threading.Event, metrics: Metrics, nonce: str) -> None:
        """The periodic tasks (heartbeat, slot check, lease watch, vacuum, partitions), each on
        a thread of its own until ``stop`` is set."""
        ...

    def gap_rows(self, sid: uuid.UUID, first: int, last: int) -> list[LedgerEvent | Rejected]:
        """Session ``sid``'s rows at positions ``first``..``last`` (those it holds)."""
        ...

    def rebuild(self, sid: uuid.UUID) -> tuple[SessionContext, list[MemoRow]]:
        """Session ``sid`` folded again from the ledger (latest usable snapshot and the tail),
        with the memo rows of the calls it completed; LedgerError if it cannot be."""
        ...

    def refuse_misfit(self, cause: BaseException | None) -> None:
        """SlotError if the slot is not a pgoutput slot of the ledger's database."""
        ...

    def drop_slot(self) -> None: ...

    def snapshot(self, name: str) -> contextlib.AbstractContextManager[psycopg.Connection[Any]]:
        """A read-only transaction as of the exported snapshot ``name``."""
        ...

    def diverged(self, checkpoint: int) -> list[str]:
        """Why the projections (in another database) may no longer agree with the ledger's
        server: empty when they do. The server they now follow is recorded after
        :meth:`recorded`."""
        ...

    def recorded(self) -> None:
        """Record the server the projections follow (found by the last :meth:`diverged`)."""
        ...

    def discard_ahead(self) -> int:
        """Discard the projections the ledger does not hold as they folded them; how many."""
        ...

    def advance_slot(self, lsn: int, timeout: float) -> None:
        """After a stop: see that the slot shows ``lsn`` confirmed, advancing it if its
        walsender ended before reading the last confirmation. Best effort, bounded."""
        ...


class PgLedgerServer:
    """The ledger database (and projection database) of ``config``."""

    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config
        self.slot_lost = threading.Event()
        self._me: divergence.Server | None = None

    def preflight(self) -> str | None:
        cfg = self.config
        return preflight(cfg.dsn, cfg.publication, cfg.target_dsn, slot=cfg.slot)

    def start_tasks(self, stop: threading.Event, metrics: Metrics, nonce: str) -> None:
        cfg = self.config
        guard = SlotGuard(cfg.slot, cfg.thresholds, metrics, cfg.publication, lost=self.slot_lost)
        tasks: list[Periodic] = []
        if cfg.heartbeat_interval:
            tasks.append(
                Periodic(
                    "heartbeat", cfg.heartbeat_interval, cfg.dsn, heartbeat(cfg.slot, nonce), stop
                )
            )
        if cfg.health_interval:
            tasks.append(
                Periodic(
                    "slot check", cfg.health_interval, cfg.dsn, guard, stop, errors=(ValueError,)
                )
            )
        projections = cfg.target_dsn or cfg.dsn
        if cfg.lease_watch_interval:
            watch = lease_watch(cfg.notify_channel)
            tasks.append(
                Periodic("lease watch", cfg.lease_watch_interval, projections, watch, stop)
            )
        if cfg.vacuum_interval:
            step = vacuum(lambda: metrics.session_rows, cfg.vacuum_interval)
            tasks.append(Periodic("vacuum", VACUUM_TICK, projections, step, stop))
        if cfg.partition_ensure_interval:
            tasks.append(
                Periodic(
                    "partitions",
                    cfg.partition_ensure_interval,
                    cfg.dsn,
                    partition_keeper(cfg.partitions_ahead),
                    stop,
                    first=0.0,
                    retry=min(cfg.partition_ensure_interval, 60.0),
                    errors=(LedgerError,),
                    level=logging.WARNING,
                    failure="could not create the upcoming partitions",
                )
            )
        for task in tasks:
            task.start()

    def gap_rows(self, sid: uuid.UUID, first: int, last: int) -> list[LedgerEvent | Rejected]:
        with connected(self.config.dsn, "ledger database (positions the stream skipped)") as c:
            return list(load_events(c, sid, after_position=first - 1, upto_position=last))

    def rebuild(self, sid: uuid.UUID) -> tuple[SessionContext, list[MemoRow]]:
        with connected(self.config.dsn, "ledger database (rebuild)") as conn:
            ctx = rebuild_context(conn, sid, memo=True)
            return ctx, _memo_rows(conn, ctx)

    def refuse_misfit(self, cause: BaseException | None) -> None:
        """PostgreSQL 15 says "invalidated" of any slot without a restart LSN, a physical slot
        that never reserved WAL included, and 16+ refuses a physical slot in words of its own:
        the server's error alone does not tell them from the ledger's slot lost."""
        with connected(self.config.dsn, "ledger database (the slot)") as conn:
            misfit = slot_misfit(conn, self.config.slot)
        if misfit is not None:
            raise SlotError(misfit) from cause

    def drop_slot(self) -> None:
        with connected(self.config.dsn, "ledger database (the slot)") as conn:
            drop_slot(conn, self.config.slot, force=True)

    @contextlib.contextmanager
    def snapshot(self, name: str) -> Iterator[psycopg.Connection[Any]]:
        with connected(self.config.dsn, "ledger database (bootstrap)", autocommit=False) as src:
            src.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            src.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(name)))
            try:
                yield src
            finally:
                src.rollback()

    def diverged(self, checkpoint: int) -> list[str]:
        cfg = self.config
        assert cfg.target_dsn is not None
        found, self._me = divergence.check(cfg.dsn, cfg.target_dsn, cfg.slot, checkpoint)
        return list(found.reasons) if found else []

    def recorded(self) -> None:
        if self._me is not None and self.config.target_dsn:
            divergence.record(self.config.target_dsn, self.config.slot, self._me)

    def discard_ahead(self) -> int:
        cfg = self.config
        assert cfg.target_dsn is not None
        with (
            connected(cfg.dsn, "ledger database") as ledger,
            connected(cfg.target_dsn, "projection database") as target,
        ):
            ahead = divergence.projections_ahead(ledger, target)
        for sid, pos, head in ahead[:20]:
            log.error(
                "session %s: its projection is at position %d, the ledger's head at %d with "
                "another history: discarded, folded again from the ledger",
                sid,
                pos,
                head,
            )
        if len(ahead) > 20:
            log.error("… and %d sessions more", len(ahead) - 20)
        if ahead:
            divergence.discard(cfg.target_dsn, [sid for sid, _, _ in ahead])
        return len(ahead)

    def advance_slot(self, lsn: int, timeout: float) -> None:
        """The walsender reads the final status message on its own time, and may never read
        it: a connection closed while the server is still streaming is reset, and what the
        walsender had not read is lost with it. So a slot still behind once its walsender is
        gone (the slot not active) is advanced there with ``pg_replication_slot_advance``: the
        position is that of batches committed and on disk. (A standby that took the slot
        meanwhile starts from the checkpoint anyway.)"""
        slot = self.config.slot
        deadline = time.monotonic() + timeout
        with contextlib.suppress(Exception), connected(self.config.dsn, "ledger database") as c:
            c.execute("SELECT set_config('statement_timeout', %s, false)", (f"{timeout:.0f}s",))
            while time.monotonic() < deadline:
                row = c.execute(
                    "SELECT confirmed_flush_lsn >= %s::pg_lsn, active FROM pg_replication_slots "
                    "WHERE slot_name = %s",
                    (format_lsn(lsn), slot),
                ).fetchone()
                if row is None or row[0]:
                    return
                if not row[1]:
                    c.execute(
                        "SELECT pg_replication_slot_advance(%s, %s::pg_lsn)",
                        (slot, format_lsn(lsn)),
                    )
                    log.info(
                        "slot %s advanced to %s: its walsender ended before reading the last "
                        "confirmation",
                        slot,
                        format_lsn(lsn),
                    )
                    return
                time.sleep(0.01)


class NoLedgerServer:
    """No server behind the sink and the stream: nothing to check or run beside them, no rows
    to read back (a gap stays a gap, as the sink records it), no slot to drop or advance."""

    def __init__(self) -> None:
        self.slot_lost = threading.Event()

    def preflight(self) -> str | None:
        return None

    def start_tasks(self, stop: threading.Event, metrics: Metrics, nonce: str) -> None:
        return None

    def gap_rows(self, sid: uuid.UUID, first: int, last: int) -> list[LedgerEvent | Rejected]:
        return []

    def rebuild(self, sid: uuid.UUID) -> tuple[SessionContext, list[MemoRow]]:
        raise LedgerError("no ledger database to rebuild the session from")

    def refuse_misfit(self, cause: BaseException | None) -> None:
        return None

    def drop_slot(self) -> None:
        return None

    def snapshot(self, name: str) -> contextlib.AbstractContextManager[psycopg.Connection[Any]]:
        raise ConfigError("no ledger database to take a snapshot of")

    def diverged(self, checkpoint: int) -> list[str]:
        return []

    def recorded(self) -> None:
        return None

    def discard_ahead(self) -> int:
        return 0

    def advance_slot(self, lsn: int, timeout: float) -> None:
        return None


def _memo_rows(conn: psycopg.Connection[Any], ctx: SessionContext) -> list[MemoRow]:
    """The agent_memo rows of every call ``ctx`` (folded with its memo) completed."""
    calls: list[CompletedTool | CompletedModel] = [
        *ctx.completed_tools.values(),
        *ctx.completed_models.values(),
    ]
    seqs = [c.observed_seq if isinstance(c, CompletedTool) else c.responded_seq for c in calls]
    at = dict(
        conn.execute(
            "SELECT seq, position FROM agent_events WHERE session_id = %s AND seq = ANY(%s)",
            (ctx.session_id, seqs),
        ).fetchall()
    )
    return [(ctx.session_id, at[s], c) for s, c in zip(seqs, calls, strict=True) if s in at]
