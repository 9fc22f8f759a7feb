"""Runs that sleep and wake — suspend, signal, lease, take over — all as ledger appends.

No table is updated in place to coordinate workers: the run's state is folded from its events
(:class:`ledger_cdc.fold.RunState`). A run is *pending* (ready to lease) after ``run.queued``,
after ``run.released``, or when a signal it waits for arrives; *running* while a worker holds an
unexpired lease; *suspended* while it waits for a signal; *stale* when it is running on a lease
past its ``until`` (server clock), which any worker may take over.

Taking a run is an append of ``run.leased`` with ``expected_position`` set to the position the
worker read: when two race, exactly one wins and the other gets :class:`ConcurrentAppendError`.
The holder's own appends go through :class:`LeasedRun`, which rebases on events others append
(signals) and raises :class:`LeaseLostError` if the run was taken over meanwhile.

Renewal is a ``run.leased`` too; :meth:`LeasedRun.renew` only appends once less than half the
ttl is left, so a running run adds at most two renewal events per ttl (ttl 30 s: four a minute).

Waking without polling: the consumer NOTIFYs ``ledger_runs`` (payload: the session id) in the
transaction that commits a batch in which runs became pending, and once a second for leases that
expired (:class:`ledger_cdc.consumer.ConsumerConfig`). :func:`pending_runs` listens and also
re-checks the projections every ``recheck`` seconds, so a lost notification delays a wake-up but
never loses it. Writers never notify.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from .errors import ConcurrentAppendError, ConfigError, LedgerError, NoSuchSessionError
from .events import (
    LedgerEvent,
    RunLeased,
    RunQueued,
    RunReleased,
    RunSuspended,
    SignalReceived,
    TaskCompleted,
    TaskFailed,
    payload_type,
)
from .fold import RUN_PENDING, RUN_RUNNING, SessionContext, apply
from .replay import rebuild_context, rebuild_context_async
from .writer import (
    AppendResult,
    OutboxItem,
    append,
    append_async,
    session_head,
    session_head_async,
)

__all__ = [
    "CHANNEL",
    "DEFAULT_TTL",
    "AsyncLeasedRun",
    "LeaseLostError",
    "LeasedRun",
    "ReadyRun",
    "RunNotReadyError",
    "lease",
    "lease_async",
    "list_runs",
    "pending_runs",
    "ready_status",
    "signal",
    "signal_async",
    "submit",
    "submit_async",
]

CHANNEL = "ledger_runs"
DEFAULT_TTL = 30.0
_CHANNEL_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class LeaseLostError(LedgerError):
    """The run was taken over (or released) since this worker leased it: stop working on it."""


class RunNotReadyError(LedgerError):
    """The run is not ready to lease (it is running on a live lease, suspended, or ended)."""


def ready_status(ctx: SessionContext, now: dt.datetime) -> str | None:
    """'pending' or 'stale' if a worker may lease the run at server time ``now``, else None."""
    run = ctx.run
    if run is None:
        return None
    if run.status == RUN_PENDING:
        return "pending"
    if run.status == RUN_RUNNING and run.lease is not None and run.lease.until <= now:
        return "stale"
    return None


def _fold_append(
    ctx: SessionContext, res: AppendResult, agent: str, etype: str, payload: Any
) -> None:
    """Advance ``ctx`` by the event just appended (the same reducer the consumer uses)."""
    created = res.created_at or dt.datetime.now(dt.timezone.utc)
    apply(ctx, LedgerEvent(res.seq, ctx.session_id, res.position, agent, etype, payload, created))


def _holds(ctx: SessionContext, worker: str, lease_seq: int) -> bool:
    """Whether the lease taken (or last renewed) by the event at ``lease_seq`` is still current."""
    run = ctx.run
    return (
        run is not None
        and run.status == RUN_RUNNING
        and run.lease is not None
        and run.lease.worker == worker
        and run.lease.seq == lease_seq
    )


def _check_channel(channel: str) -> str:
    if not _CHANNEL_RE.match(channel):
        raise ConfigError(
            f"invalid notification channel {channel!r}: use lower-case letters, digits, _"
        )
    return channel


_NOW = "SELECT statement_timestamp()"


def _leasable(ctx: SessionContext, now: dt.datetime) -> None:
    if ready_status(ctx, now) is None:
        run = ctx.run
        what = "not a run (no run.* event)" if run is None else run.status
        if run is not None and run.lease is not None and run.status == RUN_RUNNING:
            what += f" (leased by {run.lease.worker} until {run.lease.until.isoformat()})"
        raise RunNotReadyError(f"run {ctx.session_id} is {what}: not ready to lease")


# -- submitting and signalling (any process) ----------------------------------------------------


def submit(
    conn: psycopg.Connection[Any],
    session_id: uuid.UUID | str,
    *,
    agent: str = "scheduler",
    reason: str | None = None,
) -> AppendResult:
    """Queue a run: it is pending until a worker leases it."""
    return append(conn, session_id, agent, "run.queued", RunQueued(reason))


async def submit_async(
    conn: psycopg.AsyncConnection[Any],
    session_id: uuid.UUID | str,
    *,
    agent: str = "scheduler",
    reason: str | None = None,
) -> AppendResult:
    return await append_async(conn, session_id, agent, "run.queued", RunQueued(reason))


def signal(
    conn: psycopg.Connection[Any],
    session_id: uuid.UUID | str,
    name: str,
    payload: Any = None,
    *,
    sender: str = "signal",
    signal_id: str | None = None,
    create: bool = False,
) -> AppendResult:
    """Send a signal to a run (``signal.received``). With ``signal_id``, sending it again (a
    webhook delivered twice) is a no-op. A run suspended on ``name`` becomes pending; a signal
    that arrives before the run suspends waits in its inbox. A session with no events is
    refused with :class:`NoSuchSessionError` (a mistyped id would otherwise start a new
    session), unless ``create``."""
    key = None if signal_id is None else f"signal:{signal_id}"
    if not create and session_head(conn, session_id) == 0:
        raise _no_session(session_id)
    return append(
        conn,
        session_id,
        sender,
        "signal.received",
        SignalReceived(name, payload, sender),
        idempotency_key=key,
    )


async def signal_async(
    conn: psycopg.AsyncConnection[Any],
    session_id: uuid.UUID | str,
    name: str,
    payload: Any = None,
    *,
    sender: str = "signal",
    signal_id: str | None = None,
    create: bool = False,
) -> AppendResult:
    """The async twin of :func:`signal`."""
    key = None if signal_id is None else f"signal:{signal_id}"
    if not create and await session_head_async(conn, session_id) == 0:
        raise _no_session(session_id)
    return await append_async(
        conn,
        session_id,
        sender,
        "signal.received",
        SignalReceived(name, payload, sender),
        idempotency_key=key,
    )


def _no_session(session_id: uuid.UUID | str) -> NoSuchSessionError:
    return NoSuchSessionError(
        f"session {session_id} has no events: not signalled (check the id, or pass create=True "
        "/ --create to start a session with this signal)"
    )


# -- holding a run --------------------------------------------------------------------------------


class _RunBase:
    def __init__(self, ctx: SessionContext, worker: str, ttl: float, lease_seq: int) -> None:
        self.ctx = ctx
        self.worker = worker
        self.ttl = ttl
        self.lease_seq = lease_seq

    @property
    def session_id(self) -> uuid.UUID:
        return self.ctx.session_id

    @property
    def until(self) -> dt.datetime:
        run = self.ctx.run
        assert run is not None and run.lease is not None
        return run.lease.until

    @property
    def holds(self) -> bool:
        return _holds(self.ctx, self.worker, self.lease_seq)

    def _renew_due(self, now: dt.datetime) -> bool:
        return (self.until - now).total_seconds() < self.ttl / 2

    def _lost(self) -> LeaseLostError:
        run = self.ctx.run
        now = "ended" if run is None else run.status
        if run is not None and run.lease is not None:
            now += f", leased by {run.lease.worker}"
        return LeaseLostError(f"run {self.session_id}: the lease of {self.worker} is gone ({now})")

    def _after(self, res: AppendResult, etype: str, payload: Any) -> None:
        _fold_append(self.ctx, res, self.worker, etype, payload)
        if etype == "run.leased":
            self.lease_seq = res.seq


class LeasedRun(_RunBase):
    """A run this worker holds (sync). Every append checks the lease still holds."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        ctx: SessionContext,
        worker: str,
        ttl: float,
        lease_seq: int,
    ) -> None:
        super().__init__(ctx, worker, ttl, lease_seq)
        self.conn = conn

    def append(
        self,
        event_type: str,
        payload: Any,
        *,
        idempotency_key: str | None = None,
        outbox: Iterable[OutboxItem] = (),
    ) -> AppendResult:
        """Append as the lease holder: rebases on events others appended (signals), raises
        LeaseLostError if the run was taken over. Returns the appended event's result."""
        payload_type(event_type)
        items = tuple(outbox)
        while True:
            if not self.holds:
                raise self._lost()
            try:
                res = append(
                    self.conn,
                    self.session_id,
                    self.worker,
                    event_type,
                    payload,
                    expected_position=self.ctx.last_position,
                    idempotency_key=idempotency_key,
                    outbox=items,
                )
            except ConcurrentAppendError:
                self.ctx = rebuild_context(self.conn, self.session_id)
                continue
            self._after(res, event_type, payload)
            return res

    def renew(self, *, force: bool = False) -> bool:
        """Extend the lease by its ttl if less than half is left (or ``force``); True if renewed."""
        row = self.conn.execute(_NOW).fetchone()
        assert row is not None
        if not force and not self._renew_due(row[0]):
            return False
        self.append("run.leased", RunLeased(self.worker, self.ttl))
        return True

    def suspend(self, reason: str, wait_for: Iterable[str]) -> AppendResult:
        """Wait for one of the signals ``wait_for``; the lease ends with this append."""
        return self.append("run.suspended", RunSuspended(reason, list(wait_for)))

    def release(self, reason: str | None = None) -> AppendResult:
        return self.append("run.released", RunReleased(self.worker, reason))

    def complete(self, result: Any = None) -> AppendResult:
        return self.append("task.completed", TaskCompleted(result))

    def fail(self, error: str, *, retryable: bool = False) -> AppendResult:
        return self.append("task.failed", TaskFailed(error, retryable))


class AsyncLeasedRun(_RunBase):
    """The async twin of :class:`LeasedRun`."""

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        ctx: SessionContext,
        worker: str,
        ttl: float,
        lease_seq: int,
    ) -> None:
        super().__init__(ctx, worker, ttl, lease_seq)
        self.conn = conn

    async def append(
        self,
        event_type: str,
        payload: Any,
        *,
        idempotency_key: str | None = None,
        outbox: Iterable[OutboxItem] = (),
    ) -> AppendResult:
        payload_type(event_type)
        items = tuple(outbox)
        while True:
            if not self.holds:
                raise self._lost()
            try:
                res = await append_async(
                    self.conn,
                    self.session_id,
                    self.worker,
                    event_type,
                    payload,
                    expected_position=self.ctx.last_position,
                    idempotency_key=idempotency_key,
                    outbox=items,
                )
            except ConcurrentAppendError:
                self.ctx = await rebuild_context_async(self.conn, self.session_id)
                continue
            self._after(res, event_type, payload)
            return res

    async def renew(self, *, force: bool = False) -> bool:
        row = await (await self.conn.execute(_NOW)).fetchone()
        assert row is not None
        if not force and not self._renew_due(row[0]):
            return False
        await self.append("run.leased", RunLeased(self.worker, self.ttl))
        return True

    async def suspend(self, reason: str, wait_for: Iterable[str]) -> AppendResult:
        return await self.append("run.suspended", RunSuspended(reason, list(wait_for)))

    async def release(self, reason: str | None = None) -> AppendResult:
        return await self.append("run.released", RunReleased(self.worker, reason))

    async def complete(self, result: Any = None) -> AppendResult:
        return await self.append("task.completed", TaskCompleted(result))

    async def fail(self, error: str, *, retryable: bool = False) -> AppendResult:
        return await self.append("task.failed", TaskFailed(error, retryable))


def lease(
    conn: psycopg.Connection[Any],
    session_id: uuid.UUID | str,
    worker: str,
    *,
    ttl: float = DEFAULT_TTL,
) -> LeasedRun:
    """Take a pending or stale run. Raises RunNotReadyError if it is neither, and
    ConcurrentAppendError if another worker took it first. The returned run's ``ctx`` is the
    rebuilt context: retry its ``pending_tools`` (``replay.retry_tool``) after a take-over."""
    ctx = rebuild_context(conn, session_id)
    row = conn.execute(_NOW).fetchone()
    assert row is not None
    _leasable(ctx, row[0])
    payload = RunLeased(worker, ttl)
    res = append(
        conn, ctx.session_id, worker, "run.leased", payload, expected_position=ctx.last_position
    )
    _fold_append(ctx, res, worker, "run.leased", payload)
    return LeasedRun(conn, ctx, worker, ttl, res.seq)


async def lease_async(
    conn: psycopg.AsyncConnection[Any],
    session_id: uuid.UUID | str,
    worker: str,
    *,
    ttl: float = DEFAULT_TTL,
) -> AsyncLeasedRun:
    """The async twin of :func:`lease`."""
    ctx = await rebuild_context_async(conn, session_id)
    row = await (await conn.execute(_NOW)).fetchone()
    assert row is not None
    _leasable(ctx, row[0])
    payload = RunLeased(worker, ttl)
    res = await append_async(
        conn, ctx.session_id, worker, "run.leased", payload, expected_position=ctx.last_position
    )
    _fold_append(ctx, res, worker, "run.leased", payload)
    return AsyncLeasedRun(conn, ctx, worker, ttl, res.seq)


# -- finding runs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadyRun:
    session_id: uuid.UUID
    status: str  # pending | stale
    position: int  # the projection's last position when it was found ready
    lease_worker: str | None  # the previous holder of a stale run


_READY = """
SELECT session_id, CASE WHEN run_status = 'pending' THEN 'pending' ELSE 'stale' END,
       last_position, lease_worker
FROM agent_sessions
WHERE run_status = 'pending' OR (run_status = 'running' AND lease_until <= statement_timestamp())
ORDER BY updated_at
LIMIT %s
"""


async def pending_runs(
    dsn: str, *, channel: str = CHANNEL, recheck: float = 2.0, limit: int = 1000
) -> AsyncIterator[ReadyRun]:
    """Runs ready to lease, as they become ready: woken by the consumer's notifications, with a
    re-check of the projections every ``recheck`` seconds. A run is yielded again only when its
    projection moved on, or after ``recheck`` seconds if it is still ready (nobody took it)."""
    listen = sql.SQL("LISTEN {}").format(sql.Identifier(_check_channel(channel)))
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(listen)
        seen: dict[uuid.UUID, tuple[int, float]] = {}
        while True:
            now = time.monotonic()
            rows = await (await conn.execute(_READY, (limit,))).fetchall()
            for sid, status, position, worker in rows:
                last = seen.get(sid)
                if last is not None and last[0] == position and now - last[1] < recheck:
                    continue
                seen[sid] = (int(position), now)
                yield ReadyRun(sid, status, int(position), worker)
            if len(seen) > 4 * limit:  # forget runs that are long gone
                seen = {k: v for k, v in seen.items() if now - v[1] < recheck}
            async for _ in conn.notifies(timeout=recheck, stop_after=1):
                pass
            await asyncio.sleep(0)


_LIST = """
SELECT session_id, run_status, lease_worker, lease_until, last_seq, last_position, updated_at,
       lease_until <= statement_timestamp() AS expired, context->'run'->'wait_for'
FROM agent_sessions WHERE run_status IS NOT NULL {where}
ORDER BY updated_at DESC LIMIT %(limit)s
"""


def list_runs(
    conn: psycopg.Connection[Any], status: str | None = None, *, limit: int = 200
) -> list[dict[str, Any]]:
    """Runs from the projections; ``status`` is pending, running, suspended, stale (running on
    an expired lease), completed or failed."""
    where = ""
    if status == "stale":
        where = "AND run_status = 'running' AND lease_until <= statement_timestamp()"
    elif status == "running":
        where = "AND run_status = 'running' AND lease_until > statement_timestamp()"
    elif status is not None:
        where = "AND run_status = %(status)s"
    rows = conn.execute(
        _LIST.format(where=where).encode(), {"status": status, "limit": limit}
    ).fetchall()
    out = []
    for sid, st, worker, until, seq, pos, updated, expired, wait_for in rows:
        out.append(
            {
                "session_id": sid,
                "status": "stale" if st == "running" and expired else st,
                "lease_worker": worker,
                "lease_until": until,
                "last_seq": seq,
                "last_position": pos,
                "updated_at": updated,
                "wait_for": wait_for or [],
            }
        )
    return out
