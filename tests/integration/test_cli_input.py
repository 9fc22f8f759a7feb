"""Hostile and careless input at the command line: text from the ledger prints as itself (no
rich markup, no terminal escape sequence), and an option value no command can use is a usage
error naming the option (exit 2; 3 for lag, a check), never a traceback, a busy loop or a
wrong answer."""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

import pytest

from tests.support.cdc import assert_clean_exit, run_cli
from tests.support.harness import Database

# an agent id, a tool name and a result a writer may send: markup that would end or open a
# style, an escape sequence that would recolour the terminal, a right-to-left override
AGENT = "mallory[/]\x1b[31m"
TOOL = "[bold]tool[/bold]\u202e"
RESULT = "[/][link=http://127.0.0.1/]x\x1b]0;title\x07"


@pytest.mark.server
def test_ledger_text_prints_as_itself(db: Database) -> None:
    sid, other = uuid.uuid4(), uuid.uuid4()
    with db.connect() as owner:
        for s in (sid, other):
            for etype, payload in (
                ("tool.invoked", {"call_id": "c[/]", "tool": TOOL}),
                ("tool.observed", {"call_id": "c[/]", "result": RESULT}),
                ("task.failed", {"error": "boom [/] \x1b[2J"}),
            ):
                owner.execute(
                    "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
                    "VALUES (%s, %s, %s, %s::jsonb)",
                    (s, AGENT if s == sid else "other", etype, json.dumps(payload)),
                )
        owner.commit()
    for args in (["replay", str(sid)], ["inspect", str(sid)], ["diff", str(sid), str(other)]):
        r = run_cli(*args, "--dsn", db.dsn)
        assert_clean_exit(r, 0, 1)
        assert "\x1b" not in r.output and "\u202e" not in r.output, (args, r.output)
        assert "\\x1b" in r.output or args[0] == "inspect", (args, r.output)
    r = run_cli("replay", str(sid), "--dsn", db.dsn)
    assert "mallory[/]\\x1b[31m" in r.output and "c[/]" in r.output and "[bold]tool" in r.output


def test_an_error_holding_markup_is_one_plain_line() -> None:
    r = run_cli("replay", str(uuid.uuid4()), "--dsn", "host=[/]x[bold] port=notaport")
    assert_clean_exit(r, 4)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["consume", "--heartbeat-interval", "nan"], "finite"),
        (["consume", "--heartbeat-interval", "inf"], "--heartbeat-interval"),
        (["consume", "--health-interval", "-inf"], "--health-interval"),
        (["dispatch", "--poll-interval", "nan"], "finite"),
        (["dispatch", "--claim-seconds", "nan"], "finite"),
        (["dispatch", "--backoff", "-1"], "--backoff"),
        (["outbox", "--limit", "-1"], "--limit"),
        (["runs", "--limit", "0"], "--limit"),
        (["inspect", str(uuid.uuid4()), "--last", "-2"], "--last"),
        (["tail", str(uuid.uuid4()), "--count", "0"], "--count"),
        (["partitions", "archive", "--older-than", "-30d", "--to", "/tmp"], "above zero"),
        (["partitions", "archive", "--older-than", "1e10d", "--to", "/tmp"], "duration"),
        (["partitions", "archive", "--older-than", "", "--to", "/tmp"], "duration"),
        (["signal", str(uuid.uuid4()), "s", "--payload", "[" * 50_000], "--payload"),
        # finite, but past what a wait can take (the platform's clock overflows): the
        # heartbeat and slot-check threads died of it while the consumer went on unchecked
        (["consume", "--heartbeat-interval", "1e10"], "--heartbeat-interval"),
        (["consume", "--health-interval", "1e10"], "--health-interval"),
        (["consume", "--vacuum-interval", "1e10"], "--vacuum-interval"),
        (["consume", "--standby-poll", "1e10"], "--standby-poll"),
        # each try for a busy slot is a connection: a storm of them against the server
        (["consume", "--standby-poll", "0.001"], "--standby-poll"),
        (["dispatch", "--poll-interval", "0.001"], "--poll-interval"),
        (["consume", "--sink", "nats://127.0.0.1:1", "--sink", "nats://127.0.0.1:1"], "twice"),
        # a stop that may not take a moment would cut every batch in hand short
        (["consume", "--stop-timeout", "0"], "--stop-timeout"),
        (["consume", "--stop-timeout", "nan"], "finite"),
        (["consume", "--stop-timeout", "1e10"], "--stop-timeout"),
        # not 0 (off), and so small the task would run without pause: a busy loop of queries
        (["consume", "--health-interval", "1e-320"], "neither 0 (off) nor from 0.1"),
        (["consume", "--heartbeat-interval", "0.001"], "neither 0 (off) nor from 0.1"),
        (["consume", "--vacuum-interval", "1e-9"], "neither 0 (off) nor from 0.1"),
        (["consume", "--max-delay-ms", "99999999999999999999"], "--max-delay-ms"),
        (["verify", "--all", "--consumer-wait", "1e10"], "--consumer-wait"),
        (["dispatch", "--poll-interval", "1e10"], "--poll-interval"),
        (["dispatch", "--backoff-cap", "1e10"], "--backoff-cap"),
        (["dispatch", "--timeout", "1e10"], "--timeout"),
        (["dispatch", "--claim-seconds", "1e10"], "--claim-seconds"),
    ],
)
def test_an_option_no_command_can_use_is_a_usage_error(args: list[str], says: str) -> None:
    # the DSN is never reached: the value is refused before any connection
    r = run_cli(*args, "--dsn", "host=127.0.0.1 port=1 connect_timeout=1")
    assert_clean_exit(r, 2)
    assert says in r.output, r.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--slot", "Bad Slot!", "--create-slot"], "invalid slot name 'Bad Slot!'"),
        (["--publication", "bad pub;"], "invalid publication name 'bad pub;'"),
    ],
)
def test_init_names_a_bad_name_before_it_connects(args: list[str], says: str) -> None:
    """A name init would refuse is told as such, not hidden behind the server it cannot
    reach."""
    r = run_cli("init", *args, "--dsn", "host=127.0.0.1 port=1 connect_timeout=1")
    assert says in r.output, r.output
    assert "connection" not in r.output, r.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--crit-share", "nan"], "finite"),
        (["--warn-share", "0.9", "--crit-share", "0.5"], "a warning comes first"),
        (["--warn-seconds", "600"], "a warning comes first"),
        (["--sample-seconds", "1e10"], "--sample-seconds"),
        (["--watch", "--interval", "1e10"], "--interval"),
        (["--no-such-option"], "No such option"),
        (["--slot", "Bad Name"], "invalid slot name"),
        (["--slot", "x" * 64], "invalid slot name"),
    ],
)
def test_lag_cannot_tell_from_a_bad_option_exit_3(args: list[str], says: str) -> None:
    """lag's exit code is a monitoring plugin's: a usage error, or a --slot no slot can be
    named, is 3 (unknown), never 2 (critical)."""
    r = run_cli("lag", *args, "--dsn", "host=127.0.0.1 port=1 connect_timeout=1")
    assert_clean_exit(r, 3)
    assert says in r.output, r.output


def test_lag_without_a_dsn_or_a_server_is_unknown() -> None:
    r = run_cli("lag", env={"LEDGER_CDC_DSN": None})
    assert_clean_exit(r, 3)
    assert "--dsn" in r.output
    r = run_cli("lag", "--dsn", "host=127.0.0.1 port=1 connect_timeout=1", "--sample-seconds", "0")
    assert_clean_exit(r, 3)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output


@pytest.mark.server
def test_inspect_last_zero_shows_no_event(db: Database) -> None:
    sid = uuid.uuid4()
    with db.connect() as owner:
        for n in range(3):
            owner.execute(
                "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
                "VALUES (%s, 'a', 'tool.invoked', %s::jsonb)",
                (sid, json.dumps({"call_id": f"c{n}", "tool": "t"})),
            )
        owner.commit()
    for last, want in (("0", 0), ("2", 2), ("9", 3)):
        r = run_cli("inspect", str(sid), "--last", last, "--json", "--dsn", db.dsn)
        assert_clean_exit(r)
        assert len(r.output.splitlines()) == want, r.output


@pytest.mark.server
def test_import_refuses_a_line_no_reader_could_take(db: Database, tmp_path: Path) -> None:
    """A line nested past any parser's depth, a time readers would quarantine, bytes that are
    not JSON: one line naming the line, no traceback, nothing imported."""
    head = (
        '{"session_id": "6b1f0000-0000-0000-0000-000000000000", "agent_id": "a", '
        '"event_type": "tool.invoked", '
    )
    for line, says in (
        (
            head
            + '"created_at": "2026-01-01T00:00:00Z", "payload": {"k": '
            + "[" * 100_000
            + "]" * 100_000
            + "}}",
            "nested too deep",
        ),
        (head + '"created_at": "0001-01-01T00:00:00Z", "payload": {}}', "outside"),
        ("\x00 not json", "line 1"),
    ):
        source = tmp_path / "events.jsonl"
        source.write_text(line + "\n")
        r = run_cli("import", str(source), "--dsn", db.dsn)
        assert_clean_exit(r, 4, 5)
        assert says in r.output and "line 1" in r.output, r.output
    with db.connect() as conn:
        assert conn.execute("SELECT count(*) FROM agent_events").fetchone() == (0,)


@pytest.mark.parametrize("dsn", ["", "   ", "\x00", "host=127.0.0.1\x00port=1"])
def test_an_empty_or_nul_dsn_is_a_usage_error(dsn: str) -> None:
    """libpq would take an empty DSN for its defaults (the local socket) and read a NUL-cut
    one up to the NUL: refused before any connection."""
    for args in (["lag"], ["consume"], ["consume", "--dsn", "host=127.0.0.1 port=1"]):
        option = "--target-dsn" if "--dsn" in args else "--dsn"
        r = run_cli(*args, option, dsn)
        assert_clean_exit(r, 3 if args == ["lag"] else 2)  # (lag's usage errors: unknown)
        assert option in r.output, r.output


def test_a_service_that_does_not_exist_is_not_retried() -> None:
    """A DSN naming a service the service file lacks is a configuration error (exit 4 at once),
    not a server to wait for."""
    r = run_cli("consume", "--dsn", "service=ledger_cdc_no_such_service")
    assert_clean_exit(r, 4)
    assert "definition of service" in r.output, r.output


def test_a_metrics_port_already_taken_is_one_line() -> None:
    """A /metrics port another process holds is said in one line (exit 4), not an internal
    error (consume and dispatch serve it through the same function)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        # (consume serves its metrics before it connects: the DSN is never reached)
        r = run_cli(
            "consume", "--dsn", "host=127.0.0.1 port=1 connect_timeout=1", "--metrics-port", port
        )
    assert_clean_exit(r, 4)
    assert f"cannot serve metrics on '127.0.0.1' port {port}" in r.output, r.output
