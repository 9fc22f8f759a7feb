"""Reading a session as a story: the timeline of ``inspect`` and the run alignment of ``diff``.

Pure functions over :class:`LedgerEvent` lists (no I/O): :func:`timeline` pairs each tool call
with its result and marks the calls still in flight; :func:`diff_runs` aligns two runs of the
same task step by step — ignoring what always differs between runs (ids, keys, times, the
``session.forked`` marker and retries of a call) — and reports the first step where they diverge.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ledger_cdc.events import LedgerEvent, Rejected

__all__ = [
    "DiffResult",
    "Divergence",
    "TimelineRow",
    "diff_runs",
    "field_differences",
    "summarise",
    "timeline",
]


def _short(value: Any, limit: int = 120) -> Any:
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    return value if len(text) <= limit else text[: limit - 1] + "…"


def field_differences(
    expected: Any, actual: Any, path: str = "", limit: int = 5
) -> list[tuple[str, Any, Any]]:
    """Up to ``limit`` (path, expected, actual) triples where two JSON-like values differ."""
    out: list[tuple[str, Any, Any]] = []

    def walk(a: Any, b: Any, p: str) -> None:
        if len(out) >= limit or a == b:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in list(a) + [k for k in b if k not in a]:
                sub = f"{p}.{k}" if p else str(k)
                if k not in a:
                    out.append((sub, None, _short(b[k])))
                elif k not in b:
                    out.append((sub, _short(a[k]), None))
                else:
                    walk(a[k], b[k], sub)
                if len(out) >= limit:
                    return
        elif isinstance(a, list) and isinstance(b, list):
            for i in range(min(len(a), len(b))):
                walk(a[i], b[i], f"{p}[{i}]")
                if len(out) >= limit:
                    return
            if len(a) != len(b):
                out.append((f"{p}.length" if p else "length", len(a), len(b)))
        else:
            out.append((p or "(value)", _short(a), _short(b)))

    walk(expected, actual, path)
    return out


def _payload(ev: LedgerEvent) -> dict[str, Any]:
    value = msgspec.to_builtins(ev.payload)
    return value if isinstance(value, dict) else {"value": value}


def summarise(ev: LedgerEvent | Rejected) -> str:
    """One line saying what the event did (for a quarantined row: why it was not folded)."""
    if type(ev) is Rejected:
        return f"quarantined: {_short(ev.reason, 160)}"
    assert isinstance(ev, LedgerEvent)
    p = _payload(ev)
    t = ev.event_type
    if t == "context.loaded":
        return f"{len(p.get('messages', []))} message(s); task: {p.get('task')}"
    if t == "model.requested":
        return f"{p.get('model')} · prompt {p.get('prompt_hash') or '—'} · {p.get('request_id')}"
    if t == "model.responded":
        u = p.get("usage", {})
        calls = ", ".join(c.get("tool", "?") for c in p.get("tool_calls", []))
        text = _short(p.get("content", ""), 60)
        return f"{u.get('input_tokens', 0)}→{u.get('output_tokens', 0)} tokens · {text!r}" + (
            f" · calls {calls}" if calls else ""
        )
    if t == "tool.invoked":
        return f"{p.get('tool')}({_short(p.get('arguments', {}), 60)}) · {p.get('call_id')}"
    if t == "tool.observed":
        if p.get("error") is not None:
            return f"{p.get('call_id')} ✗ {_short(p['error'], 80)}"
        return f"{p.get('call_id')} → {_short(p.get('result'), 80)}"
    if t == "handoff.emitted":
        return f"→ {p.get('to_agent')} · {_short(p.get('message', ''), 60)}"
    if t == "handoff.received":
        return f"← {p.get('from_agent')} · {p.get('handoff_id')}"
    if t == "task.completed":
        return f"result {_short(p.get('result'), 80)}"
    if t == "task.failed":
        return f"{p.get('error')}" + (" (retryable)" if p.get("retryable") else "")
    if t == "session.forked":
        return (
            f"forked from {p.get('origin_session_id')} at seq {p.get('upto_seq')} "
            f"(position {p.get('upto_position')}, {p.get('events')} events)"
        )
    return str(_short(p, 80))


@dataclass(frozen=True)
class TimelineRow:
    seq: int
    position: int
    created_at: dt.datetime | None  # None: a quarantined row whose time cannot be read
    agent_id: str
    event_type: str
    summary: str
    mark: str  # "" | "in flight" | "retry" | "failed" | "quarantined"
    pair: int | None  # seq of the matching call / result


def timeline(items: Sequence[LedgerEvent | Rejected]) -> list[TimelineRow]:
    """Rows of a session's timeline, tool and model calls paired with their results; a
    quarantined row is shown where it lies, with the reason."""
    observed: dict[str, int] = {}
    responded: dict[str, int] = {}
    invoked: dict[str, int] = {}
    requested: dict[str, int] = {}
    events = [e for e in items if type(e) is LedgerEvent]
    for ev in events:
        p = _payload(ev)
        if ev.event_type == "tool.observed":
            observed[str(p.get("call_id"))] = ev.seq
        elif ev.event_type == "model.responded":
            responded[str(p.get("request_id"))] = ev.seq
        elif ev.event_type == "tool.invoked":
            invoked.setdefault(str(p.get("call_id")), ev.seq)
        elif ev.event_type == "model.requested":
            requested.setdefault(str(p.get("request_id")), ev.seq)
    rows = []
    seen_calls: set[str] = set()
    for item in items:
        if type(item) is Rejected:
            rows.append(
                TimelineRow(
                    item.seq,
                    item.position,
                    None,
                    item.agent_id,
                    item.event_type,
                    summarise(item),
                    "quarantined",
                    None,
                )
            )
            continue
        assert isinstance(item, LedgerEvent)
        ev = item
        p = _payload(ev)
        mark, pair = "", None
        if ev.event_type == "tool.invoked":
            call = str(p.get("call_id"))
            pair = observed.get(call)
            if call in seen_calls:
                mark = "retry"
            elif pair is None:
                mark = "in flight"
            seen_calls.add(call)
        elif ev.event_type == "tool.observed":
            pair = invoked.get(str(p.get("call_id")))
            mark = "failed" if p.get("error") is not None else ""
        elif ev.event_type == "model.requested":
            pair = responded.get(str(p.get("request_id")))
            mark = "" if pair is not None else "in flight"
        elif ev.event_type == "model.responded":
            pair = requested.get(str(p.get("request_id")))
        elif ev.event_type == "task.failed":
            mark = "failed"
        rows.append(
            TimelineRow(
                ev.seq,
                ev.position,
                ev.created_at,
                ev.agent_id,
                ev.event_type,
                summarise(ev),
                mark,
                pair,
            )
        )
    return rows


# What differs between two runs of the same task even when they behave the same.
_IDENTITY = frozenset({"request_id", "call_id", "idempotency_key", "handoff_id"})


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _IDENTITY}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _steps(events: Sequence[LedgerEvent | Rejected]) -> list[LedgerEvent]:
    """The events that are steps of the run: no fork marker, no retry of an earlier call, no
    quarantined row (it was never folded)."""
    out = []
    calls: set[str] = set()
    for ev in events:
        if type(ev) is not LedgerEvent:
            continue
        if ev.event_type == "session.forked":
            continue
        if ev.event_type == "tool.invoked":
            call = str(_payload(ev).get("call_id"))
            if call in calls:
                continue
            calls.add(call)
        out.append(ev)
    return out


@dataclass(frozen=True, kw_only=True)
class Divergence:
    step: int  # 1-based step number in both runs
    a: LedgerEvent | None  # None: run A ended before this step
    b: LedgerEvent | None
    reason: str
    fields: list[tuple[str, Any, Any]]  # (path, in A, in B)


@dataclass(frozen=True, kw_only=True)
class DiffResult:
    steps_a: int
    steps_b: int
    common: int  # steps equal from the start
    divergence: Divergence | None  # None: the runs are step for step the same


def _reason(a: LedgerEvent, b: LedgerEvent, fields: list[tuple[str, Any, Any]]) -> str:
    if a.event_type != b.event_type:
        return f"different step: {a.event_type} vs {b.event_type}"
    if a.agent_id != b.agent_id:
        return f"different agent: {a.agent_id} vs {b.agent_id}"
    paths = {f[0].split(".")[0].split("[")[0] for f in fields}
    t = a.event_type
    if t == "model.requested":
        return "different prompt hash" if "prompt_hash" in paths else "different model request"
    if t == "model.responded":
        return "different tool calls" if paths == {"tool_calls"} else "different model output"
    if t == "tool.invoked":
        return "different tool arguments" if "arguments" in paths else "different tool call"
    if t == "tool.observed":
        return "different tool result"
    if t == "context.loaded":
        return "different context"
    return f"different {t} payload"


def diff_runs(
    a: Sequence[LedgerEvent | Rejected], b: Sequence[LedgerEvent | Rejected]
) -> DiffResult:
    """Align two runs step by step and find the first step where they diverge."""
    sa, sb = _steps(a), _steps(b)
    for i in range(max(len(sa), len(sb))):
        ea = sa[i] if i < len(sa) else None
        eb = sb[i] if i < len(sb) else None
        if ea is None or eb is None:
            ended = "A" if ea is None else "B"
            other = eb if ea is None else ea
            assert other is not None
            return DiffResult(
                steps_a=len(sa),
                steps_b=len(sb),
                common=i,
                divergence=Divergence(
                    step=i + 1,
                    a=ea,
                    b=eb,
                    reason=f"run {ended} ends here; the other goes on with {other.event_type}",
                    fields=[],
                ),
            )
        pa, pb = _strip(_payload(ea)), _strip(_payload(eb))
        if ea.event_type == eb.event_type and ea.agent_id == eb.agent_id and pa == pb:
            continue
        fields = field_differences(pa, pb, limit=8)
        if ea.agent_id != eb.agent_id:
            fields.insert(0, ("agent_id", ea.agent_id, eb.agent_id))
        if ea.event_type != eb.event_type:
            fields.insert(0, ("event_type", ea.event_type, eb.event_type))
        reason = _reason(ea, eb, fields)
        return DiffResult(
            steps_a=len(sa),
            steps_b=len(sb),
            common=i,
            divergence=Divergence(step=i + 1, a=ea, b=eb, reason=reason, fields=fields),
        )
    return DiffResult(steps_a=len(sa), steps_b=len(sb), common=len(sa), divergence=None)
