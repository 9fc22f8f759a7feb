"""Helpers for consumer tests: a real ``ledger-cdc consume`` process, writers, and the equality
that matters (projections and snapshots == a fold of the whole table from zero)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

import msgspec
import psycopg
from click.testing import CliRunner, Result

from ledger_cdc.admin.schema import create_slot
from ledger_cdc.cli.app import cli
from ledger_cdc.client.read import projected_contexts
from ledger_cdc.client.recovery import fold_all, load_events, load_memo
from ledger_cdc.client.writer import Ledger
from ledger_cdc.consumer import Consumer, ConsumerConfig, build_consumer
from ledger_cdc.events import LedgerEvent
from ledger_cdc.fold import SessionContext, decode_context, encode_snapshot, fold
from tests.support.cli import ROOT as ROOT  # (tests import it from here too)
from tests.support.cli import start_cli
from tests.support.wait import until


class ConsumerProcess:
    """``ledger-cdc consume`` (or ``command``) as a child process (so it can be SIGKILLed for
    real)."""

    def __init__(
        self, dsn: str, *args: str, log: Path | None = None, command: str = "consume"
    ) -> None:
        self.dsn = dsn
        self.args = args
        self.command = command
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ConsumerProcess:
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = start_cli(
            *(self.command, "--dsn", self.dsn, "--log-format", "text", *self.args),
            stdout=out,
            stderr=out,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self, timeout: float = 60) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> ConsumerProcess:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        if self.alive():
            self.kill()


def stored_projections(conn: psycopg.Connection[Any]) -> dict[uuid.UUID, SessionContext]:
    """Every projection, whole (as the documented readers get it)."""
    return projected_contexts(conn)


def valid_event_count(conn: psycopg.Connection[Any]) -> int:
    return sum(1 for e in load_events(conn) if type(e) is LedgerEvent)


_BEHIND = """
SELECT count(*) FROM (SELECT session_id, max(position) AS head FROM agent_events GROUP BY 1) e
LEFT JOIN agent_sessions s USING (session_id)
WHERE s.last_position IS DISTINCT FROM e.head
"""


def wait_caught_up(dsn: str, timeout: float = 60.0) -> None:
    """Until every session's projection has reached the last event in the table (folded or
    quarantined)."""
    behind = [-1]

    def caught_up() -> bool:
        row = conn.execute(_BEHIND).fetchone()
        assert row is not None
        behind[0] = int(row[0])
        return behind[0] == 0

    with psycopg.connect(dsn, autocommit=True) as conn:
        until(
            caught_up,
            timeout,
            every=0.1,
            what=lambda: f"the consumer caught up ({behind[0]} sessions behind)",
        )


def fold_barrier(dsn: str, timeout: float = 60.0) -> uuid.UUID:
    """A marker event, committed now in a session of its own, waited for until its projection
    is stored: all that committed before it has been through the fold too (commit order), so a
    test may then assert that something was *not* folded. Returns the marker's session."""
    marker = uuid.uuid4()
    with Ledger(dsn) as ledger:
        ledger.append(marker, "barrier", "tool.invoked", {"call_id": "barrier", "tool": "barrier"})
    with psycopg.connect(dsn, autocommit=True) as conn:
        until(
            lambda: (
                conn.execute(
                    "SELECT FROM agent_sessions WHERE session_id = %s", (marker,)
                ).fetchone()
                is not None
            ),
            timeout,
            what="the marker event folded",
        )
    return marker


def assert_projections_equal_refold(dsn: str) -> int:
    """Projections and every snapshot equal a fold of agent_events from zero. Returns events."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        expected = fold_all(conn)
        got = stored_projections(conn)
        assert set(got) == set(expected), (len(got), len(expected))
        for sid, ctx in expected.items():
            assert got[sid] == ctx, f"session {sid} differs from a refold"
        # every snapshot equals a fold of its session's events up to its position
        events: dict[uuid.UUID, list[Any]] = {}
        for ev in load_events(conn):
            events.setdefault(ev.session_id, []).append(ev)
        for sid, upto_pos, data in conn.execute(
            "SELECT session_id, upto_position, data FROM agent_snapshots"
        ):
            prefix = [e for e in events[sid] if e.position <= upto_pos]
            as_snapshot = decode_context(encode_snapshot(fold(prefix, session_id=sid)))
            assert decode_context(data) == as_snapshot, f"snapshot {sid}@{upto_pos}"
        # agent_memo holds exactly the calls each session completed, once each
        for sid, ctx in expected.items():
            blank = msgspec.structs.replace(SessionContext(sid), memo_position=ctx.last_position)
            stored = load_memo(conn, blank)
            assert stored.completed_tools == ctx.completed_tools, f"memo of {sid}"
            assert stored.completed_models == ctx.completed_models, f"memo of {sid}"
        return sum(len(v) for v in events.values())


class Writers:
    """N threads appending agent turns (multi-event transactions) until stopped."""

    def __init__(
        self, dsn: str, n: int = 8, sessions: int = 40, seed: int = 1, pace: float = 0.0
    ) -> None:
        self.dsn = dsn
        self.pace = pace
        self.n = n
        self.sessions = [
            uuid.UUID(int=random.Random(seed * 1000 + i).getrandbits(128), version=4)
            for i in range(sessions)
        ]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.turns = 0
        self._lock = threading.Lock()

    def _work(self, w: int) -> None:
        rng = random.Random(w)
        try:
            with Ledger(self.dsn) as ledger:
                while not self._stop.is_set():
                    sid = rng.choice(self.sessions)
                    turn_events(ledger, sid, f"w{w}", rng)
                    with self._lock:
                        self.turns += 1
                    if self.pace:
                        self._stop.wait(self.pace)
        except BaseException as e:
            self.errors.append(e)

    def start(self) -> Writers:
        self._threads = [
            threading.Thread(target=self._work, args=(w,), daemon=True) for w in range(self.n)
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        if self.errors:
            raise self.errors[0]


def turn_events(ledger: Ledger, sid: uuid.UUID, agent: str, rng: random.Random) -> None:
    """One agent turn: now and then a new context window, a model call and its tool calls in one
    transaction, then the results. Windows, replies and results are sometimes long enough to be
    stored by reference to their events (fold.REFERENCE_MIN), sometimes short."""
    call = f"{agent}-{rng.getrandbits(40):x}"
    if rng.random() < 0.25:
        window = [
            {"role": "system", "content": "be brief. " * rng.randint(5, 150)},
            {"role": "user", "content": f"task {call}"},
        ]
        ledger.append(sid, agent, "context.loaded", {"messages": window})
    reply = "ok" if rng.random() < 0.7 else f"reply {call} " * rng.randint(10, 80)
    result: object = {"n": rng.randint(0, 9)}
    if rng.random() < 0.4:
        result = f"row {call};" * rng.randint(5, 200)
    with ledger.transaction() as tx:
        tx.append(
            sid, agent, "model.requested", {"request_id": call, "model": "m", "prompt_hash": "h"}
        )
        tx.append(
            sid,
            agent,
            "model.responded",
            {
                "request_id": call,
                "model": "m",
                "content": reply,
                "usage": {"input_tokens": rng.randint(1, 500), "output_tokens": rng.randint(1, 50)},
            },
        )
        tx.append(
            sid,
            agent,
            "tool.invoked",
            {"call_id": call, "tool": "search", "arguments": {"q": call}},
            idempotency_key=call,
        )
    if rng.random() < 0.8:
        ledger.append(sid, agent, "tool.observed", {"call_id": call, "result": result})


def wait_streaming(dsn: str, slot: str = "agent_slot", timeout: float = 60.0) -> None:
    """Until a consumer streams ``slot`` of this database (the slot exists and is active)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        until(
            lambda: (
                conn.execute(
                    "SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = %s "
                    "AND database = current_database() AND active)",
                    (slot,),
                ).fetchone()
                == (True,)
            ),
            timeout=timeout,
        )


class InThread:
    """A Consumer in a thread of the test process (for tests that look inside it). Its failure,
    if it stops on an exception, is kept and re-raised on exit: a test cannot pass while the
    consumer died."""

    def __init__(self, dsn: str, *, precreate_slot: bool = True, **kw: Any) -> None:
        kw.setdefault("create_slot", True)
        self.precreate_slot = precreate_slot
        self.consumer = build_consumer(ConsumerConfig(dsn=dsn, **kw))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.consumer.run()
        except BaseException as e:
            self.error = e

    def alive(self) -> bool:
        return self.thread.is_alive()

    def __enter__(self) -> Consumer:
        # the slot exists before any test write: rows written before it are not in the stream
        # (unless the test wants the consumer to create it, and bootstrap the history)
        if self.precreate_slot:
            with psycopg.connect(self.consumer.config.dsn, autocommit=True) as conn:
                create_slot(conn, self.consumer.config.slot)
        self.thread.start()
        return self.consumer

    def __exit__(self, *exc: object) -> None:
        self.consumer.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise AssertionError(f"the consumer stopped on {self.error!r}") from self.error


def run_cli(*args: str, env: dict[str, str | None] | None = None) -> Result:
    """``ledger-cdc ARGS`` in this process; the result has exit_code, stdout, stderr and any
    exception that escaped the CLI (a traceback a user would see)."""
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=True)


def assert_clean_exit(r: Result, *codes: int) -> None:
    """The command ended with one of ``codes`` (0 if none given) and no traceback."""
    want = codes or (0,)
    escaped = r.exception if not isinstance(r.exception, SystemExit) else None
    assert escaped is None, f"escaped {escaped!r}\n{r.output}"
    assert r.exit_code in want, f"exit {r.exit_code}, want {want}:\n{r.output}"
    assert "Traceback" not in r.output


def assert_verify_exact(dsn: str) -> None:
    """``verify --all`` passes; then a real difference, put into one projection, makes it fail
    (so it was able to fail); then the projection is put back."""
    assert_clean_exit(run_cli("verify", "--all", "--dsn", dsn))
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            # (a session whose events were all quarantined has no event_count: 0 is left out)
            "SELECT session_id, context FROM agent_sessions WHERE context ? 'event_count' "
            "ORDER BY session_id LIMIT 1"
        ).fetchone()
        assert row is not None, "no projection to tamper with"
        sid, context = row
        conn.execute(
            "UPDATE agent_sessions SET context = jsonb_set(context, '{event_count}', "
            "to_jsonb((context->>'event_count')::int + 1)) WHERE session_id = %s",
            (sid,),
        )
        try:
            r = run_cli("verify", "--all", "--json", "--dsn", dsn)
            assert_clean_exit(r, 1)
            assert '"event_count"' in r.stdout and str(sid) in r.stdout
        finally:
            conn.execute(
                "UPDATE agent_sessions SET context = %s WHERE session_id = %s",
                (psycopg.types.json.Jsonb(context), sid),
            )


def write_rows_without_a_session(conn: psycopg.Connection[Any], n: int) -> None:
    """The owner drops session_id's NOT NULL (and hash's) and writes ``n`` rows without a
    session: a ledger altered by hand, whose rows every reader must survive."""
    conn.execute(
        "ALTER TABLE agent_events ALTER COLUMN session_id DROP NOT NULL, "
        "ALTER COLUMN hash DROP NOT NULL"
    )
    for i in range(n):
        conn.execute(
            "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
            "VALUES (NULL, 'a', 'tool.invoked', %s::jsonb)",
            (json.dumps({"call_id": f"n{i}", "tool": "t"}),),
        )


def published_columns(conn: psycopg.Connection[Any]) -> list[str]:
    """The columns of agent_events that agent_pub streams."""
    (cols,) = conn.execute(  # type: ignore[misc]
        "SELECT attnames FROM pg_publication_tables WHERE pubname = 'agent_pub' "
        "AND tablename = 'agent_events'"
    ).fetchone()
    return list(cols)
