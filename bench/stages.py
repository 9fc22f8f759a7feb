"""Where a drain's time goes, stage by stage: ``drain.py --stages N``.

A consumer built in this process (the composition root's real parts) drains the backlog from a
twin slot into a database of its own, with timers around the methods each stage runs through:
``ReplicationStream.read_many`` (the socket), ``LedgerStream.feed`` (pgoutput decode, typed
values and payload, assembly), ``BatchBuilder.fold`` and ``fold_ahead`` (the reducers and the
sealed batch's rows), ``PgSink.commit`` (on the sink's thread: one database transaction per
batch, whose cost goes with the session rows it writes more than with its events). CPU is each thread's own (``time.thread_time``); the timers' cost per call is measured
on a no-op and taken off.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from common import proc_cpu_seconds

from ledger_cdc.batching.batch import Batch
from ledger_cdc.batching.builder import BatchBuilder
from ledger_cdc.consumer import ConsumerConfig
from ledger_cdc.consumer.compose import build_consumer
from ledger_cdc.consumer.metrics import Metrics
from ledger_cdc.sink.postgres import PgSink
from ledger_cdc.stream.route import LedgerStream
from ledger_cdc.stream.transport import ReplicationStream

TIMED = {
    "read": (ReplicationStream, "read_many"),
    "feed": (LedgerStream, "feed"),
    "fold": (BatchBuilder, "fold"),
    "fold_ahead": (BatchBuilder, "fold_ahead"),
}


class _Noop:
    def call(self) -> None:
        return None


def _timed(acc: dict[str, list[float]], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    cell = acc.setdefault(key, [0.0, 0.0])  # CPU seconds, calls

    def timed(self: Any, *a: Any, **kw: Any) -> Any:
        c0 = time.thread_time()
        try:
            return fn(self, *a, **kw)
        finally:
            cell[0] += time.thread_time() - c0
            cell[1] += 1

    return timed


def _timer_cost() -> float:
    """CPU seconds a timer adds to one call, less the call itself."""
    acc: dict[str, list[float]] = {}
    bare, wrapped = _Noop().call, _timed(acc, "noop", _Noop.call).__get__(_Noop())
    n = 200_000
    costs = []
    for fn in (bare, wrapped):
        c0 = time.thread_time()
        for _ in range(n):
            fn()
        costs.append(time.thread_time() - c0)
    return max(0.0, (costs[1] - costs[0]) / n)


def one_run(args: argparse.Namespace, pg: Any, dsn: str, i: int) -> dict[str, float]:
    """One in-process drain from slot ``stages{i}``: seconds per event of each stage."""
    acc: dict[str, list[float]] = {}
    saved = {k: getattr(cls, name) for k, (cls, name) in TIMED.items()}
    commits: list[tuple[int, float, float]] = []  # session rows, wall seconds, client CPU seconds
    commit = PgSink.commit

    def timed_commit(self: PgSink, batch: Batch) -> None:
        c0, w0 = time.thread_time(), time.perf_counter()
        commit(self, batch)
        commits.append((len(batch.sessions), time.perf_counter() - w0, time.thread_time() - c0))

    config = ConsumerConfig(
        dsn=dsn,
        slot=f"stages{i}",
        target_dsn=pg.dsn(f"stages{i}"),
        batch_size=args.batch_size,
        snapshot_every=100,
    )
    loop_cpu: list[float] = []  # the loop thread's CPU when it first read, when done
    walsender: list[float] = []

    def on_batch(_batch: Batch, m: Metrics) -> None:
        if m.events >= args.events and len(loop_cpu) == 1:
            loop_cpu.append(time.thread_time())
            walsender.append(_walsender_cpu(dsn, f"stages{i}"))
            consumer.stop()

    read = ReplicationStream.read_many

    def first_read(self: ReplicationStream, limit: int) -> list[Any]:
        if not loop_cpu:
            loop_cpu.append(time.thread_time())
        return read(self, limit)

    try:
        for k, (cls, name) in TIMED.items():
            setattr(cls, name, _timed(acc, k, first_read if k == "read" else saved[k]))
        PgSink.commit = timed_commit  # type: ignore[method-assign]
        consumer = build_consumer(config, on_batch=on_batch)
        t0 = time.monotonic()
        runner = threading.Timer(1800, consumer.stop)
        runner.start()
        consumer.run()
        runner.cancel()
        wall = time.monotonic() - t0
    finally:
        for k, (cls, name) in TIMED.items():
            setattr(cls, name, saved[k])
        PgSink.commit = commit  # type: ignore[method-assign]
    if len(loop_cpu) < 2:
        raise SystemExit(f"stages{i}: the drain did not finish")
    over = _timer_cost()
    n = args.events
    cpu = {k: max(0.0, c - calls * over) for k, (c, calls) in acc.items()}
    # (the loop's CPU includes its timers' cost too)
    loop_total = loop_cpu[1] - loop_cpu[0] - sum(calls for _, calls in acc.values()) * over
    fold = cpu["fold"] + cpu["fold_ahead"]
    rows = [c[0] for c in commits]
    walls = [c[1] for c in commits]
    return {
        "read": cpu["read"] / n,
        "feed": cpu["feed"] / n,
        "fold": fold / n,
        "other": max(0.0, loop_total - cpu["read"] - cpu["feed"] - fold) / n,
        "loop": loop_total / n,
        "batches": len(commits),
        "commit_wall": sum(walls) / n,
        "commit_cpu": sum(c[2] for c in commits) / n,
        "commit_per_batch": sum(walls) / len(walls),
        "commit_per_row": sum(walls) / sum(rows),
        "rows": sum(rows) / len(rows),
        "walsender": walsender[0] / n,
        "wall": wall / n,
        "timer": over,
    }


def _walsender_cpu(dsn: str, slot: str) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return proc_cpu_seconds(int(row[0])) if row and row[0] else float("nan")


def print_stages(args: argparse.Namespace, pg: Any, dsn: str) -> None:
    runs = [one_run(args, pg, dsn, i) for i in range(args.stages)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    us = 1e6
    print(
        f"  stages, in-process drains into a database of their own, medians of {len(runs)} "
        f"(timer cost taken off: {med['timer'] * us:.2f} µs per call), per event:"
    )
    print(f"    socket read (read_many)                       {med['read'] * us:6.2f} µs CPU")
    print(f"    decode + typed values + assemble (feed)       {med['feed'] * us:6.2f} µs CPU")
    print(f"    fold + seal batches                           {med['fold'] * us:6.2f} µs CPU")
    print(f"    the loop's other work                         {med['other'] * us:6.2f} µs CPU")
    print(
        f"    the loop thread in all                        {med['loop'] * us:6.2f} µs CPU "
        f"(one core: {1 / med['loop']:,.0f} events/s)"
    )
    print(
        f"    sink commits, on their own thread             {med['commit_wall'] * us:6.2f} µs wall, "
        f"{med['commit_cpu'] * us:.2f} µs client CPU ({med['batches']:.0f} batches of "
        f"{med['rows']:,.0f} session rows on average: {med['commit_per_batch'] * 1e3:.1f} ms per "
        f"batch, {med['commit_per_row'] * us:.1f} µs per session row)"
    )
    print(f"    walsender (server decoding + sending)         {med['walsender'] * us:6.2f} µs CPU")
    print(
        f"    wall, start-up included                       {med['wall'] * us:6.2f} µs "
        f"({1 / med['wall']:,.0f} events/s)"
    )
    for j, r in enumerate(runs):
        print(
            f"    run {j + 1}: loop {r['loop'] * us:.2f} µs, feed {r['feed'] * us:.2f}, fold "
            f"{r['fold'] * us:.2f}, sink {r['commit_wall'] * us:.2f} µs wall in "
            f"{r['batches']:.0f} batches, wall {r['wall'] * us:.2f} µs"
        )
