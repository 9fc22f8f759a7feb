"""Privileged SQL cannot be redirected (invariant 9).

Every SECURITY DEFINER and trigger function pins ``search_path`` with ``pg_temp`` last: without
it PostgreSQL looks a relation up in the session's temporary schema first, and any role may
create temporary tables. Proven twice: by the catalog (every such function, whatever its name,
on an unpartitioned and a partitioned ledger) and by behaviour (logged in as each group role's
member, with temporary tables named like every relation those functions touch, full of forged
rows: positions, prev_hash, heads, keys, idempotent answers and partitions stay the truth)."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql

from ledger_cdc.admin.partitions import ensure, list_partitions
from ledger_cdc.client.writer import Ledger
from tests.support.cdc import until
from tests.support.harness import Database
from tests.support.schema import init_db

pytestmark = pytest.mark.server

# every relation a ledger function reads or writes, by the name it uses
SHADOWED = (
    "agent_events",
    "agent_session_heads",
    "agent_event_keys",
    "ledger_partitioning",
    "agent_memo",
    "agent_kept_events",
    "agent_sessions",
    "agent_snapshots",
    "ledger_checkpoints",
    "ledger_dead_letters",
)

_PRIVILEGED = """
SELECT p.oid::regprocedure::text, p.prosecdef, p.prorettype = 'trigger'::regtype,
       (SELECT c FROM unnest(p.proconfig) c WHERE c LIKE 'search\\_path=%%')
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg\\_toast%%'
  AND (p.prosecdef OR p.prorettype = 'trigger'::regtype OR p.proname LIKE 'ledger\\_%%')
ORDER BY 1
"""


def _path_problem(setting: str | None, schema: str) -> str | None:
    """Why a function's search_path setting lets a relation lookup be redirected, or None."""
    if setting is None:
        return "no search_path of its own: it runs with the caller's"
    path = [p.strip().strip('"') for p in setting.split("=", 1)[1].split(",")]
    if path[-1] != "pg_temp":
        return f"search_path {path} does not end with pg_temp (searched first when unnamed)"
    if set(path[:-1]) - {"pg_catalog", schema}:
        return f"search_path {path} names a schema besides pg_catalog and the ledger's"
    return None


@pytest.mark.parametrize("partition_by", [None, "day"])
def test_every_privileged_or_trigger_function_pins_its_search_path(
    empty_db: Database, partition_by: str | None
) -> None:
    init_db(empty_db.dsn, partition_by=partition_by)
    with empty_db.connect() as conn:
        (schema,) = conn.execute("SELECT current_schema()").fetchone()  # type: ignore[misc]
        rows = conn.execute(_PRIVILEGED).fetchall()
        triggers = conn.execute(
            "SELECT DISTINCT tgfoid::regprocedure::text FROM pg_trigger "
            "WHERE tgrelid = 'agent_events'::regclass AND NOT tgisinternal"
        ).fetchall()
        no_create = conn.execute(
            "SELECT r FROM unnest(ARRAY['ledger_writer', 'ledger_reader', 'ledger_consumer', "
            "'ledger_dispatcher', 'public']) r "
            "WHERE has_schema_privilege(r, current_schema(), 'CREATE')"
        ).fetchall()
    secdef = [name for name, definer, _, _ in rows if definer]
    assert {"ledger_before_insert()", "ledger_session_head(uuid)"} <= set(secdef)
    assert {t for (t,) in triggers} <= {name for name, _, trig, _ in rows if trig}
    problems = {
        name: why
        for name, _, _, setting in rows
        if (why := _path_problem(setting, str(schema))) is not None
    }
    assert problems == {}
    # a schema a group role may create objects in could hold a look-alike function or operator
    assert no_create == []


@dataclass
class Members:
    writer: str
    reader: str
    consumer: str
    dispatcher: str


@pytest.fixture
def members(empty_db: Database) -> Iterator[Members]:
    m = Members(*(f"{k}_{empty_db.name}" for k in ("w", "r", "c", "d")))
    made = [
        (m.writer, "IN ROLE ledger_writer"),
        (m.reader, "IN ROLE ledger_reader"),
        (m.consumer, "REPLICATION IN ROLE ledger_consumer"),
        (m.dispatcher, "IN ROLE ledger_dispatcher"),
    ]
    # (the group roles are the cluster's: the harness's template made them)
    with psycopg.connect(empty_db.server.dsn(), autocommit=True) as admin:
        for name, extra in made:
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN " + extra).format(sql.Identifier(name)))
    try:
        yield m
    finally:
        with psycopg.connect(empty_db.server.dsn(), autocommit=True) as admin:
            for name, _ in made:
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def _shadow(conn: psycopg.Connection[tuple[object, ...]], sid: uuid.UUID) -> None:
    """Temporary tables named like every relation the ledger's functions use, each holding a
    forged row for ``sid`` where its shape allows: position 41, hash deadbeef, a head at 41, a
    key naming seq 999 and a partitioning unit."""
    for name in SHADOWED:
        conn.execute(
            sql.SQL(
                "CREATE TEMP TABLE {} (session_id uuid, position bigint, hash bytea, "
                "idempotency_key text, seq bigint, event_type text, payload jsonb, "
                "payload_sha256 bytea, created_at timestamptz, unit text, singleton bool)"
            ).format(sql.Identifier(name))
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO pg_temp.{} VALUES (%s, 41, '\\xdeadbeef', 'k', 999, 'task.started', "
                "'{{}}', '\\xdeadbeef', now(), 'day', true)"
            ).format(sql.Identifier(name)),
            (sid,),
        )


def _chain(db: Database, sid: uuid.UUID) -> list[tuple[int, bool]]:
    """(position, whether prev_hash is the hash of the event before it) of each event."""
    with db.connect() as conn:
        rows = conn.execute(
            "SELECT position, prev_hash, hash FROM agent_events WHERE session_id = %s "
            "ORDER BY position",
            (sid,),
        ).fetchall()
    out, before = [], None
    for position, prev, digest in rows:
        out.append((int(position), prev == before))  # type: ignore[call-overload]
        before = digest
    return out


@pytest.mark.parametrize("partition_by", [None, "day"])
def test_temporary_tables_of_every_role_steer_nothing(
    empty_db: Database, members: Members, partition_by: str | None
) -> None:
    init_db(empty_db.dsn, partition_by=partition_by)
    sid = uuid.uuid4()
    with Ledger(empty_db.dsn_as(members.writer)) as ledger:
        ledger.append(
            sid, "a", "tool.invoked", {"call_id": "c0", "tool": "t"}, idempotency_key="k0"
        )

    with empty_db.connect() as conn:
        (stored,) = conn.execute(  # type: ignore[misc]
            "SELECT payload::text FROM agent_events WHERE session_id = %s", (sid,)
        ).fetchone()

    # the writer, shadowing every relation, appends by the API and by plain SQL
    with psycopg.connect(empty_db.dsn_as(members.writer), autocommit=True) as conn:
        _shadow(conn, sid)
        (head,) = conn.execute("SELECT ledger_session_head(%s)", (sid,)).fetchone()  # type: ignore[misc]
        assert head == 1
        answers = conn.execute(
            "SELECT position, same FROM ledger_event_by_key(%s, 'k0', 'tool.invoked', %s)",
            (sid, stored),
        ).fetchall()
        assert answers == [(1, True)]
        assert conn.execute(
            "SELECT count(*) FROM ledger_event_by_key(%s, 'k', 'task.started', '{}')", (sid,)
        ).fetchone() == (0,)  # the forged key row of the temp table is not the ledger's
        (pos,) = conn.execute(  # type: ignore[misc]
            "INSERT INTO public.agent_events (session_id, agent_id, event_type, payload) "
            "VALUES (%s, 'a', 'task.completed', '{\"result\": \"forged\"}') RETURNING position",
            (sid,),
        ).fetchone()
        assert pos == 2
        with pytest.raises(psycopg.errors.UniqueViolation):  # the key is still the ledger's
            conn.execute(
                "INSERT INTO public.agent_events (session_id, agent_id, event_type, payload, "
                "idempotency_key) VALUES (%s, 'a', 'task.started', '{}', 'k0')",
                (sid,),
            )
        with pytest.raises(psycopg.errors.CheckViolation):  # a gap is still refused
            conn.execute(
                "INSERT INTO public.agent_events (session_id, position, agent_id, event_type, "
                "payload) VALUES (%s, 42, 'a', 'task.started', '{}')",
                (sid,),
            )

    # the other roles shadow the same names; a writer among them appends again
    for role in (members.reader, members.consumer, members.dispatcher):
        with psycopg.connect(empty_db.dsn_as(role), autocommit=True) as conn:
            _shadow(conn, sid)
            if role == members.reader:
                (head,) = conn.execute("SELECT ledger_session_head(%s)", (sid,)).fetchone()  # type: ignore[misc]
                assert head == 2
            if role == members.consumer:
                if partition_by:
                    made = conn.execute(
                        "SELECT * FROM ledger_ensure_partitions(2, %s)",
                        (dt.datetime(2031, 1, 1, tzinfo=dt.timezone.utc),),
                    ).fetchall()
                    assert [m for (m,) in made] == [
                        "agent_events_p20310101",
                        "agent_events_p20310102",
                        "agent_events_p20310103",
                    ]
                else:  # a temp ledger_partitioning does not make the ledger partitioned
                    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
                        conn.execute("SELECT * FROM ledger_ensure_partitions(1)")
    with Ledger(empty_db.dsn_as(members.writer)) as ledger:
        r = ledger.append(sid, "a", "task.failed", {"error": "x"})
        assert r.position == 3
    assert _chain(empty_db, sid) == [(1, True), (2, True), (3, True)]

    with empty_db.connect() as conn:
        if partition_by:
            heads = conn.execute(
                "SELECT position FROM agent_session_heads WHERE session_id = %s", (sid,)
            ).fetchall()
            keys = conn.execute(
                "SELECT idempotency_key, position FROM agent_event_keys WHERE session_id = %s",
                (sid,),
            ).fetchall()
            assert heads == [(3,)] and keys == [("k0", 1)]
            parts = {p.name for p in list_partitions(conn)}
            assert "agent_events_p20310102" in parts
            (ns,) = conn.execute(  # type: ignore[misc]
                "SELECT relnamespace::regnamespace::text FROM pg_class "
                "WHERE relname = 'agent_events_p20310102'"
            ).fetchone()
            assert ns == "public"
            assert ensure(conn, 0) == []  # today's partition was there already


@pytest.mark.min_server(17)  # (MAINTAIN is 17+: before it, only the owner vacuums)
def test_the_consumer_may_vacuum_its_projections_on_17_and_later(
    empty_db: Database, members: Members
) -> None:
    """VACUUM needs the owner, or MAINTAIN (PostgreSQL 17+), which init grants the consumer on
    the tables it rewrites."""
    init_db(empty_db.dsn)

    def vacuumed() -> object:
        with empty_db.connect() as conn:
            row = conn.execute(
                "SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = 'agent_sessions'"
            ).fetchone()
        return None if row is None else row[0]

    before = vacuumed()
    with psycopg.connect(empty_db.dsn_as(members.consumer), autocommit=True) as conn:
        conn.execute("VACUUM agent_sessions")
    until(lambda: vacuumed() != before, 30)
