"""Faults with real processes and signals: the consumer SIGKILLed in a loop, the server restarted
in immediate mode, the walsender terminated, the TCP connection cut by a loopback proxy. After
each, projections and snapshots equal a fold of the whole table from zero."""

from __future__ import annotations

import contextlib
import random
import select
import socket
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from ledger_cdc.admin.schema import create_slot
from ledger_cdc.client.writer import Ledger
from ledger_cdc.errors import LedgerError
from tests.support.cdc import (
    ConsumerProcess,
    Writers,
    assert_projections_equal_refold,
    assert_verify_exact,
    turn_events,
    until,
    wait_caught_up,
    wait_streaming,
)
from tests.support.harness import Database, Server

pytestmark = [pytest.mark.server, pytest.mark.slow]


def _slot(db: Database) -> None:
    with db.connect() as conn:
        create_slot(conn, "agent_slot")


def test_crash_loop_sigkill(db: Database, tmp_path: Path) -> None:
    _slot(db)
    rng = random.Random(20261202)
    writers = Writers(db.dsn, n=8, sessions=30, pace=0.03).start()
    kills = 0
    try:
        while kills < 12:
            proc = ConsumerProcess(
                db.dsn,
                "--batch-size",
                str(rng.choice([1, 10, 200])),
                "--snapshot-every",
                "5",
                log=tmp_path / "consumer.log",
            ).start()
            time.sleep(rng.uniform(0.4, 1.6))  # startup takes ~0.3 s: some kills land mid-batch
            proc.kill()
            kills += 1
    finally:
        writers.stop()
    assert writers.turns > 100
    with ConsumerProcess(db.dsn, "--snapshot-every", "5", log=tmp_path / "consumer.log"):
        wait_caught_up(db.dsn, 120)
    n = assert_projections_equal_refold(db.dsn)
    assert_verify_exact(db.dsn)
    assert n >= writers.turns * 3


def _running_consumer(db: Database, tmp_path: Path, dsn: str | None = None) -> ConsumerProcess:
    _slot(db)
    return ConsumerProcess(
        dsn or db.dsn, "--snapshot-every", "10", log=tmp_path / "consumer.log"
    ).start()


def test_server_immediate_restart_mid_stream(server: Server, db: Database, tmp_path: Path) -> None:
    with _running_consumer(db, tmp_path):
        writers = Writers(db.dsn, n=4, sessions=10).start()
        time.sleep(1.5)
        writers._stop.set()
        for t in writers._threads:
            t.join(60)
        server.pg.restart("immediate")  # a crash: no shutdown checkpoint
        writers = Writers(db.dsn, n=4, sessions=10, seed=2).start()
        time.sleep(1.5)
        writers.stop()
        wait_caught_up(db.dsn, 120)
    assert_projections_equal_refold(db.dsn)
    assert_verify_exact(db.dsn)


def test_server_crashes_while_projections_commit_without_waiting_for_their_flush(
    server: Server, db: Database, tmp_path: Path
) -> None:
    """Writers and the consumer (its default --sink-commit async) busy while the server is
    crashed three times: projection commits made visible but not yet written are lost with the
    crash; the consumer starts again from the checkpoint that survived (on disk before
    streaming resumes from it) and the stream sends the rest again — nothing missing, nothing
    twice. (That the slot is never confirmed past a commit not yet flushed is shown where it
    can be forced: tests/unit/test_durable.py and tests/integration/test_sink_commit.py.)"""
    stop = threading.Event()
    written = [0]

    def write() -> None:
        rng = random.Random(5)
        sessions = [uuid.UUID(int=rng.getrandbits(128), version=4) for _ in range(8)]
        while not stop.is_set():
            try:
                with Ledger(db.dsn) as ledger:
                    while not stop.is_set():
                        turn_events(ledger, rng.choice(sessions), "w", rng)
                        written[0] += 1
            except (psycopg.Error, LedgerError):
                stop.wait(0.05)  # the server is restarting: connect again

    with _running_consumer(db, tmp_path):
        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        try:
            for _ in range(3):
                before = written[0]
                until(lambda b=before: written[0] >= b + 20, timeout=60)  # type: ignore[misc]
                server.pg.restart("immediate")
        finally:
            stop.set()
            writer.join(60)
        wait_caught_up(db.dsn, 120)
    assert_projections_equal_refold(db.dsn)
    assert_verify_exact(db.dsn)


def test_walsender_terminated(db: Database, tmp_path: Path) -> None:
    with _running_consumer(db, tmp_path):
        writers = Writers(db.dsn, n=4, sessions=10).start()
        for _ in range(3):
            time.sleep(0.8)
            with db.connect() as conn:
                until(
                    lambda c=conn: (
                        c.execute(
                            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = 'agent_slot'"
                        ).fetchone()
                        not in (None, (None,))
                    ),
                    30,
                )
                conn.execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                    "WHERE slot_name = 'agent_slot'"
                )
        writers.stop()
        wait_caught_up(db.dsn, 120)
    assert_projections_equal_refold(db.dsn)
    assert_verify_exact(db.dsn)


class CuttableProxy:
    """A TCP proxy on loopback whose connections can be cut at once, or frozen: held open,
    nothing forwarded either way (a server hung, or the network silently dropping)."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.cuts = 0
        self._stop = threading.Event()
        self._frozen = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                r, _, _ = select.select([self.listener], [], [], 0.2)
                if not r:
                    continue
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            with self._lock:
                self.conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        socks = [a, b]
        try:
            while not self._stop.is_set():
                if self._frozen.is_set():
                    self._stop.wait(0.05)
                    continue
                r, _, _ = select.select(socks, [], [], 0.2)
                for s in r:
                    data = s.recv(65536)
                    if not data:
                        return
                    (b if s is a else a).sendall(data)
        except (OSError, ValueError):  # cut() closed the sockets under us
            return
        finally:
            for s in socks:
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> None:
        with self._lock:
            conns, self.conns = self.conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
                s.close()
        self.cuts += 1

    def freeze(self) -> None:
        self._frozen.set()

    def thaw(self) -> None:
        self._frozen.clear()

    def close(self) -> None:
        self._stop.set()
        self.cut()
        self.listener.close()


@pytest.mark.parametrize(
    ("make", "kind", "says"),
    [
        ("pg_create_physical_replication_slot('agent_slot')", "physical", "is a physical slot"),
        (
            "pg_create_logical_replication_slot('agent_slot', 'test_decoding')",
            "logical",
            "with plugin 'test_decoding'",
        ),
    ],
    ids=["physical", "test_decoding"],
)
def test_a_slot_replaced_by_another_kind_while_away_is_left_alone(
    server: Server, db: Database, tmp_path: Path, make: str, kind: str, says: str
) -> None:
    """While the consumer is cut off (a network partition), its slot is dropped and another of
    the same name made: a standby's physical slot, another tool's logical one. At its
    reconnect PostgreSQL 15 calls the physical slot "invalidated" (it reserved no WAL), 16+
    "a physical replication slot"; the other plugin refuses pgoutput's options. Each way the
    consumer exits 3 saying what the slot is, and the slot stays. (Resynchronising a lost
    slot drops it and makes a new one: on 15 it took the standby's.)"""
    proxy = CuttableProxy(server.pg.port)
    try:
        via_proxy = f"host=127.0.0.1 port={proxy.port} dbname={db.name} user=postgres"
        log = tmp_path / "consumer.log"
        consumer = _running_consumer(db, tmp_path, via_proxy)
        try:
            # past its checks at start (it streams before they end): this is a reconnect
            until(lambda: "streaming slot agent_slot from" in log.read_text(), 60)
            proxy.freeze()  # the consumer cannot see what happens next, nor reconnect
            with psycopg.connect(db.dsn, autocommit=True) as conn:
                conn.execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                    "WHERE slot_name = 'agent_slot' AND active_pid IS NOT NULL"
                )
                until(
                    lambda: (
                        conn.execute(
                            "SELECT active FROM pg_replication_slots WHERE slot_name = 'agent_slot'"
                        ).fetchone()
                        == (False,)
                    ),
                    30,
                )
                conn.execute("SELECT pg_drop_replication_slot('agent_slot')")
                conn.execute(f"SELECT {make}")
            proxy.thaw()
            proxy.cut()
            assert consumer.proc is not None
            assert consumer.proc.wait(90) == 3, log.read_text()
        finally:
            if consumer.alive():
                consumer.kill()
        text = log.read_text()
        assert f"{says}, not a pgoutput logical slot" in text, text
        assert "resynchronising" not in text, text
        with psycopg.connect(db.dsn) as conn:
            assert conn.execute(
                "SELECT slot_type FROM pg_replication_slots WHERE slot_name = 'agent_slot'"
            ).fetchone() == (kind,)
            conn.execute("SELECT pg_drop_replication_slot('agent_slot')")
    finally:
        proxy.close()


def test_tcp_connection_cut(server: Server, db: Database, tmp_path: Path) -> None:
    proxy = CuttableProxy(server.pg.port)
    try:
        via_proxy = f"host=127.0.0.1 port={proxy.port} dbname={db.name} user=postgres"
        log = tmp_path / "consumer.log"
        with _running_consumer(db, tmp_path, via_proxy):
            wait_streaming(db.dsn)
            writers = Writers(db.dsn, n=4, sessions=10).start()
            for i in range(3):
                time.sleep(0.5)  # writes in flight when the cut lands
                proxy.cut()
                until(lambda i=i: log.read_text().count("reconnecting") > i, 60)
                wait_streaming(db.dsn)
            writers.stop()
            wait_caught_up(db.dsn, 120)
        assert "reconnecting" in log.read_text()
    finally:
        proxy.close()
    assert_projections_equal_refold(db.dsn)
    assert_verify_exact(db.dsn)
    with psycopg.connect(db.dsn) as conn:
        (n,) = conn.execute("SELECT count(*) FROM ledger_dead_letters").fetchone()  # type: ignore[misc]
    assert n == 0


def test_a_stop_with_the_projection_database_hung_ends_within_the_stop_timeout(
    server: Server, db: Database, tmp_path: Path
) -> None:
    """The consumer's connections frozen mid-run (its server stopped answering, or the network
    silently drops), then SIGTERM: what the stop sends (the commit in flight, or its look at
    the WAL flush) never returns, and the process exits with status 4 once --stop-timeout has
    passed instead of hanging for good. Started again with the database answering, it loses
    nothing and applies nothing twice. (Every connection goes through the proxy: a
    --target-dsn would store the projections another way than the second run does.)"""
    proxy = CuttableProxy(server.pg.port)
    log = tmp_path / "consumer.log"
    try:
        via_proxy = f"host=127.0.0.1 port={proxy.port} dbname={db.name} user=postgres"
        _slot(db)
        args = ("--stop-timeout", "3", "--vacuum-interval", "0")
        consumer = ConsumerProcess(via_proxy, *args, log=log).start()
        try:
            wait_streaming(db.dsn)
            writers = Writers(db.dsn, n=2, sessions=5).start()
            try:

                def folded() -> bool:  # under way: batches committed
                    with psycopg.connect(db.dsn) as conn:
                        row = conn.execute("SELECT count(*) FROM agent_sessions").fetchone()
                    return row is not None and row[0] > 0

                until(folded, 60)
                proxy.freeze()
                turns = writers.turns
                until(lambda: writers.turns > turns + 20, 60)
            finally:
                writers.stop()
            began = time.monotonic()
            assert consumer.terminate(timeout=60) == 4
            took = time.monotonic() - began
            assert 3 <= took < 15, f"the stop took {took:.1f}s"
            assert "not done 3s after the stop" in log.read_text()
        finally:
            consumer.kill()
    finally:
        proxy.close()
    with ConsumerProcess(db.dsn, log=log).start():
        wait_caught_up(db.dsn, 120)
    assert_projections_equal_refold(db.dsn)
    assert_verify_exact(db.dsn)
