"""``ledger-cdc init`` works from a built wheel, not only from the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.harness import Database

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.server
@pytest.mark.slow
def test_init_from_installed_wheel(tmp_path: Path, empty_db: Database) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("ledger_cdc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {
        "ledger_cdc/sql/0018_baseline.sql",
        "ledger_cdc/sql/grants.sql",
        "ledger_cdc/sql/functions/ledger.sql",
        "ledger_cdc/sql/legacy/0001_ledger.sql",
        "ledger_cdc/sql/partitioned/pre.sql",
        "ledger_cdc/py.typed",
    } <= set(names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # run from an unrelated directory so the source tree cannot be imported by accident
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = (
        "import os, ledger_cdc, ledger_cdc.cli; "
        "assert ledger_cdc.__file__.startswith(os.environ['PYTHONPATH']), ledger_cdc.__file__; "
        "ledger_cdc.cli.main()"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, "init", "--dsn", empty_db.dsn],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    assert "schema versions applied: 0018, 0019;" in p.stdout
