"""Stop signals never hang a process and always end it with its own exit status: a signal that
arrives while the main thread holds the lock the stop takes, and a burst of SIGINTs and SIGTERMs
(a supervisor's and a wrapper's, a double Ctrl-C), on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from ledger_cdc.admin.schema import create_slot
from tests.support.cdc import ROOT, ConsumerProcess, until, wait_streaming
from tests.support.cli import start_cli
from tests.support.harness import Database


def _burst(pid: int, n: int = 2000) -> None:
    """SIGINT and SIGTERM in turn, ``n`` of them, a tenth of a millisecond apart: some arrive
    while the previous one is being handled."""
    for i in range(n):
        try:
            os.kill(pid, signal.SIGTERM if i % 2 else signal.SIGINT)
        except ProcessLookupError:
            return
        time.sleep(0.0001)


def test_a_stop_signal_while_the_main_thread_holds_the_stop_lock_does_not_hang(
    db: Database,
) -> None:
    # the handler runs in the main thread, here while that thread holds the lock of the event
    # the stop sets (as it does inside the previous signal's Event.set): a handler that took
    # the lock itself would wait for itself forever
    code = textwrap.dedent("""
        import os, signal, sys
        from ledger_cdc.consumer import ConsumerConfig, build_consumer
        c = build_consumer(ConsumerConfig(dsn=sys.argv[1]))
        c.install_signal_handlers()
        with c._stop._cond:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100_000):
                pass
        print("handled", flush=True)
        print("stopped" if c._stop.wait(30) else "not stopped", flush=True)
    """)
    p = subprocess.run(
        [sys.executable, "-c", code, db.dsn],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["handled", "stopped"]


def _stopped_consume(db: Database, log: Path, send: Callable[[int], None]) -> str:
    """A consumer streaming, then ``send(pid)``: it exits 0; its log."""
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    proc = ConsumerProcess(db.dsn, log=log).start()
    try:
        # (the slot is active as soon as the early stream starts, before the handlers are in)
        wait_streaming(db.dsn)
        until(lambda: "streaming slot" in log.read_text(), timeout=60)
        assert proc.proc is not None
        send(proc.proc.pid)
        assert proc.proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.alive():
            proc.kill()
    return log.read_text()


def test_a_burst_of_stop_signals_ends_consume_with_status_0(db: Database, tmp_path: Path) -> None:
    assert "stopped at" in _stopped_consume(db, tmp_path / "c.log", _burst)


def test_a_closed_terminal_drains_consume_like_a_stop(db: Database, tmp_path: Path) -> None:
    """SIGHUP (the terminal it was started from closed) finishes the batch in hand, confirms
    and exits 0, as SIGTERM does, instead of ending the process at once by the signal."""
    text = _stopped_consume(db, tmp_path / "c.log", lambda pid: os.kill(pid, signal.SIGHUP))
    assert f"signal {int(signal.SIGHUP)}: finishing the current batch" in text
    assert "stopped at" in text


def test_a_burst_of_stop_signals_ends_dispatch_with_status_0(db: Database, tmp_path: Path) -> None:
    log = tmp_path / "d.log"
    with open(log, "wb") as out:
        p = start_cli(
            *("dispatch", "--dsn", db.dsn, "--log-format", "text", "--poll-interval", "0.05"),
            *("--target", "tool:search=http://127.0.0.1:9/"),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:

            def dispatching() -> bool:
                assert p.poll() is None, log.read_text()
                return "dispatching outbox rows" in log.read_text()

            until(dispatching, 60, what=log.read_text)
            _burst(p.pid)
            assert p.wait(60) == 0, log.read_text()[-3000:]
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    assert "dispatched 0" in log.read_text()
