"""The outbox dispatcher against a real local HTTP server, as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from ledger_cdc.client.dispatch import (
    DispatchConfig,
    Dispatcher,
    DispatchMetrics,
    HttpTarget,
    OutboxMessage,
)
from ledger_cdc.client.writer import Ledger, OutboxItem
from ledger_cdc.errors import AppendError
from tests.support.cdc import run_cli, until
from tests.support.cli import Output, run_cli_process, start_cli
from tests.support.harness import Database
from tests.support.httptarget import Target


def _outbox_rows(db: Database, n: int, target: str = "tool:search") -> list[str]:
    keys = []
    with Ledger(db.dsn) as ledger:
        for i in range(n):
            sid = uuid.uuid4()
            key = f"{sid}:call-{i}"
            ledger.append(
                sid,
                "agent",
                "tool.invoked",
                {"call_id": f"call-{i}", "tool": "search", "arguments": {"i": i}},
                idempotency_key=key,
                outbox=[OutboxItem(target, {"i": i}, key)],
            )
            keys.append(key)
    return keys


def _dispatcher(
    db: Database, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return start_cli(
        *("dispatch", "--dsn", db.dsn, "--log-format", "text"),
        *("--poll-interval", "0.05", "--backoff", "0.05", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _rows(db: Database) -> dict[str, tuple[bool, bool, int, str | None]]:
    with db.connect() as conn:
        return {
            k: (d, p, a, e)
            for k, d, p, a, e in conn.execute(
                "SELECT idempotency_key, dispatched, parked, attempts, last_error FROM agent_outbox"
            )
        }


def test_killed_between_call_and_mark_retries_with_the_same_key(db: Database) -> None:
    (key,) = _outbox_rows(db, 1)
    with Target(lambda k, n: -1 if n == 1 else 200) as target:
        first = _dispatcher(db, "--target", f"tool:search={target.url}", "--claim-seconds", "1")
        try:
            assert target.first_request.wait(30), "the dispatcher never called the target"
            first.send_signal(signal.SIGKILL)  # the target has the call; the mark never lands
            first.wait(10)
        finally:
            first.kill()
        assert _rows(db)[key][:2] == (False, False)
        # the dead dispatcher's claim expires after a second; then the row is called again
        second = _dispatcher(db, "--target", f"tool:search={target.url}", "--until-idle")
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 0, out
        assert target.seen == {key: 2}
        assert [r["headers"]["Idempotency-Key"] for r in target.requests] == [key, key]
        assert json.loads(target.requests[1]["body"]) == {"i": 0}
    dispatched, parked, attempts, error = _rows(db)[key]
    assert dispatched and not parked and error is None
    assert attempts == 2  # every call is counted, the one whose outcome was never written too


def test_a_dispatcher_killed_mid_batch_charges_attempts_only_to_rows_it_called(
    db: Database,
) -> None:
    """A claim counts as an attempt of each row it takes: it takes no more than are called at
    once, so a dispatcher killed mid-batch leaves the rows it never called uncharged (they used
    to be charged, and parked unsent after --max-attempts such kills)."""
    keys = _outbox_rows(db, 10)
    with Target(lambda k, n: -1 if n == 1 else 200) as target:  # first calls hang
        args = ("--target", f"tool:search={target.url}", "--claim-seconds", "1")
        first = _dispatcher(db, *args, "--concurrency", "2", "--batch-size", "32")
        try:
            until(lambda: len(target.requests) >= 2, 30)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        finally:
            first.kill()
        called = {r["key"] for r in target.requests}
        charged = {k for k, (_, _, attempts, _) in _rows(db).items() if attempts}
        assert charged == called and len(called) == 2
        second = _dispatcher(db, *args, "--until-idle")
        out, _ = second.communicate(timeout=120)
        assert second.returncode == 0, out
    rows = _rows(db)
    assert all(rows[k][0] and not rows[k][1] for k in keys), rows


def test_two_dispatchers_never_send_a_row_twice(db: Database) -> None:
    keys = _outbox_rows(db, 240)
    with Target(delay=0.01) as target:
        procs = [
            _dispatcher(
                db,
                "--target",
                f"tool:search={target.url}",
                "--until-idle",
                "--batch-size",
                "8",
                "--concurrency",
                "2",
            )
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        assert target.seen == {k: 1 for k in keys}
        assert target.overlaps == 0
    counts = [int(o.split("dispatched ")[-1].split(",")[0]) for o in outs]
    assert sum(counts) == 240 and min(counts) > 0, counts  # both took a share
    assert all(d and a == 1 for d, _, a, _ in _rows(db).values())


def test_a_failing_target_is_retried_until_it_recovers(db: Database) -> None:
    keys = _outbox_rows(db, 5)
    with Target(lambda k, n: 503 if n <= 2 else 200) as target:
        p = _dispatcher(
            db, "--target", f"tool:search={target.url}", "--until-idle", "--max-attempts", "5"
        )
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        assert target.seen == {k: 3 for k in keys}
    assert all(r == (True, False, 3, None) for r in _rows(db).values())
    assert "attempt 1 failed: HTTP 503" in out


def test_a_target_that_always_fails_is_parked_and_reported(db: Database) -> None:
    keys = _outbox_rows(db, 3)
    with Target(lambda k, n: 500) as target:
        p = _dispatcher(
            db, "--target", f"tool:search={target.url}", "--until-idle", "--max-attempts", "3"
        )
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 1, out  # rows were parked
        assert target.seen == {k: 3 for k in keys}
    for dispatched, parked, attempts, error in _rows(db).values():
        assert (
            not dispatched
            and parked
            and attempts == 3
            and error is not None
            and "HTTP 500" in error
        )
    assert out.count("parked after 3 attempts") == 3
    listed = run_cli_process("outbox", "--dsn", db.dsn, "--parked", "--json", check=True)
    rows = json.loads(listed.stdout)
    assert sorted(r["idempotency_key"] for r in rows) == sorted(keys)
    requeue = run_cli_process("outbox", "--dsn", db.dsn, "requeue", str(rows[0]["id"]), check=True)
    assert "requeued 1" in requeue.stdout
    assert sum(1 for r in _rows(db).values() if r[1]) == 2


def test_entry_point_target_and_unserved_targets(db: Database, tmp_path: Path) -> None:
    keys = _outbox_rows(db, 4, target="notify")
    other = _outbox_rows(db, 1, target="elsewhere")
    sent = tmp_path / "sent.txt"
    (tmp_path / "mytargets.py").write_text(
        textwrap.dedent(f"""
        def send(msg):
            with open({str(sent)!r}, "a") as f:
                f.write(msg.idempotency_key + " " + str(msg.payload["i"]) + "\\n")
    """)
    )
    dist = tmp_path / "mytargets-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mytargets\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[ledger_cdc.targets]\nnotify = mytargets:send\n")
    p = _dispatcher(db, "--until-idle", env={"PYTHONPATH": str(tmp_path)})
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    assert sorted(line.split()[0] for line in sent.read_text().splitlines()) == sorted(keys)
    assert "1 due row(s) for target 'elsewhere'" in out
    rows = _rows(db)
    assert all(rows[k][0] for k in keys) and not rows[other[0]][0]


def test_dispatch_without_targets_is_a_config_error(db: Database) -> None:
    p = _dispatcher(db, "--no-entry-points", "--once")
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 4 and "no targets" in out
    bad = _dispatcher(db, "--target", "nourl", "--once")
    out, _ = bad.communicate(timeout=60)
    assert bad.returncode == 4 and "NAME=URL" in out


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_sigterm_finishes_the_batch_and_exits(db: Database, sig: signal.Signals) -> None:
    _outbox_rows(db, 2)
    with Target() as target:
        p = _dispatcher(db, "--target", f"tool:search={target.url}")
        until(lambda: sum(1 for r in _rows(db).values() if r[0]) == 2, timeout=30)
        p.send_signal(sig)
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 0, out
        assert "dispatched 2" in out


def test_a_database_that_is_briefly_unreachable_is_retried(db: Database) -> None:
    with Target() as target:
        p = _dispatcher(db, "--target", f"tool:search={target.url}")
        assert p.stdout is not None
        output = Output(p.stdout)
        try:
            first = _outbox_rows(db, 1)
            until(lambda: _rows(db)[first[0]][0], timeout=30)
            with psycopg.connect(db.server.dsn(), autocommit=True) as admin:
                # the dispatcher's session ends and, for a while, it cannot reconnect
                admin.execute(
                    sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(
                        sql.Identifier(db.name)
                    )
                )
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    (db.name,),
                )
                output.wait_for("retrying in", timeout=30)  # it failed to reconnect
                admin.execute(
                    sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(
                        sql.Identifier(db.name)
                    )
                )
            later = _outbox_rows(db, 2)
            until(lambda: all(_rows(db)[k][0] for k in later), timeout=30)
            assert p.poll() is None  # still running
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(30)
        out = output.close()
        assert "outbox database" in out and "retrying in" in out, out
        assert target.seen == {k: 1 for k in first + later}


def test_no_transaction_is_held_across_a_call(db: Database) -> None:
    """A server that ends sessions idle in a transaction for 1 s, a target that takes 2 s: the
    call is made and marked, once, without a traceback (no transaction was open meanwhile)."""
    keys = _outbox_rows(db, 3)
    with db.connect() as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET idle_in_transaction_session_timeout = '1s'").format(
                sql.Identifier(db.name)
            )
        )
    with Target(delay=2.0) as target:
        p = _dispatcher(db, "--target", f"tool:search={target.url}", "--until-idle")
        out, _ = p.communicate(timeout=90)
    assert p.returncode == 0 and "Traceback" not in out, out
    assert target.seen == {k: 1 for k in keys}
    assert all(d and a == 1 for d, _, a, _ in _rows(db).values())


def test_a_claim_outlives_a_hanging_call_and_a_terminated_session(db: Database) -> None:
    """The target hangs longer than the claim, and the dispatcher's database session is
    terminated meanwhile: its claim is renewed (on a new connection), no second dispatcher calls
    the row, and the outcome is recorded once."""
    (key,) = _outbox_rows(db, 1)
    released = threading.Event()

    def behaviour(k: str, n: int) -> int:
        released.wait(60)
        return 200

    with Target(behaviour) as target:
        args = ("--target", f"tool:search={target.url}", "--claim-seconds", "2", "--timeout", "60")
        first = _dispatcher(db, *args, "--until-idle")
        try:
            assert target.first_request.wait(30)
            with db.connect() as conn:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name <> 'keep' "
                    "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
                )
            second = _dispatcher(db, *args, "--until-idle")
            deadline = time.monotonic() + 6  # three claims long: the claim must be renewed
            while time.monotonic() < deadline:
                if target.seen[key] != 1:
                    released.set()
                    first.kill()
                    raise AssertionError(first.communicate()[0])
                time.sleep(0.1)
            released.set()
            outs = [p.communicate(timeout=60)[0] for p in (first, second)]
        finally:
            released.set()
            for p in (first,):
                if p.poll() is None:
                    p.kill()
        assert target.seen == {key: 1}, outs
        assert all("Traceback" not in o for o in outs), outs
    dispatched, parked, attempts, error = _rows(db)[key]
    assert dispatched and not parked and attempts == 1 and error is None


def _dispatch_once(db: Database, target: object, **config: float) -> tuple[float, DispatchMetrics]:
    """One in-process pass over what is due; returns (seconds taken, metrics)."""
    d = Dispatcher(DispatchConfig(db.dsn, {"tool:search": target}, **config))  # type: ignore[dict-item]
    t0 = time.monotonic()
    metrics = d.run(once=True)
    return time.monotonic() - t0, metrics


def test_a_redirect_is_a_failure_not_a_dispatch(db: Database) -> None:
    """A 302 is not followed (urllib would resend the POST as a GET without its payload, to
    wherever it points, and call that done): the row stays due, with the reason."""
    (key,) = _outbox_rows(db, 1)
    with Target(lambda k, n: 302) as target:
        _, metrics = _dispatch_once(db, HttpTarget(target.url, timeout=10))
        assert [r for r in target.requests if r["key"] is None] == []  # no GET to /elsewhere
    dispatched, parked, attempts, error = _rows(db)[key]
    assert not dispatched and not parked and attempts == 1 and metrics.failures == 1
    assert error is not None and "HTTP 302" in error and "redirects are not followed" in error


def test_a_trickling_answer_meets_the_whole_call_deadline(db: Database) -> None:
    """A target that answers a byte a second never trips a per-read timeout: the deadline is
    the whole call's, so the pass ends and the row is failed, not held for ever."""
    (key,) = _outbox_rows(db, 1)
    with Target(lambda k, n: -2) as target:
        took, _ = _dispatch_once(db, HttpTarget(target.url, timeout=1.5), claim_seconds=1.0)
    assert took < 15, took
    dispatched, _, attempts, error = _rows(db)[key]
    assert not dispatched and attempts == 1
    assert error is not None and "no answer within 1.5s" in error


def test_a_hanging_python_target_is_given_up_at_the_call_timeout(db: Database) -> None:
    (key,) = _outbox_rows(db, 1)
    release = threading.Event()

    def hangs(msg: OutboxMessage) -> None:
        release.wait(120)

    try:
        took, _ = _dispatch_once(db, hangs, call_timeout=1.0, claim_seconds=1.0)
    finally:
        release.set()
    assert took < 15, took
    with db.connect() as conn:
        claimed_by, error = conn.execute(
            "SELECT claimed_by, last_error FROM agent_outbox WHERE idempotency_key = %s", (key,)
        ).fetchone()  # type: ignore[misc]
    assert claimed_by is None and "no answer within 1s" in error


def test_requeue_leaves_a_row_that_is_being_called(db: Database) -> None:
    """`outbox requeue` of a row a dispatcher is calling now would clear its live claim and let
    a second dispatcher call it at the same time: it is left alone, and said (exit 1)."""
    (key,) = _outbox_rows(db, 1)
    with Target(lambda k, n: -1) as target:
        first = _dispatcher(
            db, "--target", f"tool:search={target.url}", "--once", "--timeout", "60"
        )
        try:
            assert target.first_request.wait(30)
            with db.connect() as conn:
                (rid,) = conn.execute("SELECT id FROM agent_outbox").fetchone()  # type: ignore[misc]
            p = run_cli("outbox", "--dsn", db.dsn, "requeue", str(rid), str(rid + 1000))
            assert p.exit_code == 1, p.output
            assert (
                "requeued 0 row(s)" in p.stdout and f"not requeued: {rid}, {rid + 1000}" in p.stderr
            )
            with db.connect() as conn:
                live = conn.execute("SELECT claim_until > now() FROM agent_outbox").fetchone()
            assert live == (True,)
        finally:
            target.release.set()
            out, _ = first.communicate(timeout=60)
    assert target.seen == {key: 1}, out
    assert _rows(db)[key][:3] == (True, False, 1)


def test_an_outbox_key_taken_by_another_session_is_refused_at_once(db: Database) -> None:
    """An outbox key is unique across the ledger (a target deduplicates by it alone). Reusing one
    in another session is an AppendError with the reason — nothing written — not a database
    outage retried for ever."""
    first, second = uuid.uuid4(), uuid.uuid4()
    call = {"call_id": "c", "tool": "t"}
    with Ledger(db.dsn) as ledger:
        ledger.append(first, "a", "tool.invoked", call, outbox=[OutboxItem("t", {}, "k-1")])
        with pytest.raises(AppendError, match="outbox key 'k-1' already names another"):
            ledger.append(second, "a", "tool.invoked", call, outbox=[OutboxItem("t", {}, "k-1")])
    with db.connect() as conn:
        n = conn.execute("SELECT count(*) FROM agent_events WHERE session_id = %s", (second,))
        assert n.fetchone() == (0,)


def test_the_dispatcher_role_is_enough(db: Database) -> None:
    keys = _outbox_rows(db, 2)
    role = f"d_{db.name}"
    with psycopg.connect(db.server.dsn(), autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN IN ROLE ledger_dispatcher").format(sql.Identifier(role))
        )
    try:
        with Target() as target:
            p = run_cli_process(
                *("dispatch", "--dsn", db.dsn_as(role)),
                *("--target", f"tool:search={target.url}", "--until-idle"),
            )
            assert p.returncode == 0, p.stderr
            assert target.seen == {k: 1 for k in keys}
    finally:
        with psycopg.connect(db.server.dsn(), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.mark.parametrize("depth", [600, 3000])
def test_a_payload_nested_past_the_decoder_is_parked_not_fatal(db: Database, depth: int) -> None:
    """A row whose payload JSON nests past what the decoder takes (written by raw SQL: msgspec
    raises RecursionError, not a DecodeError) stopped the whole dispatcher at its claim, the rows
    claimed with it uncalled, again at every restart. It is parked, uncalled, at once; the
    others are dispatched. So is one nested past what a writer may store (READ_MAX_DEPTH) but
    not past the decoder: Python 3.11's stops near 1,000 levels, 3.13's near 10,000, and what
    is called must not depend on which runs the dispatcher."""
    bad, good = _outbox_rows(db, 2)
    with db.connect() as conn:
        conn.execute(
            "UPDATE agent_outbox SET payload = (repeat('{\"k\":', %s) || '1' || "
            "repeat('}', %s))::jsonb WHERE idempotency_key = %s",
            (depth, depth, bad),
        )
    called: list[str] = []
    _, metrics = _dispatch_once(db, lambda m: called.append(m.idempotency_key))
    assert called == [good]
    rows = _rows(db)
    dispatched, parked, attempts, error = rows[bad]
    assert not dispatched and parked and attempts == 1, rows[bad]
    assert error is not None and "payload cannot be read" in error
    assert rows[good][0] and metrics.parked == 1
