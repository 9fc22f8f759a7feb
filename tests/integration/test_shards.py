"""Sharded consumers: 4 shard publications (row filter on the session id), one slot and one
consumer each, under concurrent writers. Every session is folded by exactly one shard, the one
its id maps to, and the union of the shards' projections equals a full fold."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from ledger_cdc.client.read import projected_contexts
from ledger_cdc.client.recovery import fold_all
from tests.support.cdc import ConsumerProcess, Writers, until
from tests.support.harness import Database
from tests.support.schema import init_db


@pytest.fixture
def targets(db: Database) -> Iterator[list[str]]:
    """One projections database per shard (so each shard's output can be told apart)."""
    names = [f"{db.name}_shard{k}" for k in range(4)]
    with psycopg.connect(db.server.dsn(), autocommit=True) as conn:
        for n in names:
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(n), sql.Identifier(db.server.template)
                )
            )
    try:
        yield [db.server.dsn(n) for n in names]
    finally:
        with psycopg.connect(db.server.dsn(), autocommit=True) as conn:
            for n in names:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(n))
                )


def test_four_shards_fold_disjoint_sessions_whose_union_is_the_full_fold(
    db: Database, targets: list[str]
) -> None:
    res = init_db(db.dsn, shards=4)
    assert res.shards == [(f"agent_pub_s{k}", f"agent_slot_s{k}") for k in range(4)]
    with db.connect() as conn:
        filters = dict(
            conn.execute(
                "SELECT pubname, pg_get_expr(prqual, prrelid) FROM pg_publication_rel r "
                "JOIN pg_publication p ON p.oid = r.prpubid WHERE prqual IS NOT NULL"
            )
        )
        assert set(filters) == {f"agent_pub_s{k}" for k in range(4)}
    shards = [
        ConsumerProcess(db.dsn, "--shard", str(k), "--target-dsn", targets[k]).start()
        for k in range(4)
    ]
    writers = Writers(db.dsn, n=4, sessions=40, pace=0.002).start()
    try:
        until(lambda: writers.turns > 150, timeout=60)
    finally:
        writers.stop()
    with db.connect() as conn:
        expected = fold_all(conn)

    def folded() -> list[dict[uuid.UUID, object]]:
        out = []
        for dsn in targets:
            with psycopg.connect(dsn) as c:
                out.append(dict(projected_contexts(c)))
        return out

    until(
        lambda: (
            sum(len(p) for p in folded()) == len(expected)
            and all(p[s] == expected[s] for p in folded() for s in p)
        ),
        timeout=60,
    )
    per_shard = folded()
    for dsn in targets:  # another database than the ledger's: nothing stored by reference
        with psycopg.connect(dsn) as c:
            referencing = c.execute(
                "SELECT count(*) FILTER (WHERE jsonb_typeof(context -> 'window') = 'object'), "
                "count(*) FILTER (WHERE context #>> '{window,omitted}' = 'true' OR EXISTS ("
                "SELECT FROM jsonb_array_elements(context -> 'sources') x WHERE x ->> 3 = 'true')), "
                "(SELECT count(*) FROM agent_memo WHERE NOT (entry ? 'result' OR entry ? 'content'))"
                " FROM agent_sessions"
            ).fetchone()
            assert referencing is not None and referencing[0] > 0  # windows there are
            assert referencing[1:] == (0, 0)
    for k, projections in enumerate(per_shard):
        assert projections, f"shard {k} folded nothing"
        for sid in projections:
            assert sid.bytes[15] % 4 == k  # the shard its id maps to
    union = {sid: ctx for p in per_shard for sid, ctx in p.items()}
    assert len(union) == sum(len(p) for p in per_shard)  # disjoint
    assert union == expected
    for k, dsn in enumerate(targets):
        with psycopg.connect(dsn) as c:
            assert c.execute("SELECT slot_name FROM ledger_checkpoints").fetchall() == [
                (f"agent_slot_s{k}",)
            ]
    for s in shards:
        assert s.alive()
        s.kill()
