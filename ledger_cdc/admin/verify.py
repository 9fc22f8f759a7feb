"""``verify``: refold sessions from zero and compare with what is stored; walk the hash chains.

Projections and snapshots are derived data: a bug in the code that wrote them (or a hand edit)
would make them look authoritative while disagreeing with the log. ``verify`` folds each session
from its first event with the consumer's reducers and compares the fold, at the position each
stored object claims, with every stored snapshot and with the projection, field by field, and
the memo table (``agent_memo``) with the calls the refold completed, call by call. It also
recomputes each session's hash chain and reports the first event that no longer matches — an
edited row (the append-only guard bypassed) or a broken link.

The ledger (``agent_events``; the archives' records, snapshots and kept events; the
replication slots) is read from ``dsn``; the stored objects (``agent_sessions``,
``agent_snapshots``, ``agent_memo``, ``ledger_checkpoints``, ``ledger_relays``) from the same
database, or from ``target_dsn`` when the consumer writes them into another one (``consume
--target-dsn``). Each is read in one REPEATABLE READ snapshot, the projections' taken first:
whatever they folded was committed before the ledger's snapshot, so a consumer writing
meanwhile cannot cause false differences. A stored object past the ledger's head, or of a
session without events, is ahead of the ledger (a failover lost what it folded, or a restore):
a difference. A projection missing or behind its log in that snapshot is judged afterwards, by
the slots (:func:`_judge_behind`); one that no consumer can vouch for is a difference too: "not
judged" is never a pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psycopg
from psycopg import sql

from ledger_cdc.admin.archive import archived_heads, check_archive
from ledger_cdc.admin.health import publication_filter
from ledger_cdc.admin.timeline import field_differences
from ledger_cdc.client.read import COLUMNS, row_event
from ledger_cdc.client.recovery import attach_steps, load_memo, merge_memo, snapshot_context
from ledger_cdc.client.steps import run
from ledger_cdc.connect import connect
from ledger_cdc.errors import SchemaError, WindowMissingError
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
    references,
)
from ledger_cdc.sink.base import BOOTSTRAPPING
from ledger_cdc.sink.postgres import run_columns

__all__ = ["Difference", "VerifyReport", "archive_base", "verify"]


@dataclass(frozen=True, kw_only=True)
class Difference:
    """One disagreement between the log and what is stored (or within the log itself)."""

    session_id: uuid.UUID | None  # None: rows without a session, in a ledger altered by hand
    kind: str  # projection | snapshot | memo | chain | orphan | archive | behind
    seq: int | None = None  # the seq of the stored object (or of the event) that differs
    position: int | None = None
    field: str | None = None  # dotted path in the context, e.g. pending_tools.call-3.attempts
    expected: Any = None  # from the refold (or the recomputed hash)
    actual: Any = None  # what is stored
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

    def as_dict(self) -> dict[str, Any]:
        """The report as ``ledger-cdc verify --json`` prints it."""
        return {
            "ok": self.ok,
            "sessions": self.sessions,
            "events": self.events,
            "projections": self.projections,
            "snapshots": self.snapshots,
            "memo": self.memo,
            "chained_events": self.chained_events,
            "differences": [d.as_dict() for d in self.differences],
            "unknown_sessions": [str(u) for u in self.unknown],
            "quarantined": self.quarantined,
            "notes": self.notes,
        }

    def to_json(self) -> str:
        """:meth:`as_dict` as indented JSON; a stored value JSON has no type for (a time, say)
        is written as its ``str``."""
        return json.dumps(self.as_dict(), indent=2, default=str)


_PROJECTION = (
    b"SELECT last_seq, format_version, context::text, status, last_position, event_count, "
    b"run_status, lease_worker, lease_until FROM agent_sessions WHERE session_id = %s"
)
_COLUMNS = ("status", "last_position", "event_count", "run_status", "lease_worker", "lease_until")


# agent_memo rows as they are stored, each with whether it holds its call whole (a row of the
# ledger's database may leave a tool's result or a model's content in the completing event)
_MEMO_STORED = (
    b"SELECT kind, entry::text, CASE kind WHEN 'tool' THEN entry ? 'result' "
    b"ELSE entry ? 'content' END FROM (SELECT DISTINCT ON (kind, call_id) kind, "
    b"completed_position, entry FROM agent_memo WHERE session_id = %s "
    b"AND completed_position <= %s ORDER BY kind, call_id, completed_position DESC) AS m "
    b"ORDER BY completed_position"
)
_ELSEWHERE = (
    "in a database that is not the ledger's (--target-dsn), where no reader can read it back: "
    "the consumer copies it there"
)


@dataclass(frozen=True, kw_only=True)
class _Store:
    """Where the stored objects are read. In the ledger's database, what they reference of its
    events (a context window, long messages, a call's result or content) is read back by SQL,
    as rebuild_context reads it. In another database (``target_dsn``) the consumer copies all of
    it (sink.postgres ``by_reference`` off): nothing there is read back, and a reference found
    there is a difference, for the SQL that would follow it reads the events of the database it
    runs in."""

    conn: psycopg.Connection[Any]
    by_reference: bool

    def attach(self, ctx: SessionContext) -> None:
        """Make a stored context whole (WindowMissingError: what it references is not there)."""
        if self.by_reference:
            run(self.conn, attach_steps(ctx))  # what rebuild_context does with a snapshot
            return
        window, positions = references(ctx)
        if window is not None or positions:
            what = [] if window is None else [f"the window of the event at position {window}"]
            what += [f"the message of the event at position {p}" for p in positions]
            raise WindowMissingError(
                f"session {ctx.session_id}: the stored context references {', '.join(what)} "
                + _ELSEWHERE
            )

    def memo(self, ctx: SessionContext) -> SessionContext:
        """Load the calls ``ctx`` leaves in agent_memo into it, as load_memo does
        (WindowMissingError: a row leaves what it cannot; msgspec.DecodeError: unreadable)."""
        if self.by_reference:
            return load_memo(self.conn, ctx)
        if not ctx.memo_position:
            return ctx
        sid = ctx.session_id
        rows = self.conn.execute(_MEMO_STORED, (sid, ctx.memo_position)).fetchall()
        for kind, _, whole in rows:
            if not whole:
                part = "result" if kind == "tool" else "content"
                raise WindowMissingError(
                    f"session {sid}: an agent_memo row of a {kind} call leaves its {part} in "
                    "the ledger's event " + _ELSEWHERE
                )
        return merge_memo(ctx, [(kind, text) for kind, text, _ in rows])


def _check_projection(
    store: _Store,
    report: VerifyReport,
    ctx: SessionContext,
    position: int,
    limit: int,
) -> None:
    """The session's projection (at ``position``) against the refold ``ctx``."""
    sid = ctx.session_id
    row = store.conn.execute(_PROJECTION, (sid,)).fetchone()
    if row is None:
        return
    report.projections += 1
    if row[1] not in PROJECTION_FORMATS:
        report.notes.append(f"session {sid}: projection has format {row[1]}: not compared")
        return
    seq = int(row[0])

    # the columns readers filter on (runs, pending_runs, status queries) hold what the context
    # says: the refold's values, as the consumer writes them
    expected = (str(ctx.status), ctx.last_position, ctx.event_count, *run_columns(ctx))
    for name, exp, act in zip(_COLUMNS, expected, row[3:], strict=True):
        if exp != act:
            detail = f"projection column {name} differs from a refold of the log"
            found = [(f"column {name}", exp, act)]
            report.differences += _fields_differ(found, sid, "projection", seq, position, detail)
    try:
        stored = decode_context(row[2])
    except msgspec.DecodeError as e:  # (ValidationError included) edited into another shape
        report.differences.append(
            Difference(
                session_id=sid,
                kind="projection",
                seq=seq,
                position=position,
                detail=f"projection is unreadable: {e}",
            )
        )
        return
    whole = row[1] != PROJECTION_FORMAT  # format 1 holds every completed call
    _compare_stored(store, report, "projection", ctx, stored, seq, position, limit, whole=whole)


def _compare_stored(
    store: _Store,
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
        store.attach(stored)
    except WindowMissingError as e:
        report.differences.append(
            Difference(
                session_id=sid, kind=kind, seq=seq, position=position, field="window", detail=str(e)
            )
        )
        return
    expected = ctx if whole else decode_context(encode_stored(ctx, reference=False))
    diffs = field_differences(
        msgspec.to_builtins(comparable(expected)),
        msgspec.to_builtins(comparable(stored)),
        limit=limit,
    )
    detail = f"stored {kind} at position {position} differs from a refold of the log"
    report.differences += _fields_differ(diffs, sid, kind, seq, position, detail)


def _at_position(sid: uuid.UUID, kind: str, head: int, at: int | None, detail: str) -> Difference:
    """A stored object at position ``at`` (None: missing) where the log's head is ``head``."""
    return Difference(
        session_id=sid,
        kind=kind,
        position=at,
        field="last_position",
        expected=head,
        actual=at,
        detail=detail,
    )


def _fields_differ(
    diffs: Iterable[tuple[str, Any, Any]],
    sid: uuid.UUID,
    kind: str,
    seq: int | None,
    position: int,
    detail: str,
) -> list[Difference]:
    """A difference for each (field, expected, actual) of ``diffs``."""
    return [
        Difference(
            session_id=sid,
            kind=kind,
            seq=seq,
            position=position,
            field=path,
            expected=exp,
            actual=act,
            detail=detail,
        )
        for path, exp, act in diffs
    ]


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
                session_id=sid,
                kind="chain",
                seq=int(seq),
                position=None if pos is None else int(pos),
                field="hash",
                detail=problem,
            )
        )
    row = conn.execute(
        f"SELECT count(*) FROM agent_events e WHERE true {where}".encode(),  # noqa: S608
        params,
    ).fetchone()
    report.chained_events = int(row[0]) if row else 0


# The second witness: the hash of the event at each projection's and snapshot's position as the
# consumer streamed it (read from wherever they are stored), against the table's hash there now.
_WITNESS = b"""
SELECT w.what, w.session_id, w.seq, w.position, w.streamed, e.hash
FROM unnest(%s::text[], %s::uuid[], %s::int8[], %s::int8[], %s::bytea[])
     AS w(what, session_id, seq, position, streamed)
JOIN agent_events e ON e.session_id = w.session_id AND e.position = w.position
WHERE e.hash <> w.streamed
ORDER BY 2, 4
"""
_Witnessed = tuple[str, uuid.UUID, int, int, bytes]  # (what, session, seq, position, hash)


def _witness(
    ledger: psycopg.Connection[Any],
    report: VerifyReport,
    witnessed: list[_Witnessed],
    elsewhere: bool,
) -> None:
    if not witnessed:
        return
    columns = [list(c) for c in zip(*witnessed, strict=True)]
    for what, sid, seq, pos, streamed, table in ledger.execute(_WITNESS, columns):
        detail = (
            f"the consumer streamed hash {bytes(streamed).hex()[:16]}… for position {pos} "
            f"(recorded with its {what}); the table now holds {bytes(table).hex()[:16]}…: "
            "the event was changed after it was streamed"
        )
        if elsewhere:
            detail += ", or the projections were folded from a history the ledger no longer has"
        report.differences.append(
            Difference(
                session_id=sid,
                kind="chain",
                seq=int(seq),
                position=int(pos),
                field="hash",
                expected=bytes(table).hex(),
                actual=bytes(streamed).hex(),
                detail=detail,
            )
        )


@dataclass
class _Stored:
    """What is stored, in the store's snapshot: each projection's position, each session's
    snapshot positions, and the hashes the consumer streamed with them (the second witness)."""

    projected: dict[uuid.UUID, int] = field(default_factory=dict)
    snapped: dict[uuid.UUID, list[int]] = field(default_factory=dict)
    witnessed: list[_Witnessed] = field(default_factory=list)


def _read_stored(conn: psycopg.Connection[Any], ids: list[uuid.UUID] | None) -> _Stored:
    where = sql.SQL("WHERE session_id = ANY(%s)" if ids is not None else "")
    params: tuple[Any, ...] = (ids,) if ids is not None else ()
    out = _Stored()
    for sid, seq, pos, digest in conn.execute(
        sql.SQL(
            "SELECT session_id, last_seq, last_position, last_hash FROM agent_sessions {}"
        ).format(where),
        params,
    ):
        out.projected[sid] = int(pos)
        if digest is not None:
            out.witnessed.append(("projection", sid, int(seq), int(pos), bytes(digest)))
    for sid, seq, pos, digest in conn.execute(
        sql.SQL(
            "SELECT session_id, upto_seq, upto_position, upto_hash FROM agent_snapshots {} "
            "ORDER BY session_id, upto_position"
        ).format(where),
        params,
    ):
        out.snapped.setdefault(sid, []).append(int(pos))
        if digest is not None:
            out.witnessed.append(("snapshot", sid, int(seq), int(pos), bytes(digest)))
    return out


# Two connections to one database (a --target-dsn that names the ledger's): the same server
# (started at the same moment) and the same database
_WHO = (
    b"SELECT pg_postmaster_start_time(), oid, datname FROM pg_database "
    b"WHERE datname = current_database()"
)


_PROJECTION_TABLES = (
    b"SELECT to_regclass('agent_sessions') IS NOT NULL "
    b"AND to_regclass('ledger_checkpoints') IS NOT NULL"
)


def _open_target(
    ledger: psycopg.Connection[Any], target_dsn: str
) -> psycopg.Connection[Any] | None:
    """The projections' database, or None when it is the ledger's own."""
    target = connect(target_dsn, doing="projection database")
    try:
        same = target.execute(_WHO).fetchone() == ledger.execute(_WHO).fetchone()
        tables = target.execute(_PROJECTION_TABLES).fetchone()
        target.rollback()
        ledger.rollback()
        if not same and not (tables and tables[0]):
            raise SchemaError(
                "projection database: it has no agent_sessions or ledger_checkpoints (is it the "
                "database `consume --target-dsn` writes to? `ledger-cdc init` creates them)"
            )
    except BaseException:
        target.close()
        raise
    if same:
        target.close()
        return None
    return target


def verify(
    dsn: str,
    sessions: Sequence[uuid.UUID] | None = None,
    *,
    target_dsn: str | None = None,
    chain: bool = True,
    fields_per_object: int = 5,
    on_session: Callable[[uuid.UUID], None] | None = None,
    archive_dir: Path | None = None,
    consumer_wait: float = 10.0,
    on_wait: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Refold ``sessions`` (all if None) and compare; see the module docstring.

    ``target_dsn``: the database the projections, snapshots, memo and checkpoints are in, when
    it is not the ledger's (``consume --target-dsn``); the ledger is read from ``dsn``.

    ``consumer_wait``: how long to wait for a running consumer to apply past the snapshot
    before judging the sessions whose projection was missing or behind in it (0: judged by
    what the slots confirm now). A session no consumer can vouch for by then is a difference
    of kind ``behind``: nothing tells a consumer behind from a projection lost. Negative: not
    judged, only noted (for a ledger checked without its projections, e.g. the chain alone).
    ``on_wait(n)`` is told when that wait starts, for ``n`` sessions.

    It takes DSNs, not a connection: it opens its own (the ledger's, and the projections' when
    they are elsewhere), each read-only in a repeatable-read snapshot of its own."""
    report = VerifyReport()
    with contextlib.ExitStack() as stack:
        ledger = stack.enter_context(connect(dsn))
        target = None if target_dsn is None else _open_target(ledger, target_dsn)
        if target is not None:
            stack.enter_context(target)
        run = _Run(
            ledger=ledger,
            store=_Store(conn=ledger if target is None else target, by_reference=target is None),
            report=report,
            version=reducer_version(),
            limit=fields_per_object,
        )
        for conn in {ledger, run.store.conn}:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            conn.read_only = True
        seen_at = _in_snapshot(
            run,
            None if sessions is None else list(sessions),
            chain=chain,
            archive_dir=archive_dir,
            on_session=on_session,
        )
        if run.behind and consumer_wait < 0:
            report.notes.append(
                f"{len(run.behind)} session(s) with a projection missing or behind the log not "
                "judged (consumer_wait < 0: only noted)"
            )
        elif run.behind:
            _judge_behind(run, seen_at, consumer_wait, on_wait)
    return report


@dataclass(frozen=True, kw_only=True)
class _Run:
    """One verify: its connections, its report, and what every comparison is made with."""

    ledger: psycopg.Connection[Any]
    store: _Store
    report: VerifyReport
    version: str  # the reducers' (a snapshot of other reducers is not compared)
    limit: int  # differing fields reported per stored object
    # sessions whose projection was missing or behind their log in the snapshot: (the ledger's
    # head, the projection's position), judged once the snapshots are closed
    behind: dict[uuid.UUID, tuple[int, int | None]] = field(default_factory=dict)


def _in_snapshot(
    run: _Run,
    ids: list[uuid.UUID] | None,
    *,
    chain: bool,
    archive_dir: Path | None,
    on_session: Callable[[uuid.UUID], None] | None,
) -> str | None:
    """Everything compared in the snapshots (the projections' first); the WAL position the
    ledger's was taken at (None on a standby)."""
    ledger, store, report = run.ledger, run.store, run.report
    target = None if store.conn is ledger else store.conn
    with contextlib.ExitStack() as snapshots:
        if target is not None:
            # the projections' snapshot first: everything it holds was folded from events
            # committed before the ledger's, which then cannot look behind them
            snapshots.enter_context(target.transaction())
            stored = _read_stored(target, ids)
        snapshots.enter_context(ledger.transaction())
        # the ledger's first statement takes its snapshot: every transaction it sees
        # committed before this WAL position
        seen_at = ledger.execute(
            "SELECT CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_current_wal_lsn() END"
        ).fetchone()
        if target is None:
            stored = _read_stored(ledger, ids)
        archived = archived_heads(ledger)
        _refold(run, ids, stored, archived, on_session)
        if chain:
            _chain(ledger, report, ids, archived)
            _witness(ledger, report, stored.witnessed, elsewhere=target is not None)
        if archive_dir is not None:
            for problem in check_archive(ledger, archive_dir):
                report.differences.append(
                    Difference(session_id=uuid.UUID(int=0), kind="archive", detail=problem)
                )
            if archived:
                report.notes.append(f"archives checked against their sha256 in {archive_dir}")
    return None if seen_at is None else seen_at[0]


def _refold(
    run: _Run,
    ids: list[uuid.UUID] | None,
    stored: _Stored,
    archived: dict[uuid.UUID, tuple[int, bytes, str]],
    on_session: Callable[[uuid.UUID], None] | None,
) -> None:
    """Every session of the ledger refolded and compared; the stored objects of sessions
    without events (archived whole, or ahead of the ledger); the sessions asked for that are
    nowhere."""
    projected, snapped = stored.projected, stored.snapped
    seen: set[uuid.UUID] = set()
    for sid, rows in _sessions(run.ledger, ids):
        seen.add(sid)
        if on_session is not None:
            on_session(sid)
        _verify_session(run, sid, rows, projected.get(sid), snapped.get(sid, []), archived.get(sid))
    for sid in sorted((set(projected) | set(snapped)) - seen):
        if sid in archived:  # its whole history left with an archive
            _verify_archived(run, sid, archived[sid], projected.get(sid))
        else:
            _orphan(run.report, sid, projected.get(sid), len(snapped.get(sid, [])))
    if ids is not None:
        run.report.unknown += [
            sid for sid in ids if sid not in seen and sid not in projected and sid not in snapped
        ]


def _orphan(report: VerifyReport, sid: uuid.UUID, projected: int | None, snapshots: int) -> None:
    """Stored objects of a session the ledger has no event of (nor archived history)."""
    if projected is not None:
        detail = (
            f"projection at position {projected} of a session that has no events (and no "
            "archived history): ahead of the ledger (a failover or a restore lost what it "
            "folded, or an edit)"
        )
        report.differences.append(_at_position(sid, "orphan", 0, projected, detail))
    if snapshots:
        report.differences.append(
            Difference(
                session_id=sid,
                kind="orphan",
                detail=f"{snapshots} snapshot(s) of a session that has no events (and no archived "
                "history): ahead of the ledger",
            )
        )


# The consumers' checkpoints, in the projections' database; a relay's slot (consume
# --publish-only) confirms what it published, and a bootstrapping consumer's slot starts past
# what the projections hold yet: neither vouches for them
_CHECKPOINTS = b"""
SELECT c.slot_name, c.publication, c.epoch = %s,
       EXISTS (SELECT FROM ledger_relays r WHERE r.slot_name = c.slot_name)
FROM ledger_checkpoints c ORDER BY c.slot_name
"""
# The ledger server's logical slots of the ledger's database
_SLOTS = b"""
SELECT slot_name, coalesce(confirmed_flush_lsn >= %s::pg_lsn, false), active
FROM pg_replication_slots WHERE database = current_database() AND slot_type = 'logical'
"""


@dataclass(frozen=True, kw_only=True)
class _Slot:
    """A consumer's checkpoint joined with its slot on the ledger's server."""

    name: str
    publication: str | None
    bootstrapping: bool
    relay: bool
    exists: bool
    passed: bool  # confirmed past the snapshot's WAL position
    active: bool

    @property
    def vouches(self) -> bool:
        return self.exists and not self.bootstrapping and not self.relay

    def state(self, wait: float) -> str:
        if self.relay:
            return f"slot {self.name} is a relay's (--publish-only): it vouches for no projection"
        if self.bootstrapping:
            return f"slot {self.name} is bootstrapping (folding the ledger table)"
        if not self.exists:
            return f"slot {self.name} of the checkpoint is not on the ledger's server"
        if self.passed:
            return f"slot {self.name} passed the snapshot, but its publication does not carry it"
        if self.active:
            return f"the consumer of slot {self.name} had not applied past it within {wait:g}s"
        return f"no consumer was streaming slot {self.name}"


def _slots(
    ledger: psycopg.Connection[Any], store: _Store, seen_at: str
) -> tuple[list[_Slot], list[str]]:
    """The checkpoints with their slots, joined here (the checkpoints may be in another
    database than the slots), and the ledger's slots without a checkpoint in the store."""
    with store.conn.transaction():
        checkpoints = store.conn.execute(_CHECKPOINTS, (BOOTSTRAPPING,)).fetchall()
    with ledger.transaction():
        on_server = {
            str(name): (bool(passed), bool(active))
            for name, passed, active in ledger.execute(_SLOTS, (seen_at,))
        }
    joined = []
    for name, publication, bootstrapping, relay in checkpoints:
        passed, active = on_server.get(str(name), (False, False))
        joined.append(
            _Slot(
                name=str(name),
                publication=publication,
                bootstrapping=bool(bootstrapping),
                relay=bool(relay),
                exists=str(name) in on_server,
                passed=passed,
                active=active,
            )
        )
    unknown = sorted(set(on_server) - {str(c[0]) for c in checkpoints})
    return joined, unknown


def _judge_behind(
    run: _Run,
    seen_at: str | None,
    wait: float,
    on_wait: Callable[[int], None] | None = None,
) -> None:
    """Sessions whose projection was missing or behind their log in the snapshot: a consumer
    merely lagging, or a projection deleted or put back by hand? Once a consumer's slot is
    confirmed past the snapshot's WAL position (a consumer confirms only what its committed
    projections cover), every session its publication carries must have its projection at
    least at the head the snapshot saw; one that has not was deleted or rolled back. The wait
    lasts while a consumer's slot is not past the snapshot, streamed or not (its consumer may be
    restarting). A session no consumer vouches for by then is a difference of kind ``behind``:
    a consumer dead or stalled is no pass."""
    judged: set[uuid.UUID] = set()
    now: dict[uuid.UUID, int] = {}
    if seen_at is None:
        why = (
            "the ledger's server is in recovery (a standby): its snapshot has no WAL position "
            "to hold the consumers' slots against; verify the primary"
        )
    else:
        try:
            slots, unknown = _wait_for_slots(run, seen_at, wait, on_wait)
            judged, now = _vouched_for(run, slots)
        except psycopg.errors.InsufficientPrivilege as e:
            why = f"the slots or checkpoints cannot be read: {str(e).strip()}"
        else:
            why = _why_not_judged(run.store, slots, unknown, wait)
    for sid in sorted(run.behind):
        (head, was), at = run.behind[sid], now.get(sid)
        if sid not in judged:
            kind, where = "behind", was
            detail = (
                ("no projection" if was is None else f"projection at position {was}")
                + f", the ledger's head at {head}: no consumer made progress past the snapshot "
                f"within {wait:g}s ({why}); a consumer behind cannot be told from a projection "
                "lost"
            )
        elif at is None or at < head:
            kind, where = "projection", at
            detail = (
                f"the consumer applied past this session's events (to position {head}) but "
                + ("its projection is missing" if at is None else f"its projection is at {at}")
                + ": deleted or put back by hand"
            )
        else:
            continue
        run.report.differences.append(_at_position(sid, kind, head, where, detail))


def _wait_for_slots(
    run: _Run, seen_at: str, wait: float, on_wait: Callable[[int], None] | None
) -> tuple[list[_Slot], list[str]]:
    """:func:`_slots` once every slot that vouches for projections is past the snapshot, or
    ``wait`` seconds on. A slot no consumer streams now may be one restarting or reconnecting:
    it is waited for too."""
    deadline = time.monotonic() + wait
    while True:
        slots, unknown = _slots(run.ledger, run.store, seen_at)
        waiting = [s for s in slots if s.vouches and not s.passed]
        if not waiting or time.monotonic() >= deadline:
            return slots, unknown
        if on_wait is not None:
            on_wait(len(run.behind))
            on_wait = None
        time.sleep(0.1)


def _vouched_for(run: _Run, slots: list[_Slot]) -> tuple[set[uuid.UUID], dict[uuid.UUID, int]]:
    """The sessions behind that a slot past the snapshot carries (its publication's filter),
    and where their projections are now."""
    ledger = run.ledger
    judged: set[uuid.UUID] = set()
    with ledger.transaction():
        for s in slots:
            if s.vouches and s.passed:
                judged.update(
                    sid
                    for (sid,) in ledger.execute(
                        sql.SQL(
                            "SELECT DISTINCT session_id FROM agent_events "
                            "WHERE session_id = ANY(%s) {}"
                        ).format(publication_filter(ledger, s.publication)),
                        (list(run.behind),),
                    )
                )
    with run.store.conn.transaction():
        now = {
            sid: int(pos)
            for sid, pos in run.store.conn.execute(
                "SELECT session_id, last_position FROM agent_sessions WHERE session_id = ANY(%s)",
                (list(judged),),
            )
        }
    return judged, now


def _why_not_judged(store: _Store, slots: list[_Slot], unknown: list[str], wait: float) -> str:
    """Why no consumer vouches for a session: each checkpoint's slot as it stands."""
    states = [s.state(wait) for s in slots]
    if not slots:
        states.append("no consumer's checkpoint in the projections' database")
    if unknown and store.by_reference:
        # a consumer of this ledger keeps its checkpoint (and projections) elsewhere
        states.append(
            f"slot(s) {', '.join(unknown)} of this ledger have no checkpoint in its "
            "database: if a consumer keeps its projections in another one, give --target-dsn"
        )
    return "; ".join(states)


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
    run: _Run,
    sid: uuid.UUID,
    rows: list[tuple[Any, ...]],
    projection_at: int | None,
    snapshots_at: list[int],
    archived: tuple[int, bytes, str] | None = None,
) -> None:
    """Refold one session's ``rows``, comparing each stored object at the position it claims."""
    report = run.report
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
        base = _usable_archive_base(run, sid, archived, "the session cannot be refolded")
        if base is None:
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
            _check_at(run.store, report, ctx, pos, projection_at, run.version, run.limit)
    for pos in sorted(p for p in due if p > head):
        what = "projection" if pos == projection_at else "snapshot"
        detail = (
            f"stored {what} is at position {pos} but the log ends at {head}: ahead of the "
            "ledger (a failover or a restore lost what it folded, or an edit)"
        )
        report.differences.append(_at_position(sid, what, head, pos, detail))
    _note_refolded(run, sid, head, projection_at, quarantined)


def _note_refolded(
    run: _Run, sid: uuid.UUID, head: int, projection_at: int | None, quarantined: int
) -> None:
    """What a refold leaves to say: events quarantined, a projection missing or behind (kept
    in ``run.behind``, to be judged once the snapshots are closed)."""
    report = run.report
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
    if projection_at is None or projection_at < head:
        run.behind[sid] = (head, projection_at)


def _verify_archived(
    run: _Run, sid: uuid.UUID, archived: tuple[int, bytes, str], projection_at: int | None
) -> None:
    """A session whose every event was archived: its archive snapshot must be usable (its
    bytes match their hash), and its projection, if at the same point, must equal it."""
    run.report.sessions += 1
    base = _usable_archive_base(run, sid, archived, "the session cannot be rebuilt")
    if base is None:
        return
    run.report.notes.append(
        f"session {sid}: all its history archived ({archived[2]}); checked against the "
        f"snapshot at position {base.last_position}"
    )
    if projection_at == base.last_position:
        _check_projection(run.store, run.report, base, base.last_position, run.limit)
    elif projection_at is not None:
        run.report.notes.append(
            f"session {sid}: projection at position {projection_at}, archive snapshot at "
            f"{base.last_position}: not compared"
        )


def _usable_archive_base(
    run: _Run, sid: uuid.UUID, archived: tuple[int, bytes, str], cannot: str
) -> SessionContext | None:
    """:func:`archive_base` of the session's archived history, or None and a difference that
    says so (``cannot``: what this means for the session)."""
    upto, _, where = archived
    base = archive_base(run.ledger, sid, upto, run.version)
    if base is None:
        run.report.differences.append(
            Difference(
                session_id=sid,
                kind="snapshot",
                position=upto,
                detail=f"history up to position {upto} was archived ({where}) but no usable "
                f"snapshot covers it: {cannot}",
            )
        )
    return base


def archive_base(
    conn: psycopg.Connection[Any], sid: uuid.UUID, upto: int, version: str
) -> SessionContext | None:
    """The first snapshot at or after the archived bound that rebuild_context would trust: in
    the ledger's own database (``conn``), where the archive cuts its snapshots, their memo rows
    with them (consumer.resync bootstraps from it too)."""
    store = _Store(conn=conn, by_reference=True)
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
                store.attach(ctx)
            except WindowMissingError:
                continue
            return store.memo(ctx)  # the refold goes on with the whole memo
    return None


def _check_at(
    store: _Store,
    report: VerifyReport,
    ctx: SessionContext,
    pos: int,
    projection_at: int | None,
    version: str,
    limit: int,
) -> None:
    sid = ctx.session_id
    if pos == projection_at:
        _check_projection(store, report, ctx, pos, limit)
        _check_memo(store, report, ctx, pos, limit)
    for seq, fmt, rv, digest, data, hashed in store.conn.execute(
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
                    session_id=sid,
                    kind="snapshot",
                    seq=int(seq),
                    position=pos,
                    field="content_hash",
                    expected=hashlib.sha256(raw).hexdigest(),
                    actual=bytes(digest).hex(),
                    detail="snapshot bytes do not match their content hash",
                )
            )
        try:
            stored = decode_context(raw)
        except msgspec.DecodeError as e:
            report.differences.append(
                Difference(
                    session_id=sid,
                    kind="snapshot",
                    seq=int(seq),
                    position=pos,
                    detail=f"snapshot is unreadable: {e}",
                )
            )
            continue
        # before its window is attached: what is stored (fields at their default left out, or
        # every field written)
        canonical = (encode_stored(stored, reference=False), encode_context(stored))
        found = len(report.differences)
        _compare_stored(store, report, "snapshot", ctx, stored, int(seq), pos, limit)
        if hashed and raw not in canonical and len(report.differences) == found:
            report.differences.append(
                Difference(
                    session_id=sid,
                    kind="snapshot",
                    seq=int(seq),
                    position=pos,
                    detail="snapshot bytes are not the canonical encoding of its context",
                )
            )


def _check_memo(
    store: _Store,
    report: VerifyReport,
    ctx: SessionContext,
    pos: int,
    limit: int,
) -> None:
    """agent_memo (the latest row of each call at or below the refold's position) against the calls
    the refold completed: a missing row would make a rebuilt worker call again."""
    sid = ctx.session_id
    try:
        stored = store.memo(
            msgspec.structs.replace(SessionContext(sid), memo_position=ctx.last_position)
        )
    except (WindowMissingError, msgspec.DecodeError) as err:
        unreadable = not isinstance(err, WindowMissingError)
        detail = f"agent_memo is unreadable: {err}" if unreadable else str(err)
        report.differences.append(
            Difference(session_id=sid, kind="memo", position=pos, detail=detail)
        )
        return
    pairs: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("completed_tools", dict(ctx.completed_tools), dict(stored.completed_tools)),
        ("completed_models", dict(ctx.completed_models), dict(stored.completed_models)),
    ]
    for name, expected, actual in pairs:
        report.memo += len(actual)
        for call in sorted(expected.keys() | actual.keys()):
            exp, act = expected.get(call), actual.get(call)
            path = f"{name}.{call}"
            found: Iterable[tuple[str, Any, Any]]
            if exp is None:
                found = [(path, None, "row")]
                detail = "agent_memo holds a call the log never completed"
            elif act is None:
                found = [(path, "row", None)]
                detail = (
                    "the log completed this call but agent_memo has no row for it: a rebuilt "
                    "worker would call it again"
                )
            elif exp != act:
                found = field_differences(
                    msgspec.to_builtins(exp), msgspec.to_builtins(act), path, limit
                )
                detail = "agent_memo row differs from a refold of the log"
            else:
                continue
            report.differences += _fields_differ(found, sid, "memo", None, pos, detail)
