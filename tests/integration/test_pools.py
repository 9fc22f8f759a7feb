"""The writers' pools give out the connection returned last (the backend whose caches are
warm), and a writer's pool has its first connection ready when it is made, so that calls one
at a time use one connection, not two."""

from __future__ import annotations

import asyncio

import pytest

from ledger_cdc.client.pools import AsyncLifoPool, LifoPool
from ledger_cdc.client.writer import AsyncLedger, Ledger
from tests.support.harness import Database

pytestmark = pytest.mark.server


def test_the_pool_gives_out_the_connection_returned_last(empty_db: Database) -> None:
    with LifoPool(empty_db.dsn, min_size=1, max_size=4, open=True) as pool:
        first, second, third = pool.getconn(), pool.getconn(), pool.getconn()
        for conn in (first, third, second):  # second returned last
            pool.putconn(conn)
        again = pool.getconn()
        assert again is second
        pool.putconn(again)
        assert pool.getconn() is second  # and again, while the others stay idle


def test_the_async_pool_gives_out_the_connection_returned_last(empty_db: Database) -> None:
    async def main() -> None:
        async with AsyncLifoPool(empty_db.dsn, min_size=1, max_size=4, open=False) as pool:
            first, second, third = [await pool.getconn() for _ in range(3)]
            for conn in (second, first, third):  # third returned last
                await pool.putconn(conn)
            pids = set()
            for _ in range(5):
                async with pool.connection() as conn:
                    assert conn is third
                    pids.add(conn.info.backend_pid)
            assert len(pids) == 1

    asyncio.run(main())


def test_a_writer_made_from_a_dsn_serves_calls_one_at_a_time_on_one_connection(
    db: Database,
) -> None:
    ledger = Ledger(db.dsn)
    try:
        for _ in range(10):
            with ledger.connection() as conn:
                conn.execute("SELECT 1")
        assert ledger._pool is not None and ledger._pool.get_stats()["pool_size"] == 1
    finally:
        ledger.close()

    async def main() -> None:
        aledger = await AsyncLedger.connect(db.dsn)
        try:
            for _ in range(10):
                async with aledger.connection() as conn:
                    await conn.execute("SELECT 1")
            assert aledger._pool is not None and aledger._pool.get_stats()["pool_size"] == 1
        finally:
            await aledger.close()

    asyncio.run(main())
