"""Transactional appends to the ledger, sync and async, over psycopg 3.

The append logic is written once, as a generator of SQL steps (the shape psycopg 3 uses for its
protocol code): it yields each statement, receives the rows, and may be thrown the driver's
``UniqueViolation``. :mod:`ledger_cdc.client.steps` executes them, sync or async. Every append
runs inside ``conn.transaction()``: on an idle autocommit connection that is a transaction of its
own, inside a caller's transaction it is a savepoint, so the event commits together with the
caller's own side effects (outbox rows, application tables) or not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import (
    AsyncConnectionPool,
    ConnectionPool,
    PoolClosed,
    PoolTimeout,
    TooManyRequests,
)

from ledger_cdc.client.pools import AsyncLifoPool, LifoPool
from ledger_cdc.client.read import pending_runs
from ledger_cdc.client.steps import Op, Step, Steps, first, run, run_async, steps_op
from ledger_cdc.connect import session_setup, session_setup_async
from ledger_cdc.errors import (
    AppendError,
    ConcurrentAppendError,
    ConfigError,
    IdempotencyConflictError,
    InvalidEventError,
    LedgerError,
    PoolExhaustedError,
    describe,
    translate,
)
from ledger_cdc.events import (
    DEFAULT_LIMITS,
    Limits,
    encode_json,
    encode_payload,
    refuse_nul,
    too_deep,
)

if TYPE_CHECKING:
    from typing import Self  # (3.11: the annotations alone name it)

__all__ = [
    "INDEXED_MAX_BYTES",
    "AppendResult",
    "AsyncLedger",
    "AsyncWriteTransaction",
    "Ledger",
    "OutboxItem",
    "WriteTransaction",
    "append",
    "append_async",
]

_MAX_AUTO_RETRIES = 100
# A transaction of the writer's own that the server rolled back whole, for what another
# transaction did at the same time: a serialization failure (the database's or role's
# default_transaction_isolation may be serializable), a deadlock, a lock_timeout. Nothing of it
# was written: it is run again, up to this many times, after a short random pause.
_RERUN_STATES = frozenset({"40001", "40P01", "55P03"})
_MAX_RERUNS = 20
# the server ended the session while it sat idle in the pool (idle_session_timeout): nothing
# was sent on it, so a fresh connection from the pool takes the call
_IDLE_ENDED = "57P05"
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


# Through SECURITY DEFINER functions (sql/functions/ledger.sql): a writer learns a session's
# head and whether a key names the same event, without being able to read any event's contents.
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


INDEXED_MAX_BYTES = 1024


def _indexed(what: str, value: str) -> None:
    """A string the ledger indexes (an index entry is bounded, about 2.7 kB) and stores as
    text: at most INDEXED_MAX_BYTES of UTF-8, no NUL, no lone surrogate."""
    if not isinstance(value, str):
        raise InvalidEventError(f"{what} must be a string, got {type(value).__name__}")
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        raise InvalidEventError(f"{what} holds a lone surrogate, which UTF-8 cannot") from None
    if size > INDEXED_MAX_BYTES:
        raise InvalidEventError(
            f"{what} is {size:,} bytes, over the {INDEXED_MAX_BYTES:,} an indexed key may "
            "hold: use a digest of it"
        )
    if "\x00" in value:
        raise InvalidEventError(f"{what} holds a NUL character, which PostgreSQL text cannot")


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
    _indexed("agent_id", agent_id)
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
    if idempotency_key is not None:
        _indexed("idempotency_key", idempotency_key)
    data = encode_payload(event_type, payload, limits).decode()
    items: list[tuple[str, str, str | None]] = []
    for item in outbox:
        if not isinstance(item, OutboxItem) or not item.target:
            raise InvalidEventError(
                f"outbox entries must be OutboxItem with a target, got {item!r}"
            )
        _indexed("outbox target", item.target)
        if item.idempotency_key is not None:
            _indexed("outbox idempotency_key", item.idempotency_key)
        what = f"outbox payload for {item.target}"
        raw = refuse_nul(encode_json(item.payload, what, limits), what)
        if len(raw) > limits.max_bytes or too_deep(raw, limits.max_depth):
            raise InvalidEventError(
                f"outbox payload for {item.target} is over the writer's limits "
                f"({limits.max_bytes:,} bytes, {limits.max_depth} levels of nesting)"
            )
        items.append((item.target, raw.decode(), item.idempotency_key))
    return _Request(
        sid, agent_id, event_type, data, expected_position, idempotency_key, tuple(items)
    )


def _append_steps(req: _Request) -> Steps[AppendResult]:
    """The append protocol: idempotency check, position check, insert, outbox rows."""
    sid = req.session_id
    if req.idempotency_key is not None:
        rows = yield Step(_SELECT_KEY, _key_params(req))
        if rows:
            return _duplicate(req, rows[0])
    if req.expected_position is not None:
        (head,) = (yield Step(_SELECT_HEAD, (sid,)))[0]
        if head != req.expected_position:
            raise ConcurrentAppendError(sid, req.expected_position, int(head))
    position = None if req.expected_position is None else req.expected_position + 1
    params = (sid, position, req.agent_id, req.event_type, req.payload, req.idempotency_key)
    for _ in range(_MAX_AUTO_RETRIES):
        try:
            seq, pos, created = (yield Step(_INSERT, params, savepoint=True))[0]
            break
        except pg_errors.UniqueViolation as e:
            constraint = e.diag.constraint_name
            if constraint == _KEY_INDEX and req.idempotency_key is not None:
                rows = yield Step(_SELECT_KEY, _key_params(req))
                if rows:
                    return _duplicate(req, rows[0])
                continue
            if constraint != _POSITION_INDEX:
                raise
            if req.expected_position is not None:
                (head,) = (yield Step(_SELECT_HEAD, (sid,)))[0]
                raise ConcurrentAppendError(sid, req.expected_position, int(head)) from None
    else:
        raise AppendError(
            f"session {sid}: gave up after {_MAX_AUTO_RETRIES} position conflicts with other "
            "writers; pass expected_position to detect conflicts explicitly"
        )
    ids: list[int] = []
    for i, (target, body, key) in enumerate(req.outbox):
        okey = key or f"{sid}:{pos}:{i}"
        try:
            (oid,) = (yield Step(_INSERT_OUTBOX, (seq, sid, target, body, okey)))[0]
        except pg_errors.UniqueViolation:
            # a target deduplicates by the key alone: a second row with it would be dropped
            # there as "already done". Nothing is written (the event neither).
            raise AppendError(
                f"session {sid}: outbox key {okey!r} already names another outbox row; an "
                "outbox key is unique across the ledger (the target deduplicates by it "
                "alone): derive it from the session and call, e.g. f'{session}:{call_id}'"
            ) from None
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


def _owned(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether the append runs in a transaction of its own (the connection idle, not inside
    the caller's): only then may it run again after the server rolled it back."""
    return conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def _rerun(e: psycopg.Error, owned: bool, attempt: int) -> float | None:
    """The pause before running the append again, or None when it may not be."""
    if not owned or e.sqlstate not in _RERUN_STATES or attempt + 1 >= _MAX_RERUNS:
        return None
    return min(0.05, 0.001 * 2.0**attempt) * random.uniform(0.5, 1.5)


def _drive(conn: psycopg.Connection[Any], req: _Request) -> AppendResult:
    owned = _owned(conn)
    for attempt in range(_MAX_RERUNS):
        try:
            if _standalone(conn, req):
                return run(conn, _append_steps(req), savepoints=False)
            with conn.transaction():
                return run(conn, _append_steps(req), savepoints=True)
        except psycopg.Error as e:  # the boundary: what leaves the writer is a LedgerError
            pause = _rerun(e, owned and _owned(conn), attempt)
            if pause is None:
                raise translate(e, doing=f"append to session {req.session_id}") from e
            time.sleep(pause)
    raise AssertionError("unreachable")  # (the last attempt raises)


async def _drive_async(conn: psycopg.AsyncConnection[Any], req: _Request) -> AppendResult:
    owned = _owned(conn)
    for attempt in range(_MAX_RERUNS):
        try:
            if _standalone(conn, req):
                return await run_async(conn, _append_steps(req), savepoints=False)
            async with conn.transaction():
                return await run_async(conn, _append_steps(req), savepoints=True)
        except psycopg.Error as e:
            pause = _rerun(e, owned and _owned(conn), attempt)
            if pause is None:
                raise translate(e, doing=f"append to session {req.session_id}") from e
            await asyncio.sleep(pause)
    raise AssertionError("unreachable")


def _idle_ended(e: BaseException) -> bool:
    """The error says the server had ended the pooled session while it was idle."""
    cause = e.__cause__ if isinstance(e, LedgerError) else e
    return isinstance(cause, psycopg.Error) and cause.sqlstate == _IDLE_ENDED


def append_op(
    session_id: uuid.UUID | str,
    agent_id: str,
    event_type: str,
    payload: Any,
    *,
    expected_position: int | None = None,
    idempotency_key: str | None = None,
    outbox: Sequence[OutboxItem] = (),
    limits: Limits = DEFAULT_LIMITS,
) -> Op[AppendResult]:
    """:func:`append` as an op of a higher protocol (:mod:`ledger_cdc.client.steps`), on either
    kind of connection; the arguments are checked now, before anything is written."""
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
    return Op(lambda conn: _drive(conn, req), lambda conn: _drive_async(conn, req))


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
    op = append_op(
        session_id,
        agent_id,
        event_type,
        payload,
        expected_position=expected_position,
        idempotency_key=idempotency_key,
        outbox=outbox,
        limits=limits,
    )
    return op.sync(conn)


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
    op = append_op(
        session_id,
        agent_id,
        event_type,
        payload,
        expected_position=expected_position,
        idempotency_key=idempotency_key,
        outbox=outbox,
        limits=limits,
    )
    return await op.aio(conn)


def _head_steps(session_id: uuid.UUID | str) -> Steps[int]:
    row = first((yield Step(_SELECT_HEAD, (_session_uuid(session_id),))))
    return int(row[0]) if row else 0


def head_op(session_id: uuid.UUID | str) -> Op[int]:
    """:func:`session_head` as an op of a higher protocol."""
    return steps_op(lambda: _head_steps(session_id))


def session_head(conn: psycopg.Connection[Any], session_id: uuid.UUID | str) -> int:
    """The session's current position (0 if it has no events)."""
    return run(conn, _head_steps(session_id))


async def session_head_async(
    conn: psycopg.AsyncConnection[Any], session_id: uuid.UUID | str
) -> int:
    """The async twin of :func:`session_head`."""
    return await run_async(conn, _head_steps(session_id))


class WriteTransaction:
    """Appends that commit together (what :meth:`Ledger.transaction` yields): on one
    connection, inside one database transaction."""

    def __init__(self, conn: psycopg.Connection[Any], limits: Limits = DEFAULT_LIMITS) -> None:
        self.conn = conn
        self.limits = limits
        self.results: list[AppendResult] = []

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
        self.results.append(res)
        return res


class AsyncWriteTransaction:
    """The async twin of :class:`WriteTransaction`."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], limits: Limits = DEFAULT_LIMITS) -> None:
        self.conn = conn
        self.limits = limits
        self.results: list[AppendResult] = []

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
        self.results.append(res)
        return res


def _one_of(**given: object) -> str:
    named = [k for k, v in given.items() if v is not None]
    if len(named) != 1:
        raise ValueError(
            f"give exactly one of {', '.join(given)} (got {', '.join(named) or 'none'})"
        )
    return named[0]


def _probe(dsn: str) -> None:
    """Connect once, so a wrong DSN fails now, in one line, rather than as a pool timeout."""
    from ledger_cdc.connect import connect

    connect(dsn).close()


# -- getting a connection from the pool ----------------------------------------------------------
#
# A pool opens its connections in worker threads (tasks), which log each failure; the caller
# waiting for one sees only psycopg_pool's PoolTimeout after the pool's wait. Every way of not
# getting one is a LedgerError here, naming the pool's size, its wait and the last refusal the
# pool met (the server's own words: "too many clients" for one out of connection slots).


class _Refusals:
    """The last error a pool met opening a connection (None once one opened again)."""

    def __init__(self) -> None:
        self.last: BaseException | None = None


def _watched(refusals: _Refusals) -> type[psycopg.Connection[Any]]:
    """A connection class for a pool that records in ``refusals`` how its connects end."""

    class Watched(psycopg.Connection[Any]):
        @classmethod
        def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
            try:
                conn = super().connect(conninfo, **kwargs)
            except psycopg.Error as e:
                refusals.last = e
                raise
            refusals.last = None
            return conn

    return Watched


def _watched_async(refusals: _Refusals) -> type[psycopg.AsyncConnection[Any]]:
    """:func:`_watched` for an async pool."""

    class Watched(psycopg.AsyncConnection[Any]):
        @classmethod
        async def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
            try:
                conn = await super().connect(conninfo, **kwargs)
            except psycopg.Error as e:
                refusals.last = e
                raise
            refusals.last = None
            return conn

    return Watched


def _no_connection(
    pool: ConnectionPool[Any] | AsyncConnectionPool[Any],
    e: Exception,
    refusals: _Refusals | None,
    dsn: str | None,
) -> LedgerError:
    """The LedgerError for psycopg_pool's way of giving no connection (``e``)."""
    if isinstance(e, PoolClosed):
        return LedgerError(f"the writer's pool {pool.name!r} is closed: make a new Ledger")
    what = (
        f"no connection from the writer's pool {pool.name!r} within {pool.timeout:g} s "
        f"(pool_size={pool.max_size}"
    )
    if isinstance(e, TooManyRequests):
        return PoolExhaustedError(
            f"{what}, {pool.max_waiting} callers already waiting: max_waiting reached): "
            "raise pool_size, or append from fewer threads at once"
        )
    refused = refusals.last if refusals is not None else None
    if refused is not None:
        return PoolExhaustedError(
            f"{what}; opening another failed: {describe(refused, dsn)}): the server takes no "
            "more connections from this pool; share one Ledger per process (a pool serves "
            "every thread), lower pool_size, or raise the server's max_connections"
        )
    return PoolExhaustedError(
        f"{what}, every one in use for the whole wait): raise pool_size (or pool_timeout), or "
        "hold connections for less time (Ledger.transaction, Ledger.connection)"
    )


class Ledger:
    """The writer; safe to share between threads.

    From a DSN it keeps a pool (``psycopg_pool.ConnectionPool``, at most ``pool_size``
    connections): each :meth:`append`, and each :meth:`transaction` for as long as it lasts,
    holds a connection of its own, so threads append in parallel. From your pool (``pool=``)
    it does the same with it. From one connection (``conn=``) it serialises: an append or a
    transaction holds the connection under a lock until it ends, so threads never interleave
    statements of one transaction. Each append outside :meth:`transaction` commits by itself.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        conn: psycopg.Connection[Any] | None = None,
        pool: ConnectionPool[Any] | None = None,
        pool_size: int = 4,
        pool_timeout: float = 30.0,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        """``pool_timeout``: seconds a call waits for a connection of the pool before it
        raises :class:`~ledger_cdc.errors.PoolExhaustedError` (a DSN's pool; yours has its
        own ``timeout``)."""
        kind = _one_of(dsn=dsn, conn=conn, pool=pool)
        self.limits = limits
        self._conn = conn
        self._lock = threading.RLock()
        self._own = kind == "dsn"
        self._pool = pool
        self._dsn = dsn
        self._refusals: _Refusals | None = None
        if dsn is not None:
            _probe(dsn)
            self._refusals = _Refusals()
            self._pool = LifoPool(
                dsn,
                min_size=1,
                max_size=pool_size,
                timeout=pool_timeout,
                kwargs={"autocommit": True},
                configure=session_setup,
                connection_class=_watched(self._refusals),
                open=True,
                name="ledger-cdc",
            )
            # its first connection made, so that a first call does not open a second one (a
            # pool that cannot: each call says why when it waits in vain)
            with contextlib.suppress(PoolTimeout):
                self._pool.wait(timeout=pool_timeout)

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection of this writer's for the length of the block (taken from the pool, or
        the one connection, held under the lock). None within the pool's wait:
        :class:`~ledger_cdc.errors.PoolExhaustedError`."""
        if self._pool is not None:
            given = False
            try:
                with self._pool.connection() as conn:
                    given = True
                    yield conn
            except (PoolTimeout, TooManyRequests, PoolClosed) as e:
                if given:  # (raised by the block, from another pool)
                    raise
                raise _no_connection(self._pool, e, self._refusals, self._dsn) from e
        else:
            assert self._conn is not None
            with self._lock:
                yield self._conn

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
        """Append one event (see :func:`append`), committed by itself."""
        req = _prepare(
            session_id,
            agent_id,
            event_type,
            payload,
            expected_position,
            idempotency_key,
            outbox,
            self.limits,
        )
        # every connection the pool holds may have been ended: one more than it holds
        tries = 1 if self._pool is None else self._pool.max_size + 1
        for left in range(tries - 1, -1, -1):
            with self.connection() as conn:
                try:
                    return _drive(conn, req)
                except LedgerError as e:
                    if not left or not _idle_ended(e):
                        raise
                    # (the pool drops the ended connection: the next one is another)
        raise AssertionError("unreachable")  # (the last try raises)

    @contextmanager
    def transaction(self) -> Iterator[WriteTransaction]:
        """Appends made on the yielded object commit together, or not at all."""
        with self.connection() as conn, conn.transaction():
            yield WriteTransaction(conn, self.limits)

    def head(self, session_id: uuid.UUID | str) -> int:
        """The session's current position (0 if it has no events)."""
        with self.connection() as conn:
            return session_head(conn, session_id)

    def close(self) -> None:
        if self._own and self._pool is not None:
            self._pool.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncLedger:
    """The async twin of :class:`Ledger`, safe to share between tasks; create it with
    ``await AsyncLedger.connect(dsn)`` (a pool of ``pool_size`` connections), or from your
    ``AsyncConnectionPool`` (``pool=``) or one connection (``conn=``, serialised by a lock)."""

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any] | None = None,
        *,
        pool: AsyncConnectionPool[Any] | None = None,
        own: bool = False,
        dsn: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        _one_of(conn=conn, pool=pool)
        self.limits = limits
        self._conn = conn
        self._pool = pool
        self._own = own
        self._dsn = dsn
        self._lock: asyncio.Lock | None = None
        self._refusals: _Refusals | None = None  # (set by connect: its pool's refusals)

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        pool_size: int = 4,
        pool_timeout: float = 30.0,
        limits: Limits = DEFAULT_LIMITS,
    ) -> AsyncLedger:
        """``pool_timeout``: seconds a call waits for a connection of the pool before it
        raises :class:`~ledger_cdc.errors.PoolExhaustedError`."""
        await asyncio.to_thread(_probe, dsn)
        refusals = _Refusals()
        pool: AsyncConnectionPool[Any] = AsyncLifoPool(
            dsn,
            min_size=1,
            max_size=pool_size,
            timeout=pool_timeout,
            kwargs={"autocommit": True},
            configure=session_setup_async,
            connection_class=_watched_async(refusals),
            open=False,
            name="ledger-cdc",
        )
        await pool.open()
        # its first connection made, so that a first call does not open a second one (a pool
        # that cannot: each call says why when it waits in vain)
        with contextlib.suppress(PoolTimeout):
            await pool.wait(timeout=pool_timeout)
        ledger = cls(pool=pool, own=True, dsn=dsn, limits=limits)
        ledger._refusals = refusals
        return ledger

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection of this writer's for the length of the block. None within the pool's
        wait: :class:`~ledger_cdc.errors.PoolExhaustedError`."""
        if self._pool is not None:
            given = False
            try:
                async with self._pool.connection() as conn:
                    given = True
                    yield conn
            except (PoolTimeout, TooManyRequests, PoolClosed) as e:
                if given:
                    raise
                raise _no_connection(self._pool, e, self._refusals, self._dsn) from e
        else:
            assert self._conn is not None
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                yield self._conn

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
        """Append one event (see :func:`append`), committed by itself."""
        req = _prepare(
            session_id,
            agent_id,
            event_type,
            payload,
            expected_position,
            idempotency_key,
            outbox,
            self.limits,
        )
        tries = 1 if self._pool is None else self._pool.max_size + 1
        for left in range(tries - 1, -1, -1):
            async with self.connection() as conn:
                try:
                    return await _drive_async(conn, req)
                except LedgerError as e:
                    if not left or not _idle_ended(e):
                        raise
        raise AssertionError("unreachable")

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncWriteTransaction]:
        """Appends made on the yielded object commit together, or not at all."""
        async with self.connection() as conn, conn.transaction():
            yield AsyncWriteTransaction(conn, self.limits)

    async def head(self, session_id: uuid.UUID | str) -> int:
        async with self.connection() as conn:
            return await session_head_async(conn, session_id)

    def pending_runs(self, **options: Any) -> AsyncIterator[Any]:
        """Runs ready to lease, as they become ready (see
        :func:`ledger_cdc.client.read.pending_runs`; listens on a connection of its own, to the
        projections' database: pass ``dsn=`` when the projections live elsewhere or this ledger
        was built from a connection)."""
        dsn = options.pop("dsn", None) or self._dsn
        if dsn is None:
            raise ConfigError("pending_runs needs a DSN: use AsyncLedger.connect(dsn) or dsn=")
        return pending_runs(dsn, **options)

    async def close(self) -> None:
        if self._own:
            if self._pool is not None:
                await self._pool.close()
            elif self._conn is not None:
                await self._conn.close()

    async def __aenter__(self) -> AsyncLedger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
