"""The consumer's rules as tables: when a batch goes to the sink, when a snapshot is due, how long
a retry waits. Each policy takes its clock (and random source) as an argument."""

from __future__ import annotations

import uuid

import msgspec
import pytest

from ledger_cdc.batching import SnapshotPolicy
from ledger_cdc.consumer.policy import CATCH_UP_DELAY, CATCH_UP_LAG, IDLE_WAIT, FlushPolicy
from ledger_cdc.fold import SessionContext, SessionStatus
from ledger_cdc.retry import Backoff, delay


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# (events added, bytes added, seconds passed, sink busy) → (full, overdue)
FLUSH_TABLE = [
    ((0, 0, 0.0, False), (False, False)),  # nothing in hand
    ((0, 0, 9.0, False), (False, False)),  # nothing in hand, however long
    ((3, 100, 0.0, False), (False, False)),  # young, small
    ((3, 100, 0.06, False), (False, True)),  # older than max_delay, sink free: goes
    ((3, 100, 0.06, True), (False, False)),  # older, but the sink is busy: keeps growing
    ((10, 100, 0.0, True), (True, False)),  # batch_size events: full, busy or not
    ((1, 1001, 0.0, False), (True, False)),  # past the byte budget: full
    ((1, 1000, 0.0, False), (False, False)),  # at the budget exactly: not yet
]


@pytest.mark.parametrize(("given", "want"), FLUSH_TABLE)
def test_flush_policy(given: tuple[int, int, float, bool], want: tuple[bool, bool]) -> None:
    events, size, passed, busy = given
    clock = Clock()
    p = FlushPolicy(batch_size=10, budget=1000, max_delay=0.05, clock=clock)
    if events or size:
        p.add(events, size)
    clock.now += passed
    assert (p.full, p.overdue(busy)) == want


def test_flush_policy_reset_and_wait() -> None:
    clock = Clock()
    p = FlushPolicy(batch_size=10, budget=1000, max_delay=0.05, clock=clock)
    assert p.wait_timeout() == IDLE_WAIT
    p.add(4, 10)
    clock.now += 1
    p.add(4, 10)  # the oldest transaction sets the age
    assert p.overdue(False) and p.wait_timeout() == 0.05
    p.reset(2, 5)  # what did not fit the batch stays in hand, its age from now
    assert (p.events, p.size) == (2, 5) and not p.overdue(False)
    p.reset()
    assert p.since is None and p.wait_timeout() == IDLE_WAIT


def test_flush_policy_waits_longer_while_catching_up() -> None:
    """A transaction sent long after its commit (a backlog) lets an overdue batch wait for
    more, up to CATCH_UP_DELAY; one sent promptly brings max_delay back; full is full."""
    clock = Clock()
    p = FlushPolicy(batch_size=10, budget=1000, max_delay=0.05, clock=clock)
    p.add(3, 100, lag=CATCH_UP_LAG + 30)
    clock.now += 0.06
    assert p.catching_up and not p.overdue(False)
    clock.now += CATCH_UP_DELAY
    assert p.overdue(False) and not p.overdue(True)
    p.reset()
    p.add(3, 100, lag=CATCH_UP_LAG + 30)
    p.add(7, 100, lag=CATCH_UP_LAG + 30)
    assert p.full  # batch_size, however far behind
    p.reset()
    p.add(3, 100, lag=CATCH_UP_LAG + 30)
    p.add(1, 10, lag=CATCH_UP_LAG / 2)  # caught up: the batch in hand is overdue as usual
    clock.now += 0.06
    assert not p.catching_up and p.overdue(False)
    slow = FlushPolicy(batch_size=10, budget=1000, max_delay=CATCH_UP_DELAY * 2, clock=clock)
    slow.add(1, 10, lag=CATCH_UP_LAG + 30)
    clock.now += CATCH_UP_DELAY + 0.01
    assert not slow.overdue(False)  # a max_delay above the catch-up delay still holds
    eager = FlushPolicy(batch_size=10, budget=1000, max_delay=0.05, catch_up_delay=0, clock=clock)
    eager.add(1, 10, lag=CATCH_UP_LAG + 30)
    clock.now += 0.06
    assert eager.catching_up and eager.overdue(False)  # (a consumer that publishes)


def _ctx(count: int, status: str = SessionStatus.RUNNING) -> SessionContext:
    return msgspec.structs.replace(
        SessionContext(uuid.uuid4()), event_count=count, status=SessionStatus(status)
    )


# (every, count before the transaction, status before, count after, status after) → due
SNAPSHOT_TABLE = [
    (100, 0, "running", 99, "running", False),
    (100, 0, "running", 100, "running", True),  # crossed 100
    (100, 99, "running", 101, "running", True),  # crossed inside the transaction: due at its end
    (100, 100, "running", 150, "running", False),
    (100, 150, "running", 350, "running", True),  # crossed two multiples: one snapshot
    (100, 5, "running", 6, "completed", True),  # the session ended
    (100, 5, "running", 6, "failed", True),
    (100, 6, "completed", 7, "completed", False),  # already ended before
    (0, 0, "running", 1000, "running", False),  # every 0: only at the end
    (0, 3, "running", 4, "completed", True),
    (1, 3, "running", 4, "running", True),
]


@pytest.mark.parametrize(
    ("every", "before", "status_before", "after", "status", "due"), SNAPSHOT_TABLE
)
def test_snapshot_policy(
    every: int, before: int, status_before: str, after: int, status: str, due: bool
) -> None:
    assert SnapshotPolicy(every).due(before, status_before, _ctx(after, status)) is due


def _mid(lo: float, hi: float) -> float:
    return (lo + hi) / 2


@pytest.mark.parametrize(
    ("attempt", "want"), [(0, 0.5), (1, 1.0), (2, 2.0), (5, 16.0), (6, 30.0), (60, 30.0), (-3, 0.5)]
)
def test_backoff_doubles_to_its_cap(attempt: int, want: float) -> None:
    assert delay(attempt, base=0.5, cap=30.0, rand=_mid) == want


def test_backoff_jitter_bounds() -> None:
    assert delay(2, base=1.0, cap=60.0, jitter=0.25, rand=lambda lo, hi: lo) == 3.0
    assert delay(2, base=1.0, cap=60.0, jitter=0.25, rand=lambda lo, hi: hi) == 5.0


def test_backoff_starts_over_only_after_a_healthy_while() -> None:
    clock = Clock()
    b = Backoff(base=1.0, cap=60.0, healthy_after=30.0, clock=clock, rand=_mid)
    assert [b.failed() for _ in range(3)] == [1.0, 2.0, 4.0]
    b.succeeded()
    clock.now += 5  # a half-recovery: it fails again soon
    assert b.failed() == 8.0
    b.succeeded()
    clock.now += 31  # streamed for a while: the next failure is a first one
    assert b.failed() == 1.0
    plain = Backoff(base=1.0, cap=60.0, rand=_mid)  # no healthy_after: any success resets
    plain.failed()
    plain.failed()
    plain.succeeded()
    assert plain.failed() == 1.0


class _Conn:
    """Records the statements a task step sends (its decisions are what is tested)."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def add_notice_handler(self, handler: object) -> None:
        pass

    def execute(self, query: str) -> None:
        self.sent.append(query)


def test_the_projections_are_vacuumed_after_enough_writes_or_time_and_never_when_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ledger_cdc.consumer import tasks

    clock = [100.0]
    monkeypatch.setattr(tasks.time, "monotonic", lambda: clock[0])
    written = [0]
    step = tasks.vacuum(lambda: written[0], every=2.0)
    conn = _Conn()
    for _ in range(20):  # idle for a long while: no VACUUM at all
        clock[0] += 1.0
        step(conn)  # type: ignore[arg-type]
    assert conn.sent == []
    written[0] += 5  # a few rows after a long quiet: the interval is long up, vacuumed now
    clock[0] += tasks.VACUUM_TICK
    step(conn)  # type: ignore[arg-type]
    assert len(conn.sent) == 1
    written[0] += 5  # a few more: not before the interval is up again
    clock[0] += 1.0
    step(conn)  # type: ignore[arg-type]
    assert len(conn.sent) == 1
    clock[0] += 1.1
    step(conn)  # type: ignore[arg-type]
    assert len(conn.sent) == 2
    written[0] += tasks.VACUUM_ROWS  # a busy consumer: vacuumed at the next look
    clock[0] += tasks.VACUUM_TICK
    step(conn)  # type: ignore[arg-type]
    assert len(conn.sent) == 3
    assert all(q.startswith("VACUUM (SKIP_LOCKED) agent_sessions") for q in conn.sent)


def test_a_consumer_that_publishes_never_holds_a_backlog_batch() -> None:
    """Publishing costs the sink per event: with a JetStream sink the batch goes as soon as the
    sink is free, backlog or not; PostgreSQL alone holds it for more."""
    pytest.importorskip("nats")
    from ledger_cdc.consumer import ConsumerConfig, build_consumer

    dsn = "postgresql://ledger@127.0.0.1:9/ledger"  # nothing is connected to
    alone = build_consumer(ConsumerConfig(dsn=dsn))
    fanned = build_consumer(ConsumerConfig(dsn=dsn, sinks=("nats://127.0.0.1:9",)))
    try:
        assert alone.flush_policy.catch_up_delay == CATCH_UP_DELAY
        assert fanned.flush_policy.catch_up_delay == 0
    finally:
        for c in (alone, fanned):
            c.sink.shutdown()  # (its publishers' threads with it)
            c.stream.close()
