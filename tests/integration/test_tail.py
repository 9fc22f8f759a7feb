"""`ledger-cdc tail SESSION` follows a session live, from PostgreSQL (woken by the consumer's
notifications) and from JetStream."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

from ledger_cdc.client.writer import Ledger
from tests.support.cdc import ConsumerProcess, until
from tests.support.cli import Output, run_cli_process, start_cli
from tests.support.harness import Database
from tests.support.natsserver import NatsServer, publish, stream_config, wait_jetstream


def _tail(db: Database, sid: uuid.UUID, *extra: str) -> subprocess.Popen[str]:
    return start_cli(
        *("tail", str(sid), "--dsn", db.dsn, "--json", "--count", "4", *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _write(db: Database, sid: uuid.UUID, first: int, n: int) -> None:
    with Ledger(db.dsn) as ledger:
        for i in range(first, first + n):
            ledger.append(sid, "a", "tool.invoked", {"call_id": f"c{i}", "tool": "t"})


def _follow(db: Database, sid: uuid.UUID, *extra: str) -> list[dict[str, object]]:
    _write(db, sid, 1, 2)  # before the tail starts: printed from the beginning
    tail = _tail(db, sid, *extra)
    assert tail.stdout is not None and tail.stderr is not None
    out = Output(tail.stdout)
    out.wait_lines(2)
    _write(db, sid, 3, 2)  # written after it printed the first two: printed live
    assert tail.wait(60) == 0, tail.stderr.read()
    return [json.loads(line) for line in out.close().splitlines()]


def test_tail_from_postgres(db: Database) -> None:
    sid = uuid.uuid4()
    with ConsumerProcess(db.dsn, "--create-slot") as c, db.connect() as conn:
        until(
            lambda: (
                conn.execute("SELECT count(*) FROM pg_replication_slots WHERE active").fetchone()
                == (1,)
            )
        )
        rows = _follow(db, sid)
        c.kill()
    assert [r["position"] for r in rows] == [1, 2, 3, 4]
    assert [r["payload"]["call_id"] for r in rows] == ["c1", "c2", "c3", "c4"]  # type: ignore[index]


def test_tail_from_jetstream(db: Database, tmp_path: Path) -> None:
    srv = NatsServer(tmp_path / "js")
    try:
        wait_jetstream([srv.url])
        with ConsumerProcess(db.dsn, "--create-slot", "--sink", srv.url) as c, db.connect() as conn:
            until(
                lambda: (
                    conn.execute(
                        "SELECT count(*) FROM pg_replication_slots WHERE active"
                    ).fetchone()
                    == (1,)
                )
            )
            sid = uuid.uuid4()
            _write(db, uuid.uuid4(), 1, 1)  # the stream exists once the consumer published
            until(lambda: conn.execute("SELECT count(*) FROM agent_sessions").fetchone() == (1,))
            # what anyone allowed to publish on the subject may put there: skipped, not fatal
            subject = f"ledger.events.{sid}"
            deep = b'{"seq": 1, "payload": ' + b"[" * 5000 + b"]" * 5000 + b"}"  # RecursionError
            bodies = [b"not json", b'{"seq": 1}', b'{"commit_lsn": 7}', b"[" * 10_000, deep]
            publish(srv.url, [(subject, body, None) for body in bodies])
            rows = _follow(db, sid, "--nats", srv.url)
            c.kill()
        assert [r["position"] for r in rows] == [1, 2, 3, 4]
    finally:
        srv.kill()


def test_tail_from_jetstream_honours_the_urls_stream_and_prefix(
    db: Database, tmp_path: Path
) -> None:
    srv = NatsServer(tmp_path / "js")
    try:
        wait_jetstream([srv.url])
        url = f"{srv.url}?stream=AGENTS&prefix=agents&duplicate_window=30"
        # no stream yet: one line, the configuration exit code
        missing = _tail(db, uuid.uuid4(), "--nats", url)
        _, err = missing.communicate(timeout=60)
        assert missing.returncode == 4 and "AGENTS" in err and "Traceback" not in err, err
        with ConsumerProcess(db.dsn, "--create-slot", "--sink", url) as c, db.connect() as conn:
            until(
                lambda: (
                    conn.execute(
                        "SELECT count(*) FROM pg_replication_slots WHERE active"
                    ).fetchone()
                    == (1,)
                )
            )
            sid = uuid.uuid4()
            _write(db, uuid.uuid4(), 1, 1)
            until(lambda: conn.execute("SELECT count(*) FROM agent_sessions").fetchone() == (1,))
            rows = _follow(db, sid, "--nats", url)
            # a prefix the stream does not carry: one line, not a wait for ever
            wrong = _tail(db, sid, "--nats", f"{srv.url}?stream=AGENTS&prefix=other")
            _, err = wrong.communicate(timeout=60)
            assert wrong.returncode == 4 and "other.events.*" in err, err
            c.kill()
        assert [r["position"] for r in rows] == [1, 2, 3, 4]
        # a consumer with another duplicate window updates the existing stream to it
        with ConsumerProcess(
            db.dsn, "--sink", f"{srv.url}?stream=AGENTS&prefix=agents&duplicate_window=60"
        ):
            _write(db, uuid.uuid4(), 1, 1)
            until(lambda: _stream_window(srv.url) == 60.0, timeout=60)
    finally:
        srv.kill()


def _stream_window(url: str) -> float:
    return float(stream_config(url, "AGENTS").duplicate_window or 0)


def test_tail_from_an_unreachable_nats_fails_in_one_line(db: Database) -> None:
    out = run_cli_process(
        *("tail", str(uuid.uuid4()), "--dsn", db.dsn, "--nats", "nats://127.0.0.1:1"),
        timeout=120,
    )
    assert out.returncode == 4, out.stderr
    assert "Traceback" not in out.stderr and "ConnectionRefusedError" not in out.stderr
    assert [line for line in out.stderr.splitlines() if line.strip()] == [
        "error: cannot reach NATS at nats://127.0.0.1:1: NoServersError: nats: no servers "
        "available for connection"
    ], out.stderr
