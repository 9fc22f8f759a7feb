"""compose/docker-compose.yml is valid for a real compose parser, and the commands it gives the
ledger-cdc services are accepted by the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ledger_cdc.cli.app import cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"


def _compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("LEDGER_CDC_REQUIRE_COMPOSE"):
            pytest.fail(
                "docker-compose not installed (apt-get install docker-compose)", pytrace=False
            )
        pytest.skip("docker-compose not installed")
    return exe


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
    assert set(services) == {"postgres", "init", "consume", "nats", "prometheus"}
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
