"""LangGraph's long-term memory (``BaseStore``) on the ledger: every memory write is a ledger
event, and a table of the store's own holds the items as they are now, for reads and search.

    from ledger_cdc.integrations.langgraph_store import LedgerStore
    with LedgerStore.from_conn_string(dsn) as store:
        store.setup()
        store.put(("user-42", "memories"), "m1", {"text": "likes tea"})
        graph = builder.compile(checkpointer=saver, store=store)

A batch's puts and deletes of one namespace are one ``langgraph.memory`` event of that
namespace's ledger session (``uuid5(STORE_NAMESPACE, json of the namespace)``), appended in the
same transaction as the rows of ``langgraph_store`` they change: the table never holds a write
the ledger lacks, and ``inspect``/``verify``/``replay`` show a namespace's memory like any
session. TTL expiry by the sweeper is a write too (value ``null``, reason ``expired``); a read
that refreshes an item's TTL only moves its ``expires_at`` (bookkeeping, not a memory write).

``setup()`` applies the ledger's migrations and creates the store's tables in the schema that
holds ``agent_events`` (``current_schema()`` at setup), granting them to ``ledger_writer`` and
``ledger_reader`` where those roles exist; every statement names that schema, so no relation
of the caller's search path (a temporary table first of all) stands in for them. Values are
kept as the JSON text they were put as (their keys in order). Filters follow LangGraph's own
rules (``$eq``, ``$ne``, ``$gt``, ``$gte``, ``$lt``, ``$lte``, nested objects, lists), applied to
the namespace's items in ``updated_at`` order. With ``index=`` (LangGraph's ``IndexConfig``),
the fields' embeddings are stored per item and a ``query`` ranks by the configured distance
(cosine, inner product or l2), computed exactly over the namespace's vectors: no pgvector
needed, and no approximate index either.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import json
import logging
import math
import threading
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import psycopg
from langgraph.store.base import (
    NOT_PROVIDED,
    BaseStore,
    GetOp,
    IndexConfig,
    Item,
    ListNamespacesOp,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    TTLConfig,
    ensure_embeddings,
    get_text_at_path,
    tokenize_path,
)
from langgraph.store.base import validate_op_namespace as _validate_op
from langgraph.store.base.batch import AsyncBatchedBaseStore
from psycopg import sql

from ledger_cdc.client.steps import Step, Steps, run, run_async
from ledger_cdc.client.writer import AsyncLedger, Ledger
from ledger_cdc.errors import ConfigError
from ledger_cdc.events import register_event_type

__all__ = [
    "STORE_NAMESPACE",
    "AsyncLedgerStore",
    "LedgerStore",
    "MemoryWrite",
    "MemoryWritten",
    "memory_session",
]

log = logging.getLogger(__name__)
STORE_NAMESPACE = uuid.UUID("9a7c2f4e-1b3d-5e6f-8a9b-6d656d6f7279")
AGENT = "langgraph-store"
_WRITES_PER_EVENT = 500  # a large batch of one namespace is several events (payload limits)


class MemoryWrite(msgspec.Struct, frozen=True, omit_defaults=True):
    """One put (``value`` an object) or delete (``value`` null) of a key."""

    key: str
    value: dict[str, Any] | None
    index: list[str] | bool | None = None  # the fields embedded (False: none; None: defaults)
    ttl_minutes: float | None = None
    reason: str = ""  # "expired" when the TTL sweeper deleted it


class MemoryWritten(msgspec.Struct, frozen=True):
    """The writes of one batch to one namespace, in order."""

    namespace: list[str]
    writes: list[MemoryWrite]


register_event_type("langgraph.memory", MemoryWritten)


def memory_session(namespace: Sequence[str]) -> uuid.UUID:
    """The ledger session of a store namespace."""
    return uuid.uuid5(STORE_NAMESPACE, json.dumps(list(namespace), ensure_ascii=False))


# -- SQL: every relation named with the schema found at setup -------------------------------------

_TABLES = (
    """CREATE TABLE IF NOT EXISTS {schema}.langgraph_store (
    ns          TEXT[]      NOT NULL,
    key         TEXT        NOT NULL,
    value       TEXT        NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at  TIMESTAMPTZ,
    ttl_minutes DOUBLE PRECISION,
    PRIMARY KEY (ns, key))""",
    """CREATE INDEX IF NOT EXISTS langgraph_store_expires_at
    ON {schema}.langgraph_store (expires_at) WHERE expires_at IS NOT NULL""",
    """CREATE TABLE IF NOT EXISTS {schema}.langgraph_store_vectors (
    ns        TEXT[]             NOT NULL,
    key       TEXT               NOT NULL,
    field     TEXT               NOT NULL,
    embedding DOUBLE PRECISION[] NOT NULL,
    PRIMARY KEY (ns, key, field),
    FOREIGN KEY (ns, key) REFERENCES {schema}.langgraph_store (ns, key) ON DELETE CASCADE)""",
)
_GRANTS = (
    ("ledger_writer", "SELECT, INSERT, UPDATE, DELETE"),
    ("ledger_reader", "SELECT"),
)
_LIVE = " AND (expires_at IS NULL OR expires_at > now())"


def _q(text: str, schema: str, live: str = "") -> str:
    """A statement with its relations in ``schema`` (and ``{live}``: the clause that leaves
    out expired items, when the TTL config says so)."""
    return sql.SQL(text).format(schema=sql.Identifier(schema), live=sql.SQL(live)).as_string(None)


@dataclass
class _Config:
    """What the sync and async stores share: the schema, TTL and index configuration."""

    schema: str | None = None
    ttl: TTLConfig | None = None
    index: IndexConfig | None = None
    embeddings: Any = None
    fields: list[tuple[str, str | list[str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.index is not None:
            if not self.index.get("dims"):
                raise ConfigError("index needs 'dims' (the embeddings' dimension)")
            self.embeddings = ensure_embeddings(self.index.get("embed"))
            self.fields = [(f, _tokens(f)) for f in (self.index.get("fields") or ["$"])]
            distance = self.index.get("distance_type", "cosine")
            if distance not in _DISTANCES:
                raise ConfigError(
                    f"distance_type {distance!r} is not one of {', '.join(sorted(_DISTANCES))}"
                )

    def live(self) -> str:
        return _LIVE if (self.ttl or {}).get("omit_expired") else ""

    def texts(self, op: PutOp) -> list[tuple[str, str]]:
        """(field name, text) to embed for a put (none without an index, or ``index=False``)."""
        if self.index is None or op.value is None or op.index is False:
            return []
        paths = self.fields if op.index is None else [(f, tokenize_path(f)) for f in op.index]
        out: list[tuple[str, str]] = []
        for path, tokens in paths:
            found = get_text_at_path(op.value, tokens)
            for i, text in enumerate(found):
                out.append((f"{path}.{i}" if len(found) > 1 else path, text))
        return out


def _tokens(path: str) -> str | list[str]:
    """A field path as LangGraph's ``get_text_at_path`` takes it ("$": the whole value)."""
    return path if path == "$" else tokenize_path(path)


def _schema_steps() -> Steps[str]:
    rows = yield Step("SELECT current_schema()", ())
    if not rows or rows[0][0] is None:
        raise ConfigError("no schema on the search path to hold the store's tables")
    return str(rows[0][0])


def _setup_steps(schema: str) -> Steps[None]:
    for text in _TABLES:
        yield Step(_q(text, schema), ())
    roles = yield Step(
        "SELECT rolname FROM pg_catalog.pg_roles WHERE rolname = ANY(%s)",
        ([r for r, _ in _GRANTS],),
    )
    have = {r for (r,) in roles}
    for role, privileges in _GRANTS:
        if role in have:
            for table in ("langgraph_store", "langgraph_store_vectors"):
                yield Step(
                    sql.SQL("GRANT {} ON {}.{} TO {}")
                    .format(
                        sql.SQL(privileges),
                        sql.Identifier(schema),
                        sql.Identifier(table),
                        sql.Identifier(role),
                    )
                    .as_string(None),
                    (),
                )


# -- reads ----------------------------------------------------------------------------------------


def _when(v: Any) -> dt.datetime:
    return cast(dt.datetime, v)


def _item(row: tuple[Any, ...]) -> Item:
    ns, key, value, created, updated = row[:5]
    return Item(
        value=msgspec.json.decode(value),
        key=key,
        namespace=tuple(ns),
        created_at=_when(created),
        updated_at=_when(updated),
    )


def _get_steps(cfg: _Config, ops: list[GetOp]) -> Steps[list[Item | None]]:
    assert cfg.schema is not None
    out: list[Item | None] = []
    for op in ops:
        text = (
            "SELECT ns, key, value, created_at, updated_at FROM {schema}.langgraph_store "
            "WHERE ns = %s AND key = %s{live}"
        )
        rows = yield Step(_q(text, cfg.schema, cfg.live()), (list(op.namespace), op.key))
        out.append(_item(rows[0]) if rows else None)
        if rows and op.refresh_ttl:
            yield from _refresh_steps(cfg, [(list(op.namespace), op.key)])
    return out


def _refresh_steps(cfg: _Config, keys: list[tuple[list[str], str]]) -> Steps[None]:
    assert cfg.schema is not None
    if not keys:
        return
    text = (
        "UPDATE {schema}.langgraph_store AS s "
        "SET expires_at = now() + s.ttl_minutes * interval '1 minute' "
        "FROM jsonb_array_elements(%s::jsonb) AS k(j) "
        "WHERE s.ns = ARRAY(SELECT jsonb_array_elements_text(k.j -> 0)) "
        "AND s.key = k.j ->> 1 AND s.ttl_minutes IS NOT NULL{live}"
    )
    yield Step(_q(text, cfg.schema, cfg.live()), (json.dumps(keys),))


def _matches(value: Any, filter: dict[str, Any] | None) -> bool:
    from langgraph.store.memory import _compare_values

    if not filter:
        return True
    try:
        return all(_compare_values(value.get(k), v) for k, v in filter.items())
    except (TypeError, ValueError):  # a comparison of kinds that do not compare: no match
        return False


def _similarity(distance: str, q: list[float], v: list[float]) -> float:
    if distance == "inner_product":
        return sum(a * b for a, b in zip(q, v, strict=False))
    if distance == "l2":
        return -math.sqrt(sum((a - b) ** 2 for a, b in zip(q, v, strict=False)))
    dot = sum(a * b for a, b in zip(q, v, strict=False))
    nq = math.sqrt(sum(a * a for a in q))
    nv = math.sqrt(sum(b * b for b in v))
    return dot / (nq * nv) if nq and nv else 0.0


_DISTANCES = {"cosine", "inner_product", "l2"}


def _search_steps(cfg: _Config, op: SearchOp, query: list[float] | None) -> Steps[list[SearchItem]]:
    assert cfg.schema is not None
    prefix = list(op.namespace_prefix)
    text = (
        "SELECT ns, key, value, created_at, updated_at FROM {schema}.langgraph_store "
        "WHERE ns[1:%s] = %s::text[]{live} ORDER BY updated_at DESC, ns, key"
    )
    rows = yield Step(_q(text, cfg.schema, cfg.live()), (len(prefix), prefix))
    candidates = []
    for row in rows:
        value = msgspec.json.decode(row[2])
        if _matches(value, op.filter):
            candidates.append((row, value))
    scores: dict[tuple[tuple[str, ...], str], float] = {}
    if query is not None:
        text = (
            "SELECT ns, key, embedding FROM {schema}.langgraph_store_vectors "
            "WHERE ns[1:%s] = %s::text[]"
        )
        vecs = yield Step(_q(text, cfg.schema, cfg.live()), (len(prefix), prefix))
        distance = str((cfg.index or {}).get("distance_type", "cosine"))
        for ns, key, emb in vecs:
            s = _similarity(distance, query, emb)
            k = (tuple(ns), key)
            if k not in scores or s > scores[k]:
                scores[k] = s
        candidates = [c for c in candidates if (tuple(c[0][0]), c[0][1]) in scores]
        candidates.sort(key=lambda c: -scores[(tuple(c[0][0]), c[0][1])])
    page = candidates[op.offset : op.offset + op.limit]
    out = [
        SearchItem(
            namespace=tuple(row[0]),
            key=row[1],
            value=value,
            created_at=_when(row[3]),
            updated_at=_when(row[4]),
            score=scores.get((tuple(row[0]), row[1])) if query is not None else None,
        )
        for row, value in page
    ]
    if op.refresh_ttl:
        yield from _refresh_steps(cfg, [(list(i.namespace), i.key) for i in out])
    return out


def _list_steps(cfg: _Config, op: ListNamespacesOp) -> Steps[list[tuple[str, ...]]]:
    from langgraph.store.memory import _does_match

    assert cfg.schema is not None
    text = "SELECT DISTINCT ns FROM {schema}.langgraph_store WHERE true{live}"
    rows = yield Step(_q(text, cfg.schema, cfg.live()), ())
    namespaces = [tuple(r[0]) for r in rows]
    if op.match_conditions:
        namespaces = [
            ns for ns in namespaces if all(_does_match(c, ns) for c in op.match_conditions)
        ]
    if op.max_depth is not None:
        namespaces = sorted({ns[: op.max_depth] for ns in namespaces})
    else:
        namespaces = sorted(namespaces)
    return namespaces[op.offset : op.offset + op.limit]


# -- writes ---------------------------------------------------------------------------------------


def _puts(ops: Iterable[tuple[int, PutOp]]) -> dict[tuple[str, ...], dict[str, PutOp]]:
    """The batch's puts by namespace, the last for a key winning (as LangGraph's stores)."""
    out: dict[tuple[str, ...], dict[str, PutOp]] = {}
    for _, op in ops:
        out.setdefault(tuple(op.namespace), {})[op.key] = op
    return out


def _ttl(cfg: _Config, op: PutOp) -> float | None:
    ttl: Any = op.ttl
    if ttl is NOT_PROVIDED:
        return (cfg.ttl or {}).get("default_ttl")
    return None if ttl is None else float(ttl)


def _events(cfg: _Config, ns: tuple[str, ...], ops: list[PutOp]) -> list[MemoryWritten]:
    writes = [
        MemoryWrite(
            op.key,
            None if op.value is None else dict(op.value),
            None if op.index is None else (op.index if op.index is False else list(op.index)),
            _ttl(cfg, op) if op.value is not None else None,
        )
        for op in ops
    ]
    return [
        MemoryWritten(list(ns), writes[i : i + _WRITES_PER_EVENT])
        for i in range(0, len(writes), _WRITES_PER_EVENT)
    ]


def _write_steps(
    cfg: _Config,
    ns: tuple[str, ...],
    ops: list[PutOp],
    vectors: dict[str, list[tuple[str, list[float]]]],
) -> Steps[None]:
    """The rows of one namespace's writes (run in the transaction of their event)."""
    assert cfg.schema is not None
    dead = [op.key for op in ops if op.value is None]
    if dead:
        text = "DELETE FROM {schema}.langgraph_store WHERE ns = %s AND key = ANY(%s)"
        yield Step(_q(text, cfg.schema, cfg.live()), (list(ns), dead))
    live = [op for op in ops if op.value is not None]
    if not live:
        return
    text = (
        "INSERT INTO {schema}.langgraph_store AS s "
        "(ns, key, value, created_at, updated_at, expires_at, ttl_minutes) "
        "SELECT %s, k.key, k.value, now(), now(), "
        "now() + k.ttl * interval '1 minute', k.ttl "
        "FROM unnest(%s::text[], %s::text[], %s::float8[]) AS k(key, value, ttl) "
        "ON CONFLICT (ns, key) DO UPDATE SET value = EXCLUDED.value, "
        "updated_at = now(), expires_at = EXCLUDED.expires_at, "
        "ttl_minutes = EXCLUDED.ttl_minutes"
    )
    yield Step(
        _q(text, cfg.schema, cfg.live()),
        (
            list(ns),
            [op.key for op in live],
            [msgspec.json.encode(op.value).decode() for op in live],
            [_ttl(cfg, op) for op in live],
        ),
    )
    if cfg.index is None:
        return
    text = "DELETE FROM {schema}.langgraph_store_vectors WHERE ns = %s AND key = ANY(%s)"
    yield Step(_q(text, cfg.schema, cfg.live()), (list(ns), [op.key for op in live]))
    text = (
        "INSERT INTO {schema}.langgraph_store_vectors (ns, key, field, embedding) "
        "VALUES (%s, %s, %s, %s::float8[])"
    )
    for op in live:
        for name, vec in vectors.get(op.key, []):
            yield Step(_q(text, cfg.schema, cfg.live()), (list(ns), op.key, name, vec))


def _expired_steps(cfg: _Config) -> Steps[dict[tuple[str, ...], list[str]]]:
    assert cfg.schema is not None
    text = "SELECT ns, key FROM {schema}.langgraph_store WHERE expires_at <= now()"
    rows = yield Step(_q(text, cfg.schema, cfg.live()), ())
    out: dict[tuple[str, ...], list[str]] = {}
    for ns, key in rows:
        out.setdefault(tuple(ns), []).append(key)
    return out


def _swept_steps(cfg: _Config, ns: tuple[str, ...], keys: list[str]) -> Steps[list[str]]:
    """Delete what is still expired (a put since may have given it a new life)."""
    assert cfg.schema is not None
    text = (
        "DELETE FROM {schema}.langgraph_store WHERE ns = %s AND key = ANY(%s) "
        "AND expires_at <= now() RETURNING key"
    )
    rows = yield Step(_q(text, cfg.schema, cfg.live()), (list(ns), keys))
    return [k for (k,) in rows]


def _grouped(ops: Iterable[Op]) -> tuple[dict[type, list[tuple[int, Any]]], int]:
    grouped: dict[type, list[tuple[int, Any]]] = {}
    n = 0
    for i, op in enumerate(ops):
        _validate_op(op)
        grouped.setdefault(type(op), []).append((i, op))
        n = i + 1
    return grouped, n


def _queries(grouped: dict[type, list[tuple[int, Any]]]) -> list[tuple[int, str]]:
    return [(i, op.query) for i, op in grouped.get(SearchOp, []) if op.query]


def _reads(
    cfg: _Config,
    grouped: dict[type, list[tuple[int, Any]]],
    vectors: dict[int, list[float]],
    results: list[Result],
) -> Steps[None]:
    gets = grouped.get(GetOp, [])
    if gets:
        found = yield from _get_steps(cfg, [op for _, op in gets])
        for (i, _), item in zip(gets, found, strict=True):
            results[i] = item
    for i, op in grouped.get(SearchOp, []):
        results[i] = yield from _search_steps(cfg, op, vectors.get(i))
    for i, op in grouped.get(ListNamespacesOp, []):
        results[i] = yield from _list_steps(cfg, op)


def _check_row_factory(conn: Any) -> None:
    from psycopg.rows import tuple_row

    factory = getattr(conn, "row_factory", tuple_row)
    if factory is not tuple_row:
        raise ConfigError(
            "the store reads rows as tuples: give it a connection (or pool) with the default "
            "row factory, not dict_row"
        )


# -- the sync store -------------------------------------------------------------------------------


class LedgerStore(BaseStore):
    """LangGraph's ``BaseStore`` on a :class:`~ledger_cdc.Ledger` (see the module docstring).
    Give it a ledger, a psycopg connection or a ``ConnectionPool``, or a DSN
    (:meth:`from_conn_string`)."""

    supports_ttl = True

    def __init__(
        self,
        conn: Ledger | psycopg.Connection[Any] | Any,
        *,
        index: IndexConfig | None = None,
        ttl: TTLConfig | None = None,
    ) -> None:
        super().__init__()
        if isinstance(conn, Ledger):
            self.ledger = conn
        elif isinstance(conn, psycopg.Connection):
            _check_row_factory(conn)
            self.ledger = Ledger(conn=conn)
        else:  # a ConnectionPool
            _check_row_factory(_PoolKwargs(conn))
            self.ledger = Ledger(pool=conn)
        self.ttl_config = ttl
        self.index_config = index
        self._cfg = _Config(ttl=ttl, index=index)
        self._sweeper: threading.Thread | None = None
        self._stop = threading.Event()

    @classmethod
    @contextmanager
    def from_conn_string(
        cls,
        conn_string: str,
        *,
        pipeline: bool = False,
        pool_config: dict[str, Any] | None = None,
        index: IndexConfig | None = None,
        ttl: TTLConfig | None = None,
    ) -> Iterator[LedgerStore]:
        """As ``PostgresStore.from_conn_string`` (``pipeline`` is accepted and has no effect:
        each write is its event's transaction); closed on the way out."""
        size = int((pool_config or {}).get("max_size", 4))
        ledger = Ledger(conn_string, pool_size=size)
        store = cls(ledger, index=index, ttl=ttl)
        try:
            yield store
        finally:
            store.stop_ttl_sweeper()
            ledger.close()

    def _schema(self, conn: psycopg.Connection[Any]) -> _Config:
        if self._cfg.schema is None:
            self._cfg.schema = run(conn, _schema_steps())
        return self._cfg

    def setup(self) -> None:
        """The ledger's migrations, then the store's tables (idempotent)."""
        from ledger_cdc.admin.schema import migrate

        with self.ledger.connection() as conn:
            migrate(conn)
            cfg = self._schema(conn)
            assert cfg.schema is not None
            with conn.transaction():
                run(conn, _setup_steps(cfg.schema))

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        grouped, n = _grouped(ops)
        results: list[Result] = [None] * n
        queries = _queries(grouped)
        vectors: dict[int, list[float]] = {}
        if queries and self._cfg.embeddings is not None:
            embedded = self._cfg.embeddings.embed_documents([q for _, q in queries])
            vectors = {i: v for (i, _), v in zip(queries, embedded, strict=True)}
        with self.ledger.connection() as conn:
            cfg = self._schema(conn)
            run(conn, _reads(cfg, grouped, vectors, results))
        for ns, by_key in _puts(grouped.get(PutOp, [])).items():
            self._write(ns, list(by_key.values()))
        return results

    def _write(self, ns: tuple[str, ...], ops: list[PutOp], reason: str = "") -> None:
        texts = {op.key: self._cfg.texts(op) for op in ops}
        flat = [(k, f, t) for k, ft in texts.items() for f, t in ft]
        vectors: dict[str, list[tuple[str, list[float]]]] = {}
        if flat:
            embedded = self._cfg.embeddings.embed_documents([t for _, _, t in flat])
            for (k, f, _), v in zip(flat, embedded, strict=True):
                vectors.setdefault(k, []).append((f, v))
        events = _events(self._cfg, ns, ops)
        with self.ledger.transaction() as tx:
            cfg = self._schema(tx.conn)
            for ev in events:
                if reason:
                    ev = MemoryWritten(
                        ev.namespace, [msgspec.structs.replace(w, reason=reason) for w in ev.writes]
                    )
                tx.append(memory_session(ns), AGENT, "langgraph.memory", ev)
            run(tx.conn, _write_steps(cfg, ns, ops, vectors))

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        return await asyncio.get_running_loop().run_in_executor(None, self.batch, list(ops))

    # -- TTL ------------------------------------------------------------------------------------

    def sweep_ttl(self) -> int:
        """Delete the expired items (a ``langgraph.memory`` write each, reason ``expired``);
        returns how many."""
        with self.ledger.connection() as conn:
            cfg = self._schema(conn)
            expired = run(conn, _expired_steps(cfg))
        n = 0
        for ns, keys in expired.items():
            with self.ledger.transaction() as tx:
                gone = run(tx.conn, _swept_steps(self._cfg, ns, keys))
                if gone:
                    writes = [MemoryWrite(k, None, reason="expired") for k in gone]
                    tx.append(
                        memory_session(ns),
                        AGENT,
                        "langgraph.memory",
                        MemoryWritten(list(ns), writes),
                    )
            n += len(gone)
        return n

    def start_ttl_sweeper(
        self, sweep_interval_minutes: float | None = None
    ) -> concurrent.futures.Future[None]:
        """Sweep in a thread of its own every ``sweep_interval_minutes`` (else the TTL
        config's, else 5), until :meth:`stop_ttl_sweeper`."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        if self._sweeper is not None and self._sweeper.is_alive():
            done.set_result(None)
            return done
        interval = 60 * (
            sweep_interval_minutes or (self.ttl_config or {}).get("sweep_interval_minutes") or 5
        )
        self._stop.clear()

        def loop() -> None:
            try:
                while not self._stop.wait(interval):
                    try:
                        self.sweep_ttl()
                    except Exception as e:  # the next sweep tries again
                        log.warning("TTL sweep failed: %s", e)
            finally:
                done.set_result(None)

        self._sweeper = threading.Thread(target=loop, name="ledger-cdc-ttl", daemon=True)
        self._sweeper.start()
        return done

    def stop_ttl_sweeper(self, timeout: float | None = None) -> bool:
        if self._sweeper is None:
            return True
        self._stop.set()
        self._sweeper.join(timeout)
        stopped = not self._sweeper.is_alive()
        if stopped:
            self._sweeper = None
        return stopped


class _PoolKwargs:
    """A pool seen through the connection kwargs it opens connections with."""

    def __init__(self, pool: Any) -> None:
        from psycopg.rows import tuple_row

        self.row_factory = (getattr(pool, "kwargs", None) or {}).get("row_factory", tuple_row)


# -- the async store ------------------------------------------------------------------------------


class AsyncLedgerStore(AsyncBatchedBaseStore):
    """The same store on an :class:`~ledger_cdc.AsyncLedger`, built in async code (the ops of
    concurrent calls are batched, as LangGraph's ``AsyncPostgresStore``); its sync methods
    work from other threads."""

    supports_ttl = True

    def __init__(
        self,
        conn: AsyncLedger | psycopg.AsyncConnection[Any] | Any,
        *,
        index: IndexConfig | None = None,
        ttl: TTLConfig | None = None,
    ) -> None:
        super().__init__()
        if isinstance(conn, AsyncLedger):
            self.ledger = conn
        elif isinstance(conn, psycopg.AsyncConnection):
            _check_row_factory(conn)
            self.ledger = AsyncLedger(conn)
        else:  # an AsyncConnectionPool
            _check_row_factory(_PoolKwargs(conn))
            self.ledger = AsyncLedger(pool=conn)
        self.ttl_config = ttl
        self.index_config = index
        self._cfg = _Config(ttl=ttl, index=index)
        self._sweeper: asyncio.Task[None] | None = None

    @classmethod
    @asynccontextmanager
    async def from_conn_string(
        cls,
        conn_string: str,
        *,
        pipeline: bool = False,
        pool_config: dict[str, Any] | None = None,
        index: IndexConfig | None = None,
        ttl: TTLConfig | None = None,
    ) -> AsyncIterator[AsyncLedgerStore]:
        size = int((pool_config or {}).get("max_size", 4))
        ledger = await AsyncLedger.connect(conn_string, pool_size=size)
        store = cls(ledger, index=index, ttl=ttl)
        try:
            yield store
        finally:
            await store.stop_ttl_sweeper()
            await ledger.close()

    async def _schema(self, conn: psycopg.AsyncConnection[Any]) -> _Config:
        if self._cfg.schema is None:
            self._cfg.schema = await run_async(conn, _schema_steps())
        return self._cfg

    async def setup(self) -> None:
        """The ledger's migrations, then the store's tables (idempotent)."""
        async with self.ledger.connection() as conn:
            await _migrate_async(conn, self.ledger)
            cfg = await self._schema(conn)
            assert cfg.schema is not None
            async with conn.transaction():
                await run_async(conn, _setup_steps(cfg.schema))

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        grouped, n = _grouped(ops)
        results: list[Result] = [None] * n
        queries = _queries(grouped)
        vectors: dict[int, list[float]] = {}
        if queries and self._cfg.embeddings is not None:
            embedded = await self._cfg.embeddings.aembed_documents([q for _, q in queries])
            vectors = {i: v for (i, _), v in zip(queries, embedded, strict=True)}
        if grouped.keys() - {PutOp}:
            async with self.ledger.connection() as conn:
                cfg = await self._schema(conn)
                await run_async(conn, _reads(cfg, grouped, vectors, results))
        for ns, by_key in _puts(grouped.get(PutOp, [])).items():
            await self._write(ns, list(by_key.values()))
        return results

    async def _write(self, ns: tuple[str, ...], ops: list[PutOp]) -> None:
        texts = {op.key: self._cfg.texts(op) for op in ops}
        flat = [(k, f, t) for k, ft in texts.items() for f, t in ft]
        vectors: dict[str, list[tuple[str, list[float]]]] = {}
        if flat:
            embedded = await self._cfg.embeddings.aembed_documents([t for _, _, t in flat])
            for (k, f, _), v in zip(flat, embedded, strict=True):
                vectors.setdefault(k, []).append((f, v))
        events = _events(self._cfg, ns, ops)
        async with self.ledger.transaction() as tx:
            cfg = await self._schema(tx.conn)
            for ev in events:
                await tx.append(memory_session(ns), AGENT, "langgraph.memory", ev)
            await run_async(tx.conn, _write_steps(cfg, ns, ops, vectors))

    async def sweep_ttl(self) -> int:
        """See :meth:`LedgerStore.sweep_ttl`."""
        async with self.ledger.connection() as conn:
            cfg = await self._schema(conn)
            expired = await run_async(conn, _expired_steps(cfg))
        n = 0
        for ns, keys in expired.items():
            async with self.ledger.transaction() as tx:
                gone = await run_async(tx.conn, _swept_steps(self._cfg, ns, keys))
                if gone:
                    writes = [MemoryWrite(k, None, reason="expired") for k in gone]
                    await tx.append(
                        memory_session(ns),
                        AGENT,
                        "langgraph.memory",
                        MemoryWritten(list(ns), writes),
                    )
            n += len(gone)
        return n

    async def start_ttl_sweeper(
        self, sweep_interval_minutes: float | None = None
    ) -> asyncio.Task[None]:
        if self._sweeper is not None and not self._sweeper.done():
            return self._sweeper
        interval = 60 * (
            sweep_interval_minutes or (self.ttl_config or {}).get("sweep_interval_minutes") or 5
        )

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.sweep_ttl()
                except Exception as e:  # the next sweep tries again
                    log.warning("TTL sweep failed: %s", e)

        self._sweeper = asyncio.create_task(loop())
        return self._sweeper

    async def stop_ttl_sweeper(self, timeout: float | None = None) -> bool:
        if self._sweeper is None:
            return True
        self._sweeper.cancel()
        with suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._sweeper), timeout)
        stopped = self._sweeper.done()
        if stopped:
            self._sweeper = None
        return stopped


async def _migrate_async(conn: psycopg.AsyncConnection[Any], ledger: AsyncLedger) -> None:
    """The ledger's migrations from async code: on a sync connection of the same server and
    role (migrate is sync), made from the async one's parameters."""
    from psycopg.conninfo import make_conninfo

    params = conn.info.get_parameters()
    password = conn.info.password
    if password:
        params["password"] = password
    host = conn.info.host
    if host and "host" not in params:
        params["host"] = host
    params.setdefault("port", str(conn.info.port))
    dsn = make_conninfo("", **params)
    await asyncio.to_thread(_migrate_sync, dsn)


def _migrate_sync(dsn: str) -> None:
    from ledger_cdc.admin.schema import migrate
    from ledger_cdc.connect import open_session

    with open_session(dsn, autocommit=True) as conn:
        migrate(conn)
