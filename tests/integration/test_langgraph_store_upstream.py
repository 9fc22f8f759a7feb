"""LangGraph's own store tests (langgraph-checkpoint-postgres's ``test_store.py``, as its sdist
ships it for the installed version) run against ``LedgerStore``: their bodies unchanged, their
fixtures (``store``, ``vector_store``) and the helpers that build a store or reach into the
reference's table swapped for the ledger's (see ``tests/support/upstream.py``).

Excluded, with the reason:
- ``test_escape_like_literal``, ``test_namespace_match_pattern``: unit tests of private helpers
  of the reference (``langgraph.store.postgres.base``), not of a store's behaviour;
- ``test_nonnull_migrations``: reads the reference's ``PostgresStore.MIGRATIONS`` list;
- ``test_omit_expired_search_pagination``: its body rewrites ``updated_at`` in the reference's
  ``store`` table through its private ``_cursor()``.
Vector tests run without pgvector: the ledger's store ranks by exact distance in Python, so
every server here runs them (``halfvec`` is stored at full precision).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("langgraph.store.postgres")

from ledger_cdc.client.writer import Ledger
from ledger_cdc.integrations.langgraph_store import LedgerStore
from tests.support import upstream
from tests.support.harness import Database, Server, _new_database

# LangGraph's own tests exercise the store and saver, not the server: run once, on the newest
pytestmark = [pytest.mark.server, pytest.mark.one_server]

_TESTS = upstream.sdist_tests("langgraph-checkpoint-postgres")
_UP = upstream.load(
    _TESTS, "test_store", {"DEFAULT_URI": "unused", "VECTOR_TYPES": ["vector", "halfvec"]}
)
EXCLUDED = {
    "test_escape_like_literal": "a private helper of the reference",
    "test_namespace_match_pattern": "a private helper of the reference",
    "test_nonnull_migrations": "the reference's MIGRATIONS list",
    "test_omit_expired_search_pagination": "rewrites the reference's table via _cursor()",
}
RUN = upstream.collect(_UP, globals(), EXCLUDED)
_server: list[Server] = []


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
def store(request: Any) -> Iterator[LedgerStore]:
    ttl = {
        "default_ttl": _UP.TTL_MINUTES,
        "refresh_on_read": True,
        "sweep_interval_minutes": _UP.TTL_MINUTES / 2,
    }
    with _database() as db:
        with LedgerStore.from_conn_string(db.dsn, ttl=ttl) as s:
            s.setup()
            s.setup()  # idempotent
        if request.param == "pool":  # one made from a ConnectionPool
            from psycopg_pool import ConnectionPool

            with ConnectionPool(db.dsn, max_size=10, kwargs={"autocommit": True}) as pool:
                s = LedgerStore(pool, ttl=ttl)
                s.start_ttl_sweeper()
                yield s
                s.stop_ttl_sweeper()
        else:
            with LedgerStore.from_conn_string(
                db.dsn, pipeline=request.param == "pipe", ttl=ttl
            ) as s:
                s.start_ttl_sweeper()
                yield s
                s.stop_ttl_sweeper()


@pytest.fixture
def fake_embeddings() -> Any:
    return _UP.CharacterEmbeddings(dims=500)


@contextmanager
def _create_vector_store(
    vector_type: str,
    distance_type: str,
    fake_embeddings: Any,
    text_fields: list[str] | None = None,
    enable_ttl: bool = True,
) -> Iterator[LedgerStore]:
    index = {
        "dims": fake_embeddings.dims,
        "embed": fake_embeddings,
        "ann_index_config": {"vector_type": vector_type},
        "distance_type": distance_type,
        "fields": text_fields,
    }
    ttl = {"default_ttl": 2, "refresh_on_read": True} if enable_ttl else None
    with _database() as db, LedgerStore.from_conn_string(db.dsn, index=index, ttl=ttl) as s:
        s.setup()
        s.setup()
        yield s


@pytest.fixture(params=_UP._vector_params, ids=lambda p: f"{p[0]}_{p[1]}")
def vector_store(request: Any, fake_embeddings: Any) -> Iterator[LedgerStore]:
    vector_type, distance_type, enable_ttl = request.param
    with _create_vector_store(
        vector_type, distance_type, fake_embeddings, enable_ttl=enable_ttl
    ) as s:
        yield s


def _row(store: LedgerStore, ns: tuple[str, ...], key: str, what: str) -> Any:
    with store.ledger.connection() as conn:
        return conn.execute(
            f"SELECT {what} FROM langgraph_store WHERE ns = %s AND key = %s",
            (list(ns), key),
        ).fetchall()


def _expire_now(store: LedgerStore, ns: tuple[str, ...], key: str) -> None:
    with store.ledger.connection() as conn:
        conn.execute(
            "UPDATE langgraph_store SET expires_at = now() - interval '1 minute' "
            "WHERE ns = %s AND key = %s",
            (list(ns), key),
        )


def _row_exists(store: LedgerStore, ns: tuple[str, ...], key: str) -> bool:
    return len(_row(store, ns, key, "1")) == 1


def _stored_expires_at(store: LedgerStore, ns: tuple[str, ...], key: str) -> dt.datetime:
    return _row(store, ns, key, "expires_at")[0][0]  # type: ignore[no-any-return]


upstream.replace(
    _UP,
    _create_vector_store=_create_vector_store,
    _expire_now=_expire_now,
    _row_exists=_row_exists,
    _stored_expires_at=_stored_expires_at,
)


def test_every_upstream_test_is_run_or_excluded_with_a_reason() -> None:
    assert len(RUN) >= 25, RUN
    assert all(EXCLUDED.values())
    _ = Ledger  # (the store's writer)
