"""One source for each stored shape (``sink.shape``): the tables, ``ledger_apply_batch``'s records
and the rows both sinks store follow the Python declaration, column by column.

The SQL is read from the migrated database's catalog (``pg_attribute``, ``pg_proc.prosrc``), never
from the migration files: what is compared is what the server runs.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from typing import Any

import msgspec
import psycopg
import pytest
from psycopg import sql

import ledger_cdc.sink.postgres as pg_sink
from ledger_cdc.batching import Batch, SnapshotRow
from ledger_cdc.fold import (
    FORMAT_VERSION,
    PROJECTION_FORMAT,
    REFERENCE_MIN,
    CompletedModel,
    CompletedTool,
    SessionContext,
    encode_memo_entry,
    encode_stored,
    fold,
    memo_key,
)
from ledger_cdc.sink.memory import MemorySink
from ledger_cdc.sink.shape import (
    MEMO,
    SESSIONS,
    SNAPSHOTS,
    TABLES,
    Column,
    Table,
    memo_row,
    session_row,
    snapshot_row,
)
from tests.support.harness import Database
from tests.unit.test_fold import ev

_COLUMNS = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod)
FROM pg_attribute a
WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""


def _catalog(conn: psycopg.Connection[Any], table: str) -> list[tuple[str, str]]:
    return [(str(n), str(t)) for n, t in conn.execute(_COLUMNS, (table,))]


@pytest.mark.server
@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_the_declared_columns_are_the_tables(db: Database, table: Table) -> None:
    """Name and type of every column, in table order; a column the sink does not write is
    named, with the reason, in ``Table.unwritten``."""
    with db.connect() as conn:
        stored = _catalog(conn, table.name)
    assert set(table.unwritten) <= {n for n, _ in stored}, "an unwritten column the table lacks"
    written = [(n, t) for n, t in stored if n not in table.unwritten]
    assert written == [(c.name, c.pgtype) for c in table.columns]


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis that closes the one before ``start``."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise AssertionError(f"unbalanced parentheses after {text[start : start + 60]!r}")


def _split(text: str) -> list[str]:
    """A comma-separated list, commas inside parentheses kept (``numeric(10, 2)``)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*parts, cur.strip()] if cur.strip() else parts


def _no_comments(src: str) -> str:
    return re.sub(r"--[^\n]*", "", src)


_RECORDSET = re.compile(
    r"jsonb_to_recordset\s*\(\s*p_batch\s*->\s*'(\w+)'\s*\)\s+AS\s+\w+\s*\(", re.IGNORECASE
)
_INSERT = re.compile(r"INSERT\s+INTO\s+(\w+)(?:\s+AS\s+\w+)?\s*\(", re.IGNORECASE)


def _records(src: str) -> dict[str, list[tuple[str, str]]]:
    """Each ``jsonb_to_recordset(p_batch -> 'key') AS x(col type, ...)``: key → its columns."""
    out = {}
    for m in _RECORDSET.finditer(src):
        body = src[m.end() : _closing(src, m.end())]
        cols = [part.split(None, 1) for part in _split(body)]
        out[m.group(1)] = [(name.lower(), kind.strip()) for name, kind in cols]
    return out


def _inserts(src: str) -> dict[str, list[str]]:
    """Each ``INSERT INTO table (col, ...)``: table → its columns."""
    return {
        m.group(1): [c.lower() for c in _split(src[m.end() : _closing(src, m.end())])]
        for m in _INSERT.finditer(src)
    }


@pytest.mark.server
def test_ledger_apply_batch_reads_the_declared_columns(db: Database) -> None:
    """The record of each stored shape in ``ledger_apply_batch`` (``jsonb_to_recordset(...) AS
    x(...)``, parsed from ``pg_proc.prosrc``) is the declaration's, name and type (bytes travel
    as text: Column.in_document), and so is the column list of the INSERT it feeds."""
    with db.connect() as conn:
        (src,) = conn.execute(  # type: ignore[misc]
            "SELECT prosrc FROM pg_proc WHERE oid = 'ledger_apply_batch'::regproc"
        ).fetchone()

        def canonical(kind: str) -> str:
            (name,) = conn.execute(  # type: ignore[misc]
                "SELECT format_type(%s::regtype, NULL)", (kind,)
            ).fetchone()
            return str(name)

        src = _no_comments(str(src))
        records = _records(src)
        inserts = _inserts(src)
        assert {t.short for t in TABLES} <= set(records), records.keys()
        for table in TABLES:
            got = [(name, canonical(kind)) for name, kind in records[table.short]]
            assert got == [(c.name, c.in_document) for c in table.columns], table.name
            written = [c for c in inserts[table.name] if c not in table.unwritten]
            assert written == list(table.names), table.name


# -- what both sinks store -------------------------------------------------------------------

SID = uuid.UUID("00000000-0000-0000-0000-000000000001")
OTHER = uuid.UUID("00000000-0000-0000-0000-000000000002")
_LONG = 'é😀"\\\n' * (REFERENCE_MIN // 4)  # stored by reference, and every kind of escape


def _batch() -> Batch:
    """A batch with every column of every shape set, some to NULL: two projections (one with
    a leased run), a tool and a model completion (one entry left in its event, keys long
    enough to be digested), two snapshots."""
    log = [
        ev(1, "run.queued", {}),
        ev(2, "run.leased", {"worker": "w1", "ttl": 30}),
        ev(3, "model.requested", {"request_id": "r" * 600, "model": "m", "prompt_hash": "p"}),
        ev(4, "model.responded", {"request_id": "r" * 600, "model": "m", "content": "short"}),
        ev(5, "tool.invoked", {"call_id": "c1", "tool": "t", "idempotency_key": "k" * 600}),
        ev(6, "tool.observed", {"call_id": "c1", "result": _LONG}),
    ]
    leased = fold(log, session_id=SID)
    plain = SessionContext(OTHER, task="tâche 😀", last_seq=7, last_position=3, event_count=3)
    batch = Batch(end_lsn=0x5000)
    batch.sessions[SID] = (leased, encode_stored(leased), 0x4FF0, b"\x01" * 32)
    batch.sessions[plain.session_id] = (plain, encode_stored(plain), 0x4FF8, None)
    batch.memo.append((SID, 4, leased.completed_models["r" * 600]))
    batch.memo.append((SID, 6, leased.completed_tools["c1"]))
    one, two = encode_stored(leased), encode_stored(plain)  # (two: UTF-8 past ASCII)
    batch.snapshots.append(SnapshotRow(SID, 60, 6, "v1", b"\x02" * 32, one, b"\x03" * 32))
    batch.snapshots.append(SnapshotRow(SID, 40, 4, "v1", b"\x04" * 32, two, None))
    return batch


def test_rows_are_built_field_by_field_from_what_they_name() -> None:
    """The row builders pass their values by position (the hot path's): each lands in the
    field of its name."""
    batch = _batch()
    ctx, data, lsn, head = batch.sessions[SID]
    ctx = msgspec.structs.replace(ctx, event_count=ctx.last_position - 1)  # three numbers apart
    row = session_row(SID, ctx, data, lsn, head)
    run = ctx.run
    assert run is not None and run.lease is not None
    assert row._asdict() == {
        "session_id": SID,
        "status": "running",
        "last_seq": ctx.last_seq,
        "last_position": ctx.last_position,
        "event_count": ctx.event_count,
        "format_version": PROJECTION_FORMAT,
        "context": data,
        "commit_lsn": "0/4FF0",
        "run_status": "running",
        "lease_worker": "w1",
        "lease_until": run.lease.until,
        "last_hash": head,
    }
    _, position, model = batch.memo[0]
    assert isinstance(model, CompletedModel)
    assert memo_row(SID, position, model, True)._asdict() == {
        "session_id": SID,
        "kind": "model",
        "call_id": memo_key(model.request_id),
        "completed_seq": model.responded_seq,
        "completed_position": position,
        "idempotency_key": None,
        "prompt_hash": "p",
        "entry": encode_memo_entry(model),
    }
    _, position, tool = batch.memo[1]
    assert isinstance(tool, CompletedTool) and tool.idempotency_key is not None
    tool_row = memo_row(SID, position, tool, True)
    assert (tool_row.call_id, tool_row.completed_seq, tool_row.completed_position) == (
        "c1",
        tool.observed_seq,
        position,
    )
    assert tool_row.idempotency_key == memo_key(tool.idempotency_key) != tool.idempotency_key
    assert b"result" not in tool_row.entry  # left in its event
    snap = batch.snapshots[0]
    assert snapshot_row(snap)._asdict() == {
        "session_id": snap.session_id,
        "upto_seq": snap.upto_seq,
        "upto_position": snap.upto_position,
        "format_version": FORMAT_VERSION,
        "reducer_version": snap.reducer_version,
        "content_hash": snap.content_hash,
        "data": snap.context,
        "upto_hash": snap.upto_hash,
    }
    assert snap.upto_seq != snap.upto_position


def _comparable(column: Column, value: Any) -> Any:
    """A stored value as both sides can hold it: JSON parsed (jsonb orders its keys)."""
    if value is None:
        return None
    if column.pgtype == "jsonb":
        return json.loads(value) if isinstance(value, (bytes, str)) else value
    if column.pgtype == "bytea":
        return bytes(value)
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.timezone.utc)
    return value


def _by_key(table: Table, rows: Any) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    at = [table.names.index(k) for k in table.key]
    return {tuple(row[i] for i in at): tuple(row) for row in rows}


def _read(conn: psycopg.Connection[Any], table: Table) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    query = sql.SQL("SELECT {} FROM {}").format(
        sql.SQL(", ").join(map(sql.Identifier, table.names)), sql.Identifier(table.name)
    )
    return _by_key(table, conn.execute(query))


@pytest.mark.server
@pytest.mark.parametrize("path", ["one statement", "text COPY", "binary COPY"])
def test_both_sinks_store_the_same_rows(
    db: Database, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One batch committed to the in-memory sink and to PostgreSQL, by each of the PostgreSQL
    sink's paths (ledger_apply_batch's JSON document, the text COPY, the binary COPY): the
    memory store holds rows of the declared shapes, and each column of each row equals what
    the table holds."""
    if path != "one statement":
        monkeypatch.setattr(pg_sink, "_SMALL_ROWS", -1)
    if path == "binary COPY":
        monkeypatch.setattr(pg_sink, "_LARGE", -1)
    memory = MemorySink()
    memory.load_checkpoint()
    memory.commit(_batch())
    sink = pg_sink.PgSink(db.dsn, "shape_slot")
    try:
        sink.load_checkpoint()
        applied: list[Batch] = []
        real_apply = pg_sink.PgSink._apply

        def spy(self: pg_sink.PgSink, batch: Batch) -> None:
            applied.append(batch)
            real_apply(self, batch)

        monkeypatch.setattr(pg_sink.PgSink, "_apply", spy)
        sink.commit(_batch())
        assert bool(applied) == (path == "one statement")
    finally:
        sink.close()
    store = memory.store
    held: list[tuple[Table, list[Any]]] = [
        (SESSIONS, list(store.sessions.values())),
        (MEMO, list(store.memo.values())),
        (SNAPSHOTS, list(store.snapshots.values())),
    ]
    with db.connect() as conn:
        for table, rows in held:
            assert rows and all(row._fields == table.names for row in rows), table.name
            mine, theirs = _by_key(table, rows), _read(conn, table)
            assert mine.keys() == theirs.keys(), table.name
            for key, row in mine.items():
                for column, a, b in zip(table.columns, row, theirs[key], strict=True):
                    assert _comparable(column, a) == _comparable(column, b), (
                        f"{table.name}.{column.name} by {path}"
                    )
    # the memo row whose entry left its result in the event reads back whole
    (tool,) = [r for r in store.memo.values() if r.kind == "tool"]
    assert store.memo_entry(tool).result == _LONG
