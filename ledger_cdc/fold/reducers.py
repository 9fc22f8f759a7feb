"""Reducers: the only place event semantics live.

The reducers are pure functions of (context, event): no clock, no I/O, no globals consulted. For
speed they update the context they are handed — a fold only ever hands them a context nobody else
holds (a fresh one, or a copy of a snapshot), so folding a log in one pass and folding it from any
snapshot onward give equal contexts. Unknown event types are kept in the log and ignored here.

What a fold applies is a :class:`Reducers` object, passed to whoever folds (the consumer's
config, ``rebuild_context``, ``verify``): the built-in reducers plus any *projections* an
application adds (``Reducers().with_projection(name, fn)``), whose state lives in
``context.extra[name]``. Its :attr:`Reducers.version` is what snapshots record, so a snapshot
folded by other reducers is never reused. Functions here that take no ``reducers`` use
:func:`default_reducers` — the built-in ones unless the application replaced them at start-up
with :func:`register_reducer` / :func:`set_default_reducers`; every long-lived folder (the
consumer, a verify run) takes its object once and keeps it.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgspec

from ledger_cdc.events import (
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
    ToolInvoked,
    ToolObserved,
)
from ledger_cdc.fold.codec import copy_context, referable
from ledger_cdc.fold.context import (
    REDUCER_VERSION,
    REFERENCE_MIN,
    RUN_PENDING,
    RUN_RUNNING,
    RUN_SUSPENDED,
    CompletedModel,
    CompletedTool,
    ContextWindow,
    ForkOrigin,
    Handoff,
    Lease,
    MessageSource,
    PendingModel,
    PendingTool,
    RunState,
    RunStatus,
    SessionContext,
    SessionStatus,
    Signal,
)
from ledger_cdc.fold.frameworks import (
    FRAMEWORK_EVENTS,
    FRAMEWORK_PROJECTION,
    FRAMEWORK_VERSION,
    fold_framework,
)

__all__ = [
    "BUILTIN_REDUCERS",
    "Projection",
    "Reducer",
    "Reducers",
    "apply",
    "completion",
    "default_reducers",
    "fold",
    "fold_one",
    "reducer_version",
    "register_reducer",
    "set_default_reducers",
    "unregister_reducer",
]

Reducer = Callable[[SessionContext, LedgerEvent], None]


def _context_loaded(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: ContextLoaded = ev.payload
    ctx.messages = list(p.messages)
    # stored by reference to this event (a storage hint: see ContextWindow)
    ctx.window = (
        ContextWindow(ev.position, len(p.messages), sum(len(m.content) for m in p.messages))
        if p.messages
        else None
    )
    ctx.sources = []
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
        if len(p.content) >= REFERENCE_MIN:  # long enough to be stored by reference
            ctx.sources.append(MessageSource(len(ctx.messages) - 1, ev.position, len(p.content)))


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
    # long enough to be stored by reference, and read back from the event as written here
    if len(content) >= REFERENCE_MIN and (p.error is not None or referable(p.result)):
        ctx.sources.append(MessageSource(len(ctx.messages) - 1, ev.position, len(content)))


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
    ctx.status = SessionStatus.COMPLETED
    ctx.result = p.result
    ctx.error = None
    _end_run(ctx)


def _task_failed(ctx: SessionContext, ev: LedgerEvent) -> None:
    p: TaskFailed = ev.payload
    ctx.status = SessionStatus.FAILED
    ctx.error = p.error
    ctx.retryable = p.retryable
    _end_run(ctx)


def _end_run(ctx: SessionContext) -> None:
    if ctx.run is not None:
        ctx.run.status = RunStatus(ctx.status.value)
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
    except (OverflowError, ValueError):  # ValueError: NaN (only an in-process payload holds it)
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
    waiting = set(run.wait_for)  # an inbox × a long list would be quadratic
    for i, sig in enumerate(run.inbox):  # the signal may have come first
        if sig.name in waiting:
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


BUILTIN_REDUCERS: Mapping[str, Reducer] = MappingProxyType(
    {
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
)


@dataclass(frozen=True)
class Projection:
    """An application's projection reducer: ``state = fn(state, event)`` for each event of
    ``event_types`` (all if None), its state in ``context.extra[name]`` (msgspec JSON-encodable).
    ``fn`` must be pure, like the built-in reducers; change ``version`` whenever its output
    changes, so snapshots folded by the old version are not reused."""

    name: str
    fn: Callable[[Any, LedgerEvent], Any]
    event_types: frozenset[str] | None = None
    version: str = "1"
    initial: Callable[[], Any] = dict


class Reducers:
    """The reducers one fold applies: the built-in ones and the projections added. Immutable:
    :meth:`with_projection` and :meth:`without` return new objects."""

    __slots__ = ("_builtin", "projections", "version")

    def __init__(self, projections: Iterable[Projection] = ()) -> None:
        by_name = {p.name: p for p in projections}
        self.projections: tuple[Projection, ...] = tuple(by_name[n] for n in sorted(by_name))
        self._builtin = BUILTIN_REDUCERS
        self.version = "+".join(
            [REDUCER_VERSION] + [f"{p.name}-{p.version}" for p in self.projections]
        )

    def __repr__(self) -> str:
        return f"Reducers({self.version!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Reducers) and other.projections == self.projections

    def __hash__(self) -> int:
        return hash(self.projections)

    def with_projection(
        self,
        name: str,
        fn: Callable[[Any, LedgerEvent], Any],
        *,
        event_types: Iterable[str] | None = None,
        version: str = "1",
        initial: Callable[[], Any] = dict,
    ) -> Reducers:
        types = frozenset(event_types) if event_types is not None else None
        added = Projection(name, fn, types, version, initial)
        return Reducers([p for p in self.projections if p.name != name] + [added])

    def without(self, name: str) -> Reducers:
        return Reducers(p for p in self.projections if p.name != name)

    def fold_one(self, ctx: SessionContext, item: LedgerEvent | Rejected) -> str | None:
        """Fold one event into ``ctx`` (which the caller hands over), or quarantine it: returns
        None when folded, else the reason it was not.

        The one decision every path makes the same way (the consumer's stream, its bootstrap
        and resync, ``rebuild_context``, ``verify``, ``replay``, the archive), so a refold from
        zero always reaches the consumer's context. It never raises for any content of an event:

        - a :class:`~ledger_cdc.events.Rejected` row (its payload or time could not be read) is
          quarantined;
        - a projection that raises, or returns state that JSON cannot hold, quarantines the
          event, and nothing of it is applied;
        - the built-in reducers are total (saturating where arithmetic could overflow).

        A quarantined event still moves ``last_seq`` / ``last_position`` (the session goes on
        past it) and counts in ``quarantined``, not in ``event_count`` — unless it is
        ``unplaced`` (its session or position could not be read): then ``ctx`` is not touched."""
        if type(item) is Rejected:
            if not item.unplaced:  # one in no session's history moves none
                _quarantine(ctx, item.seq, item.position)
            return item.reason
        ev: LedgerEvent = item  # type: ignore[assignment]
        states: list[tuple[str, Any]] | None = None
        if self.projections:
            try:
                states = self._states(ctx, ev)
            except Exception as e:
                if isinstance(e, MemoryError):
                    raise
                _quarantine(ctx, ev.seq, ev.position)
                return f"reducer failed on {ev.event_type}: {_why(e)}"
        fn = self._builtin.get(ev.event_type)
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

    def _states(self, ctx: SessionContext, ev: LedgerEvent) -> list[tuple[str, Any]]:
        """The new state of every projection for ``ev``, as JSON would give it back (what a
        context reloaded from its projection holds), computed before anything is applied."""
        out = []
        for p in self.projections:
            if p.event_types is None or ev.event_type in p.event_types:
                state = ctx.extra.get(p.name)
                if state is None:
                    state = p.initial()
                new = p.fn(state, ev)
                out.append((p.name, _plain.decode(_as_json.encode(new))))
        return out

    def fold(
        self,
        events: Iterable[LedgerEvent | Rejected],
        ctx: SessionContext | None = None,
        session_id: uuid.UUID | None = None,
    ) -> SessionContext:
        """Fold events (of one session, in position order) from ``ctx`` (not modified) or from
        zero."""
        if ctx is not None:
            cur = copy_context(ctx)
        elif session_id is not None:
            cur = SessionContext(session_id)
        else:
            cur = None
        for ev in events:
            if cur is None:
                cur = SessionContext(ev.session_id)
            self.fold_one(cur, ev)
        if cur is None:
            raise ValueError("fold of no events needs ctx or session_id")
        return cur


_plain = msgspec.json.Decoder()
_as_json = msgspec.json.Encoder()  # any keys JSON can write (order="deterministic" wants str)


def _quarantine(ctx: SessionContext, seq: int, position: int) -> None:
    ctx.quarantined += 1
    ctx.last_seq = seq
    ctx.last_position = position


def _why(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 300 else text[:300] + "…"


# the agent frameworks' events (LangGraph, OpenAI Agents, Pydantic AI), folded as a projection:
# a payload it cannot read is quarantined like any other
BUILTIN = Reducers(
    [Projection(FRAMEWORK_PROJECTION, fold_framework, FRAMEWORK_EVENTS, FRAMEWORK_VERSION)]
)
_default = BUILTIN


def default_reducers() -> Reducers:
    """The reducers used where none are passed: the built-in ones, unless replaced."""
    return _default


def set_default_reducers(reducers: Reducers) -> None:
    """Replace the process's default reducers (at start-up, before anything folds)."""
    global _default
    _default = reducers


def register_reducer(
    name: str,
    fn: Callable[[Any, LedgerEvent], Any],
    *,
    event_types: Iterable[str] | None = None,
    version: str = "1",
    initial: Callable[[], Any] = dict,
) -> None:
    """Add a projection to the default reducers (see :class:`Projection`); shorthand for
    ``set_default_reducers(default_reducers().with_projection(...))``."""
    set_default_reducers(
        _default.with_projection(
            name, fn, event_types=event_types, version=version, initial=initial
        )
    )


def unregister_reducer(name: str) -> None:
    set_default_reducers(_default.without(name))


def reducer_version(reducers: Reducers | None = None) -> str:
    """The version string snapshots record: built-in reducers plus every projection."""
    return (reducers or _default).version


def fold_one(
    ctx: SessionContext, item: LedgerEvent | Rejected, reducers: Reducers | None = None
) -> str | None:
    """:meth:`Reducers.fold_one` with ``reducers`` (default: :func:`default_reducers`)."""
    return (reducers or _default).fold_one(ctx, item)


def apply(
    ctx: SessionContext, ev: LedgerEvent | Rejected, reducers: Reducers | None = None
) -> SessionContext:
    """:func:`fold_one`, for callers that do not need its verdict; returns ``ctx``."""
    (reducers or _default).fold_one(ctx, ev)
    return ctx


def fold(
    events: Iterable[LedgerEvent | Rejected],
    ctx: SessionContext | None = None,
    session_id: uuid.UUID | None = None,
    reducers: Reducers | None = None,
) -> SessionContext:
    """:meth:`Reducers.fold` with ``reducers`` (default: :func:`default_reducers`)."""
    return (reducers or _default).fold(events, ctx, session_id)


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
