"""deploy/: the Prometheus alerts pass promtool's check and their own unit tests (each alert
fires, and not before it should), the Grafana dashboard is well formed, the systemd unit
passes ``systemd-analyze verify`` and keeps its hardening, and the Kubernetes manifest is
valid for the API (kubernetes-validate, strict). That the metrics the rules and the dashboard
name are the ones a running consumer exports is tests/integration/test_deploy_server.py's."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.tools import required_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "ledger-cdc.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "ledger-cdc.rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "ledger-cdc.json"
UNIT = DEPLOY / "systemd" / "ledger-cdc-consume.service"
MANIFEST = DEPLOY / "kubernetes" / "ledger-cdc-sidecar.yaml"


def _promtool() -> str:
    return required_tool("promtool", "LEDGER_CDC_REQUIRE_PROMTOOL", "apt-get install prometheus")


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=120)


def _alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


# -- Prometheus ---------------------------------------------------------------------------------


def test_alert_rules_pass_promtool_check() -> None:
    r = _run(_promtool(), "check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr


def test_alert_rules_pass_their_unit_tests() -> None:
    r = _run(_promtool(), "test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired: set[str] = set()
    quiet: set[str] = set()
    for t in tests:
        for case in t.get("alert_rule_test", []):
            (fired if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names - fired == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested not firing"
    # what the issue asks to be alerted on
    for topic in ("Absent", "Lag", "SlotWal", "SafeWal", "DeadLetters", "Resync", "Failover"):
        assert any(topic in n for n in names), topic


def test_every_alert_says_how_bad_and_what_to_do() -> None:
    for a in _alerts():
        assert a["labels"]["severity"] in ("warning", "critical"), a["alert"]
        assert a["annotations"]["summary"] and len(a["annotations"]["description"]) > 60


# -- Grafana --------------------------------------------------------------------------------------


def test_the_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "ledger-cdc" and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 10
    for p in graphs:
        assert p["title"] and p["description"], p
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert "ledger_cdc_" in t["expr"], (p["title"], t["expr"])
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert 'slot=~"$slot"' in t["expr"], t["expr"]  # the slot picker applies


# -- systemd --------------------------------------------------------------------------------------


def _unit() -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # (keys keep their case)
    parser.read_string(UNIT.read_text())
    return parser


def test_the_systemd_unit_is_hardened_and_keeps_secrets_off_the_command_line() -> None:
    text = UNIT.read_text()
    service = _unit()["Service"]
    for key, value in {
        "DynamicUser": "yes",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "CapabilityBoundingSet": "",
        "SystemCallArchitectures": "native",
        "KillSignal": "SIGTERM",
    }.items():
        assert service.get(key) == value, key
    filters = [
        line.split("=", 1)[1] for line in text.splitlines() if line.startswith("SystemCallFilter=")
    ]
    assert "@system-service" in filters
    exec_start = service["ExecStart"]
    assert exec_start.startswith("/opt/ledger-cdc/bin/ledger-cdc consume ")
    assert "--metrics-port" in exec_start and "--dsn" not in exec_start
    assert not re.search(r"password|://[^@\s]*:[^@\s]*@", exec_start, re.I)
    assert service["EnvironmentFile"] == "/etc/ledger-cdc/consume.env"
    assert service["LoadCredential"] == "pgpass:/etc/ledger-cdc/pgpass"
    assert "Environment=PGPASSFILE=%d/pgpass" in text


def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    # verify checks that ExecStart's program exists: this environment's ledger-cdc stands in
    exe = shutil.which("ledger-cdc") or str(Path(sys.executable).parent / "ledger-cdc")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/ledger-cdc/bin/ledger-cdc", exe))
    r = _run(analyze, "verify", "--man=no", str(unit))
    out = r.stdout + r.stderr
    assert r.returncode == 0 and not re.search(r"Unknown|ignoring|not executable|Failed", out), out
    # and what the hardening leaves exposed, as systemd scores it (0 best, 10 worst)
    r = _run(analyze, "security", "--offline=yes", "--threshold=20", str(unit))
    if "--offline" in r.stderr and "unrecognized" in r.stderr:  # (before systemd 250)
        return
    assert r.returncode == 0, r.stdout + r.stderr


# -- Kubernetes -----------------------------------------------------------------------------------


def _manifests() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


@pytest.mark.parametrize("version", ["1.29.0", "latest"])
def test_the_kubernetes_manifest_is_valid(version: str) -> None:
    import kubernetes_validate

    if version == "latest":
        version = kubernetes_validate.latest_version()
    docs = _manifests()
    assert [d["kind"] for d in docs] == ["Deployment"]
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {e.message}", pytrace=False)


def test_the_sidecar_probes_secrets_and_security_context() -> None:
    (deployment,) = _manifests()
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    (sidecar,) = [c for c in pod["initContainers"] if c["name"] == "ledger-cdc"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    assert sidecar["args"][0] == "consume"
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz?live=1"
    assert sidecar["readinessProbe"]["httpGet"]["path"].startswith("/healthz")
    assert "live" not in sidecar["readinessProbe"]["httpGet"]["path"]
    port = sidecar["args"][sidecar["args"].index("--metrics-port") + 1]
    assert sidecar["ports"][0]["containerPort"] == int(port)
    assert sidecar["resources"]["requests"] and sidecar["resources"]["limits"]["memory"]
    for c in (*pod["initContainers"], *pod["containers"]):
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        for env in c.get("env", []):  # a password only ever from a Secret
            if "PASSWORD" in env["name"]:
                assert "secretKeyRef" in env["valueFrom"], env
            assert not re.search(r"password=|://[^@\s]*:[^@\s]*@", env.get("value", ""), re.I)
    # the consumer's stop (finish the batch, commit, confirm) fits in the grace period
    assert pod["terminationGracePeriodSeconds"] > 30
