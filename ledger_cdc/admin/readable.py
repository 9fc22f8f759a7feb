"""Framework sessions read as stories: what ``inspect``, ``tail``, ``replay``, ``diff`` and the
web view say about LangGraph checkpoints and writes, OpenAI Agents items and Pydantic AI steps.

Pure functions over events (no I/O), on top of :mod:`ledger_cdc.admin.timeline` (whose pairing
of calls and marks they keep) and :mod:`ledger_cdc.fold.frameworks` (whose decoding and
projection they use, so what a timeline says a graph did is what the fold folded). Values are
cut to ``limit`` characters (None: whole). :func:`diff_threads` compares two LangGraph threads
checkpoint by checkpoint on their decoded channel values, ids and times left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ledger_cdc.admin.timeline import TimelineRow, field_differences, summarise, timeline
from ledger_cdc.events import (
    Blob,
    CheckpointSaved,
    CheckpointsHidden,
    HarnessRecord,
    ItemPopped,
    ItemsAdded,
    ItemsCleared,
    LedgerEvent,
    Rejected,
    ThreadDeleted,
    WritesPut,
)
from ledger_cdc.fold.frameworks import (
    FRAMEWORK_EVENTS,
    MISSING,
    NULL_TASK,
    GraphState,
    checkpoint_meta,
    decode_typed,
    fold_framework,
    graph_status,
    item_view,
    plain,
    record_view,
    render,
    task_node,
)

__all__ = [
    "SHORT",
    "ThreadDiff",
    "describe",
    "diff_threads",
    "framework_states",
    "is_thread",
    "readable_timeline",
]

SHORT = 120
"""Characters of a value a one-line summary shows (``--full``: all)."""


def _cut(text: str, limit: int | None) -> str:
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def _channel_writes(pairs: Iterable[tuple[str, Any]], limit: int | None, appended: set[str]) -> str:
    out, routes = [], []
    for ch, v in pairs:
        if ch.startswith("branch:to:"):
            routes.append(ch[len("branch:to:") :])
        elif v is not MISSING and not ch.startswith("__"):
            out.append(f"{ch}{'+=' if ch in appended else '='}{render(v, limit)}")
    text = ", ".join(out)
    if routes:
        text += (" " if text else "") + "→ " + ", ".join(sorted(routes))
    return text


def _checkpoint_line(p: CheckpointSaved, space: Mapping[str, Any] | None, limit: int | None) -> str:
    cp, meta = checkpoint_meta(p)
    step, source = meta.get("step"), meta.get("source")
    bits = [f"step {step}" + (f" ({source})" if source else "")]
    if p.ns:
        bits.append(f"ns {p.ns}")
    if space is not None and space.get("ran"):
        bits.append("ran " + ", ".join(space["ran"]))
    updated = cp.get("updated_channels")
    names = set(updated) if isinstance(updated, list) else {b.channel for b in p.blobs}
    blobs = [b for b in p.blobs if b.channel in names or source == "input"]
    values = [(b.channel, decode_typed(b.value)) for b in blobs]
    if source == "input":
        start = next((v for ch, v in values if ch == "__start__"), None)
        if start is not None:
            bits.append(f"input {render(start, limit)}")
    wrote = _channel_writes(values, limit, {b.channel for b in blobs if b.base is not None})
    if wrote and source != "input":
        bits.append(("state " if source == "update" else "") + wrote)
    if space is not None:
        bits.append("next " + (", ".join(space["next"]) if space.get("next") else "—"))
    if p.parent_id:
        bits.append(f"parent …{p.parent_id[-12:]}")
    return " · ".join(bits)


def _writes_line(p: WritesPut, limit: int | None) -> tuple[str, str]:
    """(node, what the task wrote)."""
    node = task_node(p.task_path, p.task_id)
    values = [(w.channel, decode_typed(w.value)) for w in p.writes]
    bits = []
    for ch, v in values:
        if ch == "__interrupt__":
            items = v if isinstance(v, list) else [v]
            shown = [
                render(i.fields.get("value"), limit)
                if hasattr(i, "fields") and isinstance(i.fields, Mapping)
                else render(i, limit)
                for i in items
            ]
            bits.append("interrupt: " + "; ".join(shown))
        elif ch == "__error__":
            bits.append("✗ " + (_cut(v, limit) if isinstance(v, str) else render(v, limit)))
        elif ch == "__resume__":
            bits.append(
                ("resume: " if p.task_id == NULL_TASK else "resumed with ") + render(v, limit)
            )
        elif ch == "__pregel_tasks":
            bits.append("send " + render(v, limit))
    regular = _channel_writes(
        ((ch, v) for ch, v in values if not ch.startswith("__")), limit, set()
    )
    if regular:
        bits.append(("wrote " if p.task_id != NULL_TASK else "update ") + regular)
    return node, " · ".join(bits) or "(no writes)"


def describe(ev: LedgerEvent | Rejected, limit: int | None = SHORT, space: Any = None) -> str:
    """One line saying what an event did, framework events decoded; ``space`` is the
    LangGraph namespace state after it (from :func:`fold_framework`), for a checkpoint's
    nodes that ran and next. A framework payload that does not decode says so (the fold
    quarantines it)."""
    if type(ev) is Rejected or ev.event_type not in FRAMEWORK_EVENTS:
        return summarise(ev)
    assert isinstance(ev, LedgerEvent)
    try:
        return _describe(ev, limit, space)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        return f"unreadable: {_cut(str(e), 160)}"


def _describe(ev: LedgerEvent, limit: int | None, space: Any) -> str:
    p = ev.payload
    if isinstance(p, CheckpointSaved):
        return _checkpoint_line(p, space, limit)
    if isinstance(p, WritesPut):
        node, text = _writes_line(p, limit)
        return f"{node} {text}"
    if isinstance(p, ThreadDeleted):
        return f"thread {p.thread_id!r} deleted (its earlier checkpoints hidden)"
    if isinstance(p, CheckpointsHidden):
        return f"{len(p.checkpoints)} checkpoint(s) hidden" + (f": {p.reason}" if p.reason else "")
    if isinstance(p, ItemsAdded):
        shown = [f"{role}: {_cut(text, limit)}" for role, text in map(item_view, p.items)]
        return f"{len(p.items)} item(s) · " + " · ".join(shown)
    if isinstance(p, ItemPopped):
        return f"popped item {p.index} of position {p.added_at}"
    if isinstance(p, ItemsCleared):
        return "session cleared" + (f": {p.reason}" if p.reason else "")
    if isinstance(p, HarnessRecord):
        kind, text = record_view(ev.event_type, p.record)
        return f"{kind} · {_cut(text, limit)}"
    return summarise(ev)


def _agent(ev: LedgerEvent | Rejected) -> str:
    """The agent column: a LangGraph write shows its node."""
    if type(ev) is LedgerEvent and isinstance(ev.payload, WritesPut):
        return f"{ev.agent_id}/{task_node(ev.payload.task_path, ev.payload.task_id)}"
    return ev.agent_id


def readable_timeline(
    items: Sequence[LedgerEvent | Rejected], limit: int | None = SHORT, ns: str | None = None
) -> list[TimelineRow]:
    """:func:`~ledger_cdc.admin.timeline.timeline` with framework events described (LangGraph
    checkpoints with the nodes that ran and next, as the fold folds them); with ``ns``, only
    the LangGraph events of that checkpoint namespace (and every other event)."""
    rows = timeline(items)
    state: Any = {}
    out = []
    for item, row in zip(items, rows, strict=True):
        if type(item) is LedgerEvent and item.event_type in FRAMEWORK_EVENTS:
            try:
                state = fold_framework(state, item)
            except Exception as e:
                if isinstance(e, MemoryError):
                    raise
                out.append(
                    dataclasses.replace(
                        row, summary=f"quarantined: {_cut(str(e), 160)}", mark="quarantined"
                    )
                )
                continue
            p = item.payload
            this_ns = getattr(p, "ns", None)
            if ns is not None and this_ns is not None and this_ns != ns:
                continue
            space = (state.get("langgraph") or {}).get("ns", {}).get(this_ns)
            mark = row.mark
            if isinstance(p, WritesPut) and any(w.channel == "__interrupt__" for w in p.writes):
                mark = "interrupt"
            elif isinstance(p, WritesPut) and any(w.channel == "__error__" for w in p.writes):
                mark = "failed"
            row = dataclasses.replace(
                row,
                agent_id=_agent(item),
                summary=describe(item, limit, space if isinstance(p, CheckpointSaved) else None),
                mark=mark,
            )
        out.append(row)
    return out


def framework_states(extra: Mapping[str, Any], ns: str = "") -> list[str]:
    """Lines saying where a session's framework is, from its folded context's ``extra``."""
    fw = extra.get("agent_framework") or {}
    lines = []
    lg = fw.get("langgraph")
    if lg:
        root = graph_status(lg, ns)
        if root is not None:
            lines.append(
                f"graph {root.text}" + ("" if root.step is None else f" (step {root.step})")
            )
        for other in sorted(n for n in lg.get("ns", {}) if n != ns):
            st = graph_status(lg, other)
            if st is not None:
                lines.append(f"  ns {other}: {st.text}")
        lines.append(
            f"thread {lg.get('thread')!r}: {lg.get('checkpoints', 0)} checkpoint(s), "
            f"{lg.get('writes', 0)} write(s)"
            + (f", deleted {lg['deleted']} time(s)" if lg.get("deleted") else "")
        )
    oa = fw.get("openai_agents")
    if oa:
        roles = ", ".join(f"{n} {r}" for r, n in sorted(oa["roles"].items()))
        last = oa.get("last")
        lines.append(
            f"OpenAI Agents session: {oa['items']} item(s) ({roles})"
            + (f"; last {last['role']}: {last['text']}" if last else "")
        )
    pa = fw.get("pydantic_ai")
    if pa:
        snap = pa.get("last_snapshot")
        lines.append(
            f"Pydantic AI run {pa.get('run_id', '')} {pa['status']}: {pa['steps']} step(s), "
            f"{pa['snapshots']} snapshot(s)"
            + (f"; last snapshot {snap['state']} at step {snap['step']}" if snap else "")
            + (f"; error {pa['error']}" if pa.get("error") else "")
        )
    return lines


def graph_of(extra: Mapping[str, Any], ns: str = "") -> GraphState | None:
    lg = (extra.get("agent_framework") or {}).get("langgraph")
    return None if not lg else graph_status(lg, ns)


def is_thread(items: Sequence[LedgerEvent | Rejected]) -> bool:
    return any(type(e) is LedgerEvent and e.event_type == "langgraph.checkpoint" for e in items)


# -- diff of two threads ------------------------------------------------------------------------

# what differs between two runs of one graph even when they behave the same
_IDS = frozenset(
    {"id", "ts", "run_id", "tool_call_id", "call_id", "created_at", "timestamp", "checkpoint_id"}
)


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _IDS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _mapping(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


@dataclass(frozen=True)
class _Step:
    step: int | None
    ran: list[str]
    values: dict[str, Any]  # channel → plain value (ids and times left out)
    position: int
    seq: int


def _lineage(items: Sequence[LedgerEvent | Rejected], ns: str) -> list[_Step]:
    """The checkpoints leading to the thread's latest in ``ns``, oldest first, with the full
    value of each channel at each (a delta's base chain applied)."""
    cps: dict[str, tuple[LedgerEvent, CheckpointSaved]] = {}
    blobs: dict[tuple[str, str], Blob] = {}
    for ev in items:
        if type(ev) is not LedgerEvent:
            continue
        p = ev.payload
        if isinstance(p, ThreadDeleted):
            cps.clear()
            blobs.clear()
        elif isinstance(p, CheckpointSaved) and p.ns == ns:
            cps[p.checkpoint_id] = (ev, p)
            for b in p.blobs:
                blobs[(b.channel, b.version)] = b
    if not cps:
        return []
    chain: list[tuple[LedgerEvent, CheckpointSaved]] = []
    cid: str | None = max(cps)
    while cid is not None and cid in cps and len(chain) <= len(cps):
        chain.append(cps[cid])
        cid = cps[cid][1].parent_id
    chain.reverse()
    cache: dict[tuple[str, str], Any] = {}

    def value(channel: str, version: str, depth: int = 0) -> Any:
        key = (channel, version)
        if key in cache:
            return cache[key]
        b = blobs.get(key)
        if b is None or depth > 64:
            return MISSING
        v = decode_typed(b.value)
        if b.base is not None:
            base = value(channel, b.base, depth + 1)
            v = (list(base) if isinstance(base, list) else []) + (
                list(v) if isinstance(v, list) else [v]
            )
        cache[key] = v
        return v

    out = []
    prev_seen: dict[str, Any] = {}
    for ev, p in chain:
        cp, meta = checkpoint_meta(p)
        seen = _mapping(cp.get("versions_seen"))
        ran = sorted(
            str(n)
            for n, v in seen.items()
            if n not in ("__interrupt__", "__input__") and prev_seen.get(n) != v
        )
        prev_seen = dict(seen)
        versions = _mapping(cp.get("channel_versions"))
        values = {}
        for ch, ver in sorted(versions.items()):
            if str(ch).startswith("branch:to:"):
                continue
            v = value(str(ch), str(ver))
            if v is not MISSING:
                values[str(ch)] = _strip(plain(v))
        step = meta.get("step")
        out.append(_Step(step if isinstance(step, int) else None, ran, values, ev.position, ev.seq))
    return out


@dataclass(frozen=True, kw_only=True)
class ThreadDiff:
    """Where two threads part: ``step`` (None: they do not), the ``channel`` that differs there
    (``nodes`` when different nodes ran), both values, and their checkpoints' positions."""

    steps_a: int
    steps_b: int
    common: int
    step: int | None
    channel: str | None
    reason: str
    a: Any = None
    b: Any = None
    position_a: int | None = None
    position_b: int | None = None
    fields: tuple[tuple[str, Any, Any], ...] = ()


def diff_threads(
    a: Sequence[LedgerEvent | Rejected], b: Sequence[LedgerEvent | Rejected], ns: str = ""
) -> ThreadDiff:
    """Compare two LangGraph threads step by step (the checkpoints leading to each one's
    latest): the nodes that ran, then each channel's decoded value, ids and times left out."""
    la, lb = _lineage(a, ns), _lineage(b, ns)
    for i in range(max(len(la), len(lb))):
        sa = la[i] if i < len(la) else None
        sb = lb[i] if i < len(lb) else None
        if sa is None or sb is None:
            ended, other = ("A", sb) if sa is None else ("B", sa)
            assert other is not None
            return ThreadDiff(
                steps_a=len(la),
                steps_b=len(lb),
                common=i,
                step=other.step,
                channel=None,
                reason=f"thread {ended} ends before step {other.step}; the other goes on"
                + (f" (ran {', '.join(other.ran)})" if other.ran else ""),
                position_a=None if sa is None else sa.position,
                position_b=None if sb is None else sb.position,
            )
        if sa.ran != sb.ran:
            return ThreadDiff(
                steps_a=len(la),
                steps_b=len(lb),
                common=i,
                step=sa.step,
                channel="nodes",
                reason=f"different nodes ran at step {sa.step}",
                a=", ".join(sa.ran) or "—",
                b=", ".join(sb.ran) or "—",
                position_a=sa.position,
                position_b=sb.position,
            )
        for ch in sorted(set(sa.values) | set(sb.values)):
            va, vb = sa.values.get(ch, MISSING), sb.values.get(ch, MISSING)
            if va == vb:
                continue
            shown_a = "(no value)" if va is MISSING else va
            shown_b = "(no value)" if vb is MISSING else vb
            return ThreadDiff(
                steps_a=len(la),
                steps_b=len(lb),
                common=i,
                step=sa.step,
                channel=ch,
                reason=f"channel {ch} differs at step {sa.step}",
                a=shown_a,
                b=shown_b,
                position_a=sa.position,
                position_b=sb.position,
                fields=tuple(field_differences(shown_a, shown_b, ch, limit=8)),
            )
    return ThreadDiff(
        steps_a=len(la), steps_b=len(lb), common=len(la), step=None, channel=None, reason="same"
    )
