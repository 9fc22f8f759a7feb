"""A slot dropped under a running consumer (by hand, or a failover to a server without it) is
made again and the ledger resynchronised by default, nothing lost or doubled; with
``--on-slot-lost exit`` the consumer stops with exit status 3 instead, saying why."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg
import pytest

from ledger_cdc.admin.schema import create_slot
from ledger_cdc.client.writer import Ledger
from ledger_cdc.errors import SlotError
from tests.support.cdc import (
    ConsumerProcess,
    InThread,
    assert_projections_equal_refold,
    until,
    wait_caught_up,
)
from tests.support.harness import Database

pytestmark = pytest.mark.server


def _drop_slot(dsn: str, slot: str) -> None:
    """Drop the slot out from under its walsender (terminated first), as an operator would."""
    with psycopg.connect(dsn, autocommit=True) as conn:

        def dropped() -> bool:
            conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                "WHERE slot_name = %s AND active_pid IS NOT NULL",
                (slot,),
            )
            try:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            except psycopg.errors.ObjectInUse:
                return False
            return True

        until(dropped, 30)


def test_a_dropped_slot_is_made_again_and_resynced(db: Database) -> None:
    sid = uuid.uuid4()
    with InThread(db.dsn, create_slot=False) as consumer, Ledger(db.dsn) as ledger:
        for i in range(3):
            ledger.append(sid, "a", "tool.invoked", {"call_id": f"a{i}", "tool": "t"})
        until(lambda: consumer.metrics.events == 3, 60)
        _drop_slot(db.dsn, "agent_slot")
        for i in range(3):  # written while no slot exists: only the table has them
            ledger.append(sid, "a", "tool.invoked", {"call_id": f"b{i}", "tool": "t"})
        until(lambda: consumer.metrics.extra.get("slot_resyncs_total") == 1, 60)
        ledger.append(sid, "a", "tool.invoked", {"call_id": "c", "tool": "t"})
        wait_caught_up(db.dsn, 60)
    assert assert_projections_equal_refold(db.dsn) == 7


def test_on_slot_lost_exit_stops_with_status_3(db: Database, tmp_path: Path) -> None:
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    log = tmp_path / "c.log"
    with ConsumerProcess(db.dsn, "--on-slot-lost", "exit", log=log) as proc, Ledger(db.dsn) as w:
        w.append(uuid.uuid4(), "a", "tool.invoked", {"call_id": "x", "tool": "t"})
        wait_caught_up(db.dsn, 60)
        _drop_slot(db.dsn, "agent_slot")
        assert proc.proc is not None and proc.proc.wait(60) == 3
    text = log.read_text()
    assert "exiting (--on-slot-lost exit)" in text and "does not exist" in text


def test_a_first_start_without_a_slot_still_needs_create_slot(db: Database) -> None:
    consumer = InThread(db.dsn, create_slot=False, precreate_slot=False)
    with pytest.raises(AssertionError) as e, consumer:
        until(lambda: not consumer.alive(), 60)
    assert isinstance(e.value.__cause__, SlotError)
