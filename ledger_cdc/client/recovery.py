"""Rebuilding contexts from the ledger table: the same reducers as the consumer, from the log.

``rebuild_context(conn, session_id)`` is what a restarted agent worker calls: the latest usable
snapshot at or below ``upto_seq`` (current format and reducer version, content hash intact), plus
the events after it, folded by :mod:`ledger_cdc.fold` — the consumer's reducers, never a second
implementation. A snapshot of another format is skipped and the fold starts from zero. The
context it returns lists the tool calls in flight when the worker died (``pending_tools``, with
their idempotency keys) and memoises the completed tool and model calls, so the runtime answers a
repeated call from the ledger (:func:`memoised_tool`, :func:`memoised_model`) instead of calling
again; :func:`retry_tool` records the retry of an in-flight call under its original key.

Snapshots do not copy the memo (see :mod:`ledger_cdc.fold`): the rebuilt context holds the calls
completed after its snapshot, and ``memo_position`` says up to where the others are in
``agent_memo``.
:func:`memoised_tool` looks in the context first and then in that table, by index, bounded by
``memo_position`` (a context rebuilt at an earlier ``upto_seq`` never sees a later completion).
``rebuild_context(..., memo=True)`` loads the whole memo instead, for a context equal to a fold
from zero (what ``ledger-cdc replay`` prints).
:func:`fork` copies a session's prefix into a new session (time travel); ``fold_all`` refolds
every session from zero (what ``verify`` compares against).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import hashlib
import logging
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import psycopg

from ledger_cdc.client.read import COLUMNS, events_query, fold_all, load_events, row_event
from ledger_cdc.client.steps import (
    Op,
    Ops,
    Step,
    Steps,
    drive,
    drive_async,
    first,
    run,
    run_async,
    steps_op,
)
from ledger_cdc.client.writer import AppendResult, OutboxItem, append, append_op
from ledger_cdc.errors import (
    ConcurrentAppendError,
    HistoryArchivedError,
    InvalidEventError,
    LedgerError,
    MemoNotLoadedError,
    NoSuchSessionError,
)
from ledger_cdc.events import (
    LedgerEvent,
    SessionForked,
    ToolInvoked,
)
from ledger_cdc.fold import (
    SNAPSHOT_FORMATS,
    CompletedModel,
    CompletedTool,
    SessionContext,
    apply,
    attach,
    decode_context,
    fold_one,
    memo_key,
    reducer_version,
    references,
)

__all__ = [
    "ForkResult",
    "HistoryArchivedError",
    "NoSuchSessionError",
    "fold_all",
    "fork",
    "load_events",
    "load_memo",
    "load_memo_async",
    "memoised_model",
    "memoised_model_async",
    "memoised_tool",
    "memoised_tool_async",
    "rebuild_context",
    "rebuild_context_async",
    "retry_tool",
    "retry_tool_async",
    "row_event",
]

log = logging.getLogger(__name__)

# -- rebuild_context ----------------------------------------------------------------------------

# The latest usable snapshot by position (two appends racing on one session can take seq and
# position in opposite orders; positions are the session's own order). With upto_seq, a snapshot
# whose last event has seq <= upto_seq is taken; across such a race an event before it by
# position may have a later seq (time travel to that exact point is approximate by that event).
_SNAPSHOT = (
    b"SELECT upto_seq, upto_position, content_hash, "
    b"coalesce(data, convert_to(context::text, 'UTF8')), data IS NOT NULL FROM agent_snapshots "
    b"WHERE session_id = %s AND format_version = ANY(%s) AND reducer_version = %s "
    b"AND upto_seq <= %s "
    b"AND upto_position < %s ORDER BY upto_position DESC LIMIT 1"
)
_NO_LIMIT = 2**63 - 1
_FORMATS = list(SNAPSHOT_FORMATS)
# What a stored context references: the messages of its window (its context.loaded event's, or
# an archive's copy) and the strings of the messages it took from events
REFERENCED = b"SELECT ledger_window(%s, %s)::text, ledger_messages(%s, %s::int8[])"


def attach_steps(ctx: SessionContext) -> Steps[SessionContext]:
    """A stored context made whole: what it references read back and put in place."""
    window, positions = references(ctx)
    if window is not None or positions:
        sid = ctx.session_id
        row = first((yield Step(REFERENCED, (sid, window, sid, positions))))
        attach(ctx, *(row if row is not None else (None, None)))
    return ctx


def _session(session_id: uuid.UUID | str) -> uuid.UUID:
    if isinstance(session_id, uuid.UUID):
        return session_id
    try:
        return uuid.UUID(str(session_id))
    except ValueError:
        raise InvalidEventError(f"session id must be a UUID, got {session_id!r}") from None


def _upto(upto_seq: int | None) -> int | None:
    """``upto_seq`` as given: None (the whole history) or a whole number (a bool is none)."""
    if upto_seq is not None and (isinstance(upto_seq, bool) or not isinstance(upto_seq, int)):
        raise InvalidEventError(f"upto_seq must be a whole number or None, got {upto_seq!r}")
    return upto_seq


def snapshot_context(sid: uuid.UUID, row: Sequence[Any]) -> SessionContext | None:
    """The snapshot's context if its bytes still hash to its content hash, else None.

    Rows written under a legacy schema older than its file 0005 hold jsonb, whose key order is
    not the hashed one: those are trusted as they are (``verify`` still compares them with a
    refold)."""
    upto_seq, _, digest, data, hashed = row
    raw = bytes(data)
    if hashed and hashlib.sha256(raw).digest() != bytes(digest):
        log.warning(
            "snapshot of session %s at seq %s does not match its content hash: skipped "
            "(run `ledger-cdc verify %s`)",
            sid,
            upto_seq,
            sid,
        )
        return None
    try:
        with _no_gc():
            return decode_context(raw)
    except msgspec.DecodeError as e:
        log.warning(
            "snapshot of session %s at seq %s is unreadable (%s): skipped", sid, upto_seq, e
        )
        return None


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Decoding a snapshot allocates tens of thousands of objects that live on: without this,
    each allocation burst triggers collections that walk them all (several ms per rebuild)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# The last archived position of a session: archived, or in a partition an archive has detached
# and not yet recorded (its rows are out of the ledger meanwhile: never folded across as a gap);
# then the partition's name too. That history is gone from the ledger either way, so it is a
# HistoryArchivedError, not one to retry: the archive records it in a moment, or, killed, is
# taken up by the next archive run (which attaches the partition again first).
_ARCHIVED = b"""
SELECT max(upto_position), (array_agg(detached ORDER BY upto_position DESC))[1] FROM (
    SELECT upto_position, NULL AS detached FROM ledger_archived_heads WHERE session_id = %s
    UNION ALL
    SELECT h.upto_position, a.partition_name FROM ledger_archiving_heads h
    JOIN ledger_archiving a USING (partition_name)
    WHERE h.session_id = %s AND NOT EXISTS (
        SELECT FROM pg_inherits i
        WHERE i.inhrelid = to_regclass(a.partition_name) AND NOT i.inhdetachpending)
) u
"""


def _archived(row: Sequence[Any]) -> str:
    """How the history up to ``row[0]`` left the ledger, and what brings it back."""
    if len(row) > 1 and row[1] is not None:
        return (
            f"being archived up to position {row[0]} ({row[1]} is detached and not yet "
            "recorded; if that archive run was killed, the next `ledger-cdc partitions "
            "archive` attaches it again first)"
        )
    return f"archived up to position {row[0]}"


def _no_archived_history(sid: uuid.UUID, row: Sequence[Any] | None) -> None:
    if row is not None and row[0] is not None:
        raise HistoryArchivedError(
            f"session {sid}: its history is {_archived(row)}, and no usable snapshot covers "
            "the requested point (rebuild at a later upto_seq, or restore the archive)"
        )


def _not_inside_archive(
    sid: uuid.UUID, after: int, upto_seq: int, archived: Sequence[Any] | None
) -> None:
    """A point between a snapshot and archived history: what happened between them left with
    the archive, so the state there is not known (unless a snapshot is at exactly that seq)."""
    if archived is not None and archived[0] is not None and int(archived[0]) > after:
        raise HistoryArchivedError(
            f"session {sid}: seq {upto_seq} falls in history {_archived(archived)}; the "
            f"nearest snapshot before it is at position {after}, and no snapshot is at exactly "
            "that seq (rebuild at a snapshot's seq or after the archived history, or restore "
            "the archive)"
        )


def _tail_query(
    sid: uuid.UUID, after_seq: int, after_position: int, upto_seq: int
) -> tuple[bytes, list[Any]]:
    """The events after a snapshot (at ``after_seq`` / ``after_position``) up to ``upto_seq``,
    by the session's seq range. ``position > after`` alone reads on to the end of the session,
    and ``seq <= upto`` alone from its start (what the planner picks once the statistics lag a
    growing session, reading the whole session instead of its tail). Within a session seq grows
    with position (an append needs the previous position committed, and draws its seq after), so
    the range is the tail; an append that raced that order shows as a gap or as a next event within
    the bound (_NEXT), and the rebuild re-reads by position. ``position + 0``: the seq range
    is always the index used."""
    query = (
        f"SELECT {COLUMNS} FROM agent_events WHERE session_id = %s AND seq > %s "  # noqa: S608 - fixed text
        "AND seq <= %s AND position + 0 > %s ORDER BY position"
    )
    return query.encode(), [sid, after_seq, upto_seq, after_position]


def _contiguous(rows: Sequence[Sequence[Any]], after_position: int) -> bool:
    return all(int(row[2]) == after_position + i for i, row in enumerate(rows, 1))


# The event right after the last one the seq range gave: if its seq is within the bound too, an
# append raced the order at the end of the range, and the rebuild re-reads by position.
_NEXT = (
    b"SELECT seq <= %s FROM agent_events WHERE session_id = %s AND position > %s "
    b"ORDER BY position LIMIT 1"
)


def _next_params(
    sid: uuid.UUID, rows: Sequence[Sequence[Any]], after: int, upto_seq: int | None
) -> tuple[Any, ...]:
    return (upto_seq, sid, int(rows[-1][2]) if rows else after)


_Query = tuple[bytes, list[Any]]


def _tail_reads(
    sid: uuid.UUID, after_seq: int, after: int, upto_seq: int | None
) -> tuple[_Query, _Query | None]:
    """(the query for the tail, and the exact one to fall back to if its rows have a gap)."""
    exact = events_query(sid, after, upto_seq)  # at the head: position > after, the tail
    if upto_seq is None or after_seq == 0:
        return exact, None
    return _tail_query(sid, after_seq, after, upto_seq), exact


def _fold_tail(
    sid: uuid.UUID, ctx: SessionContext | None, rows: Iterable[Sequence[Any]]
) -> SessionContext:
    cur = ctx if ctx is not None else SessionContext(sid)
    expect = cur.last_position + 1
    with _no_gc():
        for row in rows:
            if expect and int(row[2]) != expect:
                raise HistoryArchivedError(
                    f"session {sid}: the log resumes at position {row[2]} after "
                    f"{expect - 1}: the history before it was archived and no usable snapshot "
                    "covers it (rebuild at a later upto_seq, or restore the archive)"
                )
            expect = 0
            fold_one(cur, row_event(row))
    return cur


def _rebuild_steps(sid: uuid.UUID, upto_seq: int | None, memo: bool) -> Steps[SessionContext]:
    bound = _NO_LIMIT if upto_seq is None else upto_seq
    version = reducer_version()
    ctx: SessionContext | None = None
    after = after_seq = 0
    below = _NO_LIMIT  # a snapshot found unusable: look below its position
    while ctx is None:
        key = (sid, _FORMATS, version, bound, below)
        row = first((yield Step(_SNAPSHOT, key, binary=True)))
        if row is None:
            break
        ctx = snapshot_context(sid, row)
        if ctx is not None:
            after_seq, after = int(row[0]), int(row[1])
            ctx = yield from attach_steps(ctx)
        below = int(row[1])
    if ctx is None:
        _no_archived_history(sid, first((yield Step(_ARCHIVED, (sid, sid)))))
    (query, params), exact = _tail_reads(sid, after_seq, after, upto_seq)
    rows = yield Step(query, params)
    if exact is not None:
        nxt = first((yield Step(_NEXT, _next_params(sid, rows, after, upto_seq))))
        if not _contiguous(rows, after) or (nxt is not None and nxt[0]):
            rows = yield Step(*exact)
    if upto_seq is not None and not rows and ctx is not None and after_seq != upto_seq:
        archived = first((yield Step(_ARCHIVED, (sid, sid))))
        _not_inside_archive(sid, after, upto_seq, archived)
    ctx = _fold_tail(sid, ctx, rows)
    if memo:
        ctx = yield from _load_memo_steps(ctx)
    return ctx


def rebuild_context(
    conn: psycopg.Connection[Any],
    session_id: uuid.UUID | str,
    upto_seq: int | None = None,
    *,
    memo: bool = False,
) -> SessionContext:
    """The session's context from its latest usable snapshot plus the tail of the log.

    The calls completed up to the snapshot stay in ``agent_memo`` (``ctx.memo_position``):
    answer a repeated call with :func:`memoised_tool` / :func:`memoised_model`. ``memo=True``
    loads them all into ``completed_tools`` / ``completed_models`` (``memo_position`` 0), for a
    context equal to a fold from zero. A session without any event gives an empty context
    (``last_position == 0``), so a worker can start a new session the same way it resumes one.
    """
    return run(conn, _rebuild_steps(_session(session_id), _upto(upto_seq), memo))


def rebuild_op(session_id: uuid.UUID | str) -> Op[SessionContext]:
    """:func:`rebuild_context` (at the head) as an op of a higher protocol."""
    return steps_op(lambda: _rebuild_steps(_session(session_id), None, False))


async def rebuild_context_async(
    conn: psycopg.AsyncConnection[Any],
    session_id: uuid.UUID | str,
    upto_seq: int | None = None,
    *,
    memo: bool = False,
) -> SessionContext:
    """:func:`rebuild_context` on an async connection (the same steps)."""
    return await run_async(conn, _rebuild_steps(_session(session_id), _upto(upto_seq), memo))


# -- the memo: completed calls, in the context or in agent_memo ---------------------------------

# entries leave a call's result (content) in the completing event: ledger_memo_entry reads it
_MEMO_WHERE = (
    b"SELECT ledger_memo_entry(session_id, kind, completed_position, entry)::text "
    b"FROM agent_memo WHERE session_id = %s AND completed_position <= %s "
)
_MEMO_BY = {
    ("tool", "id"): b"AND kind = 'tool' AND call_id = %s",
    ("tool", "key"): b"AND kind = 'tool' AND idempotency_key = %s",
    ("model", "id"): b"AND kind = 'model' AND call_id = %s",
    ("model", "key"): b"AND kind = 'model' AND idempotency_key = %s",
    ("model", "prompt"): b"AND kind = 'model' AND prompt_hash = %s",
}
_LATEST = b" ORDER BY completed_position DESC LIMIT 1"
_MEMO_ALL = (
    b"SELECT kind, ledger_memo_entry(session_id, kind, completed_position, entry)::text "
    b"FROM (SELECT DISTINCT ON (kind, call_id) session_id, kind, completed_position, entry "
    b"FROM agent_memo WHERE session_id = %s AND completed_position <= %s "
    b"ORDER BY kind, call_id, completed_position DESC) AS m ORDER BY completed_position"
)
_tool_entry = msgspec.json.Decoder(CompletedTool)
_model_entry = msgspec.json.Decoder(CompletedModel)

_Lookup = tuple[bytes, tuple[Any, ...]] | None


def _stored(value: str | None) -> str | None:
    """A key as agent_memo stores it (fold.memo_key)."""
    return None if value is None else memo_key(value)


def _tool_lookup(
    ctx: SessionContext, call_id: str | None, idempotency_key: str | None
) -> tuple[CompletedTool | None, _Lookup]:
    """(the answer from the context, or None and the agent_memo query that has it)."""
    try:
        return ctx.memoised_tool(call_id, idempotency_key=idempotency_key), None
    except MemoNotLoadedError:
        by, value = ("id", call_id) if call_id is not None else ("key", idempotency_key)
        query = _MEMO_WHERE + _MEMO_BY["tool", by] + _LATEST
        return None, (query, (ctx.session_id, ctx.memo_position, _stored(value)))


def _model_lookup(
    ctx: SessionContext,
    request_id: str | None,
    idempotency_key: str | None,
    prompt_hash: str | None,
) -> tuple[CompletedModel | None, _Lookup]:
    try:
        found = ctx.memoised_model(
            request_id, idempotency_key=idempotency_key, prompt_hash=prompt_hash
        )
        return found, None
    except MemoNotLoadedError:
        value: str | None
        if request_id is not None:
            by, value = "id", request_id
        elif idempotency_key is not None and prompt_hash is not None:
            # either may match: the latest completion of the two
            either = b"AND kind = 'model' AND (idempotency_key = %s OR prompt_hash = %s)"
            return None, (
                _MEMO_WHERE + either + _LATEST,
                (
                    ctx.session_id,
                    ctx.memo_position,
                    memo_key(idempotency_key),
                    memo_key(prompt_hash),
                ),
            )
        elif idempotency_key is not None:
            by, value = "key", idempotency_key
        else:
            by, value = "prompt", prompt_hash
        query = _MEMO_WHERE + _MEMO_BY["model", by] + _LATEST
        return None, (query, (ctx.session_id, ctx.memo_position, _stored(value)))


def _lookup_steps(found: Any, lookup: _Lookup, decoder: msgspec.json.Decoder[Any]) -> Steps[Any]:
    if lookup is None:
        return found
    row = first((yield Step(lookup[0], lookup[1])))
    return None if row is None else decoder.decode(row[0])


def _tool_steps(
    ctx: SessionContext, call_id: str | None, idempotency_key: str | None
) -> Steps[CompletedTool | None]:
    found, lookup = _tool_lookup(ctx, call_id, idempotency_key)
    tool: CompletedTool | None = yield from _lookup_steps(found, lookup, _tool_entry)
    return tool


def _model_steps(
    ctx: SessionContext,
    request_id: str | None,
    idempotency_key: str | None,
    prompt_hash: str | None,
) -> Steps[CompletedModel | None]:
    found, lookup = _model_lookup(ctx, request_id, idempotency_key, prompt_hash)
    model: CompletedModel | None = yield from _lookup_steps(found, lookup, _model_entry)
    return model


def memoised_tool(
    conn: psycopg.Connection[Any],
    ctx: SessionContext,
    call_id: str | None = None,
    *,
    idempotency_key: str | None = None,
) -> CompletedTool | None:
    """The completed tool call with this call id (or idempotency key) as of ``ctx``: from the
    context if it completed after its snapshot, else from ``agent_memo`` (one indexed read)."""
    return run(conn, _tool_steps(ctx, call_id, idempotency_key))


def memoised_model(
    conn: psycopg.Connection[Any],
    ctx: SessionContext,
    request_id: str | None = None,
    *,
    idempotency_key: str | None = None,
    prompt_hash: str | None = None,
) -> CompletedModel | None:
    """The completed model call with this request id (or idempotency key, or prompt hash: the
    latest such response) as of ``ctx``; see :func:`memoised_tool`."""
    return run(conn, _model_steps(ctx, request_id, idempotency_key, prompt_hash))


async def memoised_tool_async(
    conn: psycopg.AsyncConnection[Any],
    ctx: SessionContext,
    call_id: str | None = None,
    *,
    idempotency_key: str | None = None,
) -> CompletedTool | None:
    """:func:`memoised_tool` on an async connection."""
    return await run_async(conn, _tool_steps(ctx, call_id, idempotency_key))


async def memoised_model_async(
    conn: psycopg.AsyncConnection[Any],
    ctx: SessionContext,
    request_id: str | None = None,
    *,
    idempotency_key: str | None = None,
    prompt_hash: str | None = None,
) -> CompletedModel | None:
    """:func:`memoised_model` on an async connection."""
    return await run_async(conn, _model_steps(ctx, request_id, idempotency_key, prompt_hash))


def merge_memo(ctx: SessionContext, rows: Iterable[Sequence[Any]]) -> SessionContext:
    """Merge agent_memo ``rows`` (kind, entry as JSON text) into ``ctx`` (in place;
    ``memo_position`` 0): the calls completed after them, already in ``ctx``, are kept."""
    tools: dict[str, CompletedTool] = {}
    models: dict[str, CompletedModel] = {}
    with _no_gc():
        for kind, text in rows:
            if kind == "tool":
                tool = _tool_entry.decode(text)
                tools[tool.call_id] = tool
            else:
                model = _model_entry.decode(text)
                models[model.request_id] = model
    tools.update(ctx.completed_tools)  # completed after the snapshot: the context's own
    models.update(ctx.completed_models)
    ctx.completed_tools, ctx.completed_models, ctx.memo_position = tools, models, 0
    return ctx


def _load_memo_steps(ctx: SessionContext) -> Steps[SessionContext]:
    if not ctx.memo_position:
        return ctx
    rows = yield Step(_MEMO_ALL, (ctx.session_id, ctx.memo_position))
    return merge_memo(ctx, rows)


def load_memo(conn: psycopg.Connection[Any], ctx: SessionContext) -> SessionContext:
    """Load the calls ``ctx`` leaves in ``agent_memo`` into it (in place; ``memo_position`` 0)."""
    return run(conn, _load_memo_steps(ctx))


async def load_memo_async(
    conn: psycopg.AsyncConnection[Any], ctx: SessionContext
) -> SessionContext:
    """:func:`load_memo` on an async connection."""
    return await run_async(conn, _load_memo_steps(ctx))


# -- retrying an in-flight tool call ------------------------------------------------------------


def _retry_request(ctx: SessionContext, call_id: str) -> tuple[ToolInvoked, str]:
    pending = ctx.pending_tools.get(call_id)
    if pending is None:
        raise LedgerError(
            f"tool call {call_id!r} of session {ctx.session_id} is not in flight; if it "
            "completed, answer it with "
            "ledger_cdc.client.recovery.memoised_tool(conn, ctx, call_id) instead of calling it "
            "again"
        )
    payload = ToolInvoked(
        pending.call_id, pending.tool, pending.arguments, idempotency_key=pending.idempotency_key
    )
    return payload, f"{pending.idempotency_key or call_id}#retry-{pending.attempts}"


def _retry_ops(
    ctx: SessionContext, call_id: str, agent_id: str, outbox: Sequence[OutboxItem]
) -> Ops[AppendResult]:
    payload, key = _retry_request(ctx, call_id)
    res: AppendResult = yield append_op(
        ctx.session_id,
        agent_id,
        "tool.invoked",
        payload,
        expected_position=ctx.last_position,
        idempotency_key=key,
        outbox=outbox,
    )
    if res.duplicate:
        # this very retry is already in the log, past what ctx has seen: another worker made it
        raise ConcurrentAppendError(ctx.session_id, ctx.last_position, res.position)
    now = res.created_at or dt.datetime.now(dt.timezone.utc)
    apply(
        ctx,
        LedgerEvent(
            res.seq, ctx.session_id, res.position, agent_id, "tool.invoked", payload, now, key
        ),
    )
    return res


def retry_tool(
    conn: psycopg.Connection[Any],
    ctx: SessionContext,
    call_id: str,
    agent_id: str,
    *,
    outbox: Sequence[OutboxItem] = (),
) -> AppendResult:
    """Record the retry of an in-flight tool call: a new ``tool.invoked`` event with the call's
    original idempotency key (so the tool can deduplicate), appended at ``ctx.last_position``.

    Raises :class:`ConcurrentAppendError` if another worker appended to the session since ``ctx``
    was rebuilt (it took the run over, or made this same retry). On success ``ctx`` is advanced
    by the same reducer, so several retries can follow one another; then perform the call with
    ``ctx.pending_tools[call_id].idempotency_key``.
    """
    return drive(conn, _retry_ops(ctx, call_id, agent_id, outbox))


async def retry_tool_async(
    conn: psycopg.AsyncConnection[Any],
    ctx: SessionContext,
    call_id: str,
    agent_id: str,
    *,
    outbox: Sequence[OutboxItem] = (),
) -> AppendResult:
    """:func:`retry_tool` on an async connection (the same steps)."""
    return await drive_async(conn, _retry_ops(ctx, call_id, agent_id, outbox))


# -- fork ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForkResult:
    session_id: uuid.UUID
    origin_session_id: uuid.UUID
    upto_seq: int
    upto_position: int
    events: int  # copied events (the session.forked event not counted)


_PREFIX = (
    "SELECT coalesce(max(position), 0), coalesce(max(seq), 0), count(*) FROM agent_events "
    "WHERE session_id = %s AND seq <= %s"
)
# Copies keep their order: a row-level BEFORE trigger sees the rows the same statement already
# inserted, so each copy chains to the hash of the copy before it.
_COPY_PREFIX = (
    "INSERT INTO agent_events (session_id, position, agent_id, event_type, payload, "
    "idempotency_key) SELECT %s, position + 1, agent_id, event_type, payload, idempotency_key "
    "FROM agent_events WHERE session_id = %s AND seq <= %s ORDER BY position"
)


def fork(
    conn: psycopg.Connection[Any],
    session_id: uuid.UUID | str,
    upto_seq: int | None = None,
    *,
    new_session_id: uuid.UUID | None = None,
    agent_id: str = "ledger-cdc",
    reason: str | None = None,
) -> ForkResult:
    """A new session holding the origin's events up to ``upto_seq`` (all, if None), after a
    first ``session.forked`` event that records where it came from. Outbox rows are not copied:
    the fork replays history, it does not repeat side effects. One transaction."""
    origin = _session(session_id)
    upto_seq = _upto(upto_seq)
    bound = _NO_LIMIT if upto_seq is None else upto_seq
    new = new_session_id or uuid.uuid4()
    with conn.transaction():
        archived = conn.execute(_ARCHIVED, (origin, origin)).fetchone()
        if archived is not None and archived[0] is not None:
            raise HistoryArchivedError(
                f"session {origin}: its history is {_archived(archived)}; a fork copies the "
                "events themselves, so it needs them back (restore the archive), or start a "
                "new session from rebuild_context instead"
            )
        row = conn.execute(_PREFIX, (origin, bound)).fetchone()
        assert row is not None
        position, last_seq, count = (int(v) for v in row)
        if count == 0:
            where = "" if upto_seq is None else f" at or below seq {upto_seq}"
            raise NoSuchSessionError(f"session {origin} has no events{where}: nothing to fork")
        append(
            conn,
            new,
            agent_id,
            "session.forked",
            SessionForked(origin, last_seq, position, count, reason),
            expected_position=0,
        )
        conn.execute(_COPY_PREFIX, (new, origin, bound))
    return ForkResult(new, origin, last_seq, position, count)
