"""The web view's pages as HTML text: pure functions of what the store read.

Every value from the ledger goes through :func:`h` (``html.escape``, quotes included) before it
is put in a page, and nothing is put in a script, a style or an event attribute: the pages
have none (the Content-Security-Policy forbids them anyway). Links are built from ids and
numbers the server parsed, their query strings by ``urllib.parse.urlencode``.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import uuid
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlencode

from ledger_cdc.admin.readable import SHORT, describe, framework_states
from ledger_cdc.events import LedgerEvent, Rejected, WritesPut
from ledger_cdc.fold.frameworks import graph_status, task_node
from ledger_cdc.ui.store import CHUNK, PAGE, SessionRow, TimelinePage

__all__ = [
    "CSS",
    "diff_page",
    "error_page",
    "event_page",
    "h",
    "health_page",
    "session_page",
    "sessions_page",
]


def h(value: object) -> str:
    """Text from the ledger, escaped for HTML (element text and quoted attributes alike)."""
    return html.escape(str(value), quote=True)


def _q(path: str, **params: object) -> str:
    query = urlencode({k: v for k, v in params.items() if v is not None})
    return h(f"{path}?{query}" if query else path)


CSS = """
:root { --fg: #1d2330; --dim: #6b7385; --bg: #fbfbfd; --line: #e3e6ee; --accent: #3456d1; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, sans-serif; color: var(--fg); background: var(--bg);
       margin: 0; }
header { background: #1d2330; color: #fff; padding: 10px 24px; display: flex; gap: 24px;
         align-items: center; }
header a { color: #c9d3ff; text-decoration: none; }
header .brand { font-weight: 700; color: #fff; }
header form { margin-left: auto; }
main { padding: 16px 24px; }
h1 { font-size: 20px; margin: 4px 0 12px; word-break: break-all; }
h2 { font-size: 16px; margin: 20px 0 8px; }
table { border-collapse: collapse; width: 100%; background: #fff; }
th, td { text-align: left; padding: 5px 8px; border-bottom: 1px solid var(--line);
         vertical-align: top; }
th { font-weight: 600; color: var(--dim); font-size: 12px; text-transform: uppercase; }
td.summary { font-family: ui-monospace, monospace; font-size: 12.5px; white-space: pre-wrap;
             word-break: break-word; }
td.num, td.time { font-family: ui-monospace, monospace; font-size: 12px; color: var(--dim);
                  white-space: nowrap; }
.badge { display: inline-block; padding: 0 6px; border-radius: 8px; font-size: 12px;
         font-weight: 600; background: #eef0f6; color: var(--fg); white-space: nowrap; }
.s-done, .s-completed { background: #e1f5e6; color: #176b2c; }
.s-failed, .s-quarantined { background: #fde4e4; color: #a11a1a; }
.s-interrupted, .s-interrupt, .s-running, .s-resuming, .s-in-flight { background: #fff3d6;
             color: #7a5200; }
.s-retry { background: #f3e5fb; color: #6d2a93; }
.s-handoff, .s-snapshot { background: #e2ecff; color: #20449e; }
tr.m-in-flight td { background: #fffaf0; }
tr.m-failed td, tr.m-quarantined td { background: #fff6f6; }
tr.m-interrupt td { background: #fffbe9; }
.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px;
         background: #fff; border: 1px solid var(--line); padding: 10px 14px; }
.facts dt { color: var(--dim); }
.facts dd { margin: 0; font-family: ui-monospace, monospace; font-size: 13px;
            word-break: break-word; }
.pager { margin: 10px 0; display: flex; gap: 16px; }
.note { color: var(--dim); }
pre { background: #fff; border: 1px solid var(--line); padding: 10px; white-space: pre-wrap;
      word-break: break-all; font-size: 12.5px; }
svg.lag { background: #fff; border: 1px solid var(--line); }
a { color: var(--accent); }
input[type=text] { padding: 3px 6px; width: 260px; }
"""


def _layout(title: str, body: str) -> str:
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>{h(title)} · ledger-cdc</title>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        "<meta name=referrer content=no-referrer>"
        '<link rel=stylesheet href="/style.css"></head><body>'
        '<header><a class=brand href="/">ledger-cdc</a><a href="/">sessions</a>'
        '<a href="/health">slot health</a>'
        '<form method=get action="/find"><input type=text name=q '
        'placeholder="session id, thread:ID, openai:ID, pydantic:ID" aria-label=find>'
        "</form></header>"
        f"<main>{body}</main></body></html>\n"
    )


def _badge(text: str, kind: str | None = None) -> str:
    cls = (kind or text).replace(" ", "-")
    return f'<span class="badge s-{h(cls)}">{h(text)}</span>'


def _when(t: dt.datetime | None) -> str:
    return "—" if t is None else h(t.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"))


def _name_of(fw: dict[str, Any]) -> str:
    lg = fw.get("langgraph") or {}
    if lg.get("thread"):
        return f"thread {lg['thread']}"
    pa = fw.get("pydantic_ai") or {}
    if pa.get("run_id"):
        return f"pydantic run {pa['run_id']}"
    if fw.get("openai_agents"):
        return "OpenAI Agents session"
    return ""


def _state_of(row: SessionRow) -> tuple[str, str]:
    """(what to show, its kind) for a session's status: a graph's state where it has one."""
    lg = row.framework.get("langgraph")
    st = graph_status(lg) if lg else None
    if st is not None:
        return f"graph {st.kind}", st.kind
    pa = row.framework.get("pydantic_ai")
    if pa:
        return f"run {pa['status']}", str(pa["status"])
    return row.status, row.status


def sessions_page(rows: Sequence[SessionRow], page: int, more: bool) -> str:
    out = ["<h1>Sessions</h1>"]
    if rows and not rows[0].projected:
        out.append(
            "<p class=note>No projections yet (is the consumer running?): sessions as the "
            "ledger holds them.</p>"
        )
    out.append(
        "<table><thead><tr><th>session</th><th>name</th><th>status</th><th>events</th>"
        "<th>agents</th><th>last activity (UTC)</th></tr></thead><tbody>"
    )
    for r in rows:
        text, kind = _state_of(r)
        out.append(
            f'<tr><td class=num><a href="/s/{r.session_id}">{r.session_id}</a></td>'
            f"<td>{h(_name_of(r.framework))}</td><td>{_badge(text, kind)}</td>"
            f"<td class=num>{r.events}</td><td>{h(', '.join(map(str, r.agents)))}</td>"
            f"<td class=time>{_when(r.updated_at)}</td></tr>"
        )
    out.append("</tbody></table>")
    if not rows:
        out.append("<p class=note>The ledger holds no session yet.</p>")
    out.append(_pager("/", page, more))
    return _layout("sessions", "".join(out))


def _pager(path: str, page: int, more: bool) -> str:
    links = []
    if page > 0:
        links.append(f'<a href="{_q(path, page=page - 1 or None)}">← newer</a>')
    if more:
        links.append(f'<a href="{_q(path, page=page + 1)}">older →</a>')
    return f"<div class=pager>{''.join(links)}</div>"


_HANDOFF = frozenset({"handoff.emitted", "handoff.received"})


def _mark(ev: LedgerEvent | Rejected, page: TimelinePage) -> str:
    if type(ev) is Rejected:
        return "quarantined"
    assert isinstance(ev, LedgerEvent)
    t = ev.event_type
    p = ev.payload
    if t == "tool.invoked" and hasattr(p, "call_id"):
        first = page.first_invoked.get(str(p.call_id))
        if first is not None and first < ev.seq:
            return "retry"
        if str(p.call_id) in page.pending_tools:
            return "in flight"
    if t == "tool.observed" and getattr(p, "error", None) is not None:
        return "failed"
    if t == "task.failed":
        return "failed"
    if t in _HANDOFF:
        return "handoff"
    if t == "pydantic.snapshot":
        return "snapshot"
    if isinstance(p, WritesPut):
        channels = {w.channel for w in p.writes}
        if "__interrupt__" in channels:
            return "interrupt"
        if "__error__" in channels:
            return "failed"
    return ""


def _agent(ev: LedgerEvent | Rejected) -> str:
    if type(ev) is LedgerEvent and isinstance(ev.payload, WritesPut):
        return f"{ev.agent_id}/{task_node(ev.payload.task_path, ev.payload.task_id)}"
    return ev.agent_id


def _facts(pairs: Iterable[tuple[str, str]]) -> str:
    return "<dl class=facts>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in pairs) + "</dl>"


def session_page(sid: uuid.UUID, page: TimelinePage, after: int) -> str:
    s = page.session
    title = _name_of(s.framework) if s else ""
    out = [f"<h1>{h(title) + ' · ' if title else ''}session {sid}</h1>"]
    facts: list[tuple[str, str]] = []
    if s is None:
        facts.append(("status", "no projection yet (the consumer has not folded this session)"))
    else:
        text, kind = _state_of(s)
        facts.append(("status", _badge(text, kind)))
        for line in framework_states({"agent_framework": s.framework}):
            facts.append(("framework", h(line)))
        facts.append(("events", f"{s.events} folded, position {s.last_position}"))
        facts.append(("agents", h(", ".join(map(str, s.agents))) or "—"))
        facts.append(("last activity", _when(s.updated_at)))
        if page.pending_tools:
            calls = ", ".join(
                f"{c} ({(p or {}).get('tool', '?')}, attempt {(p or {}).get('attempts', 1)})"
                for c, p in page.pending_tools.items()
            )
            facts.append(("in flight", _badge("in flight") + " " + h(calls)))
    if page.snapshots:
        facts.append(("snapshots", h(", ".join(f"at {p}" for p, _ in page.snapshots[:10]))))
    facts.append(("ledger head", f"position {page.head}"))
    out.append(_facts(facts))
    out.append(f'<p><a href="{_q("/diff", a=str(sid))}">compare with another session…</a></p>')
    out.append("<h2>Timeline</h2>" + _timeline_pager(sid, page, after))
    out.append(
        "<table><thead><tr><th>pos</th><th>seq</th><th>time (UTC)</th><th>agent</th>"
        "<th>type</th><th></th><th>what happened</th></tr></thead><tbody>"
    )
    snaps = {p for p, _ in page.snapshots}
    for ev in page.events:
        size = page.large.get(ev.position)
        if size is not None:
            summary = f"large payload ({size:,} bytes): open it to read it a page at a time"
            mark = ""
        else:
            summary = describe(ev, SHORT)
            mark = _mark(ev, page)
        when = (
            h(ev.created_at.astimezone(dt.timezone.utc).strftime("%H:%M:%S.%f")[:-3])
            if isinstance(ev, LedgerEvent)
            else "—"
        )
        badge = _badge(mark) if mark else ""
        if ev.position in snaps:
            badge += " " + _badge("snapshot")
        out.append(
            f'<tr class="m-{h(mark.replace(" ", "-"))}">'
            f'<td class=num><a href="/s/{sid}/e/{ev.position}">{ev.position}</a></td>'
            f"<td class=num>{ev.seq}</td><td class=time>{when}</td><td>{h(_agent(ev))}</td>"
            f"<td>{h(ev.event_type)}</td><td>{badge}</td>"
            f"<td class=summary>{h(summary)}</td></tr>"
        )
    out.append("</tbody></table>")
    if not page.events:
        out.append("<p class=note>No events on this page.</p>")
    out.append(_timeline_pager(sid, page, after))
    return _layout(f"session {sid}", "".join(out))


def _timeline_pager(sid: uuid.UUID, page: TimelinePage, after: int) -> str:
    path = f"/s/{sid}"
    links = []
    if after > 0:
        links.append(f'<a href="{_q(path)}">⇤ first</a>')
        links.append(f'<a href="{_q(path, after=max(after - PAGE, 0) or None)}">← earlier</a>')
    last = page.events[-1].position if page.events else after
    if last < page.head:
        links.append(f'<a href="{_q(path, after=last)}">later →</a>')
        links.append(f'<a href="{_q(path, last=1)}">last ⇥</a>')
    shown = f"positions {page.events[0].position}–{last} of {page.head}" if page.events else ""
    return f"<div class=pager><span class=note>{shown}</span>{''.join(links)}</div>"


def event_page(
    sid: uuid.UUID,
    position: int,
    event_type: str,
    size: int,
    offset: int,
    text: str,
    readable: str | None,
) -> str:
    out = [f'<h1>Event {position} of <a href="/s/{sid}">session {sid}</a></h1>']
    out.append(_facts([("type", h(event_type)), ("payload", f"{size:,} characters of JSON")]))
    if readable is not None:
        out.append(f"<h2>Decoded</h2><pre>{h(readable)}</pre>")
    end = offset + len(text)
    out.append(f"<h2>Payload (characters {offset:,}–{end:,})</h2><pre>{h(text)}</pre>")
    links = []
    if offset > 0:
        back = _q(f"/s/{sid}/e/{position}", offset=max(offset - CHUNK, 0))
        links.append(f'<a href="{back}">← previous part</a>')
    if end < size:
        links.append(f'<a href="{_q(f"/s/{sid}/e/{position}", offset=end)}">next part →</a>')
    out.append(f"<div class=pager>{''.join(links)}</div>")
    return _layout(f"event {position}", "".join(out))


def diff_page(
    a: str, b: str, result: list[tuple[str, str]] | None, lines: Sequence[tuple[str, str, str]]
) -> str:
    out = ["<h1>Compare two sessions</h1>"]
    out.append(
        '<form method=get action="/diff"><p>'
        f'<input type=text name=a value="{h(a)}" aria-label="session A"> '
        f'<input type=text name=b value="{h(b)}" aria-label="session B"> '
        "<button type=submit>compare</button></p></form>"
    )
    if result is not None:
        out.append(_facts((k, h(v)) for k, v in result))
    if lines:
        out.append("<table><thead><tr><th></th><th>A</th><th>B</th></tr></thead><tbody>")
        for label, va, vb in lines:
            out.append(
                f"<tr><td>{h(label)}</td><td class=summary>{h(va)}</td>"
                f"<td class=summary>{h(vb)}</td></tr>"
            )
        out.append("</tbody></table>")
    return _layout("diff", "".join(out))


_SLOT_KIND = {"healthy": "done", "warning": "running", "critical": "failed", "lost": "failed"}


def _sparkline(points: Sequence[tuple[float, float]], width: int = 600, height: int = 80) -> str:
    if not points:
        return "<p class=note>No samples yet.</p>"
    t0, t1 = points[0][0], max(points[-1][0], points[0][0] + 1)
    top = max(max(v for _, v in points), 1.0)
    coords = " ".join(
        f"{(t - t0) / (t1 - t0) * (width - 10) + 5:.1f},{height - 5 - v / top * (height - 10):.1f}"
        for t, v in points
    )
    return (
        f'<svg class=lag width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role=img aria-label="lag over the last hour">'
        f'<polyline fill=none stroke="#3456d1" stroke-width=2 points="{coords}"/></svg>'
        f"<p class=note>max {top:g} s over {len(points)} sample(s)</p>"
    )


def health_page(
    slots: Sequence[Any], samples: dict[str, list[tuple[float, float | None, int | None, str]]]
) -> str:
    out = ["<h1>Slot health</h1>"]
    if not slots:
        out.append("<p class=note>No logical replication slot in this database.</p>")
    for s in slots:
        out.append(f"<h2>{h(s.slot)} {_badge(s.status_name, _SLOT_KIND.get(s.status_name))}</h2>")
        out.append(
            _facts(
                [
                    ("active", h(s.active)),
                    ("lag", "—" if s.lag_seconds is None else f"{s.lag_seconds:.1f} s"),
                    (
                        "unfolded events",
                        h(s.unfolded_events if s.unfolded_events is not None else "—"),
                    ),
                    (
                        "WAL retained",
                        h(s.retained_bytes if s.retained_bytes is not None else "—") + " bytes",
                    ),
                    ("WAL status", h(s.wal_status or "—")),
                    ("confirmed flush", h(s.confirmed_flush_lsn or "—")),
                    ("reasons", h("; ".join(s.reasons) or "—")),
                ]
            )
        )
        points = [(t, lag) for t, lag, _, _ in samples.get(s.slot, []) if lag is not None]
        out.append("<h2>Lag (seconds), last hour</h2>" + _sparkline(points))
    return _layout("slot health", "".join(out))


def error_page(status: str, message: str) -> str:
    return _layout(status, f"<h1>{h(status)}</h1><p>{h(message)}</p>")


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)
