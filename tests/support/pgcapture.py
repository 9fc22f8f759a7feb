"""Capturing real pgoutput messages from a test server through the SQL interface.

``pg_logical_slot_get_binary_changes`` returns the very bytes the walsender would send as
XLogData payloads, one row per message, so tests can decode real server output without a
replication connection.
"""

from __future__ import annotations

from typing import Any

import psycopg

from ledger_cdc.lsn import parse_lsn
from ledger_cdc.pgoutput import Decoder, Message


def make_slot(conn: psycopg.Connection[Any], name: str, *, two_phase: bool = False) -> None:
    conn.execute(
        "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)", (name, two_phase)
    )


def capture(
    conn: psycopg.Connection[Any], slot: str, publication: str, **options: str
) -> list[tuple[int, bytes]]:
    """Consume the slot's pending changes: [(lsn, message bytes)]."""
    opts: dict[str, str] = {"proto_version": "1", "publication_names": publication}
    opts.update(options)
    flat: list[str] = []
    for k, v in opts.items():
        flat += [k, v]
    placeholders = ", ".join(["%s"] * len(flat))
    rows = conn.execute(
        f"SELECT lsn::text, data FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL, {placeholders})",
        (slot, *flat),
    ).fetchall()
    return [(parse_lsn(lsn), bytes(data)) for lsn, data in rows]


def decode_all(raw: list[tuple[int, bytes]], decoder: Decoder | None = None) -> list[Message]:
    d = decoder or Decoder()
    return [d.decode(data, lsn) for lsn, data in raw]


SENTINEL = b"ledger-cdc-capture-end"


class StreamWatch:
    """Which transactions the server has started streaming (Stream Start seen), and how many
    rows of each it has streamed so far."""

    def __init__(self) -> None:
        import threading

        self._cond = threading.Condition()
        self.xids: set[int] = set()
        self.rows: dict[int, int] = {}

    def saw(self, xid: int) -> None:
        with self._cond:
            self.xids.add(xid)
            self._cond.notify_all()

    def saw_row(self, xid: int) -> None:
        with self._cond:
            self.rows[xid] = self.rows.get(xid, 0) + 1
            self._cond.notify_all()

    def wait_rows(
        self, conn: psycopg.Connection[Any], more_than: int, timeout: float = 30.0
    ) -> bool:
        """Wait until more than ``more_than`` rows of the transaction open on ``conn`` have been
        streamed (the server decodes in WAL order: row ``more_than + 1`` is a later one)."""
        row = conn.execute("SELECT txid_current()").fetchone()
        assert row is not None
        xid = int(row[0]) & 0xFFFFFFFF
        with self._cond:
            return self._cond.wait_for(lambda: self.rows.get(xid, 0) > more_than, timeout)

    def wait_for(self, xid: int, timeout: float = 30.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: xid in self.xids, timeout)

    def wait_streamed(self, conn: psycopg.Connection[Any], timeout: float = 30.0) -> bool:
        """Wait until the transaction open on ``conn`` (or its current subtransaction's parent)
        has been streamed by the server."""
        row = conn.execute("SELECT txid_current()").fetchone()
        assert row is not None
        return self.wait_for(int(row[0]) & 0xFFFFFFFF, timeout)


def live_capture(
    dsn: str,
    slot: str,
    publication: str,
    action: Any,
    *,
    timeout: float = 60.0,
    **options: str,
) -> list[tuple[int, bytes]]:
    """Stream the slot over a real replication connection while ``action(conn, seen)`` runs.

    ``seen`` is a :class:`StreamWatch`, so an action can wait until the server really streamed an
    in-progress transaction before it aborts it. After the action a
    non-transactional sentinel message ends the capture.
    """
    import select
    import threading
    import time

    import psycopg2
    import psycopg2.extras

    opts: dict[str, str] = {"proto_version": "1", "publication_names": publication}
    opts.update(options)
    opts["messages"] = "true"
    rconn = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    out: list[tuple[int, bytes]] = []
    seen = StreamWatch()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                action(conn, seen)
                conn.execute(
                    "SELECT pg_logical_emit_message(false, %s, 'end')", (SENTINEL.decode(),)
                )
        except BaseException as e:
            errors.append(e)

    try:
        cur = rconn.cursor()
        cur.start_replication(slot_name=slot, decode=False, options=opts, status_interval=1)
        worker = threading.Thread(target=run)
        worker.start()
        deadline = time.monotonic() + timeout
        done = False
        streaming: int | None = None  # the xid of the stream block being read
        while not done and time.monotonic() < deadline:
            msg = cur.read_message()
            if msg is None:
                select.select([rconn], [], [], 0.2)
                if errors:
                    break
                continue
            data = bytes(msg.payload)
            out.append((msg.data_start, data))
            if data[:1] == b"S":
                streaming = int.from_bytes(data[1:5], "big")
                seen.saw(streaming)
            elif data[:1] == b"E":
                streaming = None
            elif data[:1] == b"I" and streaming is not None:
                seen.saw_row(streaming)
            if data[:1] == b"M" and SENTINEL in data:
                done = True
            cur.send_feedback(flush_lsn=msg.data_start)
        worker.join(timeout)
        if errors:
            raise errors[0]
        if not done:
            raise TimeoutError(f"capture did not see its end sentinel within {timeout}s")
    finally:
        rconn.close()
    return [(lsn, data) for lsn, data in out if SENTINEL not in data]
