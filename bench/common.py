"""Shared pieces of the benchmarks: a backlog writer, process CPU / RSS readings, percentiles."""

from __future__ import annotations

import compileall
import functools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WRITE_PROC = """
CREATE OR REPLACE PROCEDURE bench_write(n int, sessions int) LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1..n LOOP
        INSERT INTO agent_events (session_id, agent_id, event_type, payload)
        VALUES (('00000000-0000-4000-8000-' || lpad((i % sessions)::text, 12, '0'))::uuid,
                'agent-' || (i % 7), 'tool.invoked',
                jsonb_build_object('call_id', 'call-' || i, 'tool', 'search', 'arguments',
                                   jsonb_build_object('q', 'quarterly numbers', 'k', i)));
        COMMIT;
    END LOOP;
END $$;
"""

# pgbench: each client writes its own sessions, so no two clients race for a session position
PGBENCH_SCRIPT = """\\set s random(0, 124)
INSERT INTO agent_events (session_id, agent_id, event_type, payload) VALUES (('00000000-0000-4000-8000-' || lpad((:client_id * 125 + :s)::text, 12, '0'))::uuid, 'bench', 'tool.invoked', '{"call_id": "x", "tool": "search", "arguments": {"q": "quarterly numbers"}}');
"""


def words(rng: Any, chars: int, vocabulary: list[str]) -> str:
    """``chars`` characters of words drawn from ``vocabulary`` with ``rng`` (a random.Random)."""
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(vocabulary)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def init_db(dsn: str, **kwargs: Any) -> Any:
    """``ledger_cdc.admin.schema.init`` (``kwargs`` passed on) on an autocommit session opened
    on ``dsn`` and closed after; its InitResult."""
    from ledger_cdc.admin.schema import init

    with psycopg.connect(dsn, autocommit=True) as conn:
        return init(conn, **kwargs)


def write_backlog(dsn: str, n: int, sessions: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(WRITE_PROC)
        done = 0
        while done < n:
            step = min(20000, n - done)
            conn.execute("CALL bench_write(%s, %s)", (step, sessions))
            done += step


def timed_backlog(pg: Any, dsn: str, n: int, sessions: int) -> str:
    """:func:`write_backlog`, timed and printed; returns the WAL end after it (text LSN)."""
    t0 = time.monotonic()
    write_backlog(dsn, n, sessions)
    print(
        f"PostgreSQL {pg.major}: backlog of {n:,} single-event transactions over "
        f"{sessions:,} sessions written in {time.monotonic() - t0:.1f}s"
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def machine_cpu_seconds() -> float:
    """CPU seconds every process of the machine has used since boot, all cores (user, nice,
    system, irq, softirq and steal time of /proc/stat's first line; idle and iowait left out)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def proc_peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def wait_until(pred: object, timeout: float, every: float = 0.05) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():  # type: ignore[operator]
            return time.monotonic() - t0
        time.sleep(every)
    raise TimeoutError(f"not done within {timeout}s")


def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=True, **kw)  # type: ignore[call-overload]


def pgbench_argv(pg: object, script: object, clients: int, seconds: int) -> list[str]:
    """pgbench running ``script`` with ``clients`` clients for ``seconds`` against ``pg``."""
    return [
        pg.bin("pgbench"),  # type: ignore[attr-defined]
        "-n",
        "-f",
        str(script),
        "-c",
        str(clients),
        "-j",
        str(min(clients, 2)),
        "-T",
        str(seconds),
        "-h",
        "127.0.0.1",
        "-p",
        str(pg.port),  # type: ignore[attr-defined]
        "-U",
        "postgres",
        pg.url().rsplit("/", 1)[1],  # type: ignore[attr-defined]
    ]


def recvlogical(pg: Any, end: str, dbname: str = "postgres", slot: str = "twin") -> float:
    """The reference reader: ``pg_recvlogical`` draining ``slot`` to /dev/null up to the LSN
    ``end``; the seconds it took."""
    t0 = time.monotonic()
    subprocess.run(
        [
            pg.bin("pg_recvlogical"),
            "-d",
            pg.url(dbname),
            "--slot",
            slot,
            "--start",
            "-o",
            "proto_version=1",
            "-o",
            "publication_names=agent_pub",
            "-f",
            "/dev/null",
            "-E",
            end,
            "--no-loop",
        ],
        check=True,
        capture_output=True,
        timeout=1800,
    )
    return time.monotonic() - t0


def consume(
    dsn: str, extra: list[str] | None, log: Any, command: str = "consume"
) -> subprocess.Popen[bytes]:
    """``ledger-cdc consume --dsn DSN`` (or ``command``) as a process of its own, its output to
    ``log``."""
    return subprocess.Popen(
        [sys.executable, "-m", "ledger_cdc.cli", command, "--dsn", dsn, "--log-format", "text"]
        + (extra or []),
        cwd=ROOT,
        stdout=log,
        stderr=log,
    )


@functools.cache
def compiled() -> None:
    """The package's modules compiled to bytecode, as a wheel's install leaves them: a
    consumer started with PYTHONDONTWRITEBYTECODE (as on this machine) and no cached bytecode
    compiles every module it imports, each time it starts (0.1 s here)."""
    compileall.compile_dir(str(ROOT / "ledger_cdc"), quiet=1)


def consume_until(
    dsn: str,
    check_dsn: str,
    events: int,
    extra: list[str] | None = None,
    on_streaming: Callable[[], None] | None = None,
) -> tuple[float, float, float, float]:
    """Run ``ledger-cdc consume`` as its own process until ``events`` events are folded into
    ``check_dsn``'s committed projections: (seconds from the process's start, seconds until it
    was streaming the slot — imports, connections, START_REPLICATION —, CPU seconds, peak RSS
    MB).

    Done is when the projection of the ledger's last event (the highest seq) holds it: batches
    commit in commit order, so every earlier event is in a committed projection then. That is
    one primary-key lookup per look, every 20 ms; a ``sum(event_count)`` over the projections
    would scan a table the consumer is rewriting, on the server's two cores, and slow the
    drain it times. The sum is checked once, after the clock stops. ``on_streaming`` is called
    once its log says it is streaming the slot."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        last = conn.execute(
            "SELECT session_id, position FROM agent_events ORDER BY seq DESC LIMIT 1"
        ).fetchone()
    assert last is not None, "an empty ledger"
    compiled()
    log = tempfile.NamedTemporaryFile(prefix="ledger-cdc-drain-", suffix=".log", delete=False)  # noqa: SIM115
    proc = consume(dsn, extra, log)
    t0 = time.monotonic()
    cpu = rss = 0.0
    started: list[float] = []
    try:
        with psycopg.connect(check_dsn, autocommit=True) as conn:

            def done() -> bool:
                nonlocal cpu, rss
                if proc.poll() is not None:
                    raise SystemExit(f"the consumer exited: {Path(log.name).read_text()[-3000:]}")
                cpu, rss = proc_cpu_seconds(proc.pid), proc_peak_rss_mb(proc.pid)
                if not started and "streaming slot" in Path(log.name).read_text():
                    started.append(time.monotonic() - t0)
                    if on_streaming is not None:
                        on_streaming()
                row = conn.execute(
                    "SELECT last_position >= %s FROM agent_sessions WHERE session_id = %s",
                    (last[1], last[0]),
                ).fetchone()
                return row is not None and bool(row[0])

            try:
                wait_until(done, 1800, 0.02)
            except TimeoutError:
                print(Path(log.name).read_text()[-3000:])
                raise
            t = time.monotonic() - t0
            (folded,) = conn.execute(  # type: ignore[misc]
                "SELECT coalesce(sum(event_count), 0) FROM agent_sessions"
            ).fetchone()
            if int(folded) < events:
                raise SystemExit(f"{folded} of {events} events folded when the last one was")
    finally:
        proc.terminate()
        proc.wait(60)
    return t, (started[0] if started else 0.0), cpu, rss
