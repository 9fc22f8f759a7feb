"""Failover of the ledger's server, with real processes (issue 43): a primary and a physical
standby (tests/support/standby.py), writers and ``ledger-cdc consume`` on a multi-host DSN,
the primary SIGKILLed while writers run, the standby promoted, writers going on. Each test
appends one more event to every session on the promoted server, waits for a barrier event
folded after them, and ends with the projections equal to a refold of the promoted server's
ledger (0 lost, 0 doubled, none ahead) and ``verify`` passing.

- PostgreSQL 18 with a failover slot, projections in the ledger's database or on a third
  server (``--target-dsn``): the consumer goes on from the slot the standby synchronised, no
  resync. A promoted standby that keeps ``synchronized_standby_slots`` stalls logical
  decoding, which the consumer and ``lag`` must name.
- PostgreSQL 15 and 18 without one: the slot is gone after the promotion and the consumer
  makes it again and resyncs from the table (``--create-slot``, or by default once it has
  streamed).
- ``--target-dsn`` with an asynchronous standby that missed the primary's last events, which
  the projections had folded: they must be refolded from the new ledger.

In all but the last the standby is synchronous, so every turn a writer was acknowledged for is
also in the promoted server's ledger; the last one is asynchronous by design.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import psycopg
import pytest

from ledger_cdc.cli import cli
from ledger_cdc.client.read import projected_contexts
from ledger_cdc.client.recovery import fold_all, load_events, load_memo
from ledger_cdc.client.writer import Ledger
from ledger_cdc.fold import SessionContext, decode_context, encode_snapshot, fold
from tests.support.cdc import (
    ConsumerProcess,
    assert_clean_exit,
    assert_projections_equal_refold,
    assert_verify_exact,
    run_cli,
)
from tests.support.harness import _new_database
from tests.support.schema import init_db
from tests.support.standby import FailoverWriters, PrimaryStandby
from tests.support.wait import until

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(240)]

FOLDED_BEFORE = 2000  # events folded on the old primary before it is killed


@pytest.fixture
def target(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """The projection database, parametrized indirectly: False gives None (the ledger's own
    database), True a database with the ledger schema on the harness's PostgreSQL 18, a
    third server independent of the pair."""
    if not getattr(request, "param", False):
        yield None
        return
    server = request.getfixturevalue("_servers").get(18)
    for db in _new_database(server, server.template):
        yield db.dsn


# -- helpers ------------------------------------------------------------------------------------


def _tail(log: Path, n: int = 40) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(lines[-n:])


def _count(dsn: str, q: str, *params: Any) -> int:
    """A count on a fresh connection (0 while the server does not answer)."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            return int(conn.execute(q.encode(), params).fetchone()[0])  # type: ignore[index]
    except psycopg.OperationalError:
        return 0


def _folded(dsn: str) -> int:
    return _count(dsn, "SELECT coalesce(sum(event_count), 0) FROM agent_sessions")


def _while_consuming(
    what: str,
    pred: Callable[[], bool],
    consumer: ConsumerProcess,
    log: Path,
    timeout: float = 60,
) -> None:
    """Until ``pred()``; fails at once, with the consumer's log, if the consumer exits."""

    def met() -> bool:
        if pred():
            return True
        if not consumer.alive():
            code = consumer.proc.returncode if consumer.proc else None
            raise AssertionError(f"{what}: the consumer exited ({code}):\n{_tail(log)}")
        return False

    until(met, timeout, every=0.1, what=lambda: f"{what}; consumer log:\n{_tail(log)}")


def _consumer(pair: PrimaryStandby, log: Path, *args: str) -> ConsumerProcess:
    return ConsumerProcess(
        pair.dsn(), "--heartbeat-interval", "1", "--health-interval", "1", *args, log=log
    ).start()


def _fail_over(
    pair: PrimaryStandby,
    writers: FailoverWriters,
    consumer: ConsumerProcess,
    log: Path,
    *,
    reset: bool = True,
) -> int:
    """Kill the primary under the writers, promote the standby, wait until every writer has
    had turns acknowledged by it, stop them. Returns the ledger's events at the promotion."""
    writers.failing_over.set()
    pair.kill_primary()
    pair.promote(reset_synchronized_standby_slots=reset)
    at_promotion = _count(pair.dsn(), "SELECT count(*) FROM agent_events")
    writers.mark_after()
    _while_consuming(
        "every writer appends on the promoted standby",
        lambda: sum(1 for n in writers.acked_after.values() if n >= 5) == writers.n,
        consumer,
        log,
    )
    writers.failing_over.clear()
    writers.stop()  # (raises an error a writer met outside the failover)
    return at_promotion


def _settle(
    pair: PrimaryStandby,
    writers: FailoverWriters,
    projections: str,
    consumer: ConsumerProcess,
    log: Path,
) -> None:
    """One more event in every session on the promoted server, then one in a new session:
    folded in commit order, that barrier's projection proves the consumer is past the rest."""
    with Ledger(pair.dsn()) as ledger:
        for sid in writers.sessions:
            ledger.append(sid, "after", "tool.invoked", {"call_id": f"after-{sid}", "tool": "t"})
        barrier = uuid.uuid4()
        ledger.append(barrier, "after", "tool.invoked", {"call_id": "barrier", "tool": "t"})
    _while_consuming(
        "the barrier folded",
        lambda: (
            _count(
                projections, "SELECT count(*) FROM agent_sessions WHERE session_id = %s", barrier
            )
            == 1
        ),
        consumer,
        log,
    )


def _acked_in(dsn: str) -> set[tuple[uuid.UUID, str]]:
    """(session, call id) of every turn in the ledger."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {
            (sid, key)
            for sid, key in conn.execute(
                "SELECT session_id, idempotency_key FROM agent_events "
                "WHERE event_type = 'tool.invoked' AND idempotency_key IS NOT NULL"
            )
        }


def _lost(dsn: str, writers: FailoverWriters) -> int:
    """Acknowledged turns the ledger does not have."""
    have = _acked_in(dsn)
    return sum(1 for a in writers.acked if a not in have)


def _assert_target_equal_refold(ledger_dsn: str, target_dsn: str) -> int:
    """The projections in ``target_dsn`` (and their snapshots and memo) equal a fold of the
    ledger in ``ledger_dsn`` from zero; none is ahead of it. Returns the ledger's events."""
    with (
        psycopg.connect(ledger_dsn, autocommit=True) as lc,
        psycopg.connect(target_dsn, autocommit=True) as tc,
    ):
        expected = fold_all(lc)
        got = projected_contexts(tc)
        ahead = [
            (ctx.last_position, expected[sid].last_position if sid in expected else 0)
            for sid, ctx in got.items()
            if ctx.last_position > (expected[sid].last_position if sid in expected else 0)
        ]
        assert not ahead, (
            f"{len(ahead)} projections ahead of the ledger (projection, ledger head): {ahead[:5]}"
        )
        assert set(got) == set(expected), (len(got), len(expected))
        for sid, ctx in expected.items():
            assert got[sid] == ctx, f"session {sid} differs from a refold"
        events: dict[uuid.UUID, list[Any]] = {}
        for ev in load_events(lc):
            events.setdefault(ev.session_id, []).append(ev)
        for sid, upto_pos, data in tc.execute(
            "SELECT session_id, upto_position, data FROM agent_snapshots WHERE data IS NOT NULL"
        ):
            prefix = [e for e in events[sid] if e.position <= upto_pos]
            # (a database other than the ledger's holds what it would reference: copied)
            folded = fold(prefix, session_id=sid)
            as_snapshot = decode_context(encode_snapshot(folded, reference=False))
            assert decode_context(data) == as_snapshot, f"snapshot {sid}@{upto_pos}"
        for sid, ctx in expected.items():
            blank = msgspec.structs.replace(SessionContext(sid), memo_position=ctx.last_position)
            stored = load_memo(tc, blank)
            assert stored.completed_tools == ctx.completed_tools, f"memo of {sid}"
            assert stored.completed_models == ctx.completed_models, f"memo of {sid}"
        return sum(len(v) for v in events.values())


def _verify_takes_target_dsn() -> bool:
    verify = cli.commands["verify"]
    return any("--target-dsn" in p.opts for p in verify.params)


def _assert_exact(pair: PrimaryStandby, target: str | None) -> int:
    """Projections equal a refold of the promoted server's ledger, and verify says so (with
    --target-dsn where the projections are elsewhere, once verify takes it). Returns the
    ledger's events."""
    if target is None:
        events = assert_projections_equal_refold(pair.dsn())
        assert_verify_exact(pair.dsn())
        return events
    events = _assert_target_equal_refold(pair.dsn(), target)
    if _verify_takes_target_dsn():
        assert_clean_exit(run_cli("verify", "--all", "--dsn", pair.dsn(), "--target-dsn", target))
    return events


def _stop(consumer: ConsumerProcess, log: Path) -> None:
    code = consumer.terminate()
    assert code == 0, f"consume exited {code}:\n{_tail(log)}"


# -- PostgreSQL 18, failover slot ---------------------------------------------------------------


def _slot_report(dsn: str) -> dict[str, Any]:
    """What `ledger-cdc lag --json` says of agent_slot."""
    import json

    r = run_cli("lag", "--dsn", dsn, "--slot", "agent_slot", "--json", "--sample-seconds", "0")
    (report,) = json.loads(r.output)
    return dict(report)


@pytest.mark.parametrize("target", [False, True], indirect=True, ids=["same-db", "target-dsn"])
def test_failover_slot_carries_the_consumer_over_a_promotion(
    tmp_path: Path, target: str | None
) -> None:
    """The slot the standby synchronised is the one the consumer streams after the promotion:
    no resync, nothing lost or doubled, and what writers append on the new primary is folded.
    The consumer runs without --create-slot: had the slot not survived, it would resync."""
    log = tmp_path / "consume.log"
    projections_args = ("--target-dsn", target) if target else ()
    with PrimaryStandby(18, failover_slots=True, synchronous=True) as pair:
        init_db(pair.primary_dsn(), slot="agent_slot", failover=True)
        projections = target or pair.dsn()
        with (
            _consumer(pair, log, *projections_args) as consumer,
            FailoverWriters(pair.dsn()) as writers,
        ):
            _while_consuming(
                f"{FOLDED_BEFORE} events folded",
                lambda: _folded(projections) >= FOLDED_BEFORE,
                consumer,
                log,
            )
            pair.wait_slot_synced("agent_slot")
            ready = _slot_report(pair.primary_dsn())
            assert ready["failover"] and ready["failover_ready"], ready
            assert ready["failover_standbys"], ready  # (the standby that keeps it, named)
            at_promotion = _fail_over(pair, writers, consumer, log)
            _settle(pair, writers, projections, consumer, log)
            _stop(consumer, log)
        assert _lost(pair.dsn(), writers) == 0, "acknowledged turns lost"
        events = _assert_exact(pair, target)
        assert events > at_promotion >= FOLDED_BEFORE, (events, at_promotion)
        text = log.read_text()
        assert "slot agent_slot created at" not in text, f"resynced:\n{_tail(log)}"


def test_promoted_standby_keeping_synchronized_standby_slots_names_the_stall(
    tmp_path: Path,
) -> None:
    """pg_basebackup copied synchronized_standby_slots to the standby: promoted, it waits for
    a standby slot it does not have and sends the consumer nothing. The consumer's log and
    `ledger-cdc lag` name the setting; once it is reset, everything is folded, exact. (The
    failover slot is made here by SQL, as an operator would have before ledger-cdc could.)"""
    log = tmp_path / "consume.log"
    with PrimaryStandby(18, failover_slots=True, synchronous=True) as pair:
        init_db(pair.primary_dsn())
        pair.create_logical_slot("agent_slot")
        with _consumer(pair, log) as consumer, FailoverWriters(pair.dsn(), n=2) as writers:
            _while_consuming(
                "events folded",
                lambda: _folded(pair.primary_dsn()) >= FOLDED_BEFORE // 3,
                consumer,
                log,
            )
            pair.wait_slot_synced("agent_slot")
            _fail_over(pair, writers, consumer, log, reset=False)
            assert pair.standby is not None
            standby = pair.standby
            # the server's side of the stall: its WARNING names the setting
            _while_consuming(
                "the promoted server logs the wait for the standby slot",
                lambda: "synchronized_standby_slots" in pair.server_log(standby),
                consumer,
                log,
                timeout=30,
            )
            _while_consuming(
                "the consumer names synchronized_standby_slots",
                lambda: "synchronized_standby_slots" in log.read_text(),
                consumer,
                log,
                timeout=20,
            )
            lag = run_cli("lag", "--dsn", pair.dsn(), "--sample-seconds", "0")
            assert "synchronized_standby_slots" in lag.output, lag.output
            assert lag.exit_code != 0, lag.output
            pair.reset_synchronized_standby_slots()
            _settle(pair, writers, pair.dsn(), consumer, log)
            _stop(consumer, log)
        assert _lost(pair.dsn(), writers) == 0, "acknowledged turns lost"
        assert _assert_exact(pair, None) > 0


# -- no failover slot: the resync path ----------------------------------------------------------


@pytest.mark.parametrize("remade", ["create-slot", "by-default"])
@pytest.mark.parametrize("major", [15, 18], ids=["pg15", "pg18"])
def test_promotion_without_failover_slot_resyncs_from_the_table(
    tmp_path: Path, major: int, remade: str
) -> None:
    """The promoted standby has no logical slot: the consumer makes it again and folds from
    the ledger table what its projections lack, then streams; exact. With --create-slot it
    made the slot at its first start too; without, init made it and the consumer, having
    streamed, remakes a slot gone missing by default."""
    log = tmp_path / "consume.log"
    with PrimaryStandby(major, synchronous=True) as pair:
        if remade == "create-slot":
            init_db(pair.primary_dsn())
            args: tuple[str, ...] = ("--create-slot",)
        else:
            init_db(pair.primary_dsn(), slot="agent_slot")
            args = ()
        with _consumer(pair, log, *args) as consumer, FailoverWriters(pair.dsn()) as writers:
            _while_consuming(
                f"{FOLDED_BEFORE} events folded",
                lambda: _folded(pair.primary_dsn()) >= FOLDED_BEFORE,
                consumer,
                log,
            )
            at_promotion = _fail_over(pair, writers, consumer, log)
            _settle(pair, writers, pair.dsn(), consumer, log)
            _stop(consumer, log)
        assert _lost(pair.dsn(), writers) == 0, "acknowledged turns lost"
        events = _assert_exact(pair, None)
        assert events > at_promotion >= FOLDED_BEFORE, (events, at_promotion)
        bootstraps = log.read_text().count("slot agent_slot created at")
        assert bootstraps == (2 if remade == "create-slot" else 1), _tail(log)


# -- --target-dsn and an asynchronous standby that missed the last events -----------------------


@pytest.mark.parametrize("target", [True], indirect=True, ids=["target-dsn"])
def test_async_loss_with_target_dsn_refolds_from_the_new_ledger(
    tmp_path: Path, target: str
) -> None:
    """Projections on a third server (--target-dsn) folded events the asynchronous standby
    never received; the primary dies, the standby is promoted without them. After the
    consumer runs on the new primary, the projections equal a refold of the new ledger (no
    session ahead of it), events appended after the failover are folded, verify passes."""
    log = tmp_path / "consume.log"
    with PrimaryStandby(18) as pair:
        init_db(pair.primary_dsn())
        with (
            _consumer(pair, log, "--create-slot", "--target-dsn", target) as consumer,
            FailoverWriters(pair.dsn()) as writers,
        ):
            _while_consuming(
                "events folded", lambda: _folded(target) >= FOLDED_BEFORE // 2, consumer, log
            )
            pair.detach_standby()
            kept = _count(pair.standby_dsn(), "SELECT count(*) FROM agent_events")
            # the projections fold what the standby will never have
            _while_consuming(
                "events folded past the standby's",
                lambda: _folded(target) >= kept + 1000,
                consumer,
                log,
            )
            _fail_over(pair, writers, consumer, log)
            assert _lost(pair.dsn(), writers) > 0, "the standby missed nothing: no loss to test"
            _settle(pair, writers, target, consumer, log)
            assert _assert_exact(pair, target) > kept
            _stop(consumer, log)
