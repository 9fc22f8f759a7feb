"""``verify``: refold sessions from zero and compare with what is stored; walk the hash chains.

Projections and snapshots are derived data: a bug in the code that wrote them (or a hand edit)
would make them look authoritative while disagreeing with the log. ``verify`` folds each session
from its first event with the consumer's reducers and compares the fold, at the position each
stored object claims, with every stored snapshot and with the projection, field by field, and
the memo table (``agent_memo``) with the calls the refold completed, call by call. It also
recomputes each session's hash chain and reports the first event that no longer matches — an
edited row (the append-only guard bypassed) or a broken link. Everything is read in one
REPEATABLE READ snapshot, so a consumer writing meanwhile cannot cause false differences. A
projection missing or behind its log in that snapshot is judged afterwards, by the slot: see
:func:`_judge_behind`.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psycopg
from psycopg import sql

from ledger_cdc.admin.health import publication_filter
from ledger_cdc.admin.partitions import archived_heads, check_archive
from ledger_cdc.admin.timeline import field_differences
from ledger_cdc.client.read import COLUMNS, row_event
from ledger_cdc.client.recovery import attach_steps, load_memo, snapshot_context
from ledger_cdc.client.steps import run
from ledger_cdc.connect import connect
from ledger_cdc.errors import WindowMissingError
from ledger_cdc.fold import (
    PROJECTION_FORMAT,
    PROJECTION_FORMATS,
    SNAPSHOT_FORMATS,
    SessionContext,
    comparable,
    decode_context,
    encode_context,
    encode_stored,
    fold_one,
    reducer_version,
)
from ledger_cdc.sink.base import BOOTSTRAPPING
from ledger_cdc.sink.postgres import run_columns

__all__ = ["Difference", "VerifyReport", "verify"]


@dataclass(frozen=True)
class Difference:
    """One disagreement between the log and what is stored (or within the log itself)."""

    session_id: uuid.UUID | None  # None: rows without a session, in a ledger altered by hand
    kind: str  # projection | snapshot | memo | chain | orphan | archive
    seq: int | None  # the seq of the stored object (or of the event) that differs
    position: int | None
    field: str | None  # dotted path in the context, e.g. pending_tools.call-3.attempts
    expected: Any  # from the refold (or the recomputed hash)
    actual: Any  # what is stored
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "session_id": str(self.session_id),
            "kind": self.kind,
            "seq": self.seq,
            "position": self.position,
            "field": self.field,
            "expected": self.expected,
            "actual": self.actual,
            "detail": self.detail,
        }


@dataclass
class VerifyReport:
    sessions: int = 0
    events: int = 0
    projections: int = 0
    snapshots: int = 0
    memo: int = 0  # completed calls compared with agent_memo
    chained_events: int = 0
    quarantined: int = 0  # events every fold skips (unreadable payload or time, reducer error)
    unknown: list[uuid.UUID] = field(default_factory=list)  # asked for, no trace of them
    differences: list[Difference] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No difference, and every session asked for exists."""
        return not self.differences and not self.unknown


_PROJECTION = (
    b"SELECT last_seq, format_version, context::text, status, last_position, event_count, "
    b"run_status, lease_worker, lease_until FROM agent_sessions WHERE session_id = %s"
)
_COLUMNS = ("status", "last_position", "event_count", "run_status", "lease_worker", "lease_until")


def _attach(conn: psycopg.Connection[Any], ctx: SessionContext) -> None:
    run(conn, attach_steps(ctx))  # what rebuild_context does with a snapshot


def _check_projection(
    conn: psycopg.Connection[Any],
    report: VerifyReport,
    ctx: SessionContext,
    position: int,
    limit: int,
) -> None:
    """The session's projection (at ``position``) against the refold ``ctx``."""
    sid = ctx.session_id
    row = conn.execute(_PROJECTION, (sid,)).fetchone()
    if row is None:
        return
    report.projections += 1
    if row[1] not in PROJECTION_FORMATS:
        report.notes.append(f"session {sid}: projection has format {row[1]}: not compared")
        return
    seq = int(row[0])

    def differs(path: str | None, exp: Any, act: Any, detail: str) -> None:
        report.differences.append(
            Difference(sid, "projection", seq, position, path, exp, act, detail)
        )

    # the columns readers filter on (runs, pending_runs, status queries) hold what the context
    # says: the refold's values, as the consumer writes them
    expected = (str(ctx.status), ctx.last_position, ctx.event_count, *run_columns(ctx))
    for name, exp, act in zip(_COLUMNS, expected, row[3:], strict=True):
        if exp != act:
            differs(
                f"column {name}",
                exp,
                act,
                f"projection column {name} differs from a refold of the log",
            )
    try:
        stored = decode_context(row[2])
    except msgspec.DecodeError as e:  # (ValidationError included) edited into another shape
        differs(None, None, None, f"projection is unreadable: {e}")
        return
    whole = row[1] != PROJECTION_FORMAT  # format 1 holds every completed call
    _compare_stored(conn, report, "projection", ctx, stored, seq, position, limit, whole=whole)


def _compare_stored(
    conn: psycopg.Connection[Any],
    report: VerifyReport,
    kind: str,
    ctx: SessionContext,
    stored: SessionContext,
    seq: int,
    position: int,
    limit: int,
    *,
    whole: bool = False,
) -> None:
    """A stored context against the refold ``ctx``: what it references read back (a difference
    when it cannot be), the storage hints left out of both. A projection of format 1
    (``whole``) holds every completed call; the others none (they are checked in agent_memo)."""
    sid = ctx.session_id
    try:
        _attach(conn, stored)
    except WindowMissingError as e:
        report.differences.append(
            Difference(sid, kind, seq, position, "window", None, None, str(e))
        )
        return
    expected = ctx if whole else decode_context(encode_stored(ctx, reference=False))
    diffs = field_differences(
        msgspec.to_builtins(comparable(expected)),
        msgspec.to_builtins(comparable(stored)),
        limit=limit,
    )
    for path, exp, act in diffs:
        report.differences.append(
            Difference(
                sid,
                kind,
                seq,
                position,
                path,
                exp,
                act,
                f"stored {kind} at position {position} differs from a refold of the log",
            )
        )


# The chain of a session whose history up to position P was archived starts at P + 1, linked to
# the archived last hash (recorded with the archive); every other chain starts at position 1.
_CHAIN = """
WITH archived (session_id, upto, last_hash) AS (
    SELECT * FROM unnest(%(a_ids)s::uuid[], %(a_pos)s::int8[], %(a_hash)s::bytea[])
)
SELECT DISTINCT ON (session_id) session_id, seq, position, problem FROM (
    SELECT session_id, seq, position,
           CASE
               WHEN session_id IS NULL
                   THEN 'rows without a session (session_id''s NOT NULL dropped?): in no '
                        || 'session''s history, dead-lettered by the consumer'
               WHEN position IS NULL
                   THEN 'a row without a position (seq ' || seq || '): in no place of the '
                        || 'session''s history, dead-lettered by the consumer'
               WHEN lag_pos IS NULL AND position <> coalesce(upto, 0) + 1
                   THEN 'first event is at position ' || position
                        || coalesce(' (archived up to ' || upto || ')', '')
               WHEN lag_pos IS NOT NULL AND position <> lag_pos + 1
                   THEN 'gap: position ' || lag_pos || ' is followed by ' || position
               WHEN prev_hash IS DISTINCT FROM coalesce(lag_hash, last_hash)
                   THEN 'prev_hash does not link to the hash of position '
                        || coalesce(lag_pos, upto, 0)
               WHEN hash <> ledger_event_hash(coalesce(lag_hash, last_hash), session_id,
                                              position, agent_id, event_type, payload,
                                              idempotency_key, created_at)
                   THEN 'hash does not match the row''s contents (edited after it was written?)'
           END AS problem
    FROM (
        SELECT e.*, a.upto, a.last_hash,
               lag(e.hash) OVER w AS lag_hash, lag(e.position) OVER w AS lag_pos
        FROM agent_events e LEFT JOIN archived a ON a.session_id = e.session_id
        -- events at or below an archived bound that stayed behind in a later partition (their
        -- transaction began before the boundary) are covered by the archive's snapshot
        WHERE (e.position > coalesce(a.upto, 0) OR e.position IS NULL) {where}
        WINDOW w AS (PARTITION BY e.session_id ORDER BY e.position)
    ) chained
) checked
WHERE problem IS NOT NULL
ORDER BY session_id, position
"""


def _chain(
    conn: psycopg.Connection[Any],
    report: VerifyReport,
    ids: list[uuid.UUID] | None,
    archived: dict[uuid.UUID, tuple[int, bytes, str]],
) -> None:
    where = "AND e.session_id = ANY(%(ids)s)" if ids is not None else ""
    params = {
        "ids": ids,
        "a_ids": list(archived),
        "a_pos": [v[0] for v in archived.values()],
        "a_hash": [v[1] for v in archived.values()],
    }
    for sid, seq, pos, problem in conn.execute(_CHAIN.format(where=where).encode(), params):
        report.differences.append(
            Difference(
                sid,
                "chain",
                int(seq),
                None if pos is None else int(pos),
                "hash",
                None,
                None,
                problem,
            )
        )
    row = conn.execute(
        f"SELECT count(*) FROM agent_events e WHERE true {where}".encode(),  # noqa: S608
        params,
    ).fetchone()
    report.chained_events = int(row[0]) if row else 0


# The second witness: the hash of the event at each projection's and snapshot's position as the
# consumer streamed it, against the table's hash there now.
_WITNESS = """
SELECT 'projection', s.session_id, s.last_seq, s.last_position, s.last_hash, e.hash
FROM agent_sessions s JOIN agent_events e
  ON e.session_id = s.session_id AND e.position = s.last_position
WHERE s.last_hash IS NOT NULL AND s.last_hash <> e.hash {where_s}
UNION ALL
SELECT 'snapshot', n.session_id, n.upto_seq, n.upto_position, n.upto_hash, e.hash
FROM agent_snapshots n JOIN agent_events e
  ON e.session_id = n.session_id AND e.position = n.upto_position
WHERE n.upto_hash IS NOT NULL AND n.upto_hash <> e.hash {where_n}
ORDER BY 2, 4
"""


def _witness(
    conn: psycopg.Connection[Any], report: VerifyReport, ids: list[uuid.UUID] | None
) -> None:
    where_s = "AND s.session_id = ANY(%(ids)s)" if ids is not None else ""
    where_n = "AND n.session_id = ANY(%(ids)s)" if ids is not None else ""
    query = _WITNESS.format(where_s=where_s, where_n=where_n).encode()
    for what, sid, seq, pos, streamed, table in conn.execute(query, {"ids": ids}):
        report.differences.append(
            Difference(
                sid,
                "chain",
                int(seq),
                int(pos),
                "hash",
                bytes(table).hex(),
                bytes(streamed).hex(),
                f"the consumer streamed hash {bytes(streamed).hex()[:16]}… for position {pos} "
                f"(recorded with its {what}); the table now holds {bytes(table).hex()[:16]}…: "
                "the event was changed after it was streamed",
            )
        )


def verify(
    dsn: str,
    sessions: Sequence[uuid.UUID] | None = None,
    *,
    chain: bool = True,
    fields_per_object: int = 5,
    on_session: Callable[[uuid.UUID], None] | None = None,
    archive_dir: Path | None = None,
    consumer_wait: float = 10.0,
    on_wait: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Refold ``sessions`` (all if None) and compare; see the module docstring.

    ``consumer_wait``: how long to wait for a running consumer to apply past the snapshot
    before judging the sessions whose projection was missing or behind in it (0: judged by
    what the slots confirm now; negative: not judged, only noted). ``on_wait(n)`` is told
    when that wait starts, for ``n`` sessions."""
    ids = None if sessions is None else list(sessions)
    report = VerifyReport()
    version = reducer_version()
    behind: dict[uuid.UUID, int] = {}
    with connect(dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        with conn.transaction():
            # the first statement takes the snapshot: every transaction it sees committed
            # before this WAL position
            seen_at = conn.execute(
                "SELECT CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_current_wal_lsn() END"
            ).fetchone()
            where = "WHERE session_id = ANY(%s)" if ids is not None else ""
            params: tuple[Any, ...] = (ids,) if ids is not None else ()
            projected: dict[uuid.UUID, int] = {
                sid: int(pos)
                for sid, pos in conn.execute(
                    f"SELECT session_id, last_position FROM agent_sessions {where}".encode(),  # noqa: S608
                    params,
                )
            }
            snapped: dict[uuid.UUID, list[int]] = {}
            for sid, pos in conn.execute(
                f"SELECT session_id, upto_position FROM agent_snapshots {where} "  # noqa: S608
                "ORDER BY session_id, upto_position".encode(),
                params,
            ):
                snapped.setdefault(sid, []).append(int(pos))
            archived = archived_heads(conn)
            seen: set[uuid.UUID] = set()
            for sid, rows in _sessions(conn, ids):
                seen.add(sid)
                if on_session is not None:
                    on_session(sid)
                _verify_session(
                    conn,
                    report,
                    sid,
                    rows,
                    projected.get(sid),
                    snapped.get(sid, []),
                    version,
                    fields_per_object,
                    archived.get(sid),
                    behind,
                )
            for sid in sorted((set(projected) | set(snapped)) - seen):
                if sid in archived:  # its whole history left with an archive
                    _verify_archived(
                        conn,
                        report,
                        sid,
                        archived[sid],
                        projected.get(sid),
                        version,
                        fields_per_object,
                    )
                    continue
                if sid in projected:
                    report.differences.append(
                        Difference(
                            sid,
                            "orphan",
                            None,
                            projected[sid],
                            None,
                            None,
                            None,
                            "projection of a session that has no events (and no archived history)",
                        )
                    )
                if sid in snapped:
                    report.differences.append(
                        Difference(
                            sid,
                            "orphan",
                            None,
                            None,
                            None,
                            None,
                            None,
                            f"{len(snapped[sid])} snapshot(s) of a session that has no events "
                            "(and no archived history)",
                        )
                    )
            if ids is not None:
                for sid in ids:
                    if sid not in seen and sid not in projected and sid not in snapped:
                        report.unknown.append(sid)
            if chain:
                _chain(conn, report, ids, archived)
                _witness(conn, report, ids)
            if archive_dir is not None:
                for problem in check_archive(conn, archive_dir):
                    report.differences.append(
                        Difference(
                            uuid.UUID(int=0), "archive", None, None, None, None, None, problem
                        )
                    )
                if archived:
                    report.notes.append(f"archives checked against their sha256 in {archive_dir}")
        if behind and seen_at is not None and seen_at[0] is not None and consumer_wait >= 0:
            _judge_behind(conn, report, behind, seen_at[0], consumer_wait, on_wait)
    return report


# the slots that vouch for projections: not a relay's, nor one whose consumer is folding the
# table into them (a bootstrap: its new slot starts past what the projections hold yet)
_APPLIED = """
SELECT c.publication, coalesce(s.confirmed_flush_lsn >= %s::pg_lsn, false), s.active
FROM ledger_checkpoints c JOIN pg_replication_slots s ON s.slot_name = c.slot_name
WHERE s.database = current_database() AND c.epoch <> %s
  AND NOT EXISTS (SELECT FROM ledger_relays r WHERE r.slot_name = c.slot_name)
"""


def _judge_behind(
    conn: psycopg.Connection[Any],
    report: VerifyReport,
    behind: dict[uuid.UUID, int],
    seen_at: str,
    wait: float,
    on_wait: Callable[[int], None] | None = None,
) -> None:
    """Sessions whose projection was missing or behind their log in the snapshot: a consumer
    merely lagging, or a projection deleted or put back by hand? Once a consumer's slot is
    confirmed past the snapshot's WAL position (a consumer confirms only what its committed
    projections cover; a relay's slot, which confirms what it published, does not count), every
    session its publication carries must have its projection at least at the head the snapshot
    saw; one that has not was deleted or rolled back. Sessions no consumer can vouch for (none
    running, or not past it within ``wait`` s) stay notes."""
    deadline = time.monotonic() + wait
    try:
        while True:
            with conn.transaction():
                slots = conn.execute(_APPLIED, (seen_at, BOOTSTRAPPING)).fetchall()
            waiting = [r for r in slots if not r[1] and r[2]]
            if not waiting or time.monotonic() >= deadline:
                break
            if on_wait is not None:
                on_wait(len(behind))
                on_wait = None
            time.sleep(0.1)
        judged: set[uuid.UUID] = set()
        with conn.transaction():
            for publication, passed, _ in slots:
                if passed:
                    judged.update(
                        sid
                        for (sid,) in conn.execute(
                            sql.SQL(
                                "SELECT DISTINCT session_id FROM agent_events "
                                "WHERE session_id = ANY(%s) {}"
                            ).format(publication_filter(conn, publication)),
                            (list(behind),),
                        )
                    )
            now = dict(
                conn.execute(
                    "SELECT session_id, last_position FROM agent_sessions "
                    "WHERE session_id = ANY(%s)",
                    (list(judged),),
                ).fetchall()
            )
    except psycopg.errors.InsufficientPrivilege as e:
        report.notes.append(f"projections missing or behind the log not judged: {e}")
        return
    if len(judged) < len(behind):
        report.notes.append(
            f"{len(behind) - len(judged)} session(s) with a projection missing or behind the log "
            f"not judged: no running consumer had applied past the snapshot within {wait:g}s"
        )
    for sid in sorted(judged):
        head, at = behind[sid], now.get(sid)
        if at is not None and int(at) >= head:
            continue
        report.differences.append(
            Difference(
                sid,
                "projection",
                None,
                None if at is None else int(at),
                "last_position",
                head,
                None if at is None else int(at),
                f"the consumer applied past this session's events (to position {head}) but "
                + ("its projection is missing" if at is None else f"its projection is at {at}")
                + ": deleted or put back by hand",
            )
        )


def _sessions(
    conn: psycopg.Connection[Any], ids: list[uuid.UUID] | None
) -> Iterator[tuple[uuid.UUID, list[tuple[Any, ...]]]]:
    """Each session's rows in position order, streamed by a server-side cursor."""
    where = "WHERE session_id = ANY(%s)" if ids is not None else ""
    params: tuple[Any, ...] = (ids,) if ids is not None else ()
    with conn.cursor(name="ledger_verify") as cur:
        cur.itersize = 5000
        cur.execute(
            f"SELECT {COLUMNS} FROM agent_events {where} ORDER BY session_id, position".encode(),  # noqa: S608
            params,
        )
        current: uuid.UUID | None = None
        rows: list[tuple[Any, ...]] = []
        for row in cur:
            if row[1] != current:
                if current is not None:
                    yield current, rows
                current, rows = row[1], []
            rows.append(row)
        if current is not None:
            yield current, rows


def _verify_session(
    conn: psycopg.Connection[Any],
    report: VerifyReport,
    sid: uuid.UUID,
    rows: list[tuple[Any, ...]],
    projection_at: int | None,
    snapshots_at: list[int],
    version: str,
    limit: int,
    archived: tuple[int, bytes, str] | None = None,
    behind: dict[uuid.UUID, int] | None = None,
) -> None:
    report.sessions += 1
    report.events += len(rows)
    due = set(snapshots_at)
    if projection_at is not None:
        due.add(projection_at)
    ctx = SessionContext(sid)
    # the last position (a row without one, in a ledger altered by hand, sorts last: not it)
    head = max((r[2] for r in rows if type(r[2]) is int), default=0)
    if archived is not None:
        # history up to `upto` left with an archive (checked against its manifest and by the
        # chain link): the refold starts from the first trusted snapshot at or after it
        base = _archive_base(conn, sid, archived[0], version)
        if base is None:
            report.differences.append(
                Difference(
                    sid,
                    "snapshot",
                    None,
                    archived[0],
                    None,
                    None,
                    None,
                    f"history up to position {archived[0]} was archived ({archived[2]}) "
                    "but no usable snapshot covers it: the session cannot be refolded",
                )
            )
            return
        ctx = base
        due = {p for p in due if p > ctx.last_position}
        rows = [r for r in rows if type(r[2]) is int and r[2] > ctx.last_position]
        report.notes.append(
            f"session {sid}: history up to position {archived[0]} archived ({archived[2]}); "
            f"refolded from the snapshot at position {ctx.last_position}"
        )
    quarantined = 0
    for row in rows:
        # a row no reader can fold is quarantined by every fold alike (and dead-lettered by
        # the consumer): the refold goes on past it, as the consumer did
        if fold_one(ctx, row_event(row)) is not None:
            quarantined += 1
        pos = row[2]  # (None, or not an integer, in a ledger altered by hand: never due)
        if pos in due:
            _check_at(conn, report, ctx, pos, projection_at, version, limit)
    for pos in sorted(p for p in due if p > head):
        what = "projection" if pos == projection_at else "snapshot"
        report.differences.append(
            Difference(
                sid,
                what,
                None,
                pos,
                "last_position",
                head,
                pos,
                f"stored {what} is at position {pos} but the log ends at {head}",
            )
        )
    if quarantined:
        report.quarantined += quarantined
        report.notes.append(
            f"session {sid}: {quarantined} event(s) quarantined (not folded; see "
            "ledger_dead_letters)"
        )
    if projection_at is None:
        report.notes.append(f"session {sid}: {head} events, no projection yet (consumer behind?)")
    elif projection_at < head:
        report.notes.append(
            f"session {sid}: projection at position {projection_at} of {head} (consumer behind?)"
        )
    if behind is not None and (projection_at is None or projection_at < head):
        behind[sid] = head


def _verify_archived(
    conn: psycopg.Connection[Any],
    report: VerifyReport,
    sid: uuid.UUID,
    archived: tuple[int, bytes, str],
    projection_at: int | None,
    version: str,
    limit: int,
) -> None:
    """A session whose every event was archived: its archive snapshot must be usable (its
    bytes match their hash), and its projection, if at the same point, must equal it."""
    report.sessions += 1
    base = _archive_base(conn, sid, archived[0], version)
    if base is None:
        report.differences.append(
            Difference(
                sid,
                "snapshot",
                None,
                archived[0],
                None,
                None,
                None,
                f"history up to position {archived[0]} was archived ({archived[2]}) but no "
                "usable snapshot covers it: the session cannot be rebuilt",
            )
        )
        return
    report.notes.append(
        f"session {sid}: all its history archived ({archived[2]}); checked against the "
        f"snapshot at position {base.last_position}"
    )
    if projection_at == base.last_position:
        _check_projection(conn, report, base, base.last_position, limit)
    elif projection_at is not None:
        report.notes.append(
            f"session {sid}: projection at position {projection_at}, archive snapshot at "
            f"{base.last_position}: not compared"
        )


def _archive_base(
    conn: psycopg.Connection[Any], sid: uuid.UUID, upto: int, version: str
) -> SessionContext | None:
    """The first snapshot at or after the archived bound that rebuild_context would trust."""
    for row in conn.execute(
        "SELECT upto_seq, upto_position, content_hash, data, true FROM agent_snapshots "
        "WHERE session_id = %s AND upto_position >= %s AND format_version = ANY(%s) "
        "AND reducer_version = %s AND data IS NOT NULL ORDER BY upto_position",
        (sid, upto, list(SNAPSHOT_FORMATS), version),
        binary=True,
    ):
        ctx = snapshot_context(sid, row)
        if ctx is not None:
            try:
                _attach(conn, ctx)
            except WindowMissingError:
                continue
            return load_memo(conn, ctx)  # the refold goes on with the whole memo
    return None


def _check_at(
    conn: psycopg.Connection[Any],
    report: VerifyReport,
    ctx: SessionContext,
    pos: int,
    projection_at: int | None,
    version: str,
    limit: int,
) -> None:
    sid = ctx.session_id
    if pos == projection_at:
        _check_projection(conn, report, ctx, pos, limit)
        _check_memo(conn, report, ctx, pos, limit)
    for seq, fmt, rv, digest, data, hashed in conn.execute(
        "SELECT upto_seq, format_version, reducer_version, content_hash, "
        "coalesce(data, convert_to(context::text, 'UTF8')), data IS NOT NULL "
        "FROM agent_snapshots WHERE session_id = %s AND upto_position = %s",
        (sid, pos),
        binary=True,
    ):
        report.snapshots += 1
        if fmt not in SNAPSHOT_FORMATS or rv != version:
            report.notes.append(
                f"session {sid}: snapshot at seq {seq} is format {fmt} / reducers {rv}: "
                "not compared (rebuild_context does not use it either)"
            )
            continue
        raw = bytes(data)
        if hashed and hashlib.sha256(raw).digest() != bytes(digest):
            report.differences.append(
                Difference(
                    sid,
                    "snapshot",
                    int(seq),
                    pos,
                    "content_hash",
                    hashlib.sha256(raw).hexdigest(),
                    bytes(digest).hex(),
                    "snapshot bytes do not match their content hash",
                )
            )
        try:
            stored = decode_context(raw)
        except msgspec.DecodeError as e:
            report.differences.append(
                Difference(
                    sid, "snapshot", int(seq), pos, None, None, None, f"snapshot is unreadable: {e}"
                )
            )
            continue
        canonical = encode_context(stored)  # before its window is attached: what is stored
        found = len(report.differences)
        _compare_stored(conn, report, "snapshot", ctx, stored, int(seq), pos, limit)
        if hashed and canonical != raw and len(report.differences) == found:
            report.differences.append(
                Difference(
                    sid,
                    "snapshot",
                    int(seq),
                    pos,
                    None,
                    None,
                    None,
                    "snapshot bytes are not the canonical encoding of its context",
                )
            )


def _check_memo(
    conn: psycopg.Connection[Any],
    report: VerifyReport,
    ctx: SessionContext,
    pos: int,
    limit: int,
) -> None:
    """agent_memo (the latest row of each call at or below the refold's position) against the calls
    the refold completed: a missing row would make a rebuilt worker call again."""
    sid = ctx.session_id
    stored = load_memo(
        conn, msgspec.structs.replace(SessionContext(sid), memo_position=ctx.last_position)
    )
    pairs: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("completed_tools", dict(ctx.completed_tools), dict(stored.completed_tools)),
        ("completed_models", dict(ctx.completed_models), dict(stored.completed_models)),
    ]
    for name, expected, actual in pairs:
        report.memo += len(actual)
        for call in sorted(expected.keys() | actual.keys()):
            exp, act = expected.get(call), actual.get(call)
            path = f"{name}.{call}"
            if exp is None:
                detail = "agent_memo holds a call the log never completed"
                report.differences.append(
                    Difference(sid, "memo", None, pos, path, None, "row", detail)
                )
            elif act is None:
                detail = (
                    "the log completed this call but agent_memo has no row for it: a rebuilt "
                    "worker would call it again"
                )
                report.differences.append(
                    Difference(sid, "memo", None, pos, path, "row", None, detail)
                )
            elif exp != act:
                for sub, e, a in field_differences(
                    msgspec.to_builtins(exp), msgspec.to_builtins(act), path, limit
                ):
                    report.differences.append(
                        Difference(
                            sid,
                            "memo",
                            None,
                            pos,
                            sub,
                            e,
                            a,
                            "agent_memo row differs from a refold of the log",
                        )
                    )
