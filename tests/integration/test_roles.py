"""Least privilege, proven by logging in as each role: every role can do what its API documents
and no more.

- ``ledger_writer``: appends (expected position, idempotent retries and their comparison, the
  outbox), signals and runs submitted; never another event's contents, never ``agent_memo`` or
  the projections, never a chosen ``seq``, ``created_at`` or ``hash``.
- ``ledger_reader``: rebuild_context, the memo, verify, inspect, runs; never an insert.
- ``ledger_consumer`` (with REPLICATION): consume, lag; writes only its own tables.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql

from ledger_cdc.admin.partitions import list_partitions
from ledger_cdc.admin.verify import verify
from ledger_cdc.client.read import projected_contexts
from ledger_cdc.client.recovery import memoised_tool, rebuild_context
from ledger_cdc.client.runs import signal, submit
from ledger_cdc.client.writer import Ledger, OutboxItem
from ledger_cdc.consumer.tasks import partition_keeper
from ledger_cdc.errors import ConcurrentAppendError, IdempotencyConflictError
from tests.support.cdc import InThread, assert_clean_exit, run_cli, until, wait_caught_up
from tests.support.harness import Database
from tests.support.schema import init_db

pytestmark = pytest.mark.server


@dataclass
class Roles:
    db: Database
    writer: str
    reader: str
    consumer: str

    def dsn(self, role: str) -> str:
        return self.db.dsn_as(role)


@pytest.fixture
def roles(db: Database) -> Iterator[Roles]:
    r = Roles(db, f"w_{db.name}", f"r_{db.name}", f"c_{db.name}")
    made = [
        (r.writer, "IN ROLE ledger_writer"),
        (r.reader, "IN ROLE ledger_reader"),
        (r.consumer, "REPLICATION IN ROLE ledger_consumer"),
    ]
    with psycopg.connect(db.server.dsn(), autocommit=True) as admin:
        for name, extra in made:
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN " + extra).format(sql.Identifier(name)))
    try:
        yield r
    finally:
        with db.connect() as conn, psycopg.connect(db.server.dsn(), autocommit=True) as admin:
            for name, _ in made:
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def _refused(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for stmt in statements:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(stmt)


def test_writer_does_what_the_writer_api_documents(roles: Roles) -> None:
    sid = uuid.uuid4()
    with Ledger(roles.dsn(roles.writer)) as ledger:
        r1 = ledger.append(
            sid, "a", "tool.invoked", {"call_id": "c", "tool": "t"}, expected_position=0
        )
        with pytest.raises(ConcurrentAppendError):
            ledger.append(sid, "a", "task.completed", {}, expected_position=0)
        with ledger.transaction() as tx:  # an agent turn with its outbox row
            r2 = tx.append(
                sid,
                "a",
                "tool.observed",
                {"call_id": "c", "result": 1},
                idempotency_key="k-1",
                outbox=[OutboxItem("webhook:ci", {"n": 1}, "out-1")],
            )
        assert r2.outbox_ids and r2.created_at is not None
        again = ledger.append(
            sid, "a", "tool.observed", {"call_id": "c", "result": 1}, idempotency_key="k-1"
        )
        assert again.duplicate and again.seq == r2.seq and again.position == 2
        with pytest.raises(IdempotencyConflictError):
            ledger.append(
                sid, "a", "tool.observed", {"call_id": "c", "result": 2}, idempotency_key="k-1"
            )
        assert ledger.head(sid) == 2 and r1.position == 1
    with psycopg.connect(roles.dsn(roles.writer), autocommit=True) as conn:
        submit(conn, sid)
        assert not signal(conn, sid, "approve", {"by": "ann"}, signal_id="s1").duplicate
        assert signal(conn, sid, "approve", {"by": "ann"}, signal_id="s1").duplicate


def test_writer_reads_no_contents_and_chooses_no_server_column(roles: Roles) -> None:
    other = uuid.uuid4()
    with Ledger(roles.db.dsn) as ledger:
        ledger.append(other, "a", "task.completed", {"result": "secret"})
    _refused(
        roles.dsn(roles.writer),
        "SELECT payload FROM agent_events",
        "SELECT session_id FROM agent_events",
        "SELECT * FROM agent_memo",
        "SELECT * FROM agent_sessions",
        "SELECT * FROM agent_snapshots",
        "SELECT payload FROM agent_outbox",
        "SELECT * FROM ledger_dead_letters",
        # server-assigned columns
        f"INSERT INTO agent_events (seq, session_id, agent_id, event_type, payload) "
        f"VALUES (999999, '{other}', 'a', 'x.y', '{{}}')",
        "INSERT INTO agent_events (session_id, agent_id, event_type, payload, created_at) "
        "VALUES (gen_random_uuid(), 'a', 'x.y', '{}', '2000-01-01')",
        "INSERT INTO agent_events (session_id, agent_id, event_type, payload, hash) "
        "VALUES (gen_random_uuid(), 'a', 'x.y', '{}', '\\x00')",
        "UPDATE agent_events SET agent_id = 'x'",
        "DELETE FROM agent_events",
        "UPDATE agent_outbox SET dispatched = true",
    )
    # even the owner's explicit time is refused outside an import
    with (
        psycopg.connect(roles.db.dsn, autocommit=True) as owner,
        pytest.raises(psycopg.errors.InsufficientPrivilege, match="assigned by the server"),
    ):
        owner.execute(
            "INSERT INTO agent_events (session_id, agent_id, event_type, payload, created_at) "
            "VALUES (gen_random_uuid(), 'a', 'x.y', '{}', '2000-01-01')"
        )


def test_no_role_but_the_ledgers_may_ask_the_key_function(roles: Roles) -> None:
    with psycopg.connect(roles.db.server.dsn(), autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(f"n_{roles.db.name}")))
    try:
        _refused(
            roles.db.dsn_as(f"n_{roles.db.name}"),
            "SELECT * FROM ledger_event_by_key(gen_random_uuid(), 'k', 'x.y', '{}')",
            "SELECT ledger_session_head(gen_random_uuid())",
            "SELECT * FROM agent_events",
        )
    finally:
        with psycopg.connect(roles.db.server.dsn(), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(f"n_{roles.db.name}")))


def test_reader_rebuilds_and_verifies_and_writes_nothing(roles: Roles) -> None:
    sid = uuid.uuid4()
    window = [{"role": "system", "content": "rules " * 100}]  # long: stored by reference
    with InThread(roles.db.dsn), Ledger(roles.db.dsn) as ledger:
        ledger.append(sid, "a", "context.loaded", {"messages": window})
        ledger.append(sid, "a", "tool.invoked", {"call_id": "c", "tool": "t"})
        ledger.append(sid, "a", "tool.observed", {"call_id": "c", "result": "row " * 100})
        wait_caught_up(roles.db.dsn)
    dsn = roles.dsn(roles.reader)
    with psycopg.connect(dsn, autocommit=True) as conn:
        ctx = rebuild_context(conn, sid)
        assert ctx.last_position == 3
        done = memoised_tool(conn, ctx, "c")
        assert done is not None and done.result == "row " * 100
        # the documented readers of the whole context, what the reader role may call
        whole = projected_contexts(conn)[sid]
        assert whole.messages[0].content == "rules " * 100
        assert whole.completed_tools["c"].result == "row " * 100
        (viewed,) = conn.execute(
            "SELECT context FROM agent_session_contexts WHERE session_id = %s", (sid,)
        ).fetchone()  # type: ignore[misc]
        assert viewed["messages"][0]["content"] == "rules " * 100
    assert verify(dsn).ok
    for args in (["inspect", str(sid)], ["replay", str(sid)], ["verify", "--all"], ["runs"]):
        assert_clean_exit(run_cli(*args, "--dsn", dsn))
    _refused(
        dsn,
        "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
        "VALUES (gen_random_uuid(), 'a', 'x.y', '{}')",
        "DELETE FROM agent_sessions",
        "UPDATE ledger_checkpoints SET lsn = '0/1'",
    )


def _vacuums(db: Database, table: str) -> int:
    with db.connect() as conn:
        row = conn.execute(
            "SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = %s", (table,)
        ).fetchone()
    return 0 if row is None else int(row[0])  # type: ignore[call-overload]


def test_consumer_role_consumes_and_writes_only_its_tables(
    roles: Roles, caplog: pytest.LogCaptureFixture
) -> None:
    sid = uuid.uuid4()
    dsn = roles.dsn(roles.consumer)
    caplog.set_level(logging.INFO, logger="ledger_cdc.consumer")
    with (
        InThread(dsn, heartbeat_interval=0.2, vacuum_interval=0.2),
        Ledger(roles.db.dsn) as ledger,
    ):
        ledger.append(sid, "a", "tool.invoked", {"call_id": "c", "tool": "t"})
        ledger.append(sid, "a", "tool.observed", {"call_id": "c", "result": 7})
        wait_caught_up(roles.db.dsn)
        if roles.db.server.major >= 17:
            # MAINTAIN, which init grants ledger_consumer on 17+: it vacuums its projections
            until(lambda: _vacuums(roles.db, "agent_sessions") > 0, 30)
        else:
            # not the projections' owner: VACUUM is refused, said once, left to autovacuum
            until(lambda: "left to autovacuum" in caplog.text, 30)
    assert caplog.text.count("left to autovacuum") == (roles.db.server.major < 17)
    assert_clean_exit(run_cli("lag", "--dsn", dsn, "--sample-seconds", "0"), 0, 1)
    _refused(
        dsn,
        "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
        "VALUES (gen_random_uuid(), 'a', 'x.y', '{}')",
        "UPDATE agent_events SET agent_id = 'x'",
        "INSERT INTO agent_outbox (event_seq, session_id, target, payload, idempotency_key) "
        "VALUES (1, gen_random_uuid(), 't', '{}', 'k')",
    )


def test_the_consumer_role_keeps_partitions_ahead(empty_db: Database) -> None:
    """The consumer's partition task runs as ledger_consumer, which may not create tables: it
    creates the partitions ahead through ledger_ensure_partitions (as the owner, and no more
    than 120 ahead). It failed on every run before."""
    init_db(empty_db.dsn, partition_by="day", slot="agent_slot")
    name = f"c_{empty_db.name}"
    with psycopg.connect(empty_db.server.dsn(), autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN REPLICATION IN ROLE ledger_consumer").format(
                sql.Identifier(name)
            )
        )
    try:
        with psycopg.connect(empty_db.dsn_as(name), autocommit=True) as conn:
            before = {p.name for p in list_partitions(conn)}
            assert partition_keeper(10)(conn) is True
            after = {p.name for p in list_partitions(conn)}
            assert len(after - before) == 7, (before, after)  # init made 3 ahead, now 10
            with pytest.raises(psycopg.errors.InvalidParameterValue):
                conn.execute("SELECT ledger_ensure_partitions(121)")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("CREATE TABLE mine (x int)")
    finally:
        with (
            empty_db.connect() as conn,
            psycopg.connect(empty_db.server.dsn(), autocommit=True) as admin,
        ):
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_the_roles_work_on_a_hardened_database(roles: Roles) -> None:
    """A hardened database revokes from PUBLIC the use of its schema and TEMPORARY. Every init
    gives them back to the group roles: the writer appends, the reader rebuilds, and the
    consumer, which stages a large batch in temporary tables, folds a backlog over 300
    sessions (past what one statement carries). A consumer role without TEMPORARY (revoked,
    or an install older than that grant) is refused at start, in one line that says what to
    grant, instead of at the first burst."""
    db = roles.db
    dsn = roles.dsn(roles.consumer)
    with db.connect() as conn:
        conn.execute(
            sql.SQL("REVOKE TEMPORARY ON DATABASE {} FROM PUBLIC").format(sql.Identifier(db.name))
        )
        conn.execute("REVOKE ALL ON SCHEMA public FROM PUBLIC")
        conn.execute("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA public FROM PUBLIC")
    init_db(db.dsn, slot="agent_slot")  # (on a hardened database, or run again)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute(
            "SELECT has_database_privilege(current_database(), 'TEMP')"
        ).fetchone() == (True,)
    sids = [uuid.uuid4() for _ in range(300)]
    with Ledger(roles.dsn(roles.writer)) as ledger:
        for i in range(600):
            ledger.append(sids[i % 300], "a", "tool.invoked", {"call_id": f"c{i}", "tool": "t"})
    with InThread(dsn), Ledger(roles.dsn(roles.writer)) as ledger:
        wait_caught_up(db.dsn)  # (one staged batch)
        ledger.append(sids[0], "a", "tool.observed", {"call_id": "c0", "result": 1})
        wait_caught_up(db.dsn)  # (one statement: ledger_apply_batch)
    with psycopg.connect(roles.dsn(roles.reader), autocommit=True) as conn:
        assert rebuild_context(conn, sids[0]).event_count == 3
        assert projected_contexts(conn, [sids[0]])[sids[0]].event_count == 3
    with db.connect() as conn:
        (folded,) = conn.execute("SELECT sum(event_count) FROM agent_sessions").fetchone()  # type: ignore[misc]
        conn.execute(
            sql.SQL("REVOKE TEMPORARY ON DATABASE {} FROM ledger_consumer").format(
                sql.Identifier(db.name)
            )
        )
    assert folded == 601
    r = run_cli("consume", "--dsn", dsn)
    assert_clean_exit(r, 4)
    assert "may not create temporary tables" in r.output and "GRANT TEMPORARY" in r.output
