"""Archive: old partitions of a range-partitioned ledger exported and dropped.

:func:`archive` removes partitions entirely older than a bound: refused unless every session in
the partition is folded past it; each such session gets a snapshot at or after its last event
there; the rows are exported (COPY, gzip, sha256 in a manifest), then the partition is detached
and dropped in one transaction that records the archive — and that keeps, in
``agent_kept_events``, the payloads stored contexts and memo rows still reference (every
completion, and the ``context.loaded`` events projections and snapshots open with; kept once
before the detach already). It is the only path that removes ledger data. A record committed
before the detach (``ledger_archiving``) lets the next run, one at a time under an advisory
lock, put back a partition that a killed run left detached.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import functools
import gzip
import hashlib
import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ledger_cdc.admin.partitions import Partition, guards_always, list_partitions, partition_unit
from ledger_cdc.connect import open_session
from ledger_cdc.errors import ArchiveRefusedError, ConfigError
from ledger_cdc.fold import (
    FORMAT_VERSION,
    PROJECTION_FORMATS,
    SNAPSHOT_FORMATS,
    decode_context,
    encode_stored,
    reducer_version,
)
from ledger_cdc.sink.postgres import SNAPSHOT_CONFLICT

__all__ = [
    "ArchiveRefusedError",
    "ArchivedPartition",
    "archive",
    "archived_heads",
    "check_archive",
]


@dataclass
class ArchivedPartition:
    name: str
    start: dt.datetime
    end: dt.datetime
    events: int
    sessions: int
    snapshots_taken: int
    file: Path
    manifest: Path
    file_sha256: str
    skipped: str | None = None  # why nothing was done (empty partition: dropped only)
    extra: dict[str, Any] = field(default_factory=dict)


_PER_SESSION = """
SELECT p.session_id, min(p.position), max(p.position), count(*), max(p.seq),
       (array_agg(p.hash ORDER BY p.position DESC))[1], s.last_position
FROM {part} p LEFT JOIN agent_sessions s ON s.session_id = p.session_id
GROUP BY p.session_id, s.last_position
"""
_SNAPSHOT = """
SELECT EXISTS (SELECT FROM agent_snapshots WHERE session_id = %s AND upto_position >= %s
               AND format_version = %s AND reducer_version = %s)
"""
_SNAPSHOT = """
INSERT INTO agent_snapshots (session_id, upto_seq, upto_position, format_version, reducer_version,
                             content_hash, data, upto_hash)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s)
"""
_SNAPSHOT += SNAPSHOT_CONFLICT
# What stored contexts and memo rows read from the partition's events once it is gone, kept in
# agent_kept_events: every completion (a memo row leaves its call's result or content in it,
# a stored context the long messages taken from it), and the context.loaded events a stored
# context opens with: for each projection and snapshot of the partition's sessions, the latest
# context.loaded at or before its position, when that one is in this partition.
_KEEP_EVENTS = """
WITH sessions AS (SELECT DISTINCT session_id FROM {part}),
refs AS (
    SELECT s.session_id, s.last_position AS at
    FROM agent_sessions s JOIN sessions USING (session_id)
    UNION
    SELECT n.session_id, n.upto_position FROM agent_snapshots n JOIN sessions USING (session_id)
),
windows AS (
    SELECT c.session_id, c.position
    FROM refs r
    JOIN LATERAL (
        SELECT p.session_id, p.position FROM {part} p
        WHERE p.session_id = r.session_id AND p.event_type = 'context.loaded'
          AND p.position <= r.at
        ORDER BY p.position DESC LIMIT 1
    ) c ON true
    WHERE NOT EXISTS (
        SELECT FROM agent_events e
        WHERE e.session_id = r.session_id AND e.event_type = 'context.loaded'
          AND e.position > c.position AND e.position <= r.at
    )
)
INSERT INTO agent_kept_events (session_id, position, event_type, payload, partition_name)
SELECT p.session_id, p.position, p.event_type, p.payload, %(name)s
FROM {part} p
WHERE p.event_type IN ('model.responded', 'tool.observed')
   OR (p.session_id, p.position) IN (SELECT session_id, position FROM windows)
ON CONFLICT DO NOTHING
"""
_EXPORT = (
    "COPY (SELECT seq, session_id, position, agent_id, event_type, payload, idempotency_key, "
    "created_at, encode(prev_hash, 'hex'), encode(hash, 'hex') FROM {part} "
    "ORDER BY session_id, position) TO STDOUT WITH (FORMAT csv, HEADER)"
)


def archive(
    conn: psycopg.Connection[Any],
    older_than: dt.timedelta,
    to_dir: Path,
    *,
    on_partition: Callable[[str], None] | None = None,
    on_step: Callable[[str, str], None] | None = None,
    consumer_wait: float = 30.0,
) -> list[ArchivedPartition]:
    """Archive every partition whose whole range ends at or before ``now - older_than``.

    ``conn`` must be in autocommit mode (``DETACH … CONCURRENTLY`` cannot run in a transaction
    block). ``on_step(partition, step)`` is told each step as it is done: ``checked``,
    ``snapshots``, ``detached``, ``exported``, ``recorded``. One run at a time: another is
    waited for up to 10 s, then refused (:class:`ArchiveRefusedError`)."""
    partition_unit(conn)
    if not conn.autocommit:
        raise ConfigError("archive needs an autocommit connection (DETACH … CONCURRENTLY)")
    if older_than <= dt.timedelta(0):  # a bound in the future would take live partitions
        raise ConfigError(f"older_than must be a positive age, got {older_than}")
    to_dir.mkdir(parents=True, exist_ok=True)
    if not _lock(conn):
        raise ArchiveRefusedError(
            f"another archive of this ledger is running (server process {_holder(conn)}): one "
            "run at a time — a run killed during a detach keeps its server process, and this "
            "lock, until the detach ends (it waits for the transactions that can see the "
            "partition: see pg_stat_activity)"
        )
    try:
        _resume(conn, to_dir)
        now_row = conn.execute("SELECT now()").fetchone()
        assert now_row is not None
        bound = now_row[0] - older_than
        out = []
        for p in list_partitions(conn):
            if p.end > bound:
                continue
            if on_partition is not None:
                on_partition(p.name)
            out.append(
                _archive_one(
                    conn, p, to_dir, functools.partial(_step, on_step, p.name), consumer_wait
                )
            )
        return out
    finally:
        with contextlib.suppress(psycopg.Error):
            conn.execute("SELECT pg_advisory_unlock(%s)", (_ARCHIVE_LOCK,))


# One archive run at a time, per database: a run takes up the records another left under way
# (_resume), which must be a dead run's, never those of a run still exporting. A session lock,
# held for the whole run: it ends with the run's server process, however the client died.
_ARCHIVE_LOCK = 517399234
_LOCK_WAIT = 10.0  # seconds: a run killed a moment ago holds it until its server process exits


def _lock(conn: psycopg.Connection[Any]) -> bool:
    deadline = time.monotonic() + _LOCK_WAIT
    while True:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (_ARCHIVE_LOCK,)).fetchone()
        if row and row[0]:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _holder(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = 0 "
        "AND objid = %s AND objsubid = 1 AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database())",
        (_ARCHIVE_LOCK,),
    ).fetchone()
    return "unknown" if row is None else str(row[0])


def _step(on_step: Callable[[str, str], None] | None, name: str, step: str) -> None:
    if on_step is not None:
        on_step(name, step)


# What the consumer has of a partition's sessions: every session's last position in it, against
# its projection and its latest usable snapshot.
_FOLDED = """
SELECT p.session_id, max(p.position), s.last_position,
       (SELECT max(n.upto_position) FROM agent_snapshots n
        WHERE n.session_id = p.session_id AND n.format_version = ANY(%s)
          AND n.reducer_version = %s)
FROM {part} p LEFT JOIN agent_sessions s ON s.session_id = p.session_id
GROUP BY p.session_id, s.last_position
"""
_PROJECTION = (
    "SELECT last_seq, last_position, format_version, context::text, last_hash "
    "FROM agent_sessions WHERE session_id = %s"
)


def _archive_one(
    conn: psycopg.Connection[Any],
    p: Partition,
    to_dir: Path,
    step: Callable[[str], None],
    consumer_wait: float,
) -> ArchivedPartition:
    """Archive one partition, race-free by construction: its sessions are covered by snapshots,
    then it is detached (CONCURRENTLY: writers of the other partitions never wait; the detach
    waits for every transaction that could still insert into it), then what it holds now — the
    rows committed up to the detach, all of them — is checked once more, exported, recorded and
    dropped. A row can only be in the ledger or in the archive. On any failure after the
    detach, the partition is attached again."""
    part = sql.Identifier(p.name)
    data_file = to_dir / f"{p.name}.csv.gz"
    manifest_file = to_dir / f"{p.name}.manifest.json"
    if manifest_file.exists():
        raise ArchiveRefusedError(
            f"{manifest_file} exists: archive {p.name} into another directory (if no archive "
            "of this ledger records it, it is another ledger's, or what a run killed before "
            "recording wrote into this directory while the next ran elsewhere: then remove it)"
        )
    if not _detach_pending(conn, p.name):
        taken = _cover(conn, p, consumer_wait=0.0)
        step("checked")
        step("snapshots")
    else:
        taken = 0  # an archive interrupted mid-detach: finished below
    run = _record_start(conn, p)
    _detach(conn, p.name)
    step("detached")
    try:
        _record_heads(conn, p)  # with what the detach waited for
        # what the detach waited for may have added rows: they must be folded and covered too
        taken += _cover(conn, p, consumer_wait=consumer_wait)
        with conn.transaction():
            conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(part))
            sessions = conn.execute(sql.SQL(_PER_SESSION).format(part=part)).fetchall()
            file_hash, content_hash, rows = _export(conn, part, data_file)
            manifest = _manifest(p, data_file, file_hash, content_hash, rows, sessions)
            manifest["run"] = str(run)
            manifest_file.write_text(json.dumps(manifest, indent=1, sort_keys=True))
            step("exported")
            conn.execute(
                "INSERT INTO ledger_archives (partition_name, range_start, range_end, events, "
                "file_name, file_sha256, manifest) VALUES (%s, %s, %s, %s, %s, %s, %s::jsonb)",
                (p.name, p.start, p.end, rows, data_file.name, file_hash, json.dumps(manifest)),
            )
            for sid, _, last, _, _, h, _ in sessions:
                conn.execute(
                    "INSERT INTO ledger_archived_heads (session_id, upto_position, last_hash, "
                    "partition_name) VALUES (%s, %s, %s, %s) ON CONFLICT (session_id) DO "
                    "UPDATE SET upto_position = EXCLUDED.upto_position, "
                    "last_hash = EXCLUDED.last_hash, partition_name = EXCLUDED.partition_name "
                    "WHERE ledger_archived_heads.upto_position < EXCLUDED.upto_position",
                    (sid, last, h, p.name),
                )
            # what projections, snapshots and memo rows reference stays readable
            conn.execute(sql.SQL(_KEEP_EVENTS).format(part=part), {"name": p.name})
            # idempotency keys (and signal ids) stay: agent_event_keys keeps what a retry
            # compares, and agent_session_heads each session's head
            conn.execute(sql.SQL("DROP TABLE {}").format(part))
            conn.execute("DELETE FROM ledger_archiving WHERE partition_name = %s", (p.name,))
    except BaseException:
        _undo(conn, p, (manifest_file, data_file))
        raise
    step("recorded")
    return ArchivedPartition(
        p.name, p.start, p.end, rows, len(sessions), taken, data_file, manifest_file, file_hash
    )


def _cover(conn: psycopg.Connection[Any], p: Partition, *, consumer_wait: float) -> int:
    """Every session of the partition folded by the consumer past its last event there, and a
    usable snapshot at or after it (cut from its projection where missing). The consumer is
    waited for up to ``consumer_wait`` seconds; then the archive is refused. Returns the
    snapshots taken."""
    part = sql.Identifier(p.name)
    version = reducer_version()
    deadline = time.monotonic() + consumer_wait
    while True:
        rows = conn.execute(
            sql.SQL(_FOLDED).format(part=part), (list(SNAPSHOT_FORMATS), version)
        ).fetchall()
        behind = [(sid, last, folded) for sid, last, folded, _ in rows if (folded or 0) < last]
        if not behind:
            break
        if time.monotonic() >= deadline:
            sid, last, folded = behind[0]
            raise ArchiveRefusedError(
                f"partition {p.name}: the consumer has not folded {len(behind)} session(s) past "
                f"it (e.g. {sid}: position {last} in the partition, projection at "
                f"{'none' if folded is None else folded}); archive refused — let the consumer "
                "catch up"
            )
        time.sleep(0.2)
    taken = 0
    for sid, last, _, snapped in rows:
        if snapped is not None and snapped >= last:
            continue
        # the snapshot is cut from the projection: the consumer's own point, whose memo is in
        # agent_memo already (a snapshot leaves its memo to that table)
        row = conn.execute(_PROJECTION, (sid,)).fetchone()
        if row is None or row[2] not in PROJECTION_FORMATS:
            raise ArchiveRefusedError(
                f"partition {p.name}: session {sid} has no projection of the current format to "
                "cut a snapshot from; archive refused"
            )
        last_seq, position, _, text, head = row
        # a projection of format 2 is in a snapshot's form already (its window referenced)
        data = encode_stored(decode_context(text))
        conn.execute(
            _SNAPSHOT,
            (
                sid,
                last_seq,
                position,
                FORMAT_VERSION,
                version,
                hashlib.sha256(data).digest(),
                data,
                head,
            ),
        )
        taken += 1
    return taken


def _detach_pending(conn: psycopg.Connection[Any], name: str) -> bool:
    row = conn.execute(
        "SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass(%s)", (name,)
    ).fetchone()
    return bool(row and row[0])


def _detach(conn: psycopg.Connection[Any], name: str) -> None:
    """DETACH … CONCURRENTLY (or FINALIZE a detach a crash interrupted): it takes no lock that
    waits for or blocks the writers of the other partitions; it waits for the transactions that
    could still insert into this one (and for open snapshots, such as a running ``verify``)."""
    part = sql.Identifier(name)
    if _detach_pending(conn, name):
        conn.execute(sql.SQL("ALTER TABLE agent_events DETACH PARTITION {} FINALIZE").format(part))
    else:
        conn.execute(
            sql.SQL("ALTER TABLE agent_events DETACH PARTITION {} CONCURRENTLY").format(part)
        )


def _attach(conn: psycopg.Connection[Any], p: Partition) -> None:
    """Put a detached partition back into the ledger, and drop its archive-under-way record
    and what it kept ahead (best effort: what fails here is left to the next run, from that
    record)."""
    with contextlib.suppress(psycopg.Error):
        if conn.execute("SELECT to_regclass(%s)", (p.name,)).fetchone() == (None,):
            return  # dropped: nothing to put back
        with conn.transaction():
            if not conn.execute(
                "SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass(%s)", (p.name,)
            ).fetchone():
                part = sql.Identifier(p.name)
                conn.execute(
                    sql.SQL(
                        "ALTER TABLE agent_events ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})"
                    ).format(part, sql.Literal(p.start), sql.Literal(p.end))
                )
                guards_always(conn, part)
            # the ledger holds those payloads again; an archive of it keeps them anew
            conn.execute("DELETE FROM agent_kept_events WHERE partition_name = %s", (p.name,))
            conn.execute("DELETE FROM ledger_archiving WHERE partition_name = %s", (p.name,))


def _record_start(conn: psycopg.Connection[Any], p: Partition) -> uuid.UUID:
    """Commit the archive-under-way record (ledger_archiving) before the detach;
    returns the run's id, written into its manifest. What stored contexts and memo rows
    reference in the partition is kept now too: from the detach on, its rows are out of the
    ledger (for good, if this run is killed then), and those readers must not miss them."""
    run = uuid.uuid4()
    with conn.transaction():
        conn.execute(
            "INSERT INTO ledger_archiving (partition_name, range_start, range_end, run_id) "
            "VALUES (%s, %s, %s, %s) ON CONFLICT (partition_name) DO UPDATE SET run_id = %s",
            (p.name, p.start, p.end, run, run),
        )
        _record_heads(conn, p)
        conn.execute(sql.SQL(_KEEP_EVENTS).format(part=sql.Identifier(p.name)), {"name": p.name})
    return run


def _record_heads(conn: psycopg.Connection[Any], p: Partition) -> None:
    with conn.transaction():
        conn.execute("DELETE FROM ledger_archiving_heads WHERE partition_name = %s", (p.name,))
        conn.execute(
            sql.SQL(
                "INSERT INTO ledger_archiving_heads (partition_name, session_id, upto_position) "
                "SELECT %s, session_id, max(position) FROM {} GROUP BY session_id"
            ).format(sql.Identifier(p.name)),
            (p.name,),
        )


def _undo(conn: psycopg.Connection[Any], p: Partition, files: Iterable[Path]) -> None:
    """After a failure past the detach: the files removed, and the partition put back, only
    when no archive records it. The commit may have been lost with the connection after the
    server took it: then a new connection asks, once it holds the archive lock — proof that the
    lost session has ended, and its transaction with it, one way or the other. When that
    cannot be told, the files stay and the next run finds out from the record."""
    if not conn.closed:
        if _recorded(conn, p.name) is False:
            _unlink(files)
            _attach(conn, p)
        return
    try:
        other = open_session(conn.info.dsn, password=conn.info.password, autocommit=True)
    except psycopg.Error:
        return
    with other:
        try:
            if not _lock(other):
                return
            if _recorded(other, p.name) is False:
                _unlink(files)
                _attach(other, p)
        except psycopg.Error:
            return
        with contextlib.suppress(psycopg.Error):
            other.execute("SELECT pg_advisory_unlock(%s)", (_ARCHIVE_LOCK,))


def _unlink(files: Iterable[Path]) -> None:
    for f in files:
        f.unlink(missing_ok=True)


def _recorded(conn: psycopg.Connection[Any], name: str) -> bool | None:
    """Whether an archive of ``name`` is recorded; None when the database cannot say."""
    try:
        row = conn.execute(
            "SELECT EXISTS (SELECT FROM ledger_archives WHERE partition_name = %s)", (name,)
        ).fetchone()
    except psycopg.Error:
        return None
    return bool(row and row[0])


def _run_of(manifest: Path) -> str | None:
    try:
        run = json.loads(manifest.read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return run if isinstance(run, str) else None


def _resume(conn: psycopg.Connection[Any], to_dir: Path) -> None:
    """Archives a killed run left under way. A partition detached but not archived (killed
    after the detach, or its detach finished by the server after the client died) is outside
    the ledger and in no archive: it is attached again (and the files that run wrote here,
    known by the run id in their manifest, removed), so this run archives it from the start;
    one whose detach is pending (invisible to new queries already) is detached, then attached.
    A record whose archive committed (the connection lost at the commit) is dropped."""
    for name, start, end, run in conn.execute(
        "SELECT partition_name, range_start, range_end, run_id FROM ledger_archiving ORDER BY 1"
    ).fetchall():
        p = Partition(name, start, end)
        if _recorded(conn, name):
            conn.execute("DELETE FROM ledger_archiving WHERE partition_name = %s", (name,))
        elif conn.execute("SELECT to_regclass(%s)", (name,)).fetchone() == (None,):
            raise ArchiveRefusedError(
                f"{name} was being archived, but the table is gone and no archive records it: "
                "restore it from a backup, then run the archive again"
            )
        else:
            manifest = to_dir / f"{name}.manifest.json"
            if _run_of(manifest) == str(run):  # that run's files, never recorded
                _unlink((to_dir / f"{name}.csv.gz", manifest))
            if _detach_pending(conn, name):  # invisible to new queries already: finished,
                _detach(conn, name)  # so that it can be attached again
            _attach(conn, p)


def _manifest(
    p: Partition,
    data_file: Path,
    file_hash: str,
    content_hash: str,
    rows: int,
    sessions: list[tuple[Any, ...]],
) -> dict[str, Any]:
    return {
        "partition": p.name,
        "range": [p.start.isoformat(), p.end.isoformat()],
        "events": rows,
        "file": data_file.name,
        "file_sha256": file_hash,
        "content_sha256": content_hash,
        "format": "csv with header: seq, session_id, position, agent_id, event_type, payload, "
        "idempotency_key, created_at, prev_hash (hex), hash (hex)",
        "sessions": {
            str(sid): {
                "first_position": int(first),
                "last_position": int(last),
                "events": int(n),
                "last_seq": int(seq),
                "last_hash": bytes(h).hex(),
            }
            for sid, first, last, n, seq, h, _ in sessions
        },
    }


def _export(
    conn: psycopg.Connection[Any], part: sql.Identifier, path: Path
) -> tuple[str, str, int]:
    """COPY the partition to a gzip file; (sha256 of the file, sha256 of the CSV, rows)."""
    tmp = path.with_suffix(path.suffix + ".partial")
    content = hashlib.sha256()
    with conn.cursor() as cur, open(tmp, "wb") as raw:
        with (
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz,
            cur.copy(sql.SQL(_EXPORT).format(part=part)) as copy,
        ):
            for chunk in copy:
                b = bytes(chunk)
                content.update(b)
                gz.write(b)
        rows = cur.rowcount  # the server's "COPY n": no second pass over the file
    tmp.rename(path)
    return _file_sha256(path), content.hexdigest(), rows


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _rows(path: Path) -> int:
    with gzip.open(path, "rt", newline="") as f:
        return sum(1 for _ in csv.reader(f)) - 1  # the header


def check_archive(conn: psycopg.Connection[Any], directory: Path) -> list[str]:
    """Problems with the archives recorded in the database, checked against ``directory``: a
    missing file, a file whose sha256 is not the recorded one, a manifest that disagrees."""
    problems = []
    for name, file_name, recorded, events in conn.execute(
        "SELECT partition_name, file_name, file_sha256, events FROM ledger_archives ORDER BY 1"
    ):
        path = directory / file_name
        manifest = directory / f"{name}.manifest.json"
        if not path.exists() or not manifest.exists():
            problems.append(f"{name}: {path if not path.exists() else manifest} is missing")
            continue
        actual = _file_sha256(path)
        try:
            m = json.loads(manifest.read_text())
        except (ValueError, RecursionError) as e:  # edited, cut short: reported, not fatal
            problems.append(f"{name}: {manifest.name} is not a manifest ({str(e)[:200]})")
            continue
        if actual != recorded:
            problems.append(f"{name}: {path.name} has sha256 {actual}, recorded {recorded}")
        elif (
            not isinstance(m, dict) or m.get("file_sha256") != recorded or m.get("events") != events
        ):
            problems.append(f"{name}: manifest does not match the database's record")
        elif (rows := _rows(path)) != events:
            problems.append(f"{name}: {path.name} holds {rows} rows, recorded {events}")
    return problems


def archived_heads(conn: psycopg.Connection[Any]) -> dict[uuid.UUID, tuple[int, bytes, str]]:
    """Per session: the last archived position, its hash and the partition (empty when the
    ledger is not partitioned)."""
    return {
        sid: (int(pos), bytes(h), str(name))
        for sid, pos, h, name in conn.execute(
            "SELECT session_id, upto_position, last_hash, partition_name FROM ledger_archived_heads"
        )
    }
