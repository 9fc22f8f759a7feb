"""Migrations, the append-only guard, the hash chain and the least-privilege roles."""

from __future__ import annotations

import itertools
import uuid

import msgspec
import psycopg
import pytest

from ledger_cdc import Ledger
from ledger_cdc.admin.schema import (
    Migration,
    applied_migrations,
    create_slot,
    init,
    load_legacy,
    load_migrations,
    migrate,
)
from ledger_cdc.connect import connect
from ledger_cdc.errors import ConfigError, MigrationError, RetryableError
from tests.support.harness import Database
from tests.support.schema import init_db

pytestmark = pytest.mark.server


def test_init_applies_every_migration_once(empty_db: Database) -> None:
    first = init_db(empty_db.dsn, slot="agent_slot")
    versions = [m.version for m in load_migrations()]
    assert first.applied == versions
    assert first.publication_created and first.slot_created
    again = init_db(empty_db.dsn, slot="agent_slot")
    assert again.applied == [] and not again.publication_created and not again.slot_created
    with empty_db.connect() as conn:
        assert sorted(applied_migrations(conn)) == versions
        (n,) = conn.execute("SELECT count(*) FROM ledger_migrations").fetchone()  # type: ignore[misc]
        assert n == len(versions)
        pub = conn.execute(
            "SELECT tablename FROM pg_publication_tables WHERE pubname = 'agent_pub'"
        ).fetchall()
        assert pub == [("agent_events",)]
        slot = conn.execute(
            "SELECT plugin, slot_type FROM pg_replication_slots WHERE slot_name = 'agent_slot'"
        ).fetchone()
        assert slot == ("pgoutput", "logical")


def test_edited_migration_is_refused(empty_db: Database) -> None:
    init_db(empty_db.dsn)
    migs = load_migrations()
    changed = [Migration(m.version, m.name, m.text + "\n-- edited\n") for m in migs]
    with (
        empty_db.connect() as conn,
        pytest.raises(MigrationError, match="changed after it was applied"),
    ):
        migrate(conn, changed)


def test_failed_migration_leaves_nothing_recorded(empty_db: Database) -> None:
    bad = [Migration(1, "broken", "CREATE TABLE x (a int); SELECT no_such_function();")]
    with empty_db.connect() as conn:
        with pytest.raises(MigrationError, match="0001_broken failed"):
            migrate(conn, bad)
        assert applied_migrations(conn) == {}
        (x,) = conn.execute("SELECT to_regclass('x')").fetchone()  # type: ignore[misc]
        assert x is None


@pytest.mark.parametrize(
    "name", ["Agent_Slot", "slot; DROP TABLE agent_events", "", "a" * 64, "sl-ot"]
)
def test_bad_slot_names_are_refused(empty_db: Database, name: str) -> None:
    with pytest.raises(ConfigError, match="invalid slot name"):
        init_db(empty_db.dsn, slot=name)


@pytest.mark.parametrize("name", ["pub; DROP TABLE agent_events", "1pub", "p" * 64, 'pu"b'])
def test_bad_publication_names_are_refused(empty_db: Database, name: str) -> None:
    with pytest.raises(ConfigError, match="invalid publication name"):
        init_db(empty_db.dsn, publication=name)


def test_mixed_case_publication_is_quoted(empty_db: Database) -> None:
    init_db(empty_db.dsn, publication="Agent_Pub")
    with empty_db.connect() as conn:
        assert conn.execute("SELECT 1 FROM pg_publication WHERE pubname = 'Agent_Pub'").fetchone()


def test_existing_slot_with_another_plugin_is_an_error(db: Database) -> None:
    with db.connect() as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('other', 'test_decoding')")
        with pytest.raises(ConfigError, match="not a pgoutput logical slot"):
            create_slot(conn, "other")


def test_unreachable_database_is_one_clear_error() -> None:
    # the connect ``ledger-cdc init`` does before it calls init
    with pytest.raises(RetryableError, match=r"^init: .*Connection refused"):
        connect("host=127.0.0.1 port=1 dbname=x connect_timeout=2", doing="init", autocommit=True)


def test_init_refuses_a_connection_in_a_transaction(empty_db: Database) -> None:
    with empty_db.connect(autocommit=False) as conn:
        with pytest.raises(ConfigError, match="autocommit"):
            init(conn, slot="agent_slot")
        assert conn.execute("SELECT to_regclass('ledger_migrations')").fetchone() == (None,)


def _one_event(db: Database) -> uuid.UUID:
    sid = uuid.uuid4()
    with Ledger(db.dsn) as ledger:
        ledger.append(sid, "a", "task.completed", {"result": 1})
    return sid


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE agent_events SET agent_id = 'x'",
        "DELETE FROM agent_events",
        "TRUNCATE agent_events CASCADE",
    ],
)
def test_append_only_guard_refuses_changes_even_to_the_owner(db: Database, statement: str) -> None:
    _one_event(db)
    with db.connect() as conn:
        with pytest.raises(psycopg.Error, match="append-only ledger"):
            conn.execute(statement)
        # the replica role skips ordinary triggers; ours are ENABLE ALWAYS
        conn.execute("SET session_replication_role = replica")
        with pytest.raises(psycopg.Error, match="append-only ledger"):
            conn.execute(statement)
        (n,) = conn.execute("SELECT count(*) FROM agent_events").fetchone()  # type: ignore[misc]
        assert n == 1


def test_hash_chain_links_each_event_to_the_previous(db: Database) -> None:
    sid = uuid.uuid4()
    with Ledger(db.dsn) as ledger:
        for i in range(5):
            ledger.append(sid, "a", "task.completed", {"result": i})
    with db.connect() as conn:
        rows = conn.execute(
            "SELECT position, prev_hash, hash, ledger_event_hash(prev_hash, session_id, position, "
            "agent_id, event_type, payload, idempotency_key, created_at) = hash "
            "FROM agent_events WHERE session_id = %s ORDER BY position",
            (sid,),
        ).fetchall()
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0][1] is None
    for prev, cur in itertools.pairwise(rows):
        assert cur[1] == prev[2]
    assert all(r[3] for r in rows)
    assert len({bytes(r[2]) for r in rows}) == 5


def test_hash_chain_detects_an_edit_that_bypassed_the_guard(db: Database) -> None:
    sid = uuid.uuid4()
    with Ledger(db.dsn) as ledger:
        for i in range(3):
            ledger.append(sid, "a", "task.completed", {"result": i})
    with db.connect() as conn:
        conn.execute("ALTER TABLE agent_events DISABLE TRIGGER agent_events_append_only")
        conn.execute(
            "UPDATE agent_events SET payload = '{\"result\": 99}' "
            "WHERE session_id = %s AND position = 2",
            (sid,),
        )
        bad = conn.execute(
            "SELECT position FROM agent_events WHERE session_id = %s AND "
            "ledger_event_hash(prev_hash, session_id, position, agent_id, event_type, payload, "
            "idempotency_key, created_at) <> hash",
            (sid,),
        ).fetchall()
    assert bad == [(2,)]


def test_gap_in_positions_is_refused(db: Database) -> None:
    sid = uuid.uuid4()
    with (
        db.connect() as conn,
        pytest.raises(psycopg.errors.CheckViolation, match="no event at position 1"),
    ):
        conn.execute(
            "INSERT INTO agent_events (session_id, position, agent_id, event_type, payload) "
            "VALUES (%s, 2, 'a', 'task.completed', '{}')",
            (sid,),
        )


@pytest.fixture
def roles(db: Database) -> Database:
    with db.connect() as conn:
        for name, extra in (
            ("t_writer", "IN ROLE ledger_writer"),
            ("t_consumer", "REPLICATION IN ROLE ledger_consumer"),
        ):
            if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone():
                conn.execute(f"CREATE ROLE {name} LOGIN {extra}")
    return db


def test_writer_role_can_append_but_not_change(roles: Database) -> None:
    sid = uuid.uuid4()
    with Ledger(roles.dsn_as("t_writer")) as ledger:
        r1 = ledger.append(sid, "a", "task.completed", {"result": 1}, expected_position=0)
        r2 = ledger.append(sid, "a", "task.completed", {"result": 2}, idempotency_key="k")
        assert (r1.position, r2.position) == (1, 2)
        assert ledger.append(
            sid, "a", "task.completed", {"result": 2}, idempotency_key="k"
        ).duplicate
    with psycopg.connect(roles.dsn_as("t_writer"), autocommit=True) as conn:
        for stmt in (
            "UPDATE agent_events SET agent_id = 'x'",
            "DELETE FROM agent_events",
            "TRUNCATE agent_events",
            "SELECT agent_id FROM agent_events",
            "INSERT INTO agent_sessions (session_id, status, last_seq, last_position, event_count, "
            "format_version, context) VALUES (gen_random_uuid(), 'x', 0, 0, 0, 1, '{}')",
            "SELECT * FROM agent_snapshots",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(stmt)


def test_consumer_role_reads_ledger_and_writes_only_its_tables(roles: Database) -> None:
    _one_event(roles)
    with psycopg.connect(roles.dsn_as("t_consumer"), autocommit=True) as conn:
        (n,) = conn.execute("SELECT count(*) FROM agent_events").fetchone()  # type: ignore[misc]
        assert n == 1
        conn.execute("INSERT INTO ledger_checkpoints (slot_name, lsn) VALUES ('s', '0/1')")
        conn.execute("UPDATE ledger_checkpoints SET lsn = '0/2'")
        for stmt in (
            "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
            "VALUES (gen_random_uuid(), 'a', 'task.completed', '{}')",
            "UPDATE agent_events SET agent_id = 'x'",
            "DELETE FROM agent_events",
            "INSERT INTO agent_outbox (event_seq, session_id, target, payload, idempotency_key) "
            "VALUES (1, gen_random_uuid(), 't', '{}', 'k')",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(stmt)
        (is_super,) = conn.execute(
            "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
        ).fetchone()  # type: ignore[misc]
        assert is_super is False


def test_memo_migration_copies_the_calls_folded_before_it(empty_db: Database) -> None:
    """An upgrade from projections that held the whole memo: 0008 copies it into agent_memo, so
    a context rebuilt from a new snapshot still answers the calls completed before it."""
    from ledger_cdc.client.recovery import (
        load_events,
        memoised_model,
        memoised_tool,
        rebuild_context,
    )
    from ledger_cdc.fold import encode_context, fold

    migs = load_legacy()
    sid = uuid.uuid4()
    with empty_db.connect() as conn:
        migrate(conn, [m for m in migs if m.version < 8])
    with Ledger(empty_db.dsn) as ledger:
        ledger.append(
            sid, "w", "model.requested", {"request_id": "r1", "model": "m", "prompt_hash": "p1"}
        )
        ledger.append(
            sid, "w", "model.responded", {"request_id": "r1", "model": "m", "content": "hi"}
        )
        ledger.append(
            sid, "w", "tool.invoked", {"call_id": "c1", "tool": "t", "idempotency_key": "k1"}
        )
        ledger.append(sid, "w", "tool.observed", {"call_id": "c1", "result": [1, 2]})
    with empty_db.connect() as conn:
        ctx = fold([e for e in load_events(conn, sid)], session_id=sid)  # type: ignore[misc]
        conn.execute(  # the projection as the consumer before 0008 wrote it
            "INSERT INTO agent_sessions (session_id, status, last_seq, last_position, "
            "event_count, format_version, context) VALUES (%s, 'running', %s, %s, %s, %s, %s)",
            (
                sid,
                ctx.last_seq,
                ctx.last_position,
                ctx.event_count,
                1,  # the whole context, memo included
                encode_context(ctx).decode(),
            ),
        )
        assert migrate(conn)[: len(migs) - 7] == [m.version for m in migs if m.version >= 8]
        rows = conn.execute(
            "SELECT kind, call_id, completed_seq, idempotency_key, prompt_hash FROM agent_memo "
            "WHERE session_id = %s ORDER BY completed_seq",
            (sid,),
        ).fetchall()
        assert rows == [
            ("model", "r1", ctx.completed_models["r1"].responded_seq, None, "p1"),
            ("tool", "c1", ctx.completed_tools["c1"].observed_seq, "k1", None),
        ]
        lazy = msgspec.structs.replace(
            rebuild_context(conn, sid),
            completed_tools={},
            completed_models={},
            memo_position=ctx.last_position,
        )  # as if rebuilt from a snapshot at the head
        assert memoised_tool(conn, lazy, "c1") == ctx.completed_tools["c1"]
        assert memoised_model(conn, lazy, prompt_hash="p1") == ctx.completed_models["r1"]


def test_memo_keys_of_python_and_sql_agree(db: Database) -> None:
    """fold.memo_key and SQL ledger_memo_key give the same stored form for every value: short,
    exactly 512 bytes, non-ASCII, past the limit, and spelled like a digest."""
    from ledger_cdc.fold import memo_key

    values = [
        "c1",
        "a" * 512,
        "a" * 513,
        "é" * 256,  # 512 bytes of UTF-8
        "é" * 257,
        "日本語" * 100,
        "sha256~",
        "sha256~abc",
        "sha256~" + "0" * 64,
        "x" * 100_000,
        "🙂" * 128,
    ]
    with db.connect() as conn:
        got = [
            conn.execute("SELECT ledger_memo_key(%s)", (v,)).fetchone()[0]  # type: ignore[index]
            for v in values
        ]
    assert got == [memo_key(v) for v in values]
    assert got[0] == "c1" and got[1] == "a" * 512 and got[2].startswith("sha256~")
    assert len(set(got)) == len(values)


def test_migration_0015_rewrites_the_keys_already_stored(empty_db: Database) -> None:
    """Rows written before 0015 hold their keys as they came (a random 1,500-byte key fits an
    index entry): after it, each is in the stored form, where a lookup searches."""
    import secrets

    from ledger_cdc.fold import memo_key

    long_call, long_key, long_prompt = (secrets.token_hex(750) for _ in range(3))
    sid = uuid.uuid4()
    with empty_db.connect() as conn:
        conn.autocommit = True
        migrate(conn, [m for m in load_legacy() if m.version < 15])
        for call, key, prompt, pos in (
            (long_call, long_key, long_prompt, 1),
            ("short", "k", "p", 2),
            ("sha256~spelled", None, None, 3),
        ):
            conn.execute(
                "INSERT INTO agent_memo (session_id, kind, call_id, completed_seq, "
                "completed_position, idempotency_key, prompt_hash, entry) "
                "VALUES (%s, 'model', %s, %s, %s, %s, %s, '{}')",
                (sid, call, pos, pos, key, prompt),
            )
        assert migrate(conn)[:3] == [15, 16, 17]
        rows = conn.execute(
            "SELECT call_id, idempotency_key, prompt_hash FROM agent_memo "
            "ORDER BY completed_position"
        ).fetchall()
    assert rows == [
        (memo_key(long_call), memo_key(long_key), memo_key(long_prompt)),
        ("short", "k", "p"),
        (memo_key("sha256~spelled"), None, None),
    ]
    assert rows[0][0].startswith("sha256~") and rows[2][0] != "sha256~spelled"
