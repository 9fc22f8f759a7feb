"""LangGraph's own async store tests (langgraph-checkpoint-postgres's ``test_async_store.py``,
from the sdist of the installed version) run against ``AsyncLedgerStore``: bodies unchanged,
fixtures and store-building helpers swapped (see ``tests/support/upstream.py``); the async
tests run under anyio's pytest plugin (fixture and test in one event loop).

Excluded, with the reason:
- ``test_abatch_uses_single_pool_checkout``: monkeypatches the reference's private
  ``_ainternal.get_connection`` to count its pool checkouts;
- ``test_omit_expired_search_pagination``: its body rewrites ``updated_at`` in the reference's
  ``store`` table through its private ``_cursor()``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest

pytest.importorskip("langgraph.store.postgres")

from ledger_cdc.integrations.langgraph_store import AsyncLedgerStore
from tests.support import upstream
from tests.support.harness import Database, Server, _new_database

# LangGraph's own tests exercise the store and saver, not the server: run once, on the newest
pytestmark = [pytest.mark.server, pytest.mark.one_server]

_TESTS = upstream.sdist_tests("langgraph-checkpoint-postgres")
_UP = upstream.load(
    _TESTS, "test_async_store", {"DEFAULT_URI": "unused", "VECTOR_TYPES": ["vector", "halfvec"]}
)
EXCLUDED = {
    "test_abatch_uses_single_pool_checkout": "patches the reference's _ainternal",
    "test_omit_expired_search_pagination": "rewrites the reference's table via _cursor()",
}
RUN = upstream.collect(_UP, globals(), EXCLUDED, mark=pytest.mark.anyio)
_server: list[Server] = []


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _on(server: Server) -> Iterator[None]:
    _server[:] = [server]
    yield


@contextmanager
def _database() -> Iterator[Database]:
    gen = _new_database(_server[0], None)  # empty: setup() brings the schema
    db = next(gen)
    try:
        yield db
    finally:
        gen.close()


@pytest.fixture(params=["default", "pipe", "pool"])
async def store(request: Any) -> AsyncIterator[AsyncLedgerStore]:
    ttl = {
        "default_ttl": _UP.TTL_MINUTES,
        "refresh_on_read": True,
        "sweep_interval_minutes": _UP.TTL_MINUTES / 2,
    }
    with _database() as db:
        async with AsyncLedgerStore.from_conn_string(db.dsn, ttl=ttl) as s:
            await s.setup()
            await s.setup()  # idempotent
        if request.param == "pool":  # one made from an AsyncConnectionPool
            from psycopg_pool import AsyncConnectionPool

            async with AsyncConnectionPool(
                db.dsn, max_size=10, kwargs={"autocommit": True}, open=False
            ) as pool:
                s = AsyncLedgerStore(pool, ttl=ttl)
                await s.start_ttl_sweeper()
                yield s
                await s.stop_ttl_sweeper()
        else:
            async with AsyncLedgerStore.from_conn_string(
                db.dsn, pipeline=request.param == "pipe", ttl=ttl
            ) as s:
                await s.start_ttl_sweeper()
                yield s
                await s.stop_ttl_sweeper()


@pytest.fixture
def fake_embeddings() -> Any:
    return _UP.CharacterEmbeddings(dims=500)


@asynccontextmanager
async def _create_vector_store(
    vector_type: str,
    distance_type: str,
    fake_embeddings: Any,
    text_fields: list[str] | None = None,
) -> AsyncIterator[AsyncLedgerStore]:
    index = {
        "dims": fake_embeddings.dims,
        "embed": fake_embeddings,
        "ann_index_config": {"vector_type": vector_type},
        "distance_type": distance_type,
        "fields": text_fields,
    }
    with _database() as db:
        async with AsyncLedgerStore.from_conn_string(db.dsn, index=index) as s:
            await s.setup()
            yield s


@pytest.fixture(
    params=[(v, d) for v in ("vector", "halfvec") for d in ("l2", "inner_product", "cosine")],
    ids=lambda p: f"{p[0]}_{p[1]}",
)
async def vector_store(request: Any, fake_embeddings: Any) -> AsyncIterator[AsyncLedgerStore]:
    vector_type, distance_type = request.param
    async with _create_vector_store(vector_type, distance_type, fake_embeddings) as s:
        yield s


async def _rows(store: AsyncLedgerStore, ns: tuple[str, ...], key: str, what: str) -> Any:
    async with store.ledger.connection() as conn:
        cur = await conn.execute(
            f"SELECT {what} FROM langgraph_store WHERE ns = %s AND key = %s", (list(ns), key)
        )
        return await cur.fetchall()


async def _aexpire_now(store: AsyncLedgerStore, ns: tuple[str, ...], key: str) -> None:
    async with store.ledger.connection() as conn:
        await conn.execute(
            "UPDATE langgraph_store SET expires_at = now() - interval '1 minute' "
            "WHERE ns = %s AND key = %s",
            (list(ns), key),
        )


async def _arow_exists(store: AsyncLedgerStore, ns: tuple[str, ...], key: str) -> bool:
    return len(await _rows(store, ns, key, "1")) == 1


async def _astored_expires_at(
    store: AsyncLedgerStore, ns: tuple[str, ...], key: str
) -> dt.datetime:
    return (await _rows(store, ns, key, "expires_at"))[0][0]  # type: ignore[no-any-return]


upstream.replace(
    _UP,
    _create_vector_store=_create_vector_store,
    _aexpire_now=_aexpire_now,
    _arow_exists=_arow_exists,
    _astored_expires_at=_astored_expires_at,
)


def test_every_upstream_test_is_run_or_excluded_with_a_reason() -> None:
    assert len(RUN) >= 20, RUN
    assert all(EXCLUDED.values())
