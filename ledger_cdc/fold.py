"""Reducers: the only place event semantics live.

A :class:`SessionContext` is everything the orchestrator needs to know about a session after a
crash: the context window (``context.loaded``, then model replies and tool results appended), the
tool calls in flight (invoked, never observed) and the completed ones memoised by call id, the
model calls likewise, handoffs, token usage, status and the position reached.

A completed call never changes, so snapshots do not carry the memo: each completed call is one
row of ``agent_memo``, written by the consumer in the batch that folds it (:func:`completion`
names it), and a snapshot records ``memo_position``, the session position up to which its memo
lives there (:func:`encode_snapshot`). A context rebuilt from a snapshot therefore holds only
the calls completed after it, and answers memo lookups through
``ledger_cdc.replay.memoised_tool`` / ``memoised_model``; rewriting every completed call into
every snapshot would make a rebuild and the snapshot table grow with the whole history.

The reducers are pure functions of (context, event): no clock, no I/O, no globals consulted. For
speed they update the context they are handed — :func:`fold` and :class:`Folder` only ever hand
them a context nobody else holds (a fresh one, or a copy of a snapshot), so folding a log in one
pass and folding it from any snapshot onward give equal contexts. Unknown event types are kept in
the log and ignored here; applications add projection reducers of their own with
:func:`register_reducer`, whose state lives in ``context.extra[name]``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from .errors import MemoNotLoadedError
from .events import (
    MAX_TIME,
    MIN_TIME,
    ContextLoaded,
    HandoffEmitted,
    HandoffReceived,
    LedgerEvent,
    Message,
    ModelRequested,
    ModelResponded,
    Rejected,
    RunLeased,
    RunQueued,
    RunReleased,
    RunSuspended,
    SessionForked,
    SignalReceived,
    TaskCompleted,
    TaskFailed,
    ToolCall,
    ToolInvoked,
    ToolObserved,
)

__all__ = [
    "FORMAT_VERSION",
    "PROJECTION_FORMAT",
    "REDUCER_VERSION",
    "CompletedModel",
    "CompletedTool",
    "ForkOrigin",
    "Handoff",
    "Lease",
    "PendingModel",
    "PendingTool",
    "RunState",
    "SessionContext",
    "Signal",
    "TokenUsage",
    "apply",
    "completion",
    "copy_context",
    "decode_context",
    "encode_context",
    "encode_snapshot",
    "fold",
    "fold_one",
    "reducer_version",
    "register_reducer",
]

FORMAT_VERSION = 3
"""Version of the snapshot format (snapshots of another version are not used, except as the base
of a session whose earlier history was archived). 3: canonical encoding (object keys sorted) and
the quarantine count; 2: the memo is not in the snapshot but in ``agent_memo`` up to
``memo_position``; 1 held the whole memo."""
PROJECTION_FORMAT = 1
"""Version of the projection's context format (``agent_sessions.context``, the whole context)."""
REDUCER_VERSION = "core-3"
"""Version of the built-in reducers' semantics (bump when a reducer changes its output)."""


class PendingTool(msgspec.Struct, omit_defaults=True, gc=False):
    call_id: str
    tool: str
    arguments: dict[str, Any]
    idempotency_key: str | None
    invoked_seq: int
    attempts: int = 1


class CompletedTool(msgspec.Struct, omit_defaults=True, gc=False):
    call_id: str
    tool: str
    arguments: dict[str, Any]
    idempotency_key: str | None
    result: Any
    error: str | None
    invoked_seq: int
    observed_seq: int


class PendingModel(msgspec.Struct, omit_defaults=True, gc=False):
    request_id: str
    model: str
    prompt_hash: str | None
    idempotency_key: str | None
    requested_seq: int


class CompletedModel(msgspec.Struct, omit_defaults=True, gc=False):
    request_id: str
    model: str
    prompt_hash: str | None
    content: str
    input_tokens: int
    output_tokens: int
    tool_calls: list[ToolCall]
    stop_reason: str | None
    requested_seq: int | None
    responded_seq: int
    idempotency_key: str | None = None


class ForkOrigin(msgspec.Struct, omit_defaults=True, gc=False):
    session_id: uuid.UUID
    upto_seq: int
    upto_position: int


class Lease(msgspec.Struct, omit_defaults=True, gc=False):
    worker: str
    until: dt.datetime  # the leasing event's created_at (server clock) + its ttl
    seq: int
    position: int


class Signal(msgspec.Struct, omit_defaults=True, gc=False):
    name: str
    seq: int
    payload: Any = None
    sender: str | None = None


RUN_PENDING, RUN_RUNNING, RUN_SUSPENDED = "pending", "running", "suspended"


class RunState(msgspec.Struct):
    """Coordination state of a run, folded from run.* and signal.* events (no clock is read:
    whether a lease has expired is decided by whoever asks, against the server's clock)."""

    status: str = RUN_RUNNING  # pending | running | suspended | completed | failed
    lease: Lease | None = None
    wait_for: list[str] = []
    reason: str | None = None
    inbox: list[Signal] = []  # signals that no suspension has consumed yet
    woken_by: Signal | None = None
    leases: int = 0  # run.leased events, renewals included


class Handoff(msgspec.Struct, omit_defaults=True, gc=False):
    handoff_id: str
    agent: str  # to (emitted) / from (received)
    seq: int
    message: str = ""


class TokenUsage(msgspec.Struct, omit_defaults=True, gc=False):
    input_tokens: int = 0
    output_tokens: int = 0
    model_calls: int = 0


class SessionContext(msgspec.Struct):
    """The folded state of one session (see the module docstring)."""

    session_id: uuid.UUID
    status: str = "running"  # running | completed | failed
    task: str | None = None
    messages: list[Message] = []
    pending_tools: dict[str, PendingTool] = {}
    completed_tools: dict[str, CompletedTool] = {}
    pending_models: dict[str, PendingModel] = {}
    completed_models: dict[str, CompletedModel] = {}
    # calls completed at or below this position are not in completed_tools / completed_models
    # but in agent_memo (a context rebuilt from a snapshot); 0: this context holds its whole memo
    memo_position: int = 0
    handoffs_emitted: list[Handoff] = []
    handoffs_received: list[Handoff] = []
    usage: TokenUsage = msgspec.field(default_factory=TokenUsage)
    agents: list[str] = []
    result: Any = None
    error: str | None = None
    retryable: bool | None = None
    event_count: int = 0
    last_seq: int = 0
    last_position: int = 0
    ignored_events: int = 0
    quarantined: int = 0  # events not folded (see fold_one); their positions still count
    forked_from: ForkOrigin | None = None
    run: RunState | None = None
    extra: dict[str, Any] = {}

    # -- memo: what a restarted worker answers from the ledger instead of calling again ------

    def memoised_tool(
        self, call_id: str | None = None, *, idempotency_key: str | None = None
    ) -> CompletedTool | None:
        """The completed tool call with this call id (or idempotency key: the latest such
        completion), if there is one.

        Raises :class:`MemoNotLoadedError` when the answer may be in ``agent_memo`` instead
        (``memo_position > 0``): use ``ledger_cdc.replay.memoised_tool(conn, ctx, …)`` then."""
        found: CompletedTool | None = None
        if call_id is not None:
            found = self.completed_tools.get(call_id)
        elif idempotency_key is not None:  # the latest completion with this key
            for done in self.completed_tools.values():
                if done.idempotency_key == idempotency_key and (
                    found is None or done.observed_seq > found.observed_seq
                ):
                    found = done
        else:
            return None
        if found is None and self.memo_position:
            raise self._not_loaded("tool", call_id or idempotency_key)
        return found

    def memoised_model(
        self,
        request_id: str | None = None,
        *,
        idempotency_key: str | None = None,
        prompt_hash: str | None = None,
    ) -> CompletedModel | None:
        """The completed model call with this request id (or idempotency key, or prompt hash:
        the latest such response), if there is one. Raises :class:`MemoNotLoadedError` as
        :meth:`memoised_tool` does."""
        found: CompletedModel | None = None
        if request_id is not None:
            found = self.completed_models.get(request_id)
        elif idempotency_key is None and prompt_hash is None:
            return None
        else:
            for done in self.completed_models.values():
                if (
                    (idempotency_key is not None and done.idempotency_key == idempotency_key)
                    or (prompt_hash is not None and done.prompt_hash == prompt_hash)
                ) and (found is None or done.responded_seq > found.responded_seq):
                    found = done
        if found is None and self.memo_position:
            raise self._not_loaded("model", request_id or idempotency_key or prompt_hash)
        return found

    def _not_loaded(self, kind: str, what: str | None) -> MemoNotLoadedError:
        fn = "memoised_tool" if kind == "tool" else "memoised_model"
        return MemoNotLoadedError(
            f"session {self.session_id}: {kind} call {what!r} is not among the calls completed "
            f"after position {self.memo_position}, and this context does not hold the ones "
            f"before (they are in agent_memo): look it up with "
            f"ledger_cdc.replay.{fn}(conn, ctx, ...), or rebuild with memo=True"
        )


Reducer = Callable[[SessionContext, LedgerEvent], None]


def _context_loaded(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: ContextLoaded = ev.payload
    ctx.messages = list(p.messages)
    if p.task is not None:
        ctx.task = p.task


def _model_requested(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: ModelRequested = ev.payload
    ctx.pending_models[p.request_id] = PendingModel(
        p.request_id, p.model, p.prompt_hash, p.idempotency_key or ev.idempotency_key, ev.seq
    )


def _model_responded(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: ModelResponded = ev.payload
    req = ctx.pending_models.pop(p.request_id, None)
    ctx.completed_models[p.request_id] = CompletedModel(
        p.request_id,
        p.model,
        req.prompt_hash if req else None,
        p.content,
        p.usage.input_tokens,
        p.usage.output_tokens,
        list(p.tool_calls),
        p.stop_reason,
        req.requested_seq if req else None,
        ev.seq,
        req.idempotency_key if req else None,
    )
    u = ctx.usage
    u.input_tokens += p.usage.input_tokens
    u.output_tokens += p.usage.output_tokens
    u.model_calls += 1
    if p.content:
        ctx.messages.append(Message("assistant", p.content))


def _tool_invoked(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: ToolInvoked = ev.payload
    key = p.idempotency_key or ev.idempotency_key
    prior = ctx.pending_tools.get(p.call_id)
    ctx.pending_tools[p.call_id] = PendingTool(
        p.call_id,
        p.tool,
        dict(p.arguments),
        key,
        prior.invoked_seq if prior else ev.seq,
        prior.attempts + 1 if prior else 1,
    )


def _tool_observed(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: ToolObserved = ev.payload
    inv = ctx.pending_tools.pop(p.call_id, None)
    ctx.completed_tools[p.call_id] = CompletedTool(
        p.call_id,
        inv.tool if inv else "",
        inv.arguments if inv else {},
        inv.idempotency_key if inv else None,
        p.result,
        p.error,
        inv.invoked_seq if inv else ev.seq,
        ev.seq,
    )
    content = p.error if p.error is not None else _text(p.result)
    ctx.messages.append(Message("tool", content, tool_call_id=p.call_id))


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return msgspec.json.encode(value).decode()


def _handoff_emitted(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: HandoffEmitted = ev.payload
    ctx.handoffs_emitted.append(Handoff(p.handoff_id, p.to_agent, ev.seq, p.message))


def _handoff_received(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: HandoffReceived = ev.payload
    ctx.handoffs_received.append(Handoff(p.handoff_id, p.from_agent, ev.seq))


def _session_forked(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: SessionForked = ev.payload
    ctx.forked_from = ForkOrigin(p.origin_session_id, p.upto_seq, p.upto_position)


def _task_completed(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: TaskCompleted = ev.payload
    ctx.status = "completed"
    ctx.result = p.result
    ctx.error = None
    _end_run(ctx)


def _task_failed(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: TaskFailed = ev.payload
    ctx.status = "failed"
    ctx.error = p.error
    ctx.retryable = p.retryable
    _end_run(ctx)


def _end_run(ctx: SessionContext) -> None:
    if ctx.run is not None:
        ctx.run.status = ctx.status
        ctx.run.lease = None


def _run(ctx: SessionContext) -> RunState:
    if ctx.run is None:
        ctx.run = RunState()
    return ctx.run


def _run_queued(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: RunQueued = ev.payload
    run = _run(ctx)
    run.status, run.lease, run.reason = RUN_PENDING, None, p.reason


def _lease_until(created_at: dt.datetime, ttl: float) -> dt.datetime:
    """created_at + ttl, saturating at the times every reader can hold (a ttl of 1e12 s is a
    lease that does not end, not a crash; events.MAX_TIME keeps a day's margin for any zone)."""
    try:
        until = created_at + dt.timedelta(seconds=ttl)
    except OverflowError:
        return MAX_TIME if ttl > 0 else MIN_TIME
    return MAX_TIME if until > MAX_TIME else MIN_TIME if until < MIN_TIME else until


def _run_leased(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: RunLeased = ev.payload
    run = _run(ctx)
    until = _lease_until(ev.created_at, p.ttl)
    run.status = RUN_RUNNING
    run.lease = Lease(p.worker, until, ev.seq, ev.position)
    run.wait_for, run.reason = [], None
    run.leases += 1


def _run_released(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: RunReleased = ev.payload
    run = _run(ctx)
    if run.lease is None or run.lease.worker == p.worker:
        run.status, run.lease, run.reason = RUN_PENDING, None, p.reason


def _run_suspended(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: RunSuspended = ev.payload
    run = _run(ctx)
    run.status, run.lease, run.reason, run.wait_for = (
        RUN_SUSPENDED,
        None,
        p.reason,
        list(p.wait_for),
    )
    run.woken_by = None
    for i, sig in enumerate(run.inbox):  # the signal may have come first
        if sig.name in run.wait_for:
            del run.inbox[i]
            run.status, run.woken_by = RUN_PENDING, sig
            return


def _signal_received(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: SignalReceived = ev.payload
    run = _run(ctx)
    sig = Signal(p.name, ev.seq, p.payload, p.sender)
    if run.status == RUN_SUSPENDED and p.name in run.wait_for:
        run.status, run.woken_by = RUN_PENDING, sig
    else:
        run.inbox.append(sig)


REDUCERS: dict[str, Reducer] = {
    "context.loaded": _context_loaded,
    "model.requested": _model_requested,
    "model.responded": _model_responded,
    "tool.invoked": _tool_invoked,
    "tool.observed": _tool_observed,
    "handoff.emitted": _handoff_emitted,
    "handoff.received": _handoff_received,
    "task.completed": _task_completed,
    "task.failed": _task_failed,
    "session.forked": _session_forked,
    "run.queued": _run_queued,
    "run.leased": _run_leased,
    "run.released": _run_released,
    "run.suspended": _run_suspended,
    "signal.received": _signal_received,
}


@dataclass(frozen=True)
class _Custom:
    name: str
    event_types: frozenset[str] | None
    fn: Callable[[Any, LedgerEvent], Any]
    version: str
    initial: Callable[[], Any]


_CUSTOM: dict[str, _Custom] = {}


def register_reducer(
    name: str,
    fn: Callable[[Any, LedgerEvent], Any],
    *,
    event_types: Iterable[str] | None = None,
    version: str = "1",
    initial: Callable[[], Any] = dict,
) -> None:
    """Add a projection reducer: ``state = fn(state, event)`` for each event of ``event_types``
    (all types if None). Its state is kept in ``context.extra[name]`` and must be msgspec
    JSON-encodable. ``fn`` must be pure, like the built-in reducers; change ``version`` whenever
    its output changes, so snapshots folded by the old version are not reused."""
    types = frozenset(event_types) if event_types is not None else None
    _CUSTOM[name] = _Custom(name, types, fn, version, initial)


def unregister_reducer(name: str) -> None:
    _CUSTOM.pop(name, None)


def reducer_version() -> str:
    """The version string snapshots record: built-in reducers plus every registered one."""
    parts = [REDUCER_VERSION] + [
        f"{c.name}-{c.version}" for c in sorted(_CUSTOM.values(), key=lambda c: c.name)
    ]
    return "+".join(parts)


def fold_one(ctx: SessionContext, item: LedgerEvent | Rejected) -> str | None:
    """Fold one event into ``ctx`` (which the caller hands over), or quarantine it: returns
    None when folded, else the reason it was not.

    The one decision every path makes the same way (the consumer's stream, its bootstrap and
    resync, ``rebuild_context``, ``verify``, ``replay``, the archive), so a refold from zero
    always reaches the consumer's context. It never raises for any content of an event:

    - a :class:`~ledger_cdc.events.Rejected` row (its payload or time could not be read) is
      quarantined;
    - a registered reducer (:func:`register_reducer`) that raises, or returns state that JSON
      cannot hold, quarantines the event, and nothing of it is applied;
    - the built-in reducers are total (saturating where arithmetic could overflow).

    A quarantined event still moves ``last_seq`` / ``last_position`` (the session goes on past
    it) and counts in ``quarantined``, not in ``event_count``."""
    if type(item) is Rejected:
        _quarantine(ctx, item.seq, item.position)
        return item.reason
    ev: LedgerEvent = item  # type: ignore[assignment]
    states: list[tuple[str, Any]] | None = None
    if _CUSTOM:
        try:
            states = _custom_states(ctx, ev)
        except Exception as e:
            if isinstance(e, MemoryError):
                raise
            _quarantine(ctx, ev.seq, ev.position)
            return f"reducer failed on {ev.event_type}: {_why(e)}"
    fn = REDUCERS.get(ev.event_type)
    if fn is not None and not isinstance(ev.payload, dict):
        fn(ctx, ev)
    else:
        ctx.ignored_events += 1
    if states:
        for name, state in states:
            ctx.extra[name] = state
    if ev.agent_id not in ctx.agents:
        ctx.agents.append(ev.agent_id)
    ctx.event_count += 1
    ctx.last_seq = ev.seq
    ctx.last_position = ev.position
    return None


def apply(ctx: SessionContext, ev: LedgerEvent | Rejected) -> SessionContext:
    """:func:`fold_one`, for callers that do not need its verdict; returns ``ctx``."""
    fold_one(ctx, ev)
    return ctx


def _quarantine(ctx: SessionContext, seq: int, position: int) -> None:
    ctx.quarantined += 1
    ctx.last_seq = seq
    ctx.last_position = position


def _custom_states(ctx: SessionContext, ev: LedgerEvent) -> list[tuple[str, Any]]:
    """The new state of every registered reducer for ``ev``, as JSON would give it back (what a
    context reloaded from its projection holds), computed before anything is applied."""
    out = []
    for custom in _CUSTOM.values():
        if custom.event_types is None or ev.event_type in custom.event_types:
            state = ctx.extra.get(custom.name)
            if state is None:
                state = custom.initial()
            new = custom.fn(state, ev)
            out.append((custom.name, _plain.decode(_as_json.encode(new))))
    return out


def _why(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 300 else text[:300] + "…"


def fold(
    events: Iterable[LedgerEvent | Rejected],
    ctx: SessionContext | None = None,
    session_id: uuid.UUID | None = None,
) -> SessionContext:
    """Fold events (of one session, in position order) from ``ctx`` (not modified) or from zero."""
    if ctx is not None:
        cur = copy_context(ctx)
    elif session_id is not None:
        cur = SessionContext(session_id)
    else:
        cur = None
    for ev in events:
        if cur is None:
            cur = SessionContext(ev.session_id)
        fold_one(cur, ev)
    if cur is None:
        raise ValueError("fold of no events needs ctx or session_id")
    return cur


# Canonical: Struct fields in declaration order, object keys sorted. The same context gives the
# same bytes however it was loaded (jsonb, which the projection goes through, reorders keys).
_encoder = msgspec.json.Encoder(order="deterministic")
_decoder = msgspec.json.Decoder(SessionContext)
_plain = msgspec.json.Decoder()
_as_json = msgspec.json.Encoder()  # any keys JSON can write (order="deterministic" wants str)


def encode_context(ctx: SessionContext) -> bytes:
    """Canonical JSON of a context: the same bytes for equal contexts, however each was loaded
    (Struct fields in declaration order, every object's keys sorted)."""
    return _encoder.encode(ctx)


def decode_context(data: bytes | str) -> SessionContext:
    return _decoder.decode(data)


def encode_snapshot(ctx: SessionContext) -> bytes:
    """What a snapshot stores: the context without its completed calls (in ``agent_memo``, one
    row each, written no later than the snapshot), with ``memo_position`` set to its last
    position."""
    return _encoder.encode(
        msgspec.structs.replace(
            ctx, completed_tools={}, completed_models={}, memo_position=ctx.last_position
        )
    )


def completion(ctx: SessionContext, ev: LedgerEvent) -> CompletedTool | CompletedModel | None:
    """The memo entry that ``ev``, just folded into ``ctx``, completed (None for other events)."""
    p = ev.payload
    if isinstance(p, ToolObserved):
        tool = ctx.completed_tools.get(p.call_id)
        return tool if tool is not None and tool.observed_seq == ev.seq else None
    if isinstance(p, ModelResponded):
        model = ctx.completed_models.get(p.request_id)
        return model if model is not None and model.responded_seq == ev.seq else None
    return None


def copy_context(ctx: SessionContext) -> SessionContext:
    return _decoder.decode(_encoder.encode(ctx))


def content_hash(ctx: SessionContext) -> bytes:
    return hashlib.sha256(encode_context(ctx)).digest()
