"""LangGraph storage: the same 100-step graph with a growing message list on
langgraph-checkpoint-postgres's ``AsyncPostgresSaver`` and on the ledger's ``AsyncLedgerSaver``,
each in a database of its own on one server, in one run.

Printed per saver: bytes stored (every table and index the saver writes to, after VACUUM),
``aput`` p50/p99 during the run, ``aget_tuple`` p50/p99 of the latest checkpoint afterwards
(200 reads), and the ledger's ratios to the reference. Then a cold read: ``aget_tuple`` from a
ledger saver that never saw the thread (a process resuming after a crash: it reads the
checkpoint's recent events), each one right after a read of the reference's (100 pairs, so that
both meet the same load).

    sh scripts/dev.sh bench langgraph_storage [--steps 100] [--chars 500] [--pg-major 18]
"""

from __future__ import annotations

import argparse
import asyncio
import operator
import random
import statistics
import time
from typing import Annotated, Any, TypedDict

import psycopg
from common import init_db

from ledger_cdc.client.writer import AsyncLedger
from ledger_cdc.demo.embedded import EmbeddedPostgres
from ledger_cdc.integrations.langgraph import AsyncLedgerSaver

_WORDS = [
    "".join(random.Random(i).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(2 + i % 9))
    for i in range(5000)
]


class Talk(TypedDict):
    messages: Annotated[list[str], operator.add]


def graph(saver: Any, steps: int, chars: int) -> Any:
    from langgraph.graph import END, START, StateGraph

    def talk(state: Talk) -> dict[str, Any]:
        n = len(state["messages"])
        rng = random.Random(n)  # text as a model writes it: words, not one repeated phrase
        words = " ".join(rng.choice(_WORDS) for _ in range(chars // 4))
        return {"messages": [f"turn {n}: {words}"[:chars]]}

    g = StateGraph(Talk)
    g.add_node("talk", talk)
    g.add_edge(START, "talk")
    g.add_conditional_edges("talk", lambda s: END if len(s["messages"]) >= steps else "talk")
    return g.compile(checkpointer=saver)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def run(saver: Any, steps: int, chars: int) -> tuple[list[float], list[float]]:
    puts: list[float] = []
    aput = saver.aput

    async def timed_aput(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await aput(*a, **kw)
        finally:
            puts.append(time.perf_counter() - t0)

    saver.aput = timed_aput
    config = {"configurable": {"thread_id": "bench"}, "recursion_limit": 10 * steps}
    out = await graph(saver, steps, chars).ainvoke({"messages": []}, config)
    assert len(out["messages"]) == steps
    gets: list[float] = []
    for _ in range(200):
        t0 = time.perf_counter()
        got = await saver.aget_tuple({"configurable": {"thread_id": "bench"}})
        gets.append(time.perf_counter() - t0)
        assert got is not None and len(got.checkpoint["channel_values"]["messages"]) == steps
    return puts, gets


async def cold_reads(ref: Any, ledger: AsyncLedger, n: int) -> tuple[list[float], list[float]]:
    """``n`` reads of the reference's latest checkpoint, each followed by one from a new ledger
    saver."""
    config = {"configurable": {"thread_id": "bench"}}
    theirs: list[float] = []
    cold: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        want = await ref.aget_tuple(config)
        theirs.append(time.perf_counter() - t0)
        fresh = AsyncLedgerSaver(None, ledger)
        t0 = time.perf_counter()
        got = await fresh.aget_tuple(config)
        cold.append(time.perf_counter() - t0)
        assert got is not None and want is not None
        assert got.checkpoint["channel_values"] == want.checkpoint["channel_values"]
    return theirs, cold


def size(dsn: str, tables: list[str]) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM")
        total = 0
        for t in tables:
            (n,) = conn.execute("SELECT pg_total_relation_size(%s)", (t,)).fetchone()  # type: ignore[misc]
            total += int(n or 0)
        return total


async def main_async(args: argparse.Namespace) -> None:
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    with EmbeddedPostgres(major=args.pg_major) as pg:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE reference")
            conn.execute("CREATE DATABASE ledger")
        ref_dsn, led_dsn = pg.dsn("reference"), pg.dsn("ledger")
        init_db(led_dsn)
        base_led = size(led_dsn, ["agent_events"])
        ledger = await AsyncLedger.connect(led_dsn)
        try:
            async with AsyncPostgresSaver.from_conn_string(ref_dsn) as ref:
                await ref.setup()
                base_ref = size(ref_dsn, ["checkpoints", "checkpoint_blobs", "checkpoint_writes"])
                ref_puts, ref_gets = await run(ref, args.steps, args.chars)
                ours = AsyncLedgerSaver(None, ledger)
                led_puts, led_gets = await run(ours, args.steps, args.chars)
                ref_paired, cold = await cold_reads(ref, ledger, 100)
        finally:
            await ledger.close()
        ref_bytes = size(ref_dsn, ["checkpoints", "checkpoint_blobs", "checkpoint_writes"])
        ref_bytes -= base_ref
        led_bytes = size(led_dsn, ["agent_events"]) - base_led

    print(
        f"PostgreSQL {pg.major}: one thread, {args.steps} steps, each appending a "
        f"{args.chars}-character message to a growing list"
    )
    row = "  {:<34} {:>10}  aput p50/p99 {:6.2f}/{:6.2f} ms  aget_tuple p50/p99 {:6.2f}/{:6.2f} ms"
    print(
        row.format(
            "AsyncPostgresSaver (reference)",
            f"{ref_bytes / 1024:,.0f} kB",
            pct(ref_puts, 0.5),
            pct(ref_puts, 0.99),
            pct(ref_gets, 0.5),
            pct(ref_gets, 0.99),
        )
    )
    print(
        row.format(
            "AsyncLedgerSaver (agent_events)",
            f"{led_bytes / 1024:,.0f} kB",
            pct(led_puts, 0.5),
            pct(led_puts, 0.99),
            pct(led_gets, 0.5),
            pct(led_gets, 0.99),
        )
    )
    print(
        f"  cold aget_tuple (a saver that never saw the thread), paired with the reference's: "
        f"p50 {pct(cold, 0.5):.2f} ms vs {pct(ref_paired, 0.5):.2f} ms = "
        f"{statistics.median(cold) / statistics.median(ref_paired):.2f}× the reference"
    )
    print(
        f"  ratios: bytes {led_bytes / ref_bytes:.2f}×, aput p50 "
        f"{statistics.median(led_puts) / statistics.median(ref_puts):.2f}×, aget_tuple p50 "
        f"{statistics.median(led_gets) / statistics.median(ref_gets):.2f}×"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description="LangGraph storage benchmark")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--chars", type=int, default=500)
    ap.add_argument("--pg-major", type=int, default=None)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
