"""`consume --spill-dir` (env LEDGER_CDC_SPILL_DIR): where what passes --memory-limit-mb goes,
and a directory that cannot take a file said at once in one line naming it (exit 4), not
"internal error … a bug" (exit 5) once the first large transaction came."""

from __future__ import annotations

import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cdc import InThread, assert_clean_exit, run_cli, wait_caught_up
from tests.support.harness import Database

pytestmark = pytest.mark.server


def _one_error(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), output
    return lines[0]


def test_a_spill_dir_that_cannot_take_a_file_stops_consume_at_start(
    db: Database, tmp_path: Path
) -> None:
    plain = tmp_path / "plain"
    plain.write_text("")
    for spill, says in (
        (plain / "spill", "it is not a directory"),  # (root writes past chmod: not this)
        (tmp_path / "missing", "create it"),
    ):
        r = run_cli("consume", "--dsn", db.dsn, "--create-slot", "--spill-dir", str(spill))
        assert_clean_exit(r, 4)
        line = _one_error(r.output)
        assert f"spill directory {spill}:" in line and says in line, line
        assert "internal error" not in line
    # from the environment: a file where a directory is wanted
    r = run_cli("consume", "--dsn", db.dsn, env={"LEDGER_CDC_SPILL_DIR": str(plain)})
    assert_clean_exit(r, 4)
    assert f"spill directory {plain}: Not a directory" in _one_error(r.output)


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 kB tmpfs, filled: a spill directory with no room (skipped where mounting is not
    allowed)."""
    point = tmp_path / "tiny"
    point.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(point)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        with open(point / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass  # (full)
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)


def test_a_full_spill_dir_is_said_with_its_path(db: Database, full_tmpfs: Path) -> None:
    r = run_cli("consume", "--dsn", db.dsn, "--create-slot", "--spill-dir", str(full_tmpfs))
    assert_clean_exit(r, 4)
    line = _one_error(r.output)
    assert f"spill directory {full_tmpfs}: No space left on device" in line, line
    assert "free space there" in line and "--spill-dir" in line


def test_the_consumer_spills_where_it_is_told(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transaction past the memory limit is buffered in the spill directory given."""
    made: list[Any] = []
    real = tempfile.TemporaryFile

    def recording(*args: Any, **kwargs: Any) -> Any:
        made.append(kwargs.get("dir"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", recording)
    spill = tmp_path / "spill"
    spill.mkdir()
    sid = uuid.uuid4()
    with InThread(db.dsn, memory_limit=64 * 1024, spill_dir=str(spill)) as consumer:
        with db.connect() as conn, conn.transaction():
            for i in range(400):
                conn.execute(
                    "INSERT INTO agent_events (session_id, agent_id, event_type, payload) "
                    "VALUES (%s, 'a', 'tool.invoked', jsonb_build_object('call_id', %s::text, "
                    "'tool', 't', 'args', repeat('x', 500)))",
                    (sid, str(i)),
                )
        wait_caught_up(db.dsn)
        assert consumer.metrics.spills > 0
    assert str(spill) in made, made
