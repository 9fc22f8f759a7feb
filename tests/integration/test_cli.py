"""The command line as a user meets it: help, version, init, errors and exit codes (each
command's in its help), a password given on the command line."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ledger_cdc import __version__
from ledger_cdc.cli import cli
from tests.support.cdc import assert_clean_exit, run_cli, until
from tests.support.cli import run_cli_process, start_cli
from tests.support.harness import Database


def test_version_and_help() -> None:
    r = CliRunner().invoke(cli, ["--version"])
    assert r.exit_code == 0 and __version__ in r.output
    r = CliRunner().invoke(cli, ["--help"])
    assert r.exit_code == 0 and "ledger-cdc demo" in r.output and "init" in r.output
    r = CliRunner().invoke(cli, ["init", "--help"])
    assert "LEDGER_CDC_DSN" in r.output and "--create-slot" in r.output


@pytest.mark.server
def test_init_twice_then_bad_slot(empty_db: Database) -> None:
    runner = CliRunner()
    r = runner.invoke(cli, ["init", "--dsn", empty_db.dsn, "--create-slot"])
    assert r.exit_code == 0, r.output
    assert "schema versions applied: 0018" in r.output and "slot agent_slot: created" in r.output
    r = runner.invoke(cli, ["init", "--create-slot"], env={"LEDGER_CDC_DSN": empty_db.dsn})
    assert (
        r.exit_code == 0
        and "already up to date" in r.output
        and "slot agent_slot: exists" in r.output
    )
    r = runner.invoke(cli, ["init", "--dsn", empty_db.dsn, "--create-slot", "--slot", "Bad Name"])
    assert r.exit_code == 4 and "invalid slot name" in r.output


def test_connection_error_is_one_line_and_exit_4() -> None:
    p = run_cli_process("init", "--dsn", "host=127.0.0.1 port=1 connect_timeout=2")
    assert p.returncode == 4
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Connection refused" in lines[0]
    assert "Traceback" not in p.stderr


def test_missing_dsn_is_a_usage_error() -> None:
    r = CliRunner().invoke(cli, ["init"], env={"LEDGER_CDC_DSN": None})
    assert r.exit_code == 2 and "--dsn" in r.output


@pytest.mark.server
def test_demo_runs_end_to_end() -> None:
    p = run_cli_process("demo", "--sessions", "3", timeout=180)
    assert p.returncode == 0, p.stderr
    assert "agent_events" in p.stdout and "events in 3 sessions" in p.stdout
    out = " ".join(p.stdout.split())  # rich wraps long lines
    # the crash story: killed mid-call, resumed from the ledger, nothing else called twice
    assert "SIGKILL" in out and "in flight: c2" in out
    assert "answered from the ledger, calling nothing: r1, c1" in out
    assert "saw: c1 ×1, c2 ×2, c3 ×1, r1 ×1, r2 ×1" in out and "session completed" in out
    assert "verify passed" in out


@pytest.mark.server
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_demo_ended_by_a_signal_takes_its_cluster_with_it(
    tmp_path: Path, sig: signal.Signals
) -> None:
    log = tmp_path / "demo.log"
    with open(log, "wb") as out:
        p = start_cli(
            *("demo", "--sessions", "2"),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            port: list[int] = []

            def started() -> bool:
                assert p.poll() is None, log.read_text()
                m = re.search(r"on 127\.0\.0\.1:(\d+)", log.read_text())
                if m:
                    port.append(int(m.group(1)))
                return bool(m)

            until(started, timeout=120)
            p.send_signal(sig)
            assert p.wait(60) == 128 + sig, log.read_text()[-2000:]
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(30)

    def closed() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port[0])) != 0

    until(closed, timeout=30)  # its server stopped, not left running


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found: list[tuple[str, ...]] = []
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            found.extend(_commands(cmd, (*prefix, name)))
        else:
            found.append((*prefix, name))
    return found


def test_every_command_documents_its_exit_codes() -> None:
    """Each command's --help ends with its exit codes; lag's are a monitoring plugin's."""
    commands = _commands(cli)
    assert ("lag",) in commands and ("slot", "drop") in commands
    for path in commands:
        # (a group with options of its own, outbox, needs its --dsn before a subcommand)
        r = CliRunner().invoke(cli, [*path, "--help"], env={"LEDGER_CDC_DSN": "host=127.0.0.1"})
        assert r.exit_code == 0, (path, r.output)
        tail = r.output.split("Exit codes:")[-1]
        assert "Exit codes:" in r.output and re.search(r"^\s+0\s+\S", tail, re.M), (path, r.output)
    r = CliRunner().invoke(cli, ["lag", "--help"])
    codes = " ".join(r.output.split("Exit codes:")[-1].split())
    assert "2 critical" in codes and "3 unknown: a usage error" in codes, codes


SECRET = "S3cretPW"


def _warnings(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("warning:")]


def test_a_password_on_the_command_line_is_warned_of(tmp_path: Path) -> None:
    """A DSN given on the command line with its password shows it to every user (ps): one line
    on stderr says so and where to put it instead; the command goes on. Not for a DSN from the
    environment, nor for one whose password is in a passfile."""
    url = f"postgresql://u:{SECRET}@127.0.0.1:1/x?connect_timeout=1"
    r = run_cli("lag", "--dsn", url, "--sample-seconds", "0")
    assert_clean_exit(r, 3)  # (the server is not there: the command went on to try)
    (warning,) = _warnings(r.stderr)
    assert "--dsn" in warning and "ps" in warning and "LEDGER_CDC_DSN" in warning, warning
    assert "passfile" in warning and SECRET not in r.output
    # key=value, in --target-dsn, whose variable is its own (and --dsn without one is quiet)
    kv = f"host=127.0.0.1 port=1 password='{SECRET}'"
    r = run_cli(
        "consume", "--dsn", "host=127.0.0.1 port=1", "--target-dsn", kv, "--batch-size", "0"
    )
    assert_clean_exit(r, 2)  # (--batch-size 0 stops it before any connection)
    (warning,) = _warnings(r.stderr)
    assert "--target-dsn" in warning and "LEDGER_CDC_TARGET_DSN" in warning, warning
    assert SECRET not in r.output
    # from the environment, or with the password in a passfile: no warning
    r = run_cli("lag", "--sample-seconds", "0", env={"LEDGER_CDC_DSN": url})
    assert_clean_exit(r, 3)
    assert _warnings(r.stderr) == [], r.stderr
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"127.0.0.1:1:*:u:{SECRET}\n")
    passfile.chmod(0o600)
    r = run_cli(
        "lag", "--dsn", f"host=127.0.0.1 port=1 user=u passfile={passfile} connect_timeout=1"
    )
    assert_clean_exit(r, 3)
    assert _warnings(r.stderr) == [], r.stderr
