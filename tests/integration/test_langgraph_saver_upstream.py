"""LangGraph's own Postgres saver tests (langgraph-checkpoint-postgres's ``test_sync.py``,
``test_async.py`` and ``test_delta_plain_value_seed.py``, from the sdist of the installed
version) run against the ledger's savers: bodies unchanged, the helpers that build a saver
(``_saver``; the saver class and URI ``test_delta_plain_value_seed`` builds one from) swapped
for ones that build ``LedgerSaver`` / ``AsyncLedgerSaver`` in a new database and call
``setup()`` on it: from a connection ("base"), a pool ("pool"), a DSN ("pipe": the ledger's
savers have no pipeline mode; "shallow": they keep every checkpoint, and these tests ask
nothing a shallow saver would answer differently).

Excluded, with the reason:
- ``test_nonnull_migrations`` (sync): reads the reference's ``PostgresSaver.MIGRATIONS``;
- ``test_get_checkpoint_no_channel_values`` (both): monkeypatches the reference's private
  ``_load_checkpoint_tuple``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest

pytest.importorskip("langgraph.checkpoint.postgres")

from ledger_cdc.integrations.langgraph import AsyncLedgerSaver, LedgerSaver
from tests.support import upstream
from tests.support.harness import Database, Server, _new_database

# LangGraph's own tests exercise the store and saver, not the server: run once, on the newest
pytestmark = [pytest.mark.server, pytest.mark.one_server]

_TESTS = upstream.sdist_tests("langgraph-checkpoint-postgres")
_URIS = {"DEFAULT_URI": "unused", "DEFAULT_POSTGRES_URI": "unused"}
_SYNC = upstream.load(_TESTS, "test_sync", _URIS)
_ASYNC = upstream.load(_TESTS, "test_async", _URIS)
_SEED = upstream.load(_TESTS, "test_delta_plain_value_seed", _URIS)
_NO_VALUES = {
    "test_get_checkpoint_no_channel_values": "patches the reference's _load_checkpoint_tuple"
}
_SYNC_EXCLUDED = {**_NO_VALUES, "test_nonnull_migrations": "the reference's MIGRATIONS list"}
RUN = (
    upstream.collect(_SYNC, globals(), _SYNC_EXCLUDED, prefix="test_sync_")
    + upstream.collect(_ASYNC, globals(), _NO_VALUES, mark=pytest.mark.anyio, prefix="test_async_")
    + upstream.collect(_SEED, globals(), {}, mark=pytest.mark.anyio, prefix="test_seed_")
)
test_data = _SYNC.test_data
_server: list[Server] = []


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _on(server: Server) -> Iterator[None]:
    _server[:] = [server]
    with _database() as db:  # test_delta_plain_value_seed's saver: from its URI
        _SEED.DEFAULT_URI = db.dsn
        yield


@contextmanager
def _database() -> Iterator[Database]:
    gen = _new_database(_server[0], None)  # empty: setup() brings the schema
    db = next(gen)
    try:
        yield db
    finally:
        gen.close()


@contextmanager
def _saver(name: str) -> Iterator[LedgerSaver]:
    import psycopg
    from psycopg_pool import ConnectionPool

    with _database() as db:
        if name == "base":
            with psycopg.connect(db.dsn, autocommit=True) as conn:
                saver = LedgerSaver(conn)
                saver.setup()
                yield saver
        elif name == "pool":
            with ConnectionPool(db.dsn, max_size=10, kwargs={"autocommit": True}) as pool:
                saver = LedgerSaver(pool)
                saver.setup()
                yield saver
        else:
            with LedgerSaver.from_conn_string(db.dsn) as saver:
                saver.setup()
                yield saver


@asynccontextmanager
async def _asaver(name: str) -> AsyncIterator[AsyncLedgerSaver]:
    import psycopg
    from psycopg_pool import AsyncConnectionPool

    with _database() as db:
        if name == "base":
            async with await psycopg.AsyncConnection.connect(db.dsn, autocommit=True) as conn:
                saver = AsyncLedgerSaver(conn)
                await saver.setup()
                yield saver
        elif name == "pool":
            async with AsyncConnectionPool(
                db.dsn, max_size=10, kwargs={"autocommit": True}, open=False
            ) as pool:
                saver = AsyncLedgerSaver(pool)
                await saver.setup()
                yield saver
        else:
            async with AsyncLedgerSaver.from_conn_string(db.dsn) as saver:
                await saver.setup()
                yield saver


upstream.replace(_SYNC, _saver=_saver)
upstream.replace(_ASYNC, _saver=_asaver)
upstream.replace(_SEED, AsyncPostgresSaver=AsyncLedgerSaver)


def test_every_upstream_test_is_run_or_excluded_with_a_reason() -> None:
    assert len(RUN) >= 14, RUN
    assert all(_SYNC_EXCLUDED.values())
