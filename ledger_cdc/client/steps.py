"""One implementation for sync and async: database work written as a generator of SQL steps.

The protocol code (an append, a rebuild, a memo lookup, a lease) is a generator: it yields each
statement as a :class:`Step`, receives its rows, and may be thrown the driver's
``UniqueViolation`` (the only error a protocol decides on: which index refused it). It does no
I/O itself, so :func:`run` and :func:`run_async` are the only places that touch a connection,
the same shape psycopg 3 uses for its own protocol code. A protocol above single statements (a
lease: rebuild, read the clock, append, rebase on a lost race) yields ops (:class:`Op`), run by
:func:`drive` / :func:`drive_async`. Either way a public function and its ``_async`` twin
differ only in the driver that runs the same generator. Errors of the driver are not translated
here: the public function wraps them once, with what it was doing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

import psycopg
from psycopg import errors as pg_errors

from ledger_cdc.errors import LedgerError

__all__ = [
    "Op",
    "Ops",
    "Rows",
    "Step",
    "Steps",
    "drive",
    "drive_async",
    "first",
    "run",
    "run_async",
    "steps_op",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Step:
    query: str | bytes
    params: Sequence[Any]
    savepoint: bool = False  # run under a savepoint (when inside a transaction block)
    binary: bool = False  # ask for binary results


Rows: TypeAlias = list[tuple[Any, ...]]
Steps: TypeAlias = Generator[Step, Rows, T]


def first(rows: Rows) -> tuple[Any, ...] | None:
    return rows[0] if rows else None


def run(conn: psycopg.Connection[Any], steps: Steps[T], *, savepoints: bool = True) -> T:
    """Execute the steps on ``conn`` and return what the generator returns."""
    try:
        step = next(steps)
    except StopIteration as stop:  # answered without the database
        done: T = stop.value
        return done
    while True:
        try:
            if step.savepoint and savepoints:
                with conn.transaction():
                    rows = _fetch(conn.execute(step.query, step.params, binary=step.binary))
            else:
                rows = _fetch(conn.execute(step.query, step.params, binary=step.binary))
        except pg_errors.UniqueViolation as e:
            step = _throw(steps, e)
            continue
        try:
            step = steps.send(rows)
        except StopIteration as stop:
            result: T = stop.value
            return result


async def run_async(
    conn: psycopg.AsyncConnection[Any], steps: Steps[T], *, savepoints: bool = True
) -> T:
    """The same, on an async connection."""
    try:
        step = next(steps)
    except StopIteration as stop:  # answered without the database
        done: T = stop.value
        return done
    while True:
        try:
            if step.savepoint and savepoints:
                async with conn.transaction():
                    cur = await conn.execute(step.query, step.params, binary=step.binary)
                    rows = await cur.fetchall() if cur.description is not None else []
            else:
                cur = await conn.execute(step.query, step.params, binary=step.binary)
                rows = await cur.fetchall() if cur.description is not None else []
        except pg_errors.UniqueViolation as e:
            step = _throw(steps, e)
            continue
        try:
            step = steps.send(rows)
        except StopIteration as stop:
            result: T = stop.value
            return result


def _fetch(cur: psycopg.Cursor[Any]) -> Rows:
    return cur.fetchall() if cur.description is not None else []


def _throw(steps: Steps[T], e: BaseException) -> Step:
    try:
        return steps.throw(e)
    except StopIteration as stop:  # pragma: no cover - a protocol always yields after a throw
        raise LedgerError("protocol ended after a conflict") from stop


# -- operations: protocols above single statements ------------------------------------------------


@dataclass(frozen=True)
class Op(Generic[T]):
    """One operation of a higher protocol (an append, a rebuild, the server's clock), given as
    its sync and its async form. A protocol that yields ops runs on either kind of connection
    through :func:`drive` / :func:`drive_async`; the :class:`LedgerError` an op raises is thrown
    into the protocol, which may handle it (a lost race, say) and go on."""

    sync: Callable[[psycopg.Connection[Any]], T]
    aio: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]


Ops: TypeAlias = Generator["Op[Any]", Any, T]


def steps_op(make: Callable[[], Steps[T]]) -> Op[T]:
    """Steps (a read, a rebuild) as one op of a higher protocol, run by :func:`run` or
    :func:`run_async`: ``make`` gives a fresh generator each time the op runs."""
    return Op(lambda conn: run(conn, make()), lambda conn: run_async(conn, make()))


def drive(conn: psycopg.Connection[Any], ops: Ops[T]) -> T:
    try:
        op = next(ops)
        while True:
            try:
                value = op.sync(conn)
            except LedgerError as e:
                op = ops.throw(e)
                continue
            op = ops.send(value)
    except StopIteration as stop:
        result: T = stop.value
        return result


async def drive_async(conn: psycopg.AsyncConnection[Any], ops: Ops[T]) -> T:
    try:
        op = next(ops)
        while True:
            try:
                value = await op.aio(conn)
            except LedgerError as e:
                op = ops.throw(e)
                continue
            op = ops.send(value)
    except StopIteration as stop:
        result: T = stop.value
        return result
