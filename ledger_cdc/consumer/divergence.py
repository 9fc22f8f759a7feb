"""Projections that disagree with the ledger after a failover or a restore of its server.

Projections kept in the ledger's own database move with it: a promoted standby or a restored
backup holds the projections and the checkpoint as of the same moment as the ledger. Kept in
another database (``consume --target-dsn``), they can outlive the ledger's history: after an
asynchronous failover the new primary lacks the old one's last transactions, which the
projections may have folded (they run *ahead* of the ledger), and the checkpoint may lie past
the point where the new timeline forked (transactions the new primary commits there would be
skipped as already folded). The ledger on the server is the truth.

:func:`check` compares the server the consumer streams from with the one its checkpoint was
taken on (system identifier and timeline, recorded in ``ledger_checkpoints``), and each
projection's last position and hash with the ledger. What does not agree is reported as a
:class:`Divergence`, which the consumer repairs: the sessions' stored state is discarded and the
slot is rebuilt from the ledger table (a bootstrap), which folds exactly what the ledger holds.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg

from ledger_cdc.connect import connect
from ledger_cdc.errors import translate
from ledger_cdc.lsn import format_lsn, parse_lsn

__all__ = ["Divergence", "Server", "check", "discard", "projections_ahead", "record", "server"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Server:
    """Which history a server holds: its system identifier and its timeline."""

    system_id: str
    timeline: int


@dataclass
class Divergence:
    """What does not agree with the ledger's server, and why."""

    reasons: list[str] = field(default_factory=list)
    # (session, projection's last position, the ledger's head for it: 0 when it has none)
    sessions: list[tuple[uuid.UUID, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasons or self.sessions)


def server(dsn: str) -> tuple[Server, dict[int, int]]:
    """The ledger server's identity, and its timeline history: ``{timeline: LSN where it
    ended}`` for each ancestor of the current timeline (empty on timeline 1). Asked on a
    replication connection (IDENTIFY_SYSTEM, TIMELINE_HISTORY), which the consumer's role may
    open: the SQL functions that tell the same are the superuser's."""
    try:
        with connect(
            dsn, doing="ledger database (timeline)", replication="database", autocommit=True
        ) as conn:
            row = conn.execute("IDENTIFY_SYSTEM").fetchone()
            assert row is not None
            me = Server(str(row[0]), int(row[1]))
            history: dict[int, int] = {}
            if me.timeline > 1:
                hist = conn.execute(f"TIMELINE_HISTORY {me.timeline:d}").fetchone()
                assert hist is not None
                content = hist[1]
                text = content.decode() if isinstance(content, bytes | bytearray) else str(content)
                history = _parse_history(text)
    except psycopg.Error as e:
        raise translate(e, dsn=dsn, doing="ledger database (timeline)") from e
    return me, history


def _parse_history(text: str) -> dict[int, int]:
    """A timeline history file: one line per ancestor, ``timeline<TAB>switch LSN<TAB>reason``."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        parts = line.split("\t") if "\t" in line else line.split()
        if len(parts) < 2 or not parts[0].strip().isdigit():
            continue  # a comment or a blank line
        out[int(parts[0])] = parse_lsn(parts[1].strip())
    return out


_AHEAD = """
SELECT p.sid, p.pos, coalesce((SELECT max(e2.position) FROM agent_events e2
                               WHERE e2.session_id = p.sid), 0)
FROM unnest(%s::uuid[], %s::bigint[], %s::bytea[]) AS p(sid, pos, h)
LEFT JOIN agent_events e ON e.session_id = p.sid AND e.position = p.pos
WHERE NOT EXISTS (SELECT FROM ledger_archived_heads a
                  WHERE a.session_id = p.sid AND a.upto_position >= p.pos)
  AND (e.session_id IS NULL OR (p.h IS NOT NULL AND e.hash IS DISTINCT FROM p.h))
"""


def projections_ahead(
    ledger: psycopg.Connection[Any], target: psycopg.Connection[Any]
) -> list[tuple[uuid.UUID, int, int]]:
    """Projections in ``target`` whose last event the ledger does not hold as they folded it
    (no event at that position, or one of another hash): ``(session, its last position, the
    ledger's head)``. A position the ledger archived is taken on trust."""
    rows = target.execute("SELECT session_id, last_position, last_hash FROM agent_sessions")
    sids: list[uuid.UUID] = []
    positions: list[int] = []
    hashes: list[bytes | None] = []
    for sid, pos, digest in rows:
        sids.append(sid)
        positions.append(int(pos))
        hashes.append(bytes(digest) if digest is not None else None)
    if not sids:
        return []
    found = ledger.execute(_AHEAD, (sids, positions, hashes)).fetchall()
    return [(uuid.UUID(str(s)), int(p), int(h)) for s, p, h in found]


def check(
    dsn: str, target_dsn: str, slot: str, checkpoint: int
) -> tuple[Divergence, Server | None]:
    """Whether the checkpoint of ``slot`` in ``target_dsn`` (at ``checkpoint``) and its
    projections still agree with the ledger's server at ``dsn``. Cheap when the server is the
    one the checkpoint was last taken on (the common case); otherwise the timeline history is
    read and every projection's last event looked up in the ledger. Returns the divergence and
    the server, to :func:`record` once it is repaired (None: nothing new to record)."""
    found = Divergence()
    me, history = server(dsn)
    try:
        with (
            connect(target_dsn, doing="projection database", lift=True) as target,
            connect(dsn, doing="ledger database", lift=True) as ledger,
        ):
            row = target.execute(
                "SELECT server_id, timeline FROM ledger_checkpoints WHERE slot_name = %s", (slot,)
            ).fetchone()
            if row is None:
                return found, None  # nothing folded yet: nothing can be ahead
            known = None if row[0] is None else Server(str(row[0]), int(row[1]))
            if known == me:
                return found, None  # the same history as last time
            if known is not None and known.system_id != me.system_id:
                found.reasons.append(
                    f"the ledger's server is another one (system {me.system_id}, was "
                    f"{known.system_id}): a restore, or a new cluster"
                )
            elif known is not None:
                end = history.get(known.timeline)
                if known.timeline > me.timeline or (known.timeline < me.timeline and end is None):
                    found.reasons.append(
                        f"the ledger's server is on timeline {me.timeline}, which does not "
                        f"descend from the checkpoint's timeline {known.timeline}"
                    )
                elif end is not None and checkpoint > end:
                    found.reasons.append(
                        f"the checkpoint {format_lsn(checkpoint)} lies past the end of "
                        f"timeline {known.timeline} at {format_lsn(end)}, where the server's "
                        f"timeline {me.timeline} forked: a failover lost what came after"
                    )
            found.sessions = projections_ahead(ledger, target)
            if found.sessions:
                found.reasons.append(
                    f"{len(found.sessions)} projection(s) hold events the ledger does not"
                )
    except psycopg.Error as e:
        raise translate(e, doing="comparing the projections with the ledger") from e
    return found, me


def discard(target_dsn: str, sessions: list[uuid.UUID]) -> None:
    """Remove what ``target_dsn`` stores of ``sessions`` (projection, snapshots, memo), in one
    transaction: the next bootstrap folds them from the ledger's first event."""
    try:
        with (
            connect(target_dsn, doing="projection database", lift=True) as conn,
            conn.transaction(),
        ):
            for table in ("agent_memo", "agent_snapshots", "agent_sessions"):
                conn.execute(
                    f"DELETE FROM {table} WHERE session_id = ANY(%s)",  # noqa: S608
                    (sessions,),
                )
    except psycopg.Error as e:
        raise translate(e, dsn=target_dsn, doing="projection database") from e


def record(target_dsn: str, slot: str, me: Server) -> None:
    """Note the server the checkpoint of ``slot`` now agrees with."""
    try:
        with connect(target_dsn, doing="projection database", lift=True) as conn:
            conn.execute(
                "UPDATE ledger_checkpoints SET server_id = %s, timeline = %s WHERE slot_name = %s",
                (me.system_id, me.timeline, slot),
            )
    except psycopg.Error as e:
        raise translate(e, dsn=target_dsn, doing="projection database") from e
