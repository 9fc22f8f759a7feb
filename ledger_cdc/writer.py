"""Transactional appends to the ledger, sync and async, over psycopg 3.

The append logic is written once, as a generator of SQL steps (the shape psycopg 3 uses for its
protocol code): it yields each statement, receives the rows, and may be thrown the driver's
``UniqueViolation``. :func:`_drive` and :func:`_drive_async` only execute the steps. Every append
runs inside ``conn.transaction()``: on an idle autocommit connection that is a transaction of its
own, inside a caller's transaction it is a savepoint, so the event commits together with the
caller's own side effects (outbox rows, application tables) or not at all.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import AsyncIterator, Generator, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgspec
import psycopg
from psycopg import errors as pg_errors

from .errors import (
    AppendError,
    ConcurrentAppendError,
    ConfigError,
    IdempotencyConflictError,
    InvalidEventError,
)
from .events import DEFAULT_LIMITS, Limits, encode_payload, refuse_nul, too_deep

__all__ = [
    "AppendResult",
    "AsyncBatch",
    "AsyncLedger",
    "Batch",
    "Ledger",
    "OutboxItem",
    "append",
    "append_async",
]

_MAX_AUTO_RETRIES = 100
_POSITION_INDEX = "agent_events_session_position"
_KEY_INDEX = "agent_events_session_idempotency"


@dataclass(frozen=True)
class OutboxItem:
    """An external call to make once the event is committed (see ``ledger-cdc dispatch``)."""

    target: str
    payload: Any
    idempotency_key: str | None = None


@dataclass(frozen=True)
class AppendResult:
    seq: int
    position: int
    session_id: uuid.UUID
    duplicate: bool = False
    outbox_ids: tuple[int, ...] = ()
    created_at: dt.datetime | None = None  # the row's created_at (None for a duplicate)


@dataclass(frozen=True)
class _Step:
    query: str
    params: tuple[Any, ...]
    savepoint: bool = False


_Rows: TypeAlias = list[tuple[Any, ...]]
_Steps: TypeAlias = Generator[_Step, _Rows, AppendResult]

# Through SECURITY DEFINER functions (migration 0009): a writer learns a session's head and
# whether a key names the same event, without being able to read any event's contents.
_SELECT_KEY = "SELECT seq, position, same FROM ledger_event_by_key(%s, %s, %s, %s::jsonb)"
_SELECT_HEAD = "SELECT ledger_session_head(%s)"
_INSERT = (
    "INSERT INTO agent_events (session_id, position, agent_id, event_type, payload, "
    "idempotency_key) VALUES (%s, %s, %s, %s, %s::jsonb, %s) RETURNING seq, position, created_at"
)
_INSERT_OUTBOX = (
    "INSERT INTO agent_outbox (event_seq, session_id, target, payload, idempotency_key) "
    "VALUES (%s, %s, %s, %s::jsonb, %s) RETURNING id"
)


@dataclass(frozen=True)
class _Request:
    session_id: uuid.UUID
    agent_id: str
    event_type: str
    payload: str
    expected_position: int | None
    idempotency_key: str | None
    outbox: tuple[tuple[str, str, str | None], ...] = field(default=())


def _session_uuid(session_id: object) -> uuid.UUID:
    if isinstance(session_id, uuid.UUID):
        return session_id
    if isinstance(session_id, str):
        try:
            return uuid.UUID(session_id)
        except ValueError:
            pass
    raise InvalidEventError(f"session_id must be a UUID, got {session_id!r}")


def _prepare(
    session_id: object,
    agent_id: object,
    event_type: str,
    payload: Any,
    expected_position: int | None,
    idempotency_key: str | None,
    outbox: Iterable[OutboxItem],
    limits: Limits = DEFAULT_LIMITS,
) -> _Request:
    sid = _session_uuid(session_id)
    if not isinstance(agent_id, str) or not agent_id:
        raise InvalidEventError(f"agent_id must be a non-empty string, got {agent_id!r}")
    if expected_position is not None and (
        isinstance(expected_position, bool)
        or not isinstance(expected_position, int)
        or expected_position < 0
    ):
        raise InvalidEventError(
            f"expected_position must be an integer >= 0 (0 for a new session), "
            f"got {expected_position!r}"
        )
    if idempotency_key is not None and (
        not isinstance(idempotency_key, str) or not idempotency_key
    ):
        raise InvalidEventError(
            f"idempotency_key must be a non-empty string, got {idempotency_key!r}"
        )
    data = encode_payload(event_type, payload, limits).decode()
    items: list[tuple[str, str, str | None]] = []
    for item in outbox:
        if not isinstance(item, OutboxItem) or not item.target:
            raise InvalidEventError(
                f"outbox entries must be OutboxItem with a target, got {item!r}"
            )
        try:
            body = msgspec.json.encode(item.payload).decode()
        except (TypeError, msgspec.EncodeError) as e:
            raise InvalidEventError(
                f"outbox payload for {item.target} is not JSON-serialisable: {e}"
            ) from e
        raw = refuse_nul(body.encode(), f"outbox payload for {item.target}")
        if len(raw) > limits.max_bytes or too_deep(raw, limits.max_depth):
            raise InvalidEventError(
                f"outbox payload for {item.target} is over the writer's limits "
                f"({limits.max_bytes:,} bytes, {limits.max_depth} levels of nesting)"
            )
        items.append((item.target, body, item.idempotency_key))
    return _Request(
        sid, agent_id, event_type, data, expected_position, idempotency_key, tuple(items)
    )


def _append_steps(req: _Request) -> _Steps:
    """The append protocol: idempotency check, position check, insert, outbox rows."""
    sid = req.session_id
    if req.idempotency_key is not None:
        rows = yield _Step(_SELECT_KEY, _key_params(req))
        if rows:
            return _duplicate(req, rows[0])
    if req.expected_position is not None:
        (head,) = (yield _Step(_SELECT_HEAD, (sid,)))[0]
        if head != req.expected_position:
            raise ConcurrentAppendError(sid, req.expected_position, int(head))
    position = None if req.expected_position is None else req.expected_position + 1
    params = (sid, position, req.agent_id, req.event_type, req.payload, req.idempotency_key)
    for _ in range(_MAX_AUTO_RETRIES):
        try:
            seq, pos, created = (yield _Step(_INSERT, params, savepoint=True))[0]
            break
        except pg_errors.UniqueViolation as e:
            constraint = e.diag.constraint_name
            if constraint == _KEY_INDEX and req.idempotency_key is not None:
                rows = yield _Step(_SELECT_KEY, _key_params(req))
                if rows:
                    return _duplicate(req, rows[0])
                continue
            if constraint != _POSITION_INDEX:
                raise
            if req.expected_position is not None:
                (head,) = (yield _Step(_SELECT_HEAD, (sid,)))[0]
                raise ConcurrentAppendError(sid, req.expected_position, int(head)) from None
    else:
        raise AppendError(
            f"session {sid}: gave up after {_MAX_AUTO_RETRIES} position conflicts with other "
            "writers; pass expected_position to detect conflicts explicitly"
        )
    ids: list[int] = []
    for i, (target, body, key) in enumerate(req.outbox):
        okey = key or f"{sid}:{pos}:{i}"
        (oid,) = (yield _Step(_INSERT_OUTBOX, (seq, sid, target, body, okey)))[0]
        ids.append(int(oid))
    return AppendResult(int(seq), int(pos), sid, False, tuple(ids), created)


def _key_params(req: _Request) -> tuple[Any, ...]:
    return (req.session_id, req.idempotency_key, req.event_type, req.payload)


def _duplicate(req: _Request, row: tuple[Any, ...]) -> AppendResult:
    seq, pos, same = row
    if not same:
        assert req.idempotency_key is not None
        raise IdempotencyConflictError(req.session_id, req.idempotency_key, int(seq))
    return AppendResult(int(seq), int(pos), req.session_id, True)


def _standalone(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], req: _Request
) -> bool:
    """A lone event on an idle autocommit connection needs no transaction block: each statement
    commits by itself, and the unique indexes, not the block, decide every race. That saves the
    BEGIN / SAVEPOINT / RELEASE / COMMIT round trips of the general path."""
    return (
        conn.autocommit
        and not req.outbox
        and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    )


def _drive(conn: psycopg.Connection[Any], req: _Request) -> AppendResult:
    if _standalone(conn, req):
        return _drive_steps(conn, _append_steps(req), savepoints=False)
    with conn.transaction():
        return _drive_steps(conn, _append_steps(req), savepoints=True)


def _drive_steps(conn: psycopg.Connection[Any], steps: _Steps, savepoints: bool) -> AppendResult:
    step = next(steps)
    while True:
        try:
            if step.savepoint and savepoints:
                with conn.transaction():
                    rows = conn.execute(step.query, step.params).fetchall()
            else:
                rows = conn.execute(step.query, step.params).fetchall()
        except pg_errors.UniqueViolation as e:
            step = _throw(steps, e)
            continue
        try:
            step = steps.send(rows)
        except StopIteration as stop:
            result: AppendResult = stop.value
            return result


async def _drive_async(conn: psycopg.AsyncConnection[Any], req: _Request) -> AppendResult:
    if _standalone(conn, req):
        return await _drive_steps_async(conn, _append_steps(req), savepoints=False)
    async with conn.transaction():
        return await _drive_steps_async(conn, _append_steps(req), savepoints=True)


async def _drive_steps_async(
    conn: psycopg.AsyncConnection[Any], steps: _Steps, savepoints: bool
) -> AppendResult:
    step = next(steps)
    while True:
        try:
            if step.savepoint and savepoints:
                async with conn.transaction():
                    rows = await (await conn.execute(step.query, step.params)).fetchall()
            else:
                rows = await (await conn.execute(step.query, step.params)).fetchall()
        except pg_errors.UniqueViolation as e:
            step = _throw(steps, e)
            continue
        try:
            step = steps.send(rows)
        except StopIteration as stop:
            result: AppendResult = stop.value
            return result


def _throw(steps: _Steps, e: BaseException) -> _Step:
    try:
        return steps.throw(e)
    except StopIteration as stop:  # pragma: no cover - the protocol always yields after a throw
        raise AppendError("append protocol ended after a conflict") from stop


def append(
    conn: psycopg.Connection[Any],
    session_id: uuid.UUID | str,
    agent_id: str,
    event_type: str,
    payload: Any,
    *,
    expected_position: int | None = None,
    idempotency_key: str | None = None,
    outbox: Sequence[OutboxItem] = (),
    limits: Limits = DEFAULT_LIMITS,
) -> AppendResult:
    """Append one event (and its outbox rows) on ``conn``, joining its transaction if one is open.

    ``expected_position`` is the session position the writer last saw (0 for a new session); if
    another writer appended since, :class:`ConcurrentAppendError` is raised and nothing is written.
    Retrying with the same ``idempotency_key`` returns the original event's seq and writes nothing.
    A payload deeper or larger than ``limits`` (and any field its type does not declare) is
    refused with :class:`InvalidEventError` before anything is written.
    """
    req = _prepare(
        session_id,
        agent_id,
        event_type,
        payload,
        expected_position,
        idempotency_key,
        outbox,
        limits,
    )
    return _drive(conn, req)


async def append_async(
    conn: psycopg.AsyncConnection[Any],
    session_id: uuid.UUID | str,
    agent_id: str,
    event_type: str,
    payload: Any,
    *,
    expected_position: int | None = None,
    idempotency_key: str | None = None,
    outbox: Sequence[OutboxItem] = (),
    limits: Limits = DEFAULT_LIMITS,
) -> AppendResult:
    """The async twin of :func:`append`."""
    req = _prepare(
        session_id,
        agent_id,
        event_type,
        payload,
        expected_position,
        idempotency_key,
        outbox,
        limits,
    )
    return await _drive_async(conn, req)


def session_head(conn: psycopg.Connection[Any], session_id: uuid.UUID | str) -> int:
    """The session's current position (0 if it has no events)."""
    row = conn.execute(_SELECT_HEAD, (_session_uuid(session_id),)).fetchone()
    return int(row[0]) if row else 0


class Batch:
    """Several appends that commit together (see :meth:`Ledger.transaction`)."""

    def __init__(self, conn: psycopg.Connection[Any], limits: Limits = DEFAULT_LIMITS) -> None:
        self.conn = conn
        self.limits = limits
        self.results: list[AppendResult] = []
        self.keep_results = type(self) in (Batch, AsyncBatch)

    def append(
        self,
        session_id: uuid.UUID | str,
        agent_id: str,
        event_type: str,
        payload: Any,
        *,
        expected_position: int | None = None,
        idempotency_key: str | None = None,
        outbox: Sequence[OutboxItem] = (),
    ) -> AppendResult:
        res = append(
            self.conn,
            session_id,
            agent_id,
            event_type,
            payload,
            expected_position=expected_position,
            idempotency_key=idempotency_key,
            outbox=outbox,
            limits=self.limits,
        )
        if self.keep_results:
            self.results.append(res)
        return res


class AsyncBatch:
    def __init__(self, conn: psycopg.AsyncConnection[Any], limits: Limits = DEFAULT_LIMITS) -> None:
        self.conn = conn
        self.limits = limits
        self.results: list[AppendResult] = []
        self.keep_results = type(self) in (Batch, AsyncBatch)

    async def append(
        self,
        session_id: uuid.UUID | str,
        agent_id: str,
        event_type: str,
        payload: Any,
        *,
        expected_position: int | None = None,
        idempotency_key: str | None = None,
        outbox: Sequence[OutboxItem] = (),
    ) -> AppendResult:
        res = await append_async(
            self.conn,
            session_id,
            agent_id,
            event_type,
            payload,
            expected_position=expected_position,
            idempotency_key=idempotency_key,
            outbox=outbox,
            limits=self.limits,
        )
        if self.keep_results:
            self.results.append(res)
        return res


class Ledger(Batch):
    """A writer bound to one connection (opened from ``dsn`` or given). ``append`` is
    :meth:`Batch.append`: each call commits by itself unless inside :meth:`transaction`."""

    def __init__(
        self,
        dsn: str | None = None,
        *,
        conn: psycopg.Connection[Any] | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ):
        if (dsn is None) == (conn is None):
            raise ValueError("give exactly one of dsn or conn")
        self._own = conn is None
        super().__init__(
            conn if conn is not None else psycopg.connect(str(dsn), autocommit=True), limits
        )

    def close(self) -> None:
        if self._own:
            self.conn.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[Batch]:
        """Appends made on the yielded batch commit together, or not at all."""
        with self.conn.transaction():
            yield Batch(self.conn, self.limits)

    def head(self, session_id: uuid.UUID | str) -> int:
        return session_head(self.conn, session_id)


class AsyncLedger(AsyncBatch):
    """The async twin of :class:`Ledger`; create with ``await AsyncLedger.connect(dsn)``."""

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        *,
        own: bool = False,
        dsn: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        super().__init__(conn, limits)
        self._own = own
        self._dsn = dsn

    @classmethod
    async def connect(cls, dsn: str, *, limits: Limits = DEFAULT_LIMITS) -> AsyncLedger:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        return cls(conn, own=True, dsn=dsn, limits=limits)

    def pending_runs(self, **options: Any) -> AsyncIterator[Any]:
        """Runs ready to lease, as they become ready (see :func:`ledger_cdc.runs.pending_runs`;
        listens on a connection of its own, to the projections' database: pass ``dsn=`` when
        the projections live elsewhere or this ledger was built from a connection)."""
        from .runs import pending_runs

        dsn = options.pop("dsn", None) or self._dsn
        if dsn is None:
            raise ConfigError("pending_runs needs a DSN: use AsyncLedger.connect(dsn) or dsn=")
        return pending_runs(dsn, **options)

    async def close(self) -> None:
        if self._own:
            await self.conn.close()

    async def __aenter__(self) -> AsyncLedger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncBatch]:
        async with self.conn.transaction():
            yield AsyncBatch(self.conn, self.limits)

    async def head(self, session_id: uuid.UUID | str) -> int:
        cur = await self.conn.execute(_SELECT_HEAD, (_session_uuid(session_id),))
        row = await cur.fetchone()
        return int(row[0]) if row else 0
