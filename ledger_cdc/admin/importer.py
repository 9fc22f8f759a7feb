"""Importing existing agent logs with their own times: the one path that places events in the
past.

``created_at`` is the server's clock for every writer (the insert trigger refuses any other
value); the ledger's owner may lift that for its own session with ``ledger.import_times = on``,
and this module is what does so. Each line of the input is one event, validated like an append
(the strict writer: its type registered, its payload of the right shape and within the limits),
then inserted in the order given; a session's positions follow on from what it already holds.
On a partitioned ledger the partitions the times fall into are created first. Lines are written
in transactions of ``batch`` events: an import that fails part-way has written whole batches,
and says from which line to go on.

Input, JSON lines::

    {"session_id": "…", "agent_id": "planner", "event_type": "tool.invoked",
     "payload": {…}, "created_at": "2026-06-01T12:00:00Z", "idempotency_key": "k-1"}
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import psycopg

from ledger_cdc.errors import ConfigError, InvalidEventError, LedgerError, translate
from ledger_cdc.events import DEFAULT_LIMITS, Limits, admit_time, encode_payload

__all__ = ["ImportedEvent", "import_events", "read_lines"]


class ImportedEvent(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One line of an import."""

    session_id: uuid.UUID
    agent_id: str
    event_type: str
    payload: dict[str, Any]
    created_at: dt.datetime
    idempotency_key: str | None = None


_INSERT = (
    "INSERT INTO agent_events (session_id, agent_id, event_type, payload, idempotency_key, "
    "created_at) VALUES (%s, %s, %s, %s::jsonb, %s, %s)"
)
_line = msgspec.json.Decoder(ImportedEvent)


def read_lines(lines: Iterable[bytes | str]) -> Iterator[tuple[int, ImportedEvent]]:
    """(line number, event) of each non-blank JSON line; InvalidEventError names a bad line. A
    UTF-8 byte order mark opening the first line (as some editors save a file) is skipped."""
    for n, line in enumerate(lines, 1):
        if n == 1:
            if isinstance(line, bytes):
                line = line.removeprefix(b"\xef\xbb\xbf")
            else:
                line = line.removeprefix("\ufeff")
        if not line.strip():
            continue
        try:
            ev = _line.decode(line)
        except msgspec.DecodeError as e:
            raise InvalidEventError(f"line {n}: {e}") from e
        except RecursionError:
            raise InvalidEventError(f"line {n}: nested too deep to be an event") from None
        if ev.created_at.tzinfo is None:
            raise InvalidEventError(f"line {n}: created_at needs a time zone (e.g. …Z)")
        try:
            admit_time(ev.created_at)  # what every reader would quarantine is not imported
        except InvalidEventError as e:
            raise InvalidEventError(f"line {n}: {e}") from None
        yield n, ev


@dataclass
class ImportResult:
    events: int
    sessions: int
    partitions_created: list[str]


def import_events(
    conn: psycopg.Connection[Any],
    events: Iterable[tuple[int, ImportedEvent]],
    *,
    batch: int = 1000,
    limits: Limits = DEFAULT_LIMITS,
    progress: Callable[[int], None] | None = None,
) -> ImportResult:
    """Insert the events with their times, as the ledger's owner (see the module doc)."""
    from ledger_cdc.admin.partitions import ensure_for, is_partitioned

    partitioned = is_partitioned(conn)
    done = 0
    sessions: set[uuid.UUID] = set()
    created: list[str] = []
    pending: list[tuple[int, ImportedEvent, str]] = []

    def flush() -> None:
        nonlocal done
        if not pending:
            return
        first = pending[0][0]
        if partitioned:
            try:
                made = ensure_for(conn, [ev.created_at for _, ev, _ in pending])
            except (InvalidEventError, ConfigError) as e:
                refused = _refused_line(conn, pending, first)
                if refused is None:
                    raise
                raise refused from e
            created.extend(made)
        try:
            with conn.transaction():
                conn.execute("SET LOCAL ledger.import_times = on")
                with conn.cursor() as cur:
                    cur.executemany(
                        _INSERT,
                        [
                            (
                                ev.session_id,
                                ev.agent_id,
                                ev.event_type,
                                data,
                                ev.idempotency_key,
                                ev.created_at,
                            )
                            for _, ev, data in pending
                        ],
                    )
        except psycopg.Error as e:
            err = translate(e, doing=f"import, batch from line {first}")
            if "assigned by the server" in str(e):
                err = ConfigError(
                    "only the ledger's owner (or a member of its role) may import events with "
                    f"their times; nothing from line {first} on was written"
                )
            raise err from e
        done += len(pending)
        sessions.update(ev.session_id for _, ev, _ in pending)
        pending.clear()
        if progress is not None:
            progress(done)

    for n, ev in events:
        if not ev.agent_id:
            raise InvalidEventError(f"line {n}: agent_id is empty")
        try:
            data = encode_payload(ev.event_type, ev.payload, limits).decode()
        except InvalidEventError as e:
            raise InvalidEventError(f"line {n}: {e}") from e
        pending.append((n, ev, data))
        if len(pending) >= batch:
            flush()
    flush()
    return ImportResult(done, len(sessions), created)


def _refused_line(
    conn: psycopg.Connection[Any], pending: list[tuple[int, ImportedEvent, str]], first: int
) -> LedgerError | None:
    """The line of the batch whose partition may not be made (its range would end after year
    9999, or it was archived), found by trying each line's alone; none of them is kept."""
    from ledger_cdc.admin.partitions import ensure_for

    with conn.transaction(force_rollback=True):
        for n, ev, _ in pending:
            try:
                ensure_for(conn, [ev.created_at])
            except (InvalidEventError, ConfigError) as e:
                return type(e)(
                    f"line {n} (created_at {ev.created_at.isoformat()}): {e}; nothing from "
                    f"line {first} on was written"
                )
    return None
