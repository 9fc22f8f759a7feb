"""Runs on a real server: lease races, take-over, suspend and signal, waking by notification."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from ledger_cdc.client.runs import (
    LeaseLostError,
    ReadyRun,
    RunNotReadyError,
    lease,
    list_runs,
    signal,
    submit,
)
from ledger_cdc.client.writer import AsyncLedger
from ledger_cdc.errors import ConcurrentAppendError
from tests.support.cdc import ConsumerProcess, wait_caught_up, wait_streaming
from tests.support.cli import run_cli_process
from tests.support.harness import Database
from tests.support.wait import until


@pytest.fixture
def consumer(db: Database) -> Iterator[ConsumerProcess]:
    with ConsumerProcess(db.dsn, "--create-slot") as c:
        wait_streaming(db.dsn)
        yield c


def test_two_workers_race_for_a_run_and_exactly_one_wins(db: Database) -> None:
    sid = uuid.uuid4()
    with db.connect() as a, db.connect() as b:
        submit(a, sid)
        # both read the run at the same position; the second append is refused
        from ledger_cdc.client.recovery import rebuild_context
        from ledger_cdc.client.runs import RunLeased
        from ledger_cdc.client.writer import append

        pos = rebuild_context(a, sid).last_position
        append(a, sid, "w1", "run.leased", RunLeased("w1", 30), expected_position=pos)
        with pytest.raises(ConcurrentAppendError):
            append(b, sid, "w2", "run.leased", RunLeased("w2", 30), expected_position=pos)
        with pytest.raises(RunNotReadyError, match="leased by w1"):
            lease(b, sid, "w2")


def test_an_expired_lease_is_taken_over_and_the_old_holder_stops(db: Database) -> None:
    sid = uuid.uuid4()
    with db.connect() as a, db.connect() as b:
        submit(a, sid)
        first = lease(a, sid, "w1", ttl=0.5)
        first.append("tool.invoked", {"call_id": "c", "tool": "t", "idempotency_key": "k"})
        with pytest.raises(RunNotReadyError):
            lease(b, sid, "w2")
        time.sleep(0.6)
        second = lease(b, sid, "w2", ttl=30)  # stale: anyone may take it
        assert list(second.ctx.pending_tools) == ["c"]
        assert second.ctx.pending_tools["c"].idempotency_key == "k"
        with pytest.raises(LeaseLostError, match="leased by w2"):
            first.append("tool.observed", {"call_id": "c", "result": 1})
        second.append("tool.observed", {"call_id": "c", "result": 1})
        second.complete()
        with pytest.raises(RunNotReadyError, match="completed"):
            lease(a, sid, "w1")


def test_the_holder_rebases_on_signals_and_renews_sparingly(db: Database) -> None:
    sid = uuid.uuid4()
    with db.connect() as a, db.connect() as b:
        submit(a, sid)
        run = lease(a, sid, "w1", ttl=10)
        signal(b, sid, "note", {"x": 1}, signal_id="s1")
        assert signal(b, sid, "note", {"x": 1}, signal_id="s1").duplicate  # delivered twice: once
        run.append("tool.invoked", {"call_id": "c", "tool": "t"})  # rebased past the signal
        assert run.ctx.run is not None and [s.name for s in run.ctx.run.inbox] == ["note"]
        assert run.renew() is False  # more than half the ttl left: no event
        head = run.ctx.last_position
        assert run.renew(force=True) is True and run.ctx.last_position == head + 1
        run.append("tool.observed", {"call_id": "c", "result": 2})  # still the holder
        run.suspend("wait for approval", ["approve"])
        assert run.ctx.run is not None and run.ctx.run.status == "suspended"
        with pytest.raises(LeaseLostError):
            run.append("tool.invoked", {"call_id": "d", "tool": "t"})
        signal(b, sid, "approve", {"by": "ann"})
        again = lease(b, sid, "w2")
        assert again.ctx.run is not None and again.ctx.run.woken_by is not None
        assert again.ctx.run.woken_by.payload == {"by": "ann"}


# pending_runs' session (named by _next_ready) idle once it has listened: waiting to be woken
_WAITING = """
SELECT EXISTS (SELECT FROM pg_stat_activity WHERE datname = current_database()
  AND application_name = 'runs-waiter'
  AND state = 'idle' AND (query LIKE 'LISTEN%' OR query LIKE '%FROM agent_sessions%'))
"""


async def _next_ready(dsn: str, want: uuid.UUID, timeout: float) -> tuple[ReadyRun, float]:
    async def first() -> ReadyRun:
        async with await AsyncLedger.connect(dsn) as ledger:
            # a long recheck: the NOTIFY wakes
            waiter = f"{dsn} application_name=runs-waiter"
            async for r in ledger.pending_runs(recheck=30, dsn=waiter):
                if r.session_id == want:
                    return r
        raise AssertionError("pending_runs ended")

    t0 = time.monotonic()
    r = await asyncio.wait_for(first(), timeout)
    return r, time.monotonic() - t0


def test_a_suspended_run_wakes_on_its_signal_through_the_consumer(
    db: Database, consumer: ConsumerProcess
) -> None:
    sid = uuid.uuid4()
    with db.connect() as conn:
        submit(conn, sid)
        lease(conn, sid, "w1").suspend("approval", ["approve"])
        wait_caught_up(db.dsn)
        assert [r["status"] for r in list_runs(conn, "suspended")] == ["suspended"]

        def send() -> None:
            with db.connect() as c2:
                # not before the waiter listens, has found nothing ready and waits idle
                until(lambda: c2.execute(_WAITING).fetchone() == (True,), 20)
                signal(c2, sid, "approve")

        threading.Thread(target=send).start()
        ready, waited = asyncio.run(_next_ready(db.dsn, sid, 20))
        assert ready.status == "pending" and waited < 15  # woken long before the 30 s recheck
        assert list_runs(conn, "pending")[0]["session_id"] == sid


def test_a_signal_sent_while_the_consumer_is_down_wakes_the_run_when_it_returns(
    db: Database, consumer: ConsumerProcess
) -> None:
    sid = uuid.uuid4()
    with db.connect() as conn:
        submit(conn, sid)
        lease(conn, sid, "w1").suspend("approval", ["approve"])
        wait_caught_up(db.dsn)
        consumer.kill()
        signal(conn, sid, "approve")
        assert list_runs(conn, "suspended")  # nobody folded the signal (kill waited for the exit)
        restarted = ConsumerProcess(db.dsn).start()
        try:
            ready, _ = asyncio.run(_next_ready(db.dsn, sid, 60))
            assert ready.status == "pending"
        finally:
            restarted.kill()


def test_an_expired_lease_is_announced_by_the_consumer(
    db: Database, consumer: ConsumerProcess
) -> None:
    sid = uuid.uuid4()
    with db.connect() as conn:
        submit(conn, sid)
        lease(conn, sid, "w1", ttl=1.5)
        wait_caught_up(db.dsn)
        ready, _ = asyncio.run(_next_ready(db.dsn, sid, 20))
        assert ready.status == "stale" and ready.lease_worker == "w1"
        until_ = conn.execute("SELECT lease_until FROM agent_sessions").fetchone()
        assert until_ is not None and until_[0] <= dt.datetime.now(dt.timezone.utc)


def test_runs_and_signal_commands(db: Database, consumer: ConsumerProcess) -> None:
    sid = uuid.uuid4()
    with db.connect() as conn:
        submit(conn, sid)
        lease(conn, sid, "w1").suspend("approval", ["approve", "reject"])
    wait_caught_up(db.dsn)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli_process(*args, "--dsn", db.dsn)

    out = cli("runs", "--status", "suspended", "--json")
    rows = json.loads(out.stdout)
    assert [(r["session_id"], r["wait_for"]) for r in rows] == [(str(sid), ["approve", "reject"])]
    sent = cli("signal", str(sid), "approve", "--payload", '{"by": "ann"}', "--id", "a1")
    assert sent.returncode == 0 and "signal approve sent" in sent.stdout
    again = cli("signal", str(sid), "approve", "--payload", '{"by": "ann"}', "--id", "a1")
    assert "already sent" in again.stdout
    bad = cli("signal", str(sid), "approve", "--payload", "{nope")
    assert bad.returncode == 2 and "not JSON" in bad.stderr
    wait_caught_up(db.dsn)
    assert json.loads(cli("runs", "--status", "pending", "--json").stdout)[0]["session_id"] == str(
        sid
    )
    with psycopg.connect(db.dsn) as conn:
        assert list_runs(conn, "suspended") == []


def test_run_arguments_a_reader_would_not_take_are_refused(db: Database) -> None:
    """A ttl of True or NaN, a signal name that is not a string, one string given as the names
    to wait for (its letters): each refused by the writer, nothing appended, the run still
    leasable by exactly one worker."""
    from ledger_cdc.errors import InvalidEventError

    sid = uuid.uuid4()
    with db.connect() as conn:
        submit(conn, sid)
        for ttl in (True, float("nan"), float("inf"), 0, -5):
            with pytest.raises(ValueError, match="ttl must be"):
                lease(conn, sid, "w1", ttl=ttl)
        with pytest.raises(InvalidEventError, match="Expected `str`"):
            signal(conn, sid, 123)  # type: ignore[arg-type]
        run = lease(conn, sid, "w1")
        with pytest.raises(InvalidEventError, match="the string 'approval'"):
            run.suspend("waiting", "approval")
        with pytest.raises(InvalidEventError, match="non-empty strings"):
            run.suspend("waiting", ["ok", 7])  # type: ignore[list-item]
        with pytest.raises(InvalidEventError, match="over 1,000"):
            run.suspend("waiting", [f"s{i}" for i in range(1001)])
        (n,) = conn.execute(  # type: ignore[misc]
            "SELECT count(*) FROM agent_events WHERE session_id = %s", (sid,)
        ).fetchone()
        assert n == 2  # run.queued, run.leased
        run.suspend("waiting", ["approval"])
        signal(conn, sid, "a")  # one of its letters: not what it waits for
        with pytest.raises(RunNotReadyError):
            lease(conn, sid, "w2")
        signal(conn, sid, "approval")
        assert lease(conn, sid, "w2").ctx.run is not None
