"""Hostile input on a real server: nothing a writer or any database role sends stops the consumer
or breaks recovery.

One run per server version (a module fixture, so the suite pays for it once) puts every class
of hostile input into the ledger while a real ``ledger-cdc consume`` process streams it, each
class in sessions of its own; the consumer must keep streaming past all of it, a restarted
consumer must start, and a consumer bootstrapping a new slot over the hostile history must
finish. The tests then check each class: what was quarantined (dead letters with seq, LSN and
reason), what was folded, and that every reader — rebuild_context, verify, replay, inspect,
diff — works on those sessions and agrees with the consumer.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from ledger_cdc.admin.schema import create_slot, drop_slot
from ledger_cdc.admin.verify import verify
from ledger_cdc.client.recovery import memoised_model, memoised_tool, rebuild_context
from ledger_cdc.client.writer import AsyncLedger, Ledger, OutboxItem
from ledger_cdc.connect import connect
from ledger_cdc.errors import DatabaseUnavailable, InvalidEventError
from ledger_cdc.events import MAX_TIME, MIN_TIME, READ_MAX_DEPTH, Limits
from ledger_cdc.fold import SessionContext, memo_key
from ledger_cdc.stream.transport import ReplicationStream
from tests.support.cdc import (
    ConsumerProcess,
    InThread,
    assert_clean_exit,
    assert_projections_equal_refold,
    run_cli,
    stored_projections,
    until,
    wait_caught_up,
    wait_streaming,
)
from tests.support.cli import start_cli
from tests.support.harness import Database, Server, _new_database

# one worker runs the module: its consumer and hostile inputs are a module-scoped fixture
pytestmark = [pytest.mark.server, pytest.mark.xdist_group("hostile")]


def _noise(n: int) -> str:
    """n characters no compression shortens."""
    return secrets.token_urlsafe(n)[:n]


def _deep(depth: int) -> str:
    opening = "".join('{"k": ' if i % 2 == 0 else "[" for i in range(depth))
    closing = "".join("}" if i % 2 == 0 else "]" for i in reversed(range(depth)))
    return opening + "1" + closing


@dataclass
class Run:
    """What the module fixture did: sessions per class, the consumer's log."""

    db: Database
    sessions: dict[str, list[uuid.UUID]] = field(default_factory=dict)
    control: uuid.UUID = field(default_factory=uuid.uuid4)
    log: Path | None = None
    restarts: int = 0
    keys: tuple[str, ...] = ()

    def new(self, cls: str) -> uuid.UUID:
        sid = uuid.uuid4()
        self.sessions.setdefault(cls, []).append(sid)
        return sid


def _raw(conn: psycopg.Connection[Any], sid: uuid.UUID, etype: str, payload: str) -> None:
    """An INSERT by the table owner, past the writer's validation (what SQL writers can do)."""
    conn.execute(
        "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
        "VALUES (%s, 'raw', %s, %s::jsonb)",
        (sid, etype, payload),
    )


def _good(ledger: Ledger, sid: uuid.UUID, n: int) -> None:
    ledger.append(sid, "good", "tool.invoked", {"call_id": f"g{n}", "tool": "t"})


# -- the classes of hostile input ---------------------------------------------------------------


def _messages(run: Run, owner: psycopg.Connection[Any], mallory: str) -> None:
    """Logical messages from a role with no privilege at all: our heartbeat's prefix with any
    content, transactional or not, other prefixes, non-UTF-8 bytes, deep and large content."""
    contents = [
        b'{"slot":"agent_slot","ts":"x"}',
        b"[]",
        b"null",
        b'{"slot":"agent_slot","nonce":"guess","ts":1e400}',
        b'{"slot":"agent_slot","nonce":"guess","ts":12}',
        b"\xff\xfe\x00\x01",
        b"[" * 100_000 + b"]" * 100_000,
        b"x" * 1_000_000,
    ]
    with psycopg.connect(run.db.dsn_as(mallory), autocommit=True) as conn:
        for content in contents:
            for transactional in (False, True):
                for prefix in ("ledger-cdc.heartbeat", "other", ""):
                    conn.execute(
                        "SELECT pg_logical_emit_message(%s, %s, %s::bytea)",
                        (transactional, prefix, content),
                    )
        # and inside a transaction that also writes nothing of ours
        with conn.transaction():
            conn.execute(
                "SELECT pg_logical_emit_message(true, 'ledger-cdc.heartbeat', '{}'::bytea)"
            )


def _depth(run: Run, owner: psycopg.Connection[Any], mallory: str) -> None:
    sid = run.new("depth")
    _raw(owner, sid, "tool.invoked", '{"call_id": "c1", "tool": "t"}')
    _raw(owner, sid, "tool.observed", '{"call_id": "c1", "result": ' + _deep(1000) + "}")
    # at the readers' limit exactly: folded; one deeper: quarantined
    _raw(owner, sid, "app.custom", '{"v": ' + _deep(READ_MAX_DEPTH - 1) + "}")
    _raw(owner, sid, "app.custom", '{"v": ' + _deep(READ_MAX_DEPTH) + "}")
    _raw(owner, sid, "context.loaded", '{"messages": [], "zz": ' + _deep(5000) + "}")


def _numbers(run: Run, owner: psycopg.Connection[Any], mallory: str) -> None:
    sid = run.new("numbers")
    _raw(owner, sid, "run.queued", "{}")
    _raw(owner, sid, "run.leased", '{"worker": "w", "ttl": 1e12}')
    _raw(owner, sid, "run.leased", '{"worker": "w", "ttl": 1e308}')
    _raw(owner, sid, "run.leased", '{"worker": "w", "ttl": -1e308}')
    _raw(owner, sid, "run.leased", '{"worker": "w", "ttl": 1e400}')  # no float holds it
    _raw(
        owner,
        sid,
        "model.responded",
        '{"request_id": "r", "model": "m", "usage": {"input_tokens": 1e400, '
        '"output_tokens": 18446744073709551616}}',
    )
    _raw(owner, sid, "tool.invoked", '{"call_id": "n", "tool": "t", "arguments": {"x": -1e400}}')
    _raw(owner, sid, "run.leased", '{"worker": "w", "ttl": 1e12}')


def _times(run: Run, owner: psycopg.Connection[Any], mallory: str) -> None:
    """created_at values PostgreSQL accepts and Python cannot hold (placed by the owner in
    import mode, the one path that may set it)."""
    owner.execute("SET ledger.import_times = on")
    try:
        for when in (
            "20000-01-01 00:00:00+00",
            "infinity",
            "-infinity",
            "4713-01-01 00:00:00+00 BC",
            "9999-12-31 23:00:00+00",
            "0001-01-01 00:00:00+00",
        ):
            sid = run.new("times")
            owner.execute(
                "INSERT INTO agent_events (session_id, agent_id, event_type, payload, created_at) "
                "VALUES (%s, 'old', 'run.queued', '{}', %s::timestamptz)",
                (sid, when),
            )
            owner.execute(
                "INSERT INTO agent_events (session_id, agent_id, event_type, payload, created_at) "
                "VALUES (%s, 'old', 'run.leased', '{\"worker\": \"w\", \"ttl\": 30}', %s)",
                (sid, when),
            )
    finally:
        owner.execute("RESET ledger.import_times")


def _shapes(run: Run, owner: psycopg.Connection[Any], mallory: str) -> None:
    sid = run.new("shapes")
    _raw(owner, sid, "tool.observed", '{"call_id": 42}')
    _raw(owner, sid, "task.completed", "[]")
    _raw(owner, sid, "task.failed", "null")
    _raw(owner, sid, "context.loaded", '"a string"')
    _raw(owner, sid, "app.unknown", "[1, 2, 3]")
    # fields no type declares, written by a newer writer: tolerated, the rest folded
    _raw(owner, sid, "tool.invoked", '{"call_id": "u", "tool": "t", "args": {}, "v2": true}')


def _huge(run: Run, owner: psycopg.Connection[Any], mallory: str) -> None:
    sid = run.new("huge")
    _raw(owner, sid, "tool.invoked", '{"call_id": "h", "tool": "t"}')
    _raw(owner, sid, "tool.observed", json.dumps({"call_id": "h", "result": "x" * 5_000_000}))


def _relations(run: Run, owner: psycopg.Connection[Any], mallory: str) -> None:
    """Another table in the publication, changed in the same transactions as ledger rows."""
    sid = run.new("relations")
    owner.execute("CREATE TABLE IF NOT EXISTS other (id int PRIMARY KEY, v text)")
    owner.execute("ALTER PUBLICATION agent_pub ADD TABLE other")
    with owner.transaction():
        owner.execute("INSERT INTO other VALUES (1, 'a'), (2, 'b')")
        _raw(owner, sid, "tool.invoked", '{"call_id": "o", "tool": "t"}')
        owner.execute("UPDATE other SET v = 'c' WHERE id = 1")
        owner.execute("DELETE FROM other WHERE id = 2")
        owner.execute("TRUNCATE other")


def _namesakes(run: Run, owner: psycopg.Connection[Any], mallory: str) -> None:
    """Another schema's tables named like the ledger in the publication (as one of all tables
    would hold them), one without the ledger's columns and one with them, written in the same
    transaction as a ledger row: neither is folded, neither stops the consumer."""
    sid = run.new("namesakes")
    owner.execute("CREATE SCHEMA IF NOT EXISTS archive")
    owner.execute("CREATE SCHEMA IF NOT EXISTS audit")
    owner.execute("CREATE TABLE audit.agent_events (id int PRIMARY KEY, note text)")
    owner.execute("CREATE TABLE archive.agent_events (LIKE public.agent_events)")
    owner.execute("ALTER PUBLICATION agent_pub ADD TABLE audit.agent_events, archive.agent_events")
    with owner.transaction():
        owner.execute("INSERT INTO audit.agent_events VALUES (1, 'x')")
        owner.execute("INSERT INTO archive.agent_events SELECT * FROM public.agent_events LIMIT 3")
        _raw(owner, sid, "tool.invoked", '{"call_id": "n", "tool": "t"}')
        owner.execute("INSERT INTO audit.agent_events VALUES (2, 'y')")
    owner.execute("ALTER PUBLICATION agent_pub DROP TABLE audit.agent_events, archive.agent_events")


def _nulls(run: Run, owner: psycopg.Connection[Any], mallory: str) -> None:
    """Columns the ledger declares NOT NULL, made nullable by hand: rows holding NULL are
    quarantined by the stream and by every table reader alike."""
    sid = run.new("nulls")
    owner.execute(
        "ALTER TABLE agent_events ALTER COLUMN payload DROP NOT NULL, "
        "ALTER COLUMN agent_id DROP NOT NULL, ALTER COLUMN hash DROP NOT NULL"
    )
    _raw(owner, sid, "tool.invoked", '{"call_id": "a", "tool": "t"}')
    owner.execute(
        "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
        "VALUES (%s, 'raw', 'tool.observed', NULL), (%s, NULL, 'tool.observed', %s)",
        (sid, sid, '{"call_id": "a", "result": 1}'),
    )
    _raw(owner, sid, "tool.invoked", '{"call_id": "b", "tool": "t"}')


def _keys(run: Run, owner: psycopg.Connection[Any], mallory: str) -> None:
    """Call ids, idempotency keys and prompt hashes far longer than a btree entry may be
    (random, so no compression saves them): the calls are memoised all the same."""
    sid = run.new("keys")
    call, key, request, prompt = (_noise(9000) for _ in range(4))
    run.keys = (call, key, request, prompt)
    _raw(
        owner,
        sid,
        "tool.invoked",
        json.dumps({"call_id": call, "tool": "t", "idempotency_key": key}),
    )
    _raw(owner, sid, "tool.observed", json.dumps({"call_id": call, "result": 1}))
    _raw(
        owner,
        sid,
        "model.requested",
        json.dumps(
            {"request_id": request, "model": "m", "prompt_hash": prompt, "idempotency_key": key}
        ),
    )
    _raw(owner, sid, "model.responded", json.dumps({"request_id": request, "model": "m"}))
    # a short key that looks like the stored form of a long one is a key of its own
    _raw(owner, sid, "tool.invoked", json.dumps({"call_id": memo_key(call), "tool": "t"}))
    _raw(owner, sid, "tool.observed", json.dumps({"call_id": memo_key(call), "result": 2}))


CLASSES: list[Callable[[Run, psycopg.Connection[Any], str], None]] = [
    _messages,
    _depth,
    _numbers,
    _times,
    _shapes,
    _huge,
    _relations,
    _namesakes,
    _keys,
    _nulls,
]


@pytest.fixture(scope="module")
def run(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    for db in _new_database(server, server.template):
        mallory = f"mallory_{db.name}"
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(mallory)))
        log = tmp_path_factory.mktemp("hostile") / "consume.log"
        r = Run(db, log=log)
        args = ("--create-slot", "--heartbeat-interval", "0.2", "--snapshot-every", "2")
        try:
            with Ledger(db.dsn) as ledger, db.connect() as owner:
                consumer = ConsumerProcess(db.dsn, *args, log=log).start()
                try:
                    wait_streaming(db.dsn)
                    _good(ledger, r.control, 1)
                    wait_caught_up(db.dsn)
                    for inject in CLASSES:
                        inject(r, owner, mallory)
                        _good(ledger, r.control, len(r.sessions) + 100)
                    wait_caught_up(db.dsn, timeout=120)
                    assert consumer.alive(), log.read_text()[-3000:]
                    # a restarted consumer starts, past every hostile message
                    assert consumer.terminate() == 0, log.read_text()[-3000:]
                    consumer = ConsumerProcess(db.dsn, *args, log=log).start()
                    r.restarts += 1
                    _good(ledger, r.control, 1000)
                    wait_caught_up(db.dsn)
                    assert consumer.alive(), log.read_text()[-3000:]
                    assert consumer.terminate() == 0
                    # a consumer bootstrapping a new slot over the whole hostile history finishes
                    drop_slot(owner, "agent_slot", force=True)
                    owner.execute(
                        "TRUNCATE agent_sessions, agent_snapshots, agent_memo, ledger_checkpoints, "
                        "ledger_dead_letters"
                    )
                    consumer = ConsumerProcess(db.dsn, *args, log=log).start()
                    wait_caught_up(db.dsn, timeout=120)
                    _good(ledger, r.control, 2000)
                    wait_caught_up(db.dsn)
                    assert consumer.alive(), log.read_text()[-3000:]
                    # and its own heartbeats come back through the slot, forged ones or not
                    until(
                        lambda: (
                            owner.execute(
                                "SELECT heartbeat_at IS NOT NULL FROM ledger_checkpoints"
                            ).fetchone()
                            == (True,)
                        ),
                        timeout=60,
                    )
                finally:
                    if consumer.alive():
                        consumer.terminate()
            with db.connect() as conn:  # slot names are cluster-wide
                drop_slot(conn, "agent_slot", force=True)
            yield r
        finally:
            with psycopg.connect(server.dsn(), autocommit=True) as admin:
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(mallory)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(mallory)))


def _dead(run: Run, cls: str) -> list[tuple[Any, ...]]:
    with run.db.connect() as conn:
        return conn.execute(
            "SELECT seq, session_id, lsn, kind, reason FROM ledger_dead_letters "
            "WHERE session_id = ANY(%s) ORDER BY seq",
            (run.sessions.get(cls, []),),
        ).fetchall()


def _readers_agree(run: Run, cls: str) -> dict[uuid.UUID, SessionContext]:
    """Every reader works on the class's sessions and reaches the consumer's context."""
    sids = run.sessions[cls]
    with run.db.connect() as conn:
        stored = {s: c for s, c in stored_projections(conn).items() if s in sids}
        for sid in sids:
            assert rebuild_context(conn, sid, memo=True) == stored[sid]
    report = verify(run.db.dsn, sids)
    assert report.ok, report.differences[:3]
    for sid in sids:
        for args in (["replay", str(sid)], ["inspect", str(sid)], ["replay", str(sid), "--json"]):
            assert_clean_exit(run_cli(*args, "--dsn", run.db.dsn))
        assert_clean_exit(run_cli("diff", str(sid), str(run.control), "--dsn", run.db.dsn), 0, 1)
    return stored


def test_the_consumer_survived_everything(run: Run) -> None:
    """Streaming went on, a restart and a bootstrap over the hostile history completed, and the
    projections and snapshots of every session equal a refold from zero."""
    assert run.restarts == 1
    assert_projections_equal_refold(run.db.dsn)
    assert_clean_exit(run_cli("verify", "--all", "--dsn", run.db.dsn))
    text = run.log.read_text() if run.log else ""
    assert "Traceback" not in text


def test_messages_from_any_role_are_ignored(run: Run) -> None:
    with run.db.connect() as conn:
        (ctx,) = [c for s, c in stored_projections(conn).items() if s == run.control]
        lag = conn.execute(
            "SELECT heartbeat_at FROM ledger_checkpoints WHERE slot_name = 'agent_slot'"
        ).fetchone()
    # every good event folded: one before the classes, one after each, two after restarts
    assert ctx.event_count == len(ctx.pending_tools) == len(CLASSES) + 3
    # our own heartbeats still come through (forged ones did not stop or fool the consumer)
    assert lag is not None and lag[0] is not None


def test_deep_payloads_are_quarantined_by_a_fixed_rule(run: Run) -> None:
    dead = _dead(run, "depth")
    assert len(dead) == 3, dead
    assert all(d[3] == "quarantined" and "deeper than" in d[4] for d in dead)
    assert all(d[0] is not None and d[2] is not None for d in dead)  # seq and LSN
    (ctx,) = _readers_agree(run, "depth").values()
    assert ctx.event_count == 2 and ctx.quarantined == 3 and ctx.last_position == 5
    assert "c1" in ctx.pending_tools  # its result was quarantined: the call is still in flight


def test_numbers_at_the_limits_saturate_or_are_quarantined(run: Run) -> None:
    dead = _dead(run, "numbers")
    assert [d[4] for d in dead if "ttl" in d[4]] and len(dead) == 1, dead
    (ctx,) = _readers_agree(run, "numbers").values()
    assert ctx.run is not None and ctx.run.lease is not None
    assert ctx.run.lease.until == MAX_TIME  # 1e12 s from now: saturated, not a crash
    assert ctx.usage.output_tokens == 2**64 and ctx.usage.input_tokens == 10**400


def test_times_out_of_range_are_quarantined_everywhere(run: Run) -> None:
    dead = _dead(run, "times")
    assert len(dead) == 2 * 6 - 0, dead  # every row of these sessions: none readable
    assert all("created_at" in d[4] for d in dead)
    ctxs = _readers_agree(run, "times")
    for ctx in ctxs.values():
        assert ctx.quarantined == 2 and ctx.run is None
    assert MIN_TIME < MAX_TIME


def test_payloads_of_the_wrong_shape_are_quarantined_and_unknown_fields_tolerated(
    run: Run,
) -> None:
    dead = _dead(run, "shapes")
    assert len(dead) == 4, dead  # the unknown type's array and the extra fields are folded
    (ctx,) = _readers_agree(run, "shapes").values()
    assert "u" in ctx.pending_tools and ctx.ignored_events == 1


def test_a_huge_payload_is_folded(run: Run) -> None:
    assert _dead(run, "huge") == []
    (ctx,) = _readers_agree(run, "huge").values()
    assert len(ctx.completed_tools["h"].result) == 5_000_000


def test_other_relations_in_the_publication_are_not_ours(run: Run) -> None:
    assert _dead(run, "relations") == []
    (ctx,) = _readers_agree(run, "relations").values()
    assert ctx.event_count == 1


def test_another_schemas_namesake_of_the_ledger_is_not_ours(run: Run) -> None:
    assert _dead(run, "namesakes") == []
    (ctx,) = _readers_agree(run, "namesakes").values()
    assert ctx.event_count == 1 and "n" in ctx.pending_tools
    with run.db.connect() as conn:  # the rows copied to archive.agent_events: folded once
        assert_projections_equal_refold(run.db.dsn)
        (n,) = conn.execute("SELECT count(*) FROM archive.agent_events").fetchone()  # type: ignore[misc]
    assert n == 3


def test_rows_with_null_columns_are_quarantined_by_every_reader(run: Run) -> None:
    dead = _dead(run, "nulls")
    reasons = [d[4] for d in dead]
    assert len(dead) == 2 and "payload" in reasons[0] and "agent_id NULL" in reasons[1], dead
    (ctx,) = _readers_agree(run, "nulls").values()
    assert ctx.quarantined == 2 and set(ctx.pending_tools) == {"a", "b"}


def test_calls_with_keys_longer_than_an_index_entry_are_memoised(run: Run) -> None:
    """agent_memo stores such keys digested (fold.memo_key); every lookup finds the call, and a
    short key spelled like a digest is a call of its own."""
    assert _dead(run, "keys") == []
    (ctx,) = _readers_agree(run, "keys").values()
    call, key, request, prompt = run.keys
    with run.db.connect() as conn:
        rebuilt = rebuild_context(conn, ctx.session_id)
        assert rebuilt.memo_position > 0  # snapshots took the calls: lookups go to agent_memo
        for found in (
            memoised_tool(conn, rebuilt, call),
            memoised_tool(conn, rebuilt, None, idempotency_key=key),
        ):
            assert found is not None and found.call_id == call and found.result == 1
        other = memoised_tool(conn, rebuilt, memo_key(call))
        assert other is not None and other.result == 2
        for model in (
            memoised_model(conn, rebuilt, request),
            memoised_model(conn, rebuilt, idempotency_key=key),
            memoised_model(conn, rebuilt, prompt_hash=prompt),
            memoised_model(conn, rebuilt, idempotency_key=key, prompt_hash=prompt),
        ):
            assert model is not None and model.request_id == request
        assert memoised_tool(conn, rebuilt, _noise(9000)) is None
        # SQL readers find them by the same rule
        (n,) = conn.execute(  # type: ignore[misc]
            "SELECT count(*) FROM agent_memo WHERE session_id = %s AND call_id = ledger_memo_key(%s)",
            (ctx.session_id, call),
        ).fetchone()
        (whole,) = conn.execute(  # type: ignore[misc]
            "SELECT ledger_session_context(%s)::text", (ctx.session_id,)
        ).fetchone()
    assert n == 1
    assert set(json.loads(whole)["completed_tools"]) == {call, memo_key(call)}


def test_the_writer_refuses_what_readers_would_quarantine(db: Database) -> None:
    """Writers are strict: depth and size limits, fields no type declares."""
    sid = uuid.uuid4()
    deep: Any = 1
    for _ in range(990):
        deep = [deep]
    with Ledger(db.dsn) as ledger:
        with pytest.raises(InvalidEventError, match="nests deeper than 64"):
            ledger.append(sid, "a", "tool.observed", {"call_id": "c", "result": deep})
        with pytest.raises(InvalidEventError, match=r"\$\.args"):
            ledger.append(sid, "a", "tool.invoked", {"call_id": "c", "tool": "t", "args": {}})
    with Ledger(db.dsn, limits=Limits(max_depth=8, max_bytes=1000)) as small:
        with pytest.raises(InvalidEventError, match="over the limit of 1,000"):
            small.append(sid, "a", "tool.observed", {"call_id": "c", "result": "x" * 2000})
        with pytest.raises(InvalidEventError, match="deeper than 8"):
            small.append(sid, "a", "tool.observed", {"call_id": "c", "result": [[[[[[[[1]]]]]]]]})
    with pytest.raises(ValueError, match="max_depth"):
        Limits(max_depth=READ_MAX_DEPTH + 1)
    # what the server would refuse with an error of its own (an index entry's size, a NUL, a
    # lone surrogate) or store as null (NaN): refused by the writer, saying what and why
    invoked = {"call_id": "c", "tool": "t"}
    with Ledger(db.dsn) as ledger:
        for agent, key, outbox, says in (
            ("a" * 5000, None, (), "agent_id is 5,000 bytes"),
            ("a", "k" * 3000, (), "idempotency_key is 3,000 bytes"),
            ("a\x00b", None, (), "NUL"),
            ("a\ud800", None, (), "surrogate"),
            ("a", None, (OutboxItem("t" * 2000, {}),), "outbox target is 2,000 bytes"),
            ("a", None, (OutboxItem("t", {}, "k" * 2000),), "outbox idempotency_key"),
            ("a", None, (OutboxItem("t", {"x": float("nan")}),), "NaN"),
            ("a", None, (OutboxItem("t", {"x": 10**5000}),), "not JSON-serialisable"),
        ):
            with pytest.raises(InvalidEventError, match=says):
                ledger.append(
                    sid, agent, "tool.invoked", invoked, idempotency_key=key, outbox=outbox
                )
    with db.connect() as conn:
        assert conn.execute("SELECT count(*) FROM agent_events").fetchone() == (0,)


_RECHAIN = """
WITH RECURSIVE chain AS (
    SELECT seq, position, hash FROM agent_events WHERE session_id = %(sid)s AND position = 1
    UNION ALL
    SELECT e.seq, e.position,
           ledger_event_hash(c.hash, e.session_id, e.position, e.agent_id, e.event_type,
                             e.payload, e.idempotency_key, e.created_at)
    FROM agent_events e JOIN chain c ON e.session_id = %(sid)s AND e.position = c.position + 1
)
UPDATE agent_events e SET hash = c.hash,
       prev_hash = (SELECT p.hash FROM chain p WHERE p.position = c.position - 1)
FROM chain c WHERE e.seq = c.seq
"""


def _tamper(conn: psycopg.Connection[Any], sid: uuid.UUID, edit: str) -> None:
    """A superuser's edit hidden from the publication, every hash recomputed after it: the
    table's own chain is consistent again."""
    conn.execute("ALTER PUBLICATION agent_pub SET (publish = 'insert')")
    conn.execute("ALTER TABLE agent_events DISABLE TRIGGER agent_events_append_only")
    conn.execute(edit, (sid,))
    conn.execute(_RECHAIN, {"sid": sid})
    conn.execute("ALTER TABLE agent_events ENABLE ALWAYS TRIGGER agent_events_append_only")
    conn.execute("ALTER PUBLICATION agent_pub SET (publish = 'insert, update, delete, truncate')")


def test_two_witnesses_see_an_edit_that_recomputes_the_chain(db: Database) -> None:
    """The table's chain alone cannot see an edit whose hashes were recomputed; the consumer's
    record of what it streamed (and, for a change in what folds, the refold) can."""
    folded, silent = uuid.uuid4(), uuid.uuid4()
    with InThread(db.dsn, snapshot_every=2), Ledger(db.dsn) as ledger:
        for sid in (folded, silent):
            ledger.append(sid, "a", "tool.invoked", {"call_id": "c", "tool": "t"})
            ledger.append(
                sid, "a", "tool.observed", {"call_id": "c", "result": 1}, idempotency_key="k"
            )
            ledger.append(sid, "a", "task.completed", {"result": "done"})
        wait_caught_up(db.dsn)
    assert verify(db.dsn).ok
    with db.connect() as conn:
        _tamper(
            conn,
            folded,
            'UPDATE agent_events SET payload = \'{"call_id": "c", "result": 2}\' '
            "WHERE session_id = %s AND position = 2",
        )
        # an edit that changes nothing the fold reads: only the consumer's record sees it
        _tamper(
            conn,
            silent,
            "UPDATE agent_events SET idempotency_key = 'k2' WHERE session_id = %s AND position = 2",
        )
        chain_only = verify(db.dsn)
    by_session: dict[uuid.UUID, set[str]] = {}
    for d in chain_only.differences:
        by_session.setdefault(d.session_id, set()).add(d.kind)
    # the table's chain is consistent (no "first event that no longer matches")
    assert not [d for d in chain_only.differences if "no longer match" in d.detail]
    assert by_session[silent] == {"chain"}
    assert {"chain", "projection"} <= by_session[folded]
    witness = [d for d in chain_only.differences if d.session_id == silent]
    assert "changed after it was streamed" in witness[0].detail
    r = run_cli("verify", "--all", "--dsn", db.dsn)
    assert_clean_exit(r, 1)


def test_a_database_whose_sessions_speak_latin1_streams_utf8(db: Database, tmp_path: Path) -> None:
    """The walsender converts text to the session's client encoding (here the database's
    setting, LATIN1): the replication session asks for UTF-8, so non-ASCII agent ids and
    payloads are folded, not quarantined as undecodable; the sink's session speaks UTF-8 too,
    so text LATIN1 cannot hold (an arrow, an emoji) is written, not refused on every retry."""
    with db.connect() as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET client_encoding = 'LATIN1'").format(
                sql.Identifier(db.name)
            )
        )
    sid = uuid.uuid4()
    log = tmp_path / "consume.log"
    consumer = ConsumerProcess(db.dsn, "--create-slot", log=log).start()
    try:
        wait_streaming(db.dsn)
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            assert conn.execute("SHOW client_encoding").fetchone() == ("LATIN1",)
            conn.execute("SET client_encoding = 'UTF8'")  # this writer's own: the arrow fits
            conn.execute(
                "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
                "VALUES (%s, 'café', 'tool.invoked', %s::jsonb)",
                (sid, json.dumps({"call_id": "é", "tool": "naïve → 🦜"})),
            )
        with Ledger(db.dsn) as ledger:  # the project's writer speaks UTF-8 on its own
            ledger.append(sid, "café", "tool.observed", {"call_id": "é", "result": "↩ 🦜"})
        wait_caught_up(db.dsn)
        assert consumer.alive(), log.read_text()[-3000:]
        with connect(db.dsn) as conn:  # and so do its readers
            rebuilt = rebuild_context(conn, sid)
        assert rebuilt.completed_tools["é"].result == "↩ 🦜"
        assert verify(db.dsn).ok
    finally:
        if consumer.alive():
            consumer.terminate()
        with db.connect() as conn:
            drop_slot(conn, "agent_slot", force=True)
    with db.connect() as conn:
        conn.execute("SET client_encoding = 'UTF8'")  # (a LATIN1 reader cannot hold the arrow)
        (dead,) = conn.execute("SELECT count(*) FROM ledger_dead_letters").fetchone()  # type: ignore[misc]
        ctx = stored_projections(conn)[sid]
    assert dead == 0
    assert ctx.event_count == 2 and ctx.completed_tools["é"].result == "↩ 🦜"
    assert ctx == rebuilt


def test_a_database_that_prints_times_another_way_is_read(db: Database, tmp_path: Path) -> None:
    """psycopg reads times and intervals in text only in the ISO DateStyle and the postgres
    IntervalStyle. A database (or role) may print them otherwise — here day-first SQL dates,
    SQL-standard intervals, a zone of +05:45 and bytea in escape form — and every session the
    package opens for itself then asks for what it reads: the writer appends, the consumer
    folds, recovery rebuilds and the commands report, nothing quarantined, nothing refused."""
    with db.connect() as conn:
        for setting, value in (
            ("DateStyle", "SQL, DMY"),
            ("IntervalStyle", "sql_standard"),
            ("TimeZone", "Asia/Kathmandu"),
            ("bytea_output", "escape"),
        ):
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                    sql.Identifier(db.name), sql.Identifier(setting), sql.Literal(value)
                )
            )
    with psycopg.connect(db.dsn, autocommit=True) as conn:  # (what a session gets here)
        assert conn.execute("SHOW DateStyle").fetchone() == ("SQL, DMY",)
    sid = uuid.uuid4()
    log = tmp_path / "consume.log"
    consumer = ConsumerProcess(db.dsn, "--create-slot", "--snapshot-every", "2", log=log).start()
    try:
        wait_streaming(db.dsn)
        with Ledger(db.dsn) as ledger:
            first = ledger.append(sid, "a1", "tool.invoked", {"call_id": "c1", "tool": "t"})
            ledger.append(sid, "a1", "tool.observed", {"call_id": "c1", "result": "r"})
            ledger.append(sid, "a1", "model.requested", {"model": "m", "request_id": "q1"})
        assert first.created_at.utcoffset() is not None
        wait_caught_up(db.dsn)
        assert consumer.alive(), log.read_text()[-3000:]
        with connect(db.dsn) as conn:
            rebuilt = rebuild_context(conn, sid)
            done = memoised_tool(conn, rebuilt, "c1")
            (dead,) = conn.execute("SELECT count(*) FROM ledger_dead_letters").fetchone()  # type: ignore[misc]
            (snaps,) = conn.execute("SELECT count(*) FROM agent_snapshots").fetchone()  # type: ignore[misc]
            ctx = stored_projections(conn)[sid]
        assert dead == 0 and snaps >= 1
        assert rebuilt.event_count == 3 and set(rebuilt.pending_models) == {"q1"}
        assert done is not None and done.result == "r"
        assert ctx.last_position == 3 and ctx.completed_tools["c1"].result == "r"
        assert verify(db.dsn).ok
        for args in (("lag",), ("inspect", str(sid)), ("replay", str(sid)), ("verify", "--all")):
            r = run_cli(*args, "--dsn", db.dsn)
            assert_clean_exit(r)
    finally:
        if consumer.alive():
            consumer.terminate()
        with db.connect() as conn:
            drop_slot(conn, "agent_slot", force=True)


def test_the_replication_session_keeps_the_dsns_options_and_reads_iso(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replication connection asks for the styles the decoder reads (ISO times, here
    against a DSN that asks for German dates) without dropping what the DSN's own ``options``
    (or PGOPTIONS, when the DSN has none) set for the walsender."""
    for dsn, env in (
        (f"{db.dsn} options='-c wal_sender_timeout=7s -c DateStyle=German'", None),
        (db.dsn, "-c wal_sender_timeout=9s -c DateStyle=German"),
    ):
        if env is None:
            monkeypatch.delenv("PGOPTIONS", raising=False)
        else:
            monkeypatch.setenv("PGOPTIONS", env)
        stream = ReplicationStream(dsn, slot="unused", publication="agent_pub")
        conn = stream._open()
        try:
            cur = conn.cursor()
            shown = {}
            for setting in ("wal_sender_timeout", "DateStyle"):
                cur.execute(f"SHOW {setting}")
                shown[setting] = cur.fetchone()[0]
        finally:
            conn.close()
        assert shown["wal_sender_timeout"] == ("7s" if env is None else "9s")
        assert shown["DateStyle"].startswith("ISO")


def test_a_statement_timeout_set_for_applications_stops_no_consumer(
    db: Database, tmp_path: Path
) -> None:
    """A database (or role) may cancel every statement past a timeout meant for its
    applications (here 1 ms). The consumer's batches, bootstrap and upkeep are bounded by
    their size, not by a timeout, and its sessions lift it: the backlog is folded instead of
    being cancelled on every retry. A command that reads the whole ledger (verify) is cancelled
    as the database asks, in one line that says how to lift it."""
    with db.connect() as conn:
        create_slot(conn)
    with Ledger(db.dsn) as ledger:
        sids = [uuid.uuid4() for _ in range(60)]
        for i in range(600):
            ledger.append(sids[i % 60], "a", "tool.invoked", {"call_id": f"c{i}", "tool": "t"})
    with db.connect() as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET statement_timeout = '1ms'").format(
                sql.Identifier(db.name)
            )
        )
    unbounded = f"{db.dsn} options='-c statement_timeout=0'"
    log = tmp_path / "consume.log"
    consumer = ConsumerProcess(db.dsn, log=log).start()
    try:
        wait_caught_up(unbounded)
        assert consumer.alive(), log.read_text()[-3000:]
        with psycopg.connect(unbounded, autocommit=True) as conn:
            (dead,) = conn.execute("SELECT count(*) FROM ledger_dead_letters").fetchone()  # type: ignore[misc]
            (folded,) = conn.execute("SELECT sum(event_count) FROM agent_sessions").fetchone()  # type: ignore[misc]
        assert dead == 0 and folded == 600
        assert "statement timeout" not in log.read_text()
    finally:
        if consumer.alive():
            consumer.terminate()
    r = run_cli("verify", "--all", "--dsn", db.dsn)
    assert_clean_exit(r, 4)
    assert "options='-c statement_timeout=0'" in r.output
    assert_clean_exit(run_cli("verify", "--all", "--dsn", unbounded))
    with psycopg.connect(unbounded, autocommit=True) as conn:
        drop_slot(conn, "agent_slot", force=True)


def _alter(db: Database, setting: str, value: str) -> None:
    with db.connect(options="-c default_transaction_read_only=off") as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                sql.Identifier(db.name), sql.Identifier(setting), sql.Literal(value)
            )
        )


def _ended(db: Database, pid: int) -> Callable[[], bool]:
    def gone() -> bool:
        with psycopg.connect(db.dsn, autocommit=True, options="-c idle_session_timeout=0") as c:
            return c.execute(
                "SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = %s)", (pid,)
            ).fetchone()[0]  # type: ignore[index, no-any-return]

    return gone


def test_the_writer_runs_again_what_the_server_rolled_back_or_ended(db: Database) -> None:
    """Under a database whose transactions are serializable by default, concurrent appends to
    one session fail with serialization failures the server rolled back whole: the writer runs
    them again (all 180 land, positions 1…180). A pooled session the server ended while it sat
    idle (idle_session_timeout) is replaced by a fresh one, sync and async: nothing was sent
    on it."""
    _alter(db, "default_transaction_isolation", "serializable")
    _alter(db, "idle_session_timeout", "1s")
    sid = uuid.uuid4()
    errors: list[BaseException] = []
    with Ledger(db.dsn, pool_size=6) as ledger:

        def write(k: int) -> None:
            for i in range(30):
                try:
                    ledger.append(sid, "a", "tool.invoked", {"call_id": f"{k}-{i}", "tool": "t"})
                except BaseException as e:
                    errors.append(e)

        threads = [threading.Thread(target=write, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        with ledger.connection() as conn:
            pid = conn.info.backend_pid
        until(_ended(db, pid), timeout=30)  # the server ended the idle pooled session
        assert (
            ledger.append(sid, "a", "tool.observed", {"call_id": "0-0", "result": 1}).position
            == 181
        )

    async def async_side() -> int:
        led = await AsyncLedger.connect(db.dsn, pool_size=1)
        try:
            async with led.connection() as conn:
                pid = conn.info.backend_pid
            await asyncio.to_thread(until, _ended(db, pid), 30)
            return (
                await led.append(sid, "a", "tool.observed", {"call_id": "0-1", "result": 2})
            ).position
        finally:
            await led.close()

    assert asyncio.run(async_side()) == 182
    with db.connect() as conn:
        positions = [
            p
            for (p,) in conn.execute(
                "SELECT position FROM agent_events WHERE session_id = %s ORDER BY seq", (sid,)
            )
        ]
    assert sorted(positions) == list(range(1, 183))


def test_an_idle_session_timeout_ends_no_session_of_the_consumers(
    db: Database, tmp_path: Path
) -> None:
    """A database that ends sessions idle past a timeout (idle_session_timeout) does not end
    the consumer's, nor a follower's: the sink waits idle between batches as long as the
    ledger is quiet (a session ended meanwhile would fail the next batch and restart the
    stream), ``tail`` waits idle for the consumer's notifications, and ``lag`` while it
    samples the WAL rate (and between refreshes with --watch)."""
    _alter(db, "idle_session_timeout", "1s")
    sid = uuid.uuid4()
    log = tmp_path / "consume.log"
    # (nothing of the consumer's own writes WAL meanwhile: the sink then has nothing to do
    # until the next event, however long that takes)
    quiet = ("--vacuum-interval", "0", "--health-interval", "0")
    consumer = ConsumerProcess(db.dsn, "--create-slot", *quiet, log=log).start()
    tail = start_cli(
        *("tail", str(sid), "--count", "2", "--json"),
        env={**os.environ, "LEDGER_CDC_DSN": db.dsn},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_streaming(db.dsn)
        with Ledger(db.dsn) as ledger:
            ledger.append(sid, "a", "tool.invoked", {"call_id": "c1", "tool": "t"})
            wait_caught_up(f"{db.dsn} options='-c idle_session_timeout=0'")
            # two idle sessions of the database's own settings, one after the other, ended:
            # the timeout has passed twice for every session idle since the first batch
            for _ in range(2):
                probe = psycopg.connect(db.dsn, autocommit=True)
                until(_ended(db, probe.info.backend_pid), timeout=30)
                probe.close()
            ledger.append(sid, "a", "tool.observed", {"call_id": "c1", "result": "r"})
            wait_caught_up(f"{db.dsn} options='-c idle_session_timeout=0'")
        assert consumer.alive(), log.read_text()[-3000:]
        out, err = tail.communicate(timeout=60)
        assert tail.returncode == 0, err
        assert [json.loads(line)["position"] for line in out.splitlines()] == [1, 2]
        # lag samples the WAL rate over two seconds, its session idle meanwhile
        r = run_cli("lag", "--dsn", db.dsn, "--sample-seconds", "2", "--json")
        assert_clean_exit(r, 0, 1)
    finally:
        if tail.poll() is None:
            tail.kill()
        if consumer.alive():
            consumer.terminate()
        quiet_dsn = f"{db.dsn} options='-c idle_session_timeout=0'"
        with psycopg.connect(quiet_dsn, autocommit=True) as conn:
            drop_slot(conn, "agent_slot", force=True)
    assert "idle-session timeout" not in log.read_text()


def test_a_database_that_takes_no_writes_is_said_so(db: Database, tmp_path: Path) -> None:
    """A database whose transactions are read-only by default (or a hot standby) refuses the
    writer's append and the consumer's batches: both say why in one line, and the consumer
    waits for it to take writes (a failover may make it the primary) and then folds."""
    sid = uuid.uuid4()
    with db.connect() as conn:
        create_slot(conn)
    _alter(db, "default_transaction_read_only", "on")
    with Ledger(db.dsn) as ledger, pytest.raises(DatabaseUnavailable, match="takes no writes"):
        ledger.append(sid, "a", "tool.invoked", {"call_id": "c1", "tool": "t"})
    writable = f"{db.dsn} options='-c default_transaction_read_only=off'"
    with Ledger(writable) as ledger:
        ledger.append(sid, "a", "tool.invoked", {"call_id": "c1", "tool": "t"})
    log = tmp_path / "consume.log"
    consumer = ConsumerProcess(db.dsn, log=log).start()
    try:
        until(lambda: "takes no writes" in log.read_text(), timeout=60)
        _alter(db, "default_transaction_read_only", "off")
        wait_caught_up(writable, timeout=90)
        assert consumer.alive(), log.read_text()[-3000:]
    finally:
        if consumer.alive():
            consumer.terminate()
        with psycopg.connect(writable, autocommit=True) as conn:
            drop_slot(conn, "agent_slot", force=True)


def test_the_consumers_sessions_lift_every_timeout_the_database_sets(db: Database) -> None:
    """What the consumer's own sessions (sink, bootstrap, resync, upkeep: ``connect(lift=
    True)``) run under, whatever the database sets for its applications: no statement,
    idle-session or (PostgreSQL 17+) transaction timeout — a bootstrap of a large ledger is
    one long transaction, and a timeout would end it on every retry. A session of the
    database's own settings keeps them."""
    settings = {"statement_timeout": "1min", "idle_session_timeout": "1min"}
    if db.server.major >= 17:
        settings["transaction_timeout"] = "1min"
    for setting, value in settings.items():
        _alter(db, setting, value)
    with connect(db.dsn, autocommit=True, lift=True) as ours, db.connect() as theirs:
        for setting, value in settings.items():
            assert ours.execute(sql.SQL("SHOW {}").format(sql.Identifier(setting))).fetchone() == (
                "0",
            )
            assert theirs.execute(
                sql.SQL("SHOW {}").format(sql.Identifier(setting))
            ).fetchone() == (value,)
