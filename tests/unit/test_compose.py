"""compose/docker-compose.yml is valid for a real compose parser, the commands it gives the
ledger-cdc services are accepted by the CLI, the consumer logs in as a least-privilege role and
is healthy when /healthz says so, and its Prometheus loads deploy's alerts. (That roles.sql
makes those roles, and that the consumer runs as one: tests/integration/test_deploy_server.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ledger_cdc.cli.app import cli
from tests.support.tools import required_tool

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"


def _compose() -> str:
    return required_tool(
        "docker-compose", "LEDGER_CDC_REQUIRE_COMPOSE", "apt-get install docker-compose"
    )


def test_compose_file_is_valid() -> None:
    r = subprocess.run(
        [_compose(), "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


def test_compose_services_and_their_commands() -> None:
    r = subprocess.run(
        [_compose(), "-f", str(COMPOSE), "config"], capture_output=True, text=True, check=True
    )
    # the normalised file is YAML; the system python that runs docker-compose has PyYAML
    to_json = subprocess.run(
        [
            "/usr/bin/python3",
            "-c",
            "import sys, json, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))",
        ],
        input=r.stdout,
        capture_output=True,
        text=True,
    )
    if to_json.returncode != 0:
        pytest.skip("no PyYAML next to docker-compose")
    services = json.loads(to_json.stdout)["services"]
    assert set(services) == {"postgres", "init", "roles", "consume", "nats", "prometheus"}
    pg = " ".join(services["postgres"]["command"])
    assert "wal_level=logical" in pg and "max_slot_wal_keep_size=" in pg
    assert services["postgres"]["image"].startswith("postgres:18")
    for name in ("postgres", "consume", "nats", "prometheus"):
        assert services[name].get("healthcheck"), name
        assert services[name].get("restart") == "unless-stopped", name
    assert services["consume"]["build"]["dockerfile"] == "Dockerfile"
    assert (ROOT / "Dockerfile").exists()
    assert "-js" in services["nats"]["command"]
    prom = (ROOT / "compose" / "prometheus.yml").read_text()
    assert "consume:9187" in prom and "9187" in " ".join(services["consume"]["command"])
    # the alerts of deploy/, mounted beside prometheus.yml, which names them
    assert "ledger-cdc.rules.yml" in prom
    sources = [  # (compose v1 prints a volume as a string, v2 as a mapping)
        v["source"] if isinstance(v, dict) else v.split(":")[0]
        for v in services["prometheus"]["volumes"]
    ]
    assert any(src.endswith("deploy/prometheus/ledger-cdc.rules.yml") for src in sources)
    # least privilege: the admin runs init and makes the login roles (roles.sql, once init has
    # made the group roles); the consumer logs in as cdc, and no password is in a command
    consume, roles = services["consume"], services["roles"]
    assert "roles.sql" in " ".join(roles["command"])
    assert roles["depends_on"]["init"]["condition"] == "service_completed_successfully"
    assert consume["depends_on"]["roles"]["condition"] == "service_completed_successfully"
    assert consume["environment"]["LEDGER_CDC_DSN"].startswith("postgresql://cdc@")
    assert services["init"]["environment"]["LEDGER_CDC_DSN"].startswith("postgresql://ledger@")
    for name, svc in services.items():
        assert "password" not in " ".join(svc.get("command") or []).lower(), name
    # healthy is caught up (/healthz), not merely answering
    assert "/healthz" in " ".join(consume["healthcheck"]["test"])
    assert consume["read_only"] is True and consume["cap_drop"] == ["ALL"]
    env = {"LEDGER_CDC_DSN": services["consume"]["environment"]["LEDGER_CDC_DSN"]}
    os.environ.update(env)
    try:
        for name in ("init", "consume"):
            args = services[name]["command"]
            cmd = cli.commands[args[0]]
            ctx = cmd.make_context(args[0], list(args[1:]))  # parses and validates every option
            assert ctx.params["dsn"] == env["LEDGER_CDC_DSN"]
    finally:
        os.environ.pop("LEDGER_CDC_DSN", None)


def test_the_compose_prometheus_loads_the_alerts(tmp_path: Path) -> None:
    """compose mounts deploy's alert rules beside its prometheus.yml, which names them."""
    promtool = required_tool(
        "promtool", "LEDGER_CDC_REQUIRE_PROMTOOL", "apt-get install prometheus"
    )
    rules = ROOT / "deploy" / "prometheus" / "ledger-cdc.rules.yml"
    shutil.copy(ROOT / "compose" / "prometheus.yml", tmp_path)
    shutil.copy(rules, tmp_path)
    r = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout, r.stdout
    assert f"SUCCESS: {rules.read_text().count('- alert: ')} rules found" in r.stdout, r.stdout
