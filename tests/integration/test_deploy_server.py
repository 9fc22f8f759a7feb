"""deploy/ and compose/ against a real ``ledger-cdc consume``: it logs in as the least-privilege
role compose makes (compose/roles.sql, run by psql as the admin), answers ``/healthz`` as the
Kubernetes probes and the compose healthcheck expect (streaming, standing by, taking over),
and exports every metric the Grafana dashboard and the alert rules query."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from ledger_cdc.admin.schema import create_slot
from ledger_cdc.client.writer import Ledger
from tests.support.cdc import ConsumerProcess, until, wait_caught_up
from tests.support.harness import Database

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "ledger-cdc.json"
RULES = ROOT / "deploy" / "prometheus" / "ledger-cdc.rules.yml"

# Gauges the alert rules use that the consumer does not export yet (the slot check has yet to
# measure them): each is named in the rules and documented in consumer/metrics.py's HELP table.
NOT_YET_EXPORTED = {"ledger_cdc_slot_wal_status", "ledger_cdc_slot_failover_ready"}

# -- the metric names a PromQL expression reads ---------------------------------------------------

_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left"}
_KEYWORDS |= {"group_right", "bool", "offset", "inf", "nan", "atan2"}
_NAME_MATCH = re.compile(r'__name__\s*=~?\s*"([^"]*)"')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKEN = re.compile(r"(?<![\w$:.])[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects: the bare names (not functions, keywords, labels,
    durations or Grafana variables) and the alternatives of a ``__name__`` matcher. They are
    compared with the sample names of a scrape, which is what PromQL sees: a histogram's
    ``_bucket``/``_sum``/``_count`` and a counter's ``_total`` are sample names there, so none
    is stripped (stripping ``_count`` would turn ``x_count`` of a plain gauge into ``x``)."""
    names = {n for alt in _NAME_MATCH.findall(expr) for n in alt.split("|")}
    rest = _STRING.sub('""', expr)
    rest = re.sub(r"\{[^}]*\}", "", rest)  # label matchers
    rest = re.sub(r"\[[^\]]*\]", "", rest)  # ranges, subqueries
    rest = _GROUPING.sub("", rest)
    rest = re.sub(r"\$\{?\w+\}?", "", rest)  # Grafana variables
    for m in _TOKEN.finditer(rest):
        called = rest[m.end() :].lstrip().startswith("(")  # a function or an aggregation
        if not called and m[0].lower() not in _KEYWORDS:
            names.add(m[0])
    return names


def test_metric_names_of_promql() -> None:
    assert metric_names(
        'sum by (slot) (rate(ledger_cdc_events_total{slot=~"$slot"}[$__rate_interval]))'
        " / on (slot) group_left max by (slot) (x_count offset 5m) > bool 2"
    ) == {"ledger_cdc_events_total", "x_count"}
    assert metric_names(
        'max by (slot) ({__name__=~"a_seconds|b_seconds"}) > 60 or absent(up{job="x"} == 1)'
    ) == {"a_seconds", "b_seconds", "up"}
    assert metric_names("histogram_quantile(0.9, sum by (le) (rate(h_bucket[5m])))") == {"h_bucket"}


def _dashboard_names() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [
        v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        for v in dash["templating"]["list"]
        if v["type"] == "query"
    ]
    found: set[str] = set()
    for e in exprs:
        found |= metric_names(re.sub(r"label_values\(([^,]+),[^)]*\)", r"\1", e))
    return found


def _rule_names() -> set[str]:
    doc = yaml.safe_load(RULES.read_text())
    return {n for g in doc["groups"] for r in g["rules"] for n in metric_names(r["expr"])}


# -- a consumer as compose runs it -----------------------------------------------------------------


@dataclass
class ComposeRoles:
    db: Database
    cdc: str
    agent: str
    dispatch: str


@pytest.fixture
def compose_roles(db: Database) -> Iterator[ComposeRoles]:
    """compose/roles.sql, as the compose ``roles`` service runs it (psql as the admin, the
    passwords from the environment), with role names of this database's own (roles are
    cluster-wide)."""
    import subprocess

    roles = ComposeRoles(db, f"cdc_{db.name}", f"agent_{db.name}", f"dispatch_{db.name}")
    psql = db.server.pg.install.exe("psql")
    env = {
        "LEDGER_CDC_PASSWORD": "c'pw",
        "LEDGER_AGENT_PASSWORD": "a",
        "LEDGER_DISPATCH_PASSWORD": "d",
        "PATH": "/usr/bin:/bin",
    }
    argv = [psql, "--no-psqlrc", "--quiet", "--set=ON_ERROR_STOP=1"]
    argv += [f"--set=cdc_role={roles.cdc}", f"--set=agent_role={roles.agent}"]
    argv += [f"--set=dispatch_role={roles.dispatch}", "--file", str(ROOT / "compose/roles.sql")]
    try:
        for _ in range(2):  # idempotent: a second run changes nothing
            r = subprocess.run([*argv, db.dsn], capture_output=True, text=True, env=env)
            assert r.returncode == 0 and not r.stderr, r.stderr
        with db.connect() as conn:
            got = conn.execute(
                "SELECT r.rolname, r.rolreplication, r.rolsuper, array_agg(g.rolname ORDER BY g.rolname) "
                "FROM pg_roles r JOIN pg_auth_members m ON m.member = r.oid "
                "JOIN pg_roles g ON g.oid = m.roleid WHERE r.rolname = ANY(%s) GROUP BY 1, 2, 3",
                ([roles.cdc, roles.agent, roles.dispatch],),
            ).fetchall()
        assert sorted(got) == sorted(
            [
                (roles.cdc, True, False, ["ledger_consumer"]),
                (roles.agent, False, False, ["ledger_reader", "ledger_writer"]),
                (roles.dispatch, False, False, ["ledger_dispatcher"]),
            ]
        )
        yield roles
    finally:
        with db.connect() as conn, psycopg.connect(db.server.dsn(), autocommit=True) as admin:
            for name in (roles.cdc, roles.agent, roles.dispatch):
                if admin.execute("SELECT FROM pg_roles WHERE rolname = %s", (name,)).fetchone():
                    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
                    admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def _consumer(db: Database, role: str, log: Path) -> ConsumerProcess:
    return ConsumerProcess(
        db.dsn_as(role),
        "--metrics-port",
        "0",
        "--heartbeat-interval",
        "0.5",
        "--health-interval",
        "0.5",
        log=log,
    ).start()


def _base_url(proc: ConsumerProcess, log: Path) -> str:
    """Where the consumer serves (port 0: the one its log names)."""
    found: list[str] = []

    def served() -> bool:
        assert proc.alive(), log.read_text()
        m = re.search(r"metrics on http://([\d.]+):(\d+)/metrics", log.read_text())
        if m:
            found.append(f"http://{m[1]}:{m[2]}")
        return bool(m)

    until(served, timeout=90, every=0.1)
    return found[0]


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = r.read()
            code = r.status
    except urllib.error.HTTPError as e:
        body, code = e.read(), e.code
    return code, json.loads(body) if body.startswith(b"{") else body.decode()


def _ready_with(url: str, events: int) -> bool:
    code, body = _get(url)
    return code == 200 and body["events"] >= events


def _append(ledger: Ledger, sid: uuid.UUID, n: int) -> None:
    for i in range(n):
        ledger.append(sid, "a", "tool.invoked", {"call_id": f"c{i}", "tool": "t"})


@pytest.mark.server
def test_healthz_of_the_compose_consumer_its_standby_and_the_takeover(
    compose_roles: ComposeRoles, tmp_path: Path
) -> None:
    db = compose_roles.db
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    active = _consumer(db, compose_roles.cdc, tmp_path / "active.log")
    standby: ConsumerProcess | None = None
    try:
        url = _base_url(active, tmp_path / "active.log") + "/healthz"
        until(lambda: _get(url)[0] == 200, timeout=90, every=0.2)
        with Ledger(db.dsn_as(compose_roles.agent)) as ledger:
            _append(ledger, uuid.uuid4(), 5)
        wait_caught_up(db.dsn)
        # the slot check has run once the server's view of the lag is there
        until(lambda: _get(url)[1]["slot_lag_seconds"] is not None, timeout=60)
        until(lambda: _get(url)[1]["events"] >= 5, timeout=60)
        code, body = _get(url)
        assert code == 200, body
        assert body["status"] == "ok" and body["reasons"] == []
        assert body["state"] == "streaming" and body["slot"] == "agent_slot"
        assert isinstance(body["lag_seconds"], float) and body["lag_seconds"] < 60
        assert isinstance(body["lag_bytes"], int)
        assert body["dead_letters"] == 0
        # readiness with a bound no real lag meets; liveness whatever the bound; a bad bound
        code, body = _get(url + "?max_lag_seconds=0")
        assert code == 503 and body["status"] == "unhealthy"
        assert any("behind" in r for r in body["reasons"]), body
        code, body = _get(url + "?live=1&max_lag_seconds=0")
        assert (code, body["status"]) == (200, "alive")
        assert _get(url + "?max_lag_seconds=soon")[0] == 400
        # a second consumer of the slot stands by, and is ready: it takes over when needed
        standby = _consumer(db, compose_roles.cdc, tmp_path / "standby.log")
        url2 = _base_url(standby, tmp_path / "standby.log") + "/healthz"
        until(lambda: _get(url2)[1].get("state") == "standby", timeout=90, every=0.2)
        assert _get(url2)[0] == 200
        assert active.terminate() == 0
        until(lambda: _get(url2)[1].get("state") == "streaming", timeout=90, every=0.2)
        with Ledger(db.dsn_as(compose_roles.agent)) as ledger:
            _append(ledger, uuid.uuid4(), 3)
        wait_caught_up(db.dsn)
        until(lambda: _ready_with(url2, events=3), timeout=60)
        assert standby.terminate() == 0
    finally:
        for p in (active, standby):
            if p is not None and p.alive():
                p.kill()


@pytest.mark.server
def test_every_metric_the_dashboard_and_the_alerts_query_is_exported(
    compose_roles: ComposeRoles, tmp_path: Path
) -> None:
    """Scrapes a running consumer (as the least-privilege role: every slot figure is readable
    to it) until the slot check has sampled the WAL rate twice, then compares."""
    db = compose_roles.db
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    dashboard, rules = _dashboard_names(), _rule_names()
    assert "ledger_cdc_events_total" in dashboard and "ledger_cdc_slot_lag_seconds" in rules
    proc = _consumer(db, compose_roles.cdc, tmp_path / "c.log")
    try:
        url = _base_url(proc, tmp_path / "c.log") + "/metrics"
        with Ledger(db.dsn_as(compose_roles.agent)) as ledger:
            _append(ledger, uuid.uuid4(), 5)
        wait_caught_up(db.dsn)
        exported: set[str] = set()

        def scraped() -> bool:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            exported.clear()
            for fam in text_string_to_metric_families(text):
                exported.update(s.name for s in fam.samples)
            return dashboard <= exported

        try:
            until(scraped, timeout=90, every=0.5)
        except AssertionError:
            pytest.fail(f"the dashboard queries metrics not exported: {dashboard - exported}")
        assert rules - exported - {"up"} <= NOT_YET_EXPORTED, rules - exported
        assert proc.terminate() == 0
    finally:
        if proc.alive():
            proc.kill()
