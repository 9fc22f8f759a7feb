"""A big transaction's changes grouped by session (batching.by_session) with bounded memory:
every change comes back once, each session's together and in their order, whatever the budget
(a bucket over it spread again by other bits of the session id), and a fold over the grouped
changes loads each session's context once."""

from __future__ import annotations

import datetime as dt
import random
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger_cdc.batching import BatchBuilder, SessionCache, SnapshotPolicy, by_session
from ledger_cdc.events import LedgerEvent
from ledger_cdc.fold import SessionContext, default_reducers
from ledger_cdc.stream.assemble import Transaction
from ledger_cdc.stream.route import Anomaly, Item

AT = dt.datetime(2026, 12, 6, tzinfo=dt.timezone.utc)


def event(sid: uuid.UUID, position: int, seq: int) -> LedgerEvent:
    payload = {"call_id": f"c{position}", "tool": "search", "arguments": {"q": "x"}}
    return LedgerEvent(seq, sid, position, "a", "tool.invoked", payload, AT)


def interleaved(sessions: list[uuid.UUID], per: int) -> list[tuple[Item, int]]:
    """Position-major, as a bulk INSERT … ORDER BY position, session sends them."""
    out: list[tuple[Item, int]] = []
    for p in range(1, per + 1):
        for sid in sessions:
            out.append((event(sid, p, len(out) + 1), 1000))
    return out


def key(pair: tuple[Item, int]) -> tuple[int, str]:
    it = pair[0]
    return (it.seq or 0, str(getattr(it, "session_id", None)))


def runs(pairs: list[tuple[Item, int]]) -> list[uuid.UUID | None]:
    """The sessions in the order they come, one entry per run of one session's changes."""
    out: list[uuid.UUID | None] = []
    for it, _ in pairs:
        sid = it.session_id if isinstance(it, LedgerEvent) else None
        if not out or out[-1] != sid:
            out.append(sid)
    return out


@pytest.mark.parametrize("budget", [0, 10_000, 200_000, 10**9], ids=["0", "10k", "200k", "all"])
def test_each_session_comes_back_once_in_order(budget: int) -> None:
    rng = random.Random(budget)
    sessions = [uuid.UUID(int=rng.getrandbits(128)) for _ in range(700)]
    # ids alike in every bit but a few high ones, and in all but a few low ones
    sessions += [uuid.UUID(int=(n << 120) | 7) for n in range(1, 40)]
    sessions += [uuid.UUID(int=(5 << 120) | n) for n in range(8, 48)]
    pairs = interleaved(sessions, 6)
    pairs.insert(100, (Anomaly("delete", 5, 42, None, None), 100))
    out = list(by_session(pairs, None, budget))
    assert sorted(map(key, out)) == sorted(map(key, pairs))  # each once (read back: copies)
    order = runs(out)
    assert len(order) == len(set(order)) == len(set(sessions)) + 1  # one run each (and the anomaly)
    for sid in sessions:
        mine = [
            it.position for it, _ in out if isinstance(it, LedgerEvent) and it.session_id == sid
        ]
        assert mine == [1, 2, 3, 4, 5, 6]


def test_one_session_past_the_budget_is_read_back_as_it_came() -> None:
    sid = uuid.uuid4()
    pairs: list[tuple[Item, int]] = [(event(sid, p, p), 10_000) for p in range(1, 500)]
    out = list(by_session(pairs, None, 1000))
    assert [it.position for it, _ in out] == list(range(1, 500))  # type: ignore[union-attr]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 30), st.integers(1, 3000)), max_size=300),
    st.integers(0, 50_000),
)
def test_grouping_is_exact_for_any_sizes(changes: list[tuple[int, int]], budget: int) -> None:
    ids = [uuid.UUID(int=(n * 0x9E3779B97F4A7C15) << 3) for n in range(31)]
    pairs: list[tuple[Item, int]] = []
    for n, size in changes:
        pairs.append((event(ids[n], len(pairs) + 1, len(pairs) + 1), size))
    out = list(by_session(pairs, None, budget))
    assert len(out) == len(pairs)
    order = runs(out)
    assert len(order) == len(set(order))
    for sid in set(order):
        mine = [it.seq for it, _ in out if it.session_id == sid]  # type: ignore[union-attr]
        assert mine == sorted(mine)


def test_a_big_transaction_loads_each_session_once() -> None:
    """The fold of one transaction over many more sessions than the cache holds asks the
    loader for each session once, not once per part (the cost that made bulk superlinear)."""
    asked: list[uuid.UUID] = []
    stored: dict[uuid.UUID, SessionContext] = {}

    def load(ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[SessionContext, int]]:
        asked.extend(ids)
        return {sid: (stored[sid], 3000) for sid in ids if sid in stored}

    builder = BatchBuilder(
        load=load,
        cache=SessionCache(50_000),
        budget=50_000,
        reducers=default_reducers(),
        snapshots=SnapshotPolicy(every=0),
        load_at_once=64,
    )
    sessions = [uuid.UUID(int=n << 64 | n) for n in range(1, 2001)]
    pairs = interleaved(sessions, 5)
    txn: Transaction[Item] = Transaction(9, 100, 200, 0, [it for it, _ in pairs])
    _, chunks, _ = builder.big(txn, iter(pairs), epoch=None, grouped=False, write_part=print)
    written: set[uuid.UUID] = set()
    for chunk in chunks:
        for sid, (ctx, _, _, _) in chunk.sessions.items():
            stored[sid] = ctx
            written.add(sid)
    assert sorted(asked) == sorted(sessions)  # each once
    assert len(written) == len(sessions)
