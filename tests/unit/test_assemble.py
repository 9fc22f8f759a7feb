"""The assembler on message sequences built by hand: commit order, streams, aborts, two-phase,
spilling, skipping at the checkpoint."""

from __future__ import annotations

from typing import Any

from ledger_cdc.pgoutput import (
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Insert,
    Prepare,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
)
from ledger_cdc.stream.assemble import Assembler, Transaction


def ins(xid: int | None = None) -> Insert:
    return Insert(1, (b"x",), xid)


def run(asm: Assembler[str], script: list[tuple[Any, str | None]]) -> list[Transaction[str]]:
    out: list[Transaction[str]] = []
    for i, (msg, item) in enumerate(script):
        out += asm.feed(msg, item, 100, i)
    return out


def test_plain_transactions_in_commit_order() -> None:
    asm: Assembler[str] = Assembler()
    txns = run(
        asm,
        [
            (Begin(200, 0, 7), None),
            (ins(), "a1"),
            (ins(), "a2"),
            (Commit(0, 200, 210, 0), None),
            (Begin(300, 0, 5), None),
            (ins(), "b1"),
            (Commit(0, 300, 310, 0), None),
        ],
    )
    assert [(t.xid, t.items, t.end_lsn) for t in txns] == [(7, ["a1", "a2"], 210), (5, ["b1"], 310)]
    assert not asm.in_flight


def test_streamed_interleaved_with_plain_and_subtransaction_abort() -> None:
    asm: Assembler[str] = Assembler()
    txns = run(
        asm,
        [
            (StreamStart(10, True), None),
            (ins(10), "s1"),
            (ins(11), "sub1"),
            (StreamStop(), None),
            (Begin(200, 0, 20), None),
            (ins(), "p1"),
            (Commit(0, 200, 210, 0), None),
            (StreamStart(10, False), None),
            (ins(12), "sub2"),
            (ins(10), "s2"),
            (StreamStop(), None),
            (StreamAbort(10, 11), None),
            (StreamStart(30, True), None),
            (ins(30), "dead"),
            (StreamStop(), None),
            (StreamAbort(30, 30), None),
            (StreamCommit(10, 0, 400, 410, 0), None),
        ],
    )
    assert [(t.xid, t.items, t.streamed) for t in txns] == [
        (20, ["p1"], False),
        (10, ["s1", "sub2", "s2"], True),
    ]
    assert not asm.in_flight and asm.memory == 0


def test_two_phase() -> None:
    asm: Assembler[str] = Assembler()
    txns = run(
        asm,
        [
            (BeginPrepare(100, 110, 0, 1, "g1"), None),
            (ins(), "keep"),
            (Prepare(0, 100, 110, 0, 1, "g1"), None),
            (BeginPrepare(120, 130, 0, 2, "g2"), None),
            (ins(), "drop"),
            (Prepare(0, 120, 130, 0, 2, "g2"), None),
            (StreamStart(3, True), None),
            (ins(3), "streamed-prepared"),
            (StreamStop(), None),
            (StreamPrepare(0, 140, 150, 0, 3, "g3"), None),
        ],
    )
    assert txns == [] and asm.in_flight
    assert asm.oldest_in_flight_lsn() == 0
    txns = run(
        asm,
        [
            (RollbackPrepared(0, 130, 135, 0, 0, 2, "g2"), None),
            (CommitPrepared(0, 160, 170, 0, 3, "g3"), None),
            (CommitPrepared(0, 180, 190, 0, 1, "g1"), None),
        ],
    )
    assert [(t.gid, t.items, t.commit_lsn, t.end_lsn) for t in txns] == [
        ("g3", ["streamed-prepared"], 160, 170),
        ("g1", ["keep"], 180, 190),
    ]
    assert not asm.in_flight


def test_spill_to_disk_and_back() -> None:
    asm: Assembler[str] = Assembler(memory_limit=1000)
    script: list[tuple[Any, str | None]] = [(StreamStart(1, True), None)]
    script += [(ins(1 if i % 3 else 2), f"i{i}") for i in range(50)]
    script += [
        (StreamStop(), None),
        (StreamAbort(1, 2), None),
        (StreamCommit(1, 0, 900, 910, 0), None),
    ]
    txns = run(asm, script)
    assert asm.spills > 0
    # a spilled transaction is read back as it is iterated, never whole at emit
    assert txns[0].spilled and len(txns[0].items) == 33
    assert list(txns[0].items) == [f"i{i}" for i in range(50) if i % 3]
    assert asm.memory == 0


def test_transactions_at_or_below_the_checkpoint_are_skipped() -> None:
    asm: Assembler[str] = Assembler(skip_upto=310)
    txns = run(
        asm,
        [
            (Begin(200, 0, 7), None),
            (ins(), "old"),
            (Commit(0, 200, 210, 0), None),
            (Begin(300, 0, 8), None),
            (ins(), "at"),
            (Commit(0, 300, 310, 0), None),
            (Begin(400, 0, 9), None),
            (ins(), "new"),
            (Commit(0, 400, 410, 0), None),
        ],
    )
    assert [t.items for t in txns] == [["new"]] and asm.skipped == 2
