"""The throwaway cluster: lookup order, errors, settings, restart and crash."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pytest

from ledger_cdc.demo.embedded import EmbeddedPostgres, find_installations, find_postgres
from ledger_cdc.errors import PostgresNotFoundError

pytestmark = pytest.mark.server


def test_bad_env_dir_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEDGER_CDC_PG_BIN", str(tmp_path))
    with pytest.raises(
        PostgresNotFoundError, match=r"LEDGER_CDC_PG_BIN.*pip install 'ledger-cdc\[embedded\]'"
    ):
        find_postgres()


def test_env_dir_comes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    installs = find_installations()
    last = installs[-1]
    monkeypatch.setenv("LEDGER_CDC_PG_BIN", str(last.bindir))
    assert find_postgres().bindir == last.bindir
    assert find_installations()[0].source == "LEDGER_CDC_PG_BIN"


def test_missing_major_says_what_was_found() -> None:
    with pytest.raises(PostgresNotFoundError, match="no PostgreSQL 9 server binaries found"):
        find_postgres(9)


@pytest.mark.parametrize("major", [15, 18])
def test_cluster_settings_restart_and_crash(major: int) -> None:
    if not any(i.major == major for i in find_installations()):
        pytest.skip(f"no PostgreSQL {major}")
    with EmbeddedPostgres(
        major=major, max_slot_wal_keep_size="48MB", logical_decoding_work_mem="128kB"
    ) as pg:

        def settings() -> dict[str, str]:
            with psycopg.connect(pg.dsn(), autocommit=True) as c:
                rows = c.execute(
                    "SELECT name, setting, unit FROM pg_settings WHERE name IN ('wal_level', "
                    "'max_slot_wal_keep_size', 'logical_decoding_work_mem', 'listen_addresses', "
                    "'max_prepared_transactions', 'max_replication_slots', 'max_wal_senders', "
                    "'port')"
                ).fetchall()
            return {n: s for n, s, _ in rows}

        s = settings()
        assert s["wal_level"] == "logical" and s["listen_addresses"] == "127.0.0.1"
        assert s["max_slot_wal_keep_size"] == "48" and s["logical_decoding_work_mem"] == "128"
        assert int(s["max_prepared_transactions"]) > 0 and int(s["max_replication_slots"]) >= 10
        assert int(s["port"]) == pg.port != 5432
        with psycopg.connect(pg.dsn(), autocommit=True) as c:
            c.execute("CREATE TABLE t (a int)")
            c.execute("INSERT INTO t VALUES (1)")
        pg.restart("immediate")
        with psycopg.connect(pg.dsn(), autocommit=True) as c:
            assert c.execute("SELECT count(*) FROM t").fetchone() == (1,)
        old = pg.pid()
        pg.kill()
        assert not pg.running()
        pg.start()
        assert pg.pid() != old
        with psycopg.connect(pg.dsn(), autocommit=True) as c:
            assert c.execute("SELECT count(*) FROM t").fetchone() == (1,)
        basedir = pg.basedir
        assert basedir is not None and basedir.exists()
    assert not basedir.exists()
    if os.geteuid() == 0:
        assert pg._user is not None and pg._user.pw_uid != 0
