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

import datetime as dt
import math
import uuid
from collections.abc import Iterable
from typing import Any

import psycopg

from ledger_cdc.client.read import ReadyRun, pending_runs
from ledger_cdc.client.recovery import rebuild_op
from ledger_cdc.client.steps import Op, Ops, Step, Steps, drive, drive_async, first, steps_op
from ledger_cdc.client.writer import AppendResult, OutboxItem, append_op, head_op
from ledger_cdc.errors import (
    ConcurrentAppendError,
    InvalidEventError,
    LeaseLostError,
    NoSuchSessionError,
    RunNotReadyError,
)
from ledger_cdc.events import (
    LedgerEvent,
    RunLeased,
    RunQueued,
    RunReleased,
    RunSuspended,
    SignalReceived,
    TaskCompleted,
    TaskFailed,
    encode_payload,
    load_payload,
    payload_type,
)
from ledger_cdc.fold import RUN_PENDING, RUN_RUNNING, SessionContext, apply
from ledger_cdc.names import RUNS_CHANNEL

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

CHANNEL = RUNS_CHANNEL
DEFAULT_TTL = 30.0


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
    """Advance ``ctx`` by the event just appended (the same reducer the consumer uses, given
    the payload as the consumer loads it: a mapping becomes its event type's struct)."""
    typ = payload_type(etype)
    if not (isinstance(typ, type) and isinstance(payload, typ)):
        payload = load_payload(etype, encode_payload(etype, payload))
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


_NOW = "SELECT statement_timestamp()"


def _leasable(ctx: SessionContext, now: dt.datetime) -> None:
    if ready_status(ctx, now) is None:
        run = ctx.run
        what = "not a run (no run.* event)" if run is None else run.status
        if run is not None and run.lease is not None and run.status == RUN_RUNNING:
            what += f" (leased by {run.lease.worker} until {run.lease.until.isoformat()})"
        raise RunNotReadyError(f"run {ctx.session_id} is {what}: not ready to lease")


# -- submitting and signalling (any process) ----------------------------------------------------


def _now_steps() -> Steps[dt.datetime]:
    row = first((yield Step(_NOW, ())))
    assert row is not None
    now: dt.datetime = row[0]
    return now


_SERVER_NOW: Op[dt.datetime] = steps_op(_now_steps)


def _signal_ops(
    session_id: uuid.UUID | str,
    name: str,
    payload: Any,
    sender: str,
    signal_id: str | None,
    create: bool,
) -> Ops[AppendResult]:
    key = None if signal_id is None else f"signal:{signal_id}"
    if not create and (yield head_op(session_id)) == 0:
        raise _no_session(session_id)
    res: AppendResult = yield append_op(
        session_id,
        sender,
        "signal.received",
        SignalReceived(name, payload, sender),
        idempotency_key=key,
    )
    return res


def submit(
    conn: psycopg.Connection[Any],
    session_id: uuid.UUID | str,
    *,
    agent: str = "scheduler",
    reason: str | None = None,
) -> AppendResult:
    """Queue a run: it is pending until a worker leases it."""
    return _queued(session_id, agent, reason).sync(conn)


async def submit_async(
    conn: psycopg.AsyncConnection[Any],
    session_id: uuid.UUID | str,
    *,
    agent: str = "scheduler",
    reason: str | None = None,
) -> AppendResult:
    """:func:`submit` on an async connection."""
    return await _queued(session_id, agent, reason).aio(conn)


def _queued(session_id: uuid.UUID | str, agent: str, reason: str | None) -> Op[AppendResult]:
    return append_op(session_id, agent, "run.queued", RunQueued(reason))


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
    return drive(conn, _signal_ops(session_id, name, payload, sender, signal_id, create))


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
    """:func:`signal` on an async connection."""
    ops = _signal_ops(session_id, name, payload, sender, signal_id, create)
    return await drive_async(conn, ops)


def _no_session(session_id: uuid.UUID | str) -> NoSuchSessionError:
    return NoSuchSessionError(
        f"session {session_id} has no events: not signalled (check the id, or pass create=True "
        "/ --create to start a session with this signal)"
    )


# -- holding a run --------------------------------------------------------------------------------


class _RunBase:
    """What a held run is, whatever the connection: the protocols of its appends, renewals and
    endings, written once (as ops) for :class:`LeasedRun` and :class:`AsyncLeasedRun`."""

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

    def _lost(self) -> LeaseLostError:
        run = self.ctx.run
        now = "ended" if run is None else run.status
        if run is not None and run.lease is not None:
            now += f", leased by {run.lease.worker}"
        return LeaseLostError(f"run {self.session_id}: the lease of {self.worker} is gone ({now})")

    def _append_ops(
        self,
        event_type: str,
        payload: Any,
        idempotency_key: str | None,
        outbox: Iterable[OutboxItem],
    ) -> Ops[AppendResult]:
        payload_type(event_type)
        items = tuple(outbox)
        while True:
            if not self.holds:
                raise self._lost()
            try:
                res: AppendResult = yield append_op(
                    self.session_id,
                    self.worker,
                    event_type,
                    payload,
                    expected_position=self.ctx.last_position,
                    idempotency_key=idempotency_key,
                    outbox=items,
                )
            except ConcurrentAppendError:  # others appended (a signal): rebase and check again
                self.ctx = yield rebuild_op(self.session_id)
                continue
            _fold_append(self.ctx, res, self.worker, event_type, payload)
            if event_type == "run.leased":
                self.lease_seq = res.seq
            return res

    def _renew_ops(self, force: bool) -> Ops[bool]:
        now: dt.datetime = yield _SERVER_NOW
        if not force and (self.until - now).total_seconds() >= self.ttl / 2:
            return False
        yield from self._append_ops("run.leased", RunLeased(self.worker, self.ttl), None, ())
        return True

    # the endings of a hold, each an append of its own event

    def _suspend_ops(self, reason: str, wait_for: Iterable[str]) -> Ops[AppendResult]:
        payload = RunSuspended(reason, _signal_names(wait_for))
        return self._append_ops("run.suspended", payload, None, ())

    def _release_ops(self, reason: str | None) -> Ops[AppendResult]:
        return self._append_ops("run.released", RunReleased(self.worker, reason), None, ())

    def _complete_ops(self, result: Any) -> Ops[AppendResult]:
        return self._append_ops("task.completed", TaskCompleted(result), None, ())

    def _fail_ops(self, error: str, retryable: bool) -> Ops[AppendResult]:
        return self._append_ops("task.failed", TaskFailed(error, retryable), None, ())


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
        return drive(self.conn, self._append_ops(event_type, payload, idempotency_key, outbox))

    def renew(self, *, force: bool = False) -> bool:
        """Extend the lease by its ttl if less than half is left (or ``force``); True if renewed."""
        return drive(self.conn, self._renew_ops(force))

    def suspend(self, reason: str, wait_for: Iterable[str]) -> AppendResult:
        """Wait for one of the signals ``wait_for``; the lease ends with this append."""
        return drive(self.conn, self._suspend_ops(reason, wait_for))

    def release(self, reason: str | None = None) -> AppendResult:
        return drive(self.conn, self._release_ops(reason))

    def complete(self, result: Any = None) -> AppendResult:
        return drive(self.conn, self._complete_ops(result))

    def fail(self, error: str, *, retryable: bool = False) -> AppendResult:
        return drive(self.conn, self._fail_ops(error, retryable))


class AsyncLeasedRun(_RunBase):
    """:class:`LeasedRun` on an async connection (the same protocols)."""

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
        ops = self._append_ops(event_type, payload, idempotency_key, outbox)
        return await drive_async(self.conn, ops)

    async def renew(self, *, force: bool = False) -> bool:
        return await drive_async(self.conn, self._renew_ops(force))

    async def suspend(self, reason: str, wait_for: Iterable[str]) -> AppendResult:
        return await drive_async(self.conn, self._suspend_ops(reason, wait_for))

    async def release(self, reason: str | None = None) -> AppendResult:
        return await drive_async(self.conn, self._release_ops(reason))

    async def complete(self, result: Any = None) -> AppendResult:
        return await drive_async(self.conn, self._complete_ops(result))

    async def fail(self, error: str, *, retryable: bool = False) -> AppendResult:
        return await drive_async(self.conn, self._fail_ops(error, retryable))


MAX_WAIT_FOR = 1000


def _signal_names(wait_for: Iterable[str]) -> list[str]:
    """The names a suspended run waits for: strings, not one string (which would be its
    letters), at most MAX_WAIT_FOR of them."""
    if isinstance(wait_for, (str, bytes)):
        raise InvalidEventError(
            f"wait_for must be a list of signal names, got the string {wait_for!r:.80} "
            "(write [name] for one)"
        )
    names = list(wait_for)
    if len(names) > MAX_WAIT_FOR:
        raise InvalidEventError(f"wait_for holds {len(names):,} names, over {MAX_WAIT_FOR:,}")
    odd = [n for n in names if not isinstance(n, str) or not n]
    if odd:
        raise InvalidEventError(f"wait_for must hold non-empty strings, got {odd[0]!r:.80}")
    return names


def _lease_ops(
    session_id: uuid.UUID | str, worker: str, ttl: float
) -> Ops[tuple[SessionContext, int]]:
    if isinstance(ttl, bool) or not (isinstance(ttl, (int, float)) and 0 < ttl < math.inf):
        raise ValueError(f"ttl must be a finite number of seconds above 0, got {ttl!r}")
    ctx: SessionContext = yield rebuild_op(session_id)
    _leasable(ctx, (yield _SERVER_NOW))
    payload = RunLeased(worker, ttl)
    res: AppendResult = yield append_op(
        ctx.session_id, worker, "run.leased", payload, expected_position=ctx.last_position
    )
    _fold_append(ctx, res, worker, "run.leased", payload)
    return ctx, res.seq


def lease(
    conn: psycopg.Connection[Any],
    session_id: uuid.UUID | str,
    worker: str,
    *,
    ttl: float = DEFAULT_TTL,
) -> LeasedRun:
    """Take a pending or stale run. Raises RunNotReadyError if it is neither, and
    ConcurrentAppendError if another worker took it first. The returned run's ``ctx`` is the
    rebuilt context: retry its ``pending_tools`` (``retry_tool``) after a take-over."""
    ctx, seq = drive(conn, _lease_ops(session_id, worker, ttl))
    return LeasedRun(conn, ctx, worker, ttl, seq)


async def lease_async(
    conn: psycopg.AsyncConnection[Any],
    session_id: uuid.UUID | str,
    worker: str,
    *,
    ttl: float = DEFAULT_TTL,
) -> AsyncLeasedRun:
    """:func:`lease` on an async connection."""
    ctx, seq = await drive_async(conn, _lease_ops(session_id, worker, ttl))
    return AsyncLeasedRun(conn, ctx, worker, ttl, seq)


# -- finding runs -------------------------------------------------------------------------------


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
