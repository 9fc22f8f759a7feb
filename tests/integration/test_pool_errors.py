"""A writer that gets no connection says why, as a LedgerError: its pool's connections all held
(the pool's size and wait named), or the server refusing more (its own words named). Before,
psycopg_pool's PoolTimeout escaped every ``except LedgerError``."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from ledger_cdc.admin.schema import create_publication, migrate
from ledger_cdc.client.writer import AsyncLedger, Ledger
from ledger_cdc.demo.embedded import EmbeddedPostgres
from ledger_cdc.errors import DatabaseUnavailable, LedgerError, PoolExhaustedError
from tests.support.harness import _INSTALLS, _REQUIRED, Database

pytestmark = pytest.mark.server

EVENT = ("a", "tool.invoked", {"call_id": "c", "tool": "t"})


def test_a_pool_whose_connections_are_all_held_names_its_size_and_wait(db: Database) -> None:
    with Ledger(db.dsn, pool_size=1, pool_timeout=0.5) as ledger:
        # the pool's one connection, held
        with ledger.connection(), pytest.raises(PoolExhaustedError) as caught:
            ledger.append(uuid.uuid4(), *EVENT)
        ledger.append(uuid.uuid4(), *EVENT)  # given back: it serves again
    e = caught.value
    assert isinstance(e, DatabaseUnavailable) and isinstance(e, LedgerError)
    text = str(e)
    assert "within 0.5 s" in text and "pool_size=1" in text, text
    assert "every one in use" in text and "raise pool_size" in text, text


def test_the_async_pool_says_the_same(db: Database) -> None:
    async def main() -> str:
        ledger = await AsyncLedger.connect(db.dsn, pool_size=1, pool_timeout=0.5)
        try:
            async with ledger.connection():
                try:
                    await ledger.append(uuid.uuid4(), *EVENT)
                except PoolExhaustedError as e:
                    return str(e)
            raise AssertionError("no PoolExhaustedError")
        finally:
            await ledger.close()

    text = asyncio.run(main())
    assert "within 0.5 s" in text and "pool_size=1" in text, text


def test_an_error_inside_the_block_is_not_taken_for_the_pools() -> None:
    """A pool's timeout raised by the caller's own code in the block (another pool of theirs)
    is theirs: it leaves as it was."""
    from psycopg_pool import PoolTimeout

    ledger = Ledger(conn=None, pool=_FakePool())  # type: ignore[arg-type]
    with pytest.raises(PoolTimeout), ledger.connection():
        raise PoolTimeout("the caller's")


class _FakePool:
    """Just enough of a ConnectionPool for Ledger.connection: hands out a sentinel."""

    max_size = 1

    def connection(self) -> _Held:
        return _Held()


class _Held:
    def __enter__(self) -> object:
        return object()

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture(scope="module")
def full_server() -> Iterator[EmbeddedPostgres]:
    """A cluster of its own with room for four connections, none kept for superusers."""
    major = 18 if 18 in _INSTALLS else 15
    inst = _INSTALLS.get(major)
    if inst is None:
        if _REQUIRED:
            pytest.fail("no PostgreSQL binaries", pytrace=False)
        pytest.skip("no PostgreSQL binaries")
    settings = {"max_connections": "4", "superuser_reserved_connections": "0"}
    if major >= 16:
        settings["reserved_connections"] = "0"
    with EmbeddedPostgres(inst, settings=settings) as pg:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            migrate(conn)
            create_publication(conn)
        yield pg


def test_a_server_out_of_connections_is_named(full_server: EmbeddedPostgres) -> None:
    """The pool holds one connection, in use; the server has no slot for the one it would open:
    the error names the pool and the server's refusal ("too many clients")."""
    dsn = full_server.dsn()
    others: list[psycopg.Connection[object]] = []
    ledger = Ledger(dsn, pool_size=2, pool_timeout=1.5)
    try:
        assert ledger._pool is not None
        ledger._pool.wait(10)  # its first connection made
        with ledger.connection():
            while True:  # every other slot taken
                try:
                    others.append(psycopg.connect(dsn, autocommit=True))
                except psycopg.OperationalError:
                    break
            assert others, "the server had no room at all"
            with pytest.raises(PoolExhaustedError) as caught:
                ledger.append(uuid.uuid4(), *EVENT)
        text = str(caught.value)
        assert "pool_size=2" in text and "within 1.5 s" in text, text
        assert "too many clients" in text and "max_connections" in text, text
        # a new writer meanwhile: refused at once, a LedgerError in the server's words
        with pytest.raises(LedgerError) as refused:
            Ledger(dsn)
        assert "too many clients" in str(refused.value), refused.value
        # the slots free again, the pool serves
        for c in others:
            c.close()
        others.clear()
        ledger.append(uuid.uuid4(), *EVENT)
    finally:
        for c in others:
            c.close()
        ledger.close()
