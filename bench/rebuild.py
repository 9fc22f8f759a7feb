"""rebuild_context on a long session: latest snapshot + tail, next to a replay from zero.

One session of ``--events`` events (agent turns: model request and response with a tool call in
one transaction, then the tool's result), folded by a real ``ledger-cdc consume`` process that
snapshots every ``--snapshot-every`` events. Then, in one run, ``--runs`` calls of
``rebuild_context`` at random points of the log (``upto_seq``; the head included) and the same
number of replays from zero of the same prefixes (no snapshot: every event read and folded).
Prints p50/p99 of both, the ratio, and the snapshot size. Then what a restarted worker does
next: look up one memoised call completed before the snapshot (one indexed read of
``agent_memo``), and, for comparison, a rebuild that loads the whole memo (``memo=True``).

    sh scripts/dev.sh bench rebuild [--events 10000] [--snapshot-every 100] [--profile compact|verbose]

Profiles: ``compact`` (short model replies and tool results, as in the tests) and ``verbose``
(replies of about 150 characters, results of about 100). The snapshot holds the context window
and what is in flight, not the memo, which stays one row per call in ``agent_memo``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import psycopg
from common import ROOT, init_db, percentile, wait_until

from ledger_cdc.client.recovery import load_events, memoised_model, memoised_tool, rebuild_context
from ledger_cdc.client.writer import Ledger
from ledger_cdc.demo.embedded import EmbeddedPostgres
from ledger_cdc.fold import SessionContext, encode_context, fold


def write_session(dsn: str, sid: uuid.UUID, events: int, verbose: bool) -> None:
    reply = (
        "Looking at the numbers, the next step is to query the regional table. "
        * (2 if verbose else 0)
        or "ok"
    )
    with Ledger(dsn) as ledger:
        n, turn = 0, 0
        ledger.append(
            sid, "planner", "context.loaded", {"messages": [{"role": "user", "content": "go"}]}
        )
        n += 1
        while n < events:
            turn += 1
            call = f"call-{turn}"
            with ledger.transaction() as tx:
                tx.append(
                    sid,
                    "planner",
                    "model.requested",
                    {"request_id": f"r{turn}", "model": "m", "prompt_hash": f"{turn:016x}"},
                )
                tx.append(
                    sid,
                    "planner",
                    "model.responded",
                    {
                        "request_id": f"r{turn}",
                        "model": "m",
                        "content": reply,
                        "usage": {"input_tokens": 900, "output_tokens": 40},
                        "tool_calls": [{"call_id": call, "tool": "sql", "arguments": {"q": turn}}],
                    },
                )
                tx.append(
                    sid,
                    "planner",
                    "tool.invoked",
                    {
                        "call_id": call,
                        "tool": "sql",
                        "arguments": {"q": turn},
                        "idempotency_key": f"{sid}:{call}",
                    },
                    idempotency_key=f"{sid}:{call}",
                )
            result = (
                {"rows": turn % 17, "region": "emea"}
                if not verbose
                else {"rows": turn % 17, "sample": "region=emea revenue=1234.5 delta=+3.2% " * 2}
            )
            if n + 4 <= events:
                ledger.append(sid, "planner", "tool.observed", {"call_id": call, "result": result})
            n += 4 if n + 4 <= events else 3


def without_memo(ctx: SessionContext) -> bytes:
    import msgspec

    bare = msgspec.structs.replace(ctx, completed_tools={}, completed_models={}, memo_position=0)
    return encode_context(bare)


def breakdown(conn: psycopg.Connection[Any], sid: uuid.UUID, runs: int) -> dict[str, float]:
    """Where a rebuild at the head spends its time (medians, ms)."""
    from ledger_cdc.client.recovery import _SNAPSHOT
    from ledger_cdc.fold import SNAPSHOT_FORMATS, decode_context, reducer_version

    out: dict[str, list[float]] = {"fetch": [], "sha256": [], "decode": []}
    for _ in range(runs):
        gc.collect()
        t0 = time.perf_counter()
        row = conn.execute(
            _SNAPSHOT,
            (sid, list(SNAPSHOT_FORMATS), reducer_version(), 2**63 - 1, 2**63 - 1),
            binary=True,
        ).fetchone()
        t1 = time.perf_counter()
        assert row is not None
        data = bytes(row[3])
        hashlib.sha256(data).digest()
        t2 = time.perf_counter()
        decode_context(data)
        t3 = time.perf_counter()
        out["fetch"].append((t1 - t0) * 1000)
        out["sha256"].append((t2 - t1) * 1000)
        out["decode"].append((t3 - t2) * 1000)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description="rebuild_context benchmark")
    ap.add_argument("--events", type=int, default=10_000)
    ap.add_argument("--snapshot-every", type=int, default=100)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--profile", choices=["compact", "verbose"], default="compact")
    ap.add_argument("--pg-major", type=int, default=None)
    args = ap.parse_args()
    sid = uuid.uuid4()
    with EmbeddedPostgres(major=args.pg_major) as pg:
        dsn = pg.dsn()
        init_db(dsn, slot="agent_slot")
        consumer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ledger_cdc",
                "consume",
                "--dsn",
                dsn,
                "--log-format",
                "text",
                "--snapshot-every",
                str(args.snapshot_every),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        t0 = time.monotonic()
        write_session(dsn, sid, args.events, args.profile == "verbose")
        with psycopg.connect(dsn, autocommit=True) as conn:
            (head,) = conn.execute(  # type: ignore[misc]
                "SELECT max(position) FROM agent_events WHERE session_id = %s", (sid,)
            ).fetchone()

            def caught_up() -> bool:
                row = conn.execute(
                    "SELECT last_position FROM agent_sessions WHERE session_id = %s", (sid,)
                ).fetchone()
                return row is not None and row[0] == head

            wait_until(caught_up, 300)
            consumer.send_signal(signal.SIGTERM)
            consumer.wait(60)
            snaps, size = conn.execute(  # type: ignore[misc]
                "SELECT count(*), max(length(data)) FROM agent_snapshots WHERE session_id = %s",
                (sid,),
            ).fetchone()
            seqs = [
                s
                for (s,) in conn.execute(
                    "SELECT seq FROM agent_events WHERE session_id = %s ORDER BY position", (sid,)
                )
            ]
            print(
                f"PostgreSQL {pg.major}, profile {args.profile}: session of {head:,} events "
                f"written and folded in {time.monotonic() - t0:.1f}s; {snaps} snapshots, the "
                f"latest {size / 1e6:.2f} MB"
            )
            rng = random.Random(1)
            rebuild_context(conn, sid)  # warm: imports, decoders, the server's cache
            results = {}
            for label, points in (
                ("at the head", [seqs[-1]] * args.runs),
                ("at random points", [rng.choice(seqs) for _ in range(args.runs)]),
            ):
                fast, slow = [], []
                for upto in points:
                    gc.collect()  # each timing starts from the same heap, outside the timed part
                    t = time.perf_counter()
                    ctx = rebuild_context(conn, sid, upto_seq=upto)
                    fast.append((time.perf_counter() - t) * 1000)
                    gc.collect()
                    t = time.perf_counter()
                    ref = fold(list(load_events(conn, sid, upto_seq=upto)), session_id=sid)  # type: ignore[arg-type]
                    slow.append((time.perf_counter() - t) * 1000)
                    assert without_memo(ctx) == without_memo(ref), f"rebuild at seq {upto}"
                    old = [c for c in ref.completed_tools if c not in ctx.completed_tools]
                    if old:  # answered from agent_memo, as the replay from zero answers it
                        call = rng.choice(old)
                        assert memoised_tool(conn, ctx, call) == ref.completed_tools[call]
                    del ctx, ref
                results[label] = (fast, slow)
            phases = breakdown(conn, sid, args.runs)
            ctx = rebuild_context(conn, sid)
            assert ctx.memo_position > 0, "the rebuild did not start from a snapshot"
            calls = [f"call-{rng.randint(1, ctx.memo_position // 4 - 1)}" for _ in range(args.runs)]
            lookups, whole = [], []
            for call in calls:
                t = time.perf_counter()
                tool = memoised_tool(conn, ctx, call)
                model = memoised_model(conn, ctx, "r" + call[5:])
                lookups.append((time.perf_counter() - t) * 1000 / 2)
                assert tool is not None and model is not None, call
            for _ in range(max(10, args.runs // 10)):
                gc.collect()
                t = time.perf_counter()
                full = rebuild_context(conn, sid, memo=True)
                whole.append((time.perf_counter() - t) * 1000)
                del full
            (memo_rows,) = conn.execute(  # type: ignore[misc]
                "SELECT count(*) FROM agent_memo WHERE session_id = %s", (sid,)
            ).fetchone()
    for label, (fast, slow) in results.items():
        p50f, p99f = statistics.median(fast), percentile(fast, 99)
        p50s, p99s = statistics.median(slow), percentile(slow, 99)
        print(
            f"{label:>16}: rebuild_context p50 {p50f:6.2f} ms p99 {p99f:6.2f} ms | replay from "
            f"zero p50 {p50s:6.2f} ms p99 {p99s:6.2f} ms | {p50s / p50f:4.1f}x | target p50 < 5 ms "
            f"{'met' if p50f < 5 else 'NOT met'}"
        )

    print(
        "at the head, per part (p50): snapshot fetch {fetch:.2f} ms, sha256 {sha256:.2f} ms, "
        "decode {decode:.2f} ms".format(**phases)
    )
    print(
        f"memo lookup of a call completed before the snapshot (agent_memo, by id): p50 "
        f"{statistics.median(lookups):.3f} ms p99 {percentile(lookups, 99):.3f} ms"
    )
    print(
        f"rebuild_context(memo=True), the whole memo ({memo_rows:,} calls) loaded: p50 "
        f"{statistics.median(whole):.2f} ms p99 {percentile(whole, 99):.2f} ms"
    )


if __name__ == "__main__":
    main()
