"""What ``ledger-cdc replay`` and ``diff`` show of sessions, gathered from the ledger.

:func:`replay` rebuilds a session's context as a restarted worker would (the latest usable
snapshot, the tail of the log, every memoised call) and lists its calls in flight and its
memoised ones; :func:`diff_sessions` loads two sessions and finds where they part: two LangGraph
threads checkpoint by checkpoint (:func:`~ledger_cdc.admin.readable.diff_threads`), any other
two runs step by step (:func:`~ledger_cdc.admin.timeline.diff_runs`). The sessions are named as
users name them (:class:`~ledger_cdc.client.frameworks.Named`) and resolved here. Nothing here
prints: the command line renders what these return, and their JSON is theirs.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
import psycopg

from ledger_cdc.admin.readable import ThreadDiff, diff_threads, framework_states, is_thread
from ledger_cdc.admin.timeline import DiffResult, diff_runs
from ledger_cdc.client.frameworks import Named, resolve
from ledger_cdc.client.read import load_events
from ledger_cdc.client.recovery import rebuild_context
from ledger_cdc.errors import NoSuchSessionError
from ledger_cdc.events import LedgerEvent, Rejected
from ledger_cdc.fold import (
    CompletedModel,
    CompletedTool,
    PendingModel,
    PendingTool,
    SessionContext,
)

__all__ = ["Call", "Replay", "SessionsDiff", "diff_sessions", "heading", "replay", "session_events"]


def heading(named: Named) -> str:
    """The session as the user named it, and its id."""
    if named.kind == "session":
        return f"session {named.session_id}"
    return f"{named} (session {named.session_id})"


def session_events(
    conn: psycopg.Connection[Any], sid: uuid.UUID, upto_seq: int | None = None
) -> list[LedgerEvent | Rejected]:
    """The session's rows (quarantined ones as Rejected, where they lie); NoSuchSessionError
    when it has none (at or below ``upto_seq``)."""
    evs = list(load_events(conn, sid, upto_seq=upto_seq))
    if not evs:
        raise NoSuchSessionError(
            f"session {sid} has no events"
            + ("" if upto_seq is None else f" at or below seq {upto_seq}")
        )
    return evs


# -- replay ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Call:
    """A tool or model call as replay lists it: in flight (to retry with its key) or memoised
    (answered from the ledger)."""

    kind: str  # tool | model
    id: str  # the tool call's or the model request's id
    name: str  # the tool, or the model
    idempotency_key: str | None
    seq: int  # in flight: where it was invoked or requested; memoised: where it completed
    attempts: int = 1
    result: str | None = None  # memoised: the tool's result as JSON (or its error), the content


@dataclass(frozen=True, kw_only=True)
class Replay:
    """A session rebuilt as a restarted worker sees it."""

    named: Named  # resolved: its session_id is set
    context: SessionContext
    framework: list[str]  # where its framework is (a graph, an OpenAI Agents session, a run)
    ignored: int  # events of types no reducer folds (framework events aside)
    in_flight: list[Call]
    memoised: list[Call]


def replay(conn: psycopg.Connection[Any], named: Named, upto_seq: int | None = None) -> Replay:
    """``named`` resolved and rebuilt (as of ``upto_seq``), its memo loaded whole;
    NoSuchSessionError when it has no events (at or below ``upto_seq``)."""
    named = resolve(conn, named)
    assert named.session_id is not None
    ctx = rebuild_context(conn, named.session_id, upto_seq, memo=True)
    if ctx.last_position == 0:
        raise NoSuchSessionError(
            f"{heading(named)} has no events"
            + ("" if upto_seq is None else f" at or below seq {upto_seq}")
        )
    fw = ctx.extra.get("agent_framework") or {}
    return Replay(
        named=named,
        context=ctx,
        framework=framework_states(ctx.extra, named.checkpoint_ns or ""),
        ignored=ctx.ignored_events - int(fw.get("events", 0)),
        in_flight=_in_flight(ctx),
        memoised=_memoised(ctx),
    )


def _in_flight(ctx: SessionContext) -> list[Call]:
    tools = [_call(p, p.invoked_seq, attempts=p.attempts) for p in ctx.pending_tools.values()]
    return tools + [_call(m, m.requested_seq) for m in ctx.pending_models.values()]


def _memoised(ctx: SessionContext) -> list[Call]:
    tools = [_call(c, c.observed_seq, result=_tool_result(c)) for c in ctx.completed_tools.values()]
    return tools + [
        _call(m, m.responded_seq, result=m.content) for m in ctx.completed_models.values()
    ]


def _tool_result(c: CompletedTool) -> str:
    """The result as JSON, or the error."""
    return c.error if c.error is not None else msgspec.json.encode(c.result).decode()


def _call(
    entry: PendingTool | PendingModel | CompletedTool | CompletedModel,
    seq: int,
    *,
    attempts: int = 1,
    result: str | None = None,
) -> Call:
    if isinstance(entry, PendingTool | CompletedTool):
        kind, ident, name = "tool", entry.call_id, entry.tool
    else:
        kind, ident, name = "model", entry.request_id, entry.model
    return Call(
        kind=kind,
        id=ident,
        name=name,
        idempotency_key=entry.idempotency_key,
        seq=seq,
        attempts=attempts,
        result=result,
    )


# -- diff -----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SessionsDiff:
    """Two sessions compared: two LangGraph threads (``threads``), else two runs (``runs``)."""

    a: Named  # resolved
    b: Named
    runs: DiffResult | None = None
    threads: ThreadDiff | None = None

    @property
    def diverged(self) -> bool:
        if self.threads is not None:
            return self.threads.step is not None or self.threads.reason != "same"
        assert self.runs is not None
        return self.runs.divergence is not None

    def as_dict(self) -> dict[str, Any]:
        """The comparison as ``ledger-cdc diff --json`` prints it."""
        if self.threads is not None:
            t = self.threads
            return {
                "steps_a": t.steps_a,
                "steps_b": t.steps_b,
                "common_steps": t.common,
                "diverged": self.diverged,
                "step": t.step,
                "channel": t.channel,
                "reason": t.reason,
                "a": t.a,
                "b": t.b,
                "position_a": t.position_a,
                "position_b": t.position_b,
                "fields": [{"field": f, "a": a, "b": b} for f, a, b in t.fields],
            }
        assert self.runs is not None
        r, d = self.runs, self.runs.divergence
        return {
            "steps_a": r.steps_a,
            "steps_b": r.steps_b,
            "common_steps": r.common,
            "diverged": d is not None,
            "step": None if d is None else d.step,
            "reason": None if d is None else d.reason,
            "seq_a": None if d is None or d.a is None else d.a.seq,
            "seq_b": None if d is None or d.b is None else d.b.seq,
            "fields": [] if d is None else [{"field": f, "a": a, "b": b} for f, a, b in d.fields],
        }

    def to_json(self) -> str:
        """:meth:`as_dict` as indented JSON (a value JSON has no type for written as its str)."""
        return json.dumps(self.as_dict(), indent=2, default=str)


def diff_sessions(conn: psycopg.Connection[Any], a: Named, b: Named) -> SessionsDiff:
    """Resolve ``a`` and ``b``, load their events and compare them (as threads when both are
    LangGraph threads, in ``a``'s checkpoint namespace)."""
    a, b = resolve(conn, a), resolve(conn, b)
    assert a.session_id is not None and b.session_id is not None
    events_a, events_b = session_events(conn, a.session_id), session_events(conn, b.session_id)
    if is_thread(events_a) and is_thread(events_b):
        found = diff_threads(events_a, events_b, a.checkpoint_ns or "")
        return SessionsDiff(a=a, b=b, threads=found)
    return SessionsDiff(a=a, b=b, runs=diff_runs(events_a, events_b))
