"""What the agent frameworks' events mean, read without importing the frameworks: LangGraph's
checkpoints and writes, OpenAI Agents session items, Pydantic AI harness records.

Two parts, both pure. :func:`decode_typed` reads a value as LangGraph's serializer
(``JsonPlusSerializer``) wrote it — msgpack whose extension types name a class and its fields —
into plain data: an object comes back as an :class:`Instance` (its module, class name and
fields), never imported or built, so reading a ledger runs no code a payload names; a
serialisation this reader does not know (``pickle``, an encrypted one) is :class:`Opaque`.
:func:`fold_framework` is the projection the built-in reducers register as ``agent_framework``:
per session, the state of the graph (step, source, the nodes that ran, what runs next, tasks
interrupted or failed with their values, resume values, pending sends), of the OpenAI Agents
session (items by role) or of the Pydantic AI run (steps by kind, snapshots, status). Its state
is small and bounded (values kept as previews); a payload it cannot read raises, so the event
is quarantined like any other a reducer refuses. :func:`graph_status` says in one line where a
graph is.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from ledger_cdc.events import (
    CheckpointSaved,
    CheckpointsHidden,
    HarnessRecord,
    ItemPopped,
    ItemsAdded,
    ItemsCleared,
    LedgerEvent,
    ThreadDeleted,
    Typed,
    WritesPut,
)

__all__ = [
    "FRAMEWORK_EVENTS",
    "FRAMEWORK_PROJECTION",
    "FRAMEWORK_VERSION",
    "MISSING",
    "NULL_TASK",
    "GraphState",
    "Instance",
    "Opaque",
    "checkpoint_meta",
    "decode_typed",
    "fold_framework",
    "graph_status",
    "item_view",
    "plain",
    "record_view",
    "render",
    "task_node",
]

FRAMEWORK_PROJECTION = "agent_framework"
"""The name of the projection (``context.extra[FRAMEWORK_PROJECTION]``)."""
FRAMEWORK_VERSION = "1"
"""Its version: change it whenever :func:`fold_framework`'s output changes."""
FRAMEWORK_EVENTS = frozenset(
    {
        "langgraph.checkpoint",
        "langgraph.writes",
        "langgraph.thread.deleted",
        "langgraph.checkpoints.hidden",
        "openai.items.added",
        "openai.item.popped",
        "openai.items.cleared",
        "pydantic.run.registered",
        "pydantic.step",
        "pydantic.snapshot",
        "pydantic.tool.effect",
    }
)
NULL_TASK = "00000000-0000-0000-0000-000000000000"
"""The task id LangGraph writes input, resume values and state updates under."""

PREVIEW = 200  # characters of a value the projection keeps
_MAX_NS = 16  # namespaces a thread's state keeps (the root and the latest subgraphs)
_MAX_TASKS = 64
_MAX_RECENT = 8  # checkpoints whose nodes' versions are kept (a fork names an older parent)
_MAX_TRIGGERS = 512
_MAX_EXT_DEPTH = 64
_MAX_UNPACKED = 64 << 20  # bytes a compressed value may give back to be shown


# -- values as LangGraph's serializer writes them -----------------------------------------------


@dataclass(frozen=True)
class Instance:
    """An object the serializer stored as its class and its fields: ``fields`` is a mapping
    (keyword arguments, a model's fields), a list (positional arguments) or one value."""

    module: str
    name: str
    fields: Any


@dataclass(frozen=True)
class Opaque:
    """A value in a serialisation this reader does not decode (``pickle``, an encrypted one)."""

    type: str
    size: int


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
"""A channel with no value (LangGraph's ``empty`` type)."""

# extension codes of langgraph.checkpoint.serde.jsonplus
_EXT_CLASS = frozenset({0, 1, 2, 3, 4, 5})  # (module, name, fields[, method])
_EXT_NUMPY = 6
_EXT_DELTA = 7


def _decoder() -> msgspec.msgpack.Decoder[Any]:
    depth = [0]

    def ext(code: int, data: memoryview) -> Any:
        depth[0] += 1
        try:
            if depth[0] > _MAX_EXT_DEPTH:
                raise ValueError(f"objects nested more than {_MAX_EXT_DEPTH} deep")
            inner = dec.decode(data)
        finally:
            depth[0] -= 1
        if code == _EXT_DELTA:
            return inner
        if code == _EXT_NUMPY and isinstance(inner, list) and len(inner) >= 2:
            return Instance("numpy", "ndarray", {"dtype": inner[0], "shape": inner[1]})
        if (
            code in _EXT_CLASS
            and isinstance(inner, list)
            and len(inner) >= 3
            and isinstance(inner[0], str)
            and isinstance(inner[1], str)
        ):
            return Instance(inner[0], inner[1], inner[2])
        return Instance("msgpack", f"ext{code}", inner)

    dec: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(ext_hook=ext)
    return dec


def decode_typed(value: Typed) -> Any:
    """A value as ``serde.dumps_typed`` gave it, as plain data (see the module docstring).

    Raises ValueError when the bytes are not what their type says (bad base64, msgpack or
    JSON, a compressed value that does not decompress or gives back over 64 MiB): a malformed
    payload, not one of another serialisation."""
    try:
        raw = base64.b64decode(value.data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"a {value.type!r} value that is not base64: {e}") from None
    raw = value.unpacked(raw, _MAX_UNPACKED)
    t = value.serialisation
    if t == "empty":
        return MISSING
    if t == "null":
        return None
    if t in ("bytes", "bytearray"):
        return raw
    try:
        if t == "msgpack":
            return _decoder().decode(raw)
        if t == "json":
            return json.loads(raw)
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"a {t!r} value that does not decode: {str(e)[:200]}") from None
    return Opaque(t, len(raw))


def plain(value: Any) -> Any:
    """JSON-able data of a decoded value: an :class:`Instance` as ``{"_type": name, …fields}``
    (fields that are not a mapping under ``"args"``)."""
    if isinstance(value, Instance):
        out: dict[str, Any] = {"_type": value.name}
        if isinstance(value.fields, Mapping):
            out.update((str(k), plain(v)) for k, v in value.fields.items())
        else:
            out["args"] = plain(value.fields)
        return out
    if isinstance(value, Opaque):
        return {"_type": "opaque", "serialisation": value.type, "bytes": value.size}
    if value is MISSING:
        return {"_type": "missing"}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"_type": "bytes", "bytes": len(value)}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)  # msgpack's timestamps and what else a decoder may hand back


def _empty(v: Any) -> bool:
    return v is None or v == "" or v is False or (isinstance(v, (dict, list, tuple)) and not v)


# fields of LangChain's messages that say nothing a reader looks for
_MESSAGE_NOISE = frozenset({"type", "additional_kwargs", "response_metadata", "example"})


def render(value: Any, limit: int | None = PREVIEW) -> str:
    """A decoded value as one readable line, Python-like (``AIMessage(content='hi')``), empty
    fields of objects left out; cut to ``limit`` characters (None: whole)."""
    parts: list[str] = []
    budget = [limit if limit is not None else math.inf]

    def put(s: str) -> bool:
        parts.append(s)
        budget[0] -= len(s)
        return budget[0] > 0

    def walk(v: Any) -> bool:
        if isinstance(v, Instance):
            if not put(f"{v.name}("):
                return False
            if isinstance(v.fields, Mapping):
                first = True
                for k, f in v.fields.items():
                    if _empty(f) or (k in _MESSAGE_NOISE and v.module.startswith("langchain")):
                        continue
                    if not put(("" if first else ", ") + f"{k}="):
                        return False
                    first = False
                    if not walk(f):
                        return False
            elif isinstance(v.fields, (list, tuple)):
                for i, f in enumerate(v.fields):
                    if (i and not put(", ")) or not walk(f):
                        return False
            elif not walk(v.fields):
                return False
            return put(")")
        if isinstance(v, Opaque):
            return put(f"<{v.type}: {v.size} bytes>")
        if v is MISSING:
            return put("<empty>")
        if isinstance(v, Mapping):
            if not put("{"):
                return False
            for i, (k, f) in enumerate(v.items()):
                if (i and not put(", ")) or not put(f"{k!r}: ") or not walk(f):
                    return False
            return put("}")
        if isinstance(v, (list, tuple)):
            if not put("["):
                return False
            for i, f in enumerate(v):
                if (i and not put(", ")) or not walk(f):
                    return False
            return put("]")
        if isinstance(v, (bytes, bytearray, memoryview)):
            return put(f"<{len(v)} bytes>")
        return put(repr(v))

    walk(value)
    text = "".join(parts)
    if limit is not None and len(text) > limit:
        return text[: max(limit - 1, 0)] + "…"
    return text


# -- LangGraph ----------------------------------------------------------------------------------

_PULL = "~__pregel_pull, "
_PUSH = "~__pregel_push, "
ERROR, INTERRUPT, RESUME, TASKS = "__error__", "__interrupt__", "__resume__", "__pregel_tasks"
_MAX_EARLY = 8  # checkpoints whose writes came first, kept until they come
_BOOKKEEPING = frozenset({"__interrupt__", "__input__"})  # versions_seen keys that are not nodes


def task_node(task_path: str, task_id: str) -> str:
    """The node a task ran, from its path (``~__pregel_pull, tools``); ``(input)`` for the
    null task LangGraph writes resume values and updates under."""
    if task_id == NULL_TASK:
        return "(input)"
    for prefix in (_PULL, _PUSH):
        if task_path.startswith(prefix):
            rest = task_path[len(prefix) :]
            name = rest.split(", ")[0] if prefix == _PULL else rest.rsplit(", ", 1)[-1]
            return name.strip("'\"() ") or task_path
    return task_path or task_id[:8]


def checkpoint_meta(p: CheckpointSaved) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint event's checkpoint (without channel values) and metadata, decoded; either
    may be ``{}`` when stored in a serialisation this reader does not decode."""
    out = []
    for t in (p.checkpoint, p.metadata):
        v = decode_typed(t)
        if isinstance(v, Opaque):
            v = {}
        if not isinstance(v, dict):
            raise ValueError(f"checkpoint {p.checkpoint_id!r}: a {type(v).__name__}, not a mapping")
        out.append(v)
    return out[0], out[1]


def _maxima(seen: Any) -> dict[str, str]:
    """Per node, the newest channel version it has seen (it grows when the node runs)."""
    out: dict[str, str] = {}
    if isinstance(seen, dict):
        for node, chans in seen.items():
            if str(node) in _BOOKKEEPING or not isinstance(chans, dict):
                continue
            out[str(node)] = max((str(v) for v in chans.values()), default="")
    return out


def _mapping(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _trigger_node(channel: str) -> str | None:
    if channel.startswith("branch:to:"):
        return channel[len("branch:to:") :]
    if channel == "__start__":
        return "__start__"
    return None


def _fold_checkpoint(lg: dict[str, Any], p: CheckpointSaved) -> None:
    cp, meta = checkpoint_meta(p)
    lg["thread"] = p.thread_id
    lg["checkpoints"] = lg.get("checkpoints", 0) + 1
    spaces: dict[str, Any] = lg.setdefault("ns", {})
    prev = spaces.pop(p.ns, None) or {}
    seen = _maxima(cp.get("versions_seen"))
    recent: list[list[Any]] = list(prev.get("recent", []))
    parent_seen = next((s for cid, s in recent if cid == p.parent_id), None)
    ran = (
        None
        if parent_seen is None and p.parent_id is not None
        else sorted(n for n, v in seen.items() if (parent_seen or {}).get(n) != v)
    )
    triggers: dict[str, list[Any]] = dict(prev.get("triggers", {}))
    for b in p.blobs:
        if _trigger_node(b.channel) is not None:
            triggers[b.channel] = [b.version, b.value.type != "empty"]
    if len(triggers) > _MAX_TRIGGERS:
        triggers = dict(sorted(triggers.items())[-_MAX_TRIGGERS:])
    versions = _mapping(cp.get("channel_versions"))
    raw_seen = _mapping(cp.get("versions_seen"))
    nxt = set()
    for ch, (version, live) in triggers.items():
        node = _trigger_node(ch)
        if node is None or not live or str(versions.get(ch, version)) != version:
            continue
        node_seen = raw_seen.get(node)
        if not isinstance(node_seen, dict) or str(node_seen.get(ch, "")) != version:
            nxt.add(node)
    recent = [[cid, s] for cid, s in recent if cid != p.checkpoint_id][-(_MAX_RECENT - 1) :]
    recent.append([p.checkpoint_id, seen])
    step = meta.get("step")
    spaces[p.ns] = {
        "id": p.checkpoint_id,
        "parent": p.parent_id,
        "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
        "source": str(meta["source"]) if meta.get("source") is not None else None,
        "ran": ran,
        "next": sorted(nxt),
        "recent": recent,
        "triggers": triggers,
        "tasks": {},
        "resume": [],
        "sends": 0,
    }
    # writes saved before their checkpoint (the saver's writes and checkpoints of one run are
    # appended by concurrent threads: their order in the ledger is not the graph's)
    early = lg.get("early", {}).pop(f"{p.ns}|{p.checkpoint_id}", None)
    if early is not None:
        space = spaces[p.ns]
        space["tasks"].update(early["tasks"])
        space["resume"] = early["resume"][:_MAX_TASKS]
        space["sends"] = early["sends"]
    if not lg.get("early"):
        lg.pop("early", None)
    _bound_namespaces(spaces)


def _bound_namespaces(spaces: dict[str, Any]) -> None:
    while len(spaces) > _MAX_NS:
        oldest = next(ns for ns in spaces if ns != "")
        del spaces[oldest]


def _fold_writes(lg: dict[str, Any], p: WritesPut) -> None:
    lg["thread"] = p.thread_id
    lg["writes"] = lg.get("writes", 0) + 1
    values = [(w.idx, w.channel, decode_typed(w.value)) for w in p.writes]  # (all, or nothing)
    space = lg.get("ns", {}).get(p.ns)
    if space is None or space["id"] != p.checkpoint_id:
        seen = space is not None and any(cid == p.checkpoint_id for cid, _ in space["recent"])
        if seen:
            return  # writes of a checkpoint the graph has moved past: history, not state
        # a checkpoint not folded yet: kept until it comes (a few, the latest)
        early: dict[str, Any] = lg.setdefault("early", {})
        key = f"{p.ns}|{p.checkpoint_id}"
        space = early.get(key) or {"tasks": {}, "resume": [], "sends": 0}
        early.pop(key, None)
        early[key] = space
        while len(early) > _MAX_EARLY:
            del early[next(iter(early))]
    node = task_node(p.task_path, p.task_id)
    if p.task_id == NULL_TASK:
        for _, ch, v in values:
            if ch == RESUME and len(space["resume"]) < _MAX_TASKS:
                space["resume"].append(render(v))
        return
    tasks: dict[str, Any] = space["tasks"]
    task = tasks.get(p.task_id) or {"node": node, "state": "", "interrupts": [], "error": None}
    for _, ch, v in values:
        if ch == INTERRUPT:
            task["state"] = "interrupted"
            items = v if isinstance(v, list) else [v]
            task["interrupts"] = [_interrupt_value(i) for i in items[:8]]
        elif ch == ERROR:
            task["state"], task["error"] = "failed", v if isinstance(v, str) else render(v)
        elif ch == TASKS:
            space["sends"] += 1
        elif ch == RESUME:
            pass  # the task's own record of the values it resumed with
        elif not ch.startswith("__"):
            task["state"], task["error"] = "done", None
    if p.task_id in tasks or len(tasks) < _MAX_TASKS:
        tasks[p.task_id] = task


def _interrupt_value(i: Any) -> str:
    if isinstance(i, Instance) and isinstance(i.fields, Mapping) and "value" in i.fields:
        return render(i.fields["value"])
    return render(i)


def _fold_langgraph(state: dict[str, Any], ev: LedgerEvent) -> None:
    lg: dict[str, Any] = state.setdefault("langgraph", {})
    p = ev.payload
    if isinstance(p, CheckpointSaved):
        _fold_checkpoint(lg, p)
    elif isinstance(p, WritesPut):
        _fold_writes(lg, p)
    elif isinstance(p, ThreadDeleted):
        lg["ns"] = {}
        lg["deleted"] = lg.get("deleted", 0) + 1
    elif isinstance(p, CheckpointsHidden):
        hidden = {(ns, cid) for ns, cid in p.checkpoints}
        spaces = lg.get("ns", {})
        for ns in [ns for ns, s in spaces.items() if (ns, s["id"]) in hidden]:
            del spaces[ns]  # its latest is hidden: what it shows next is not in this state
        lg["hidden"] = lg.get("hidden", 0) + len(hidden)


@dataclass(frozen=True)
class GraphState:
    """Where a graph is: ``kind`` is ``interrupted``, ``failed``, ``resuming``, ``running``
    (next nodes to run; nothing tells a graph still running from one whose worker stopped) or
    ``done``; ``text`` says it in one line."""

    kind: str
    text: str
    step: int | None
    node: str | None = None


def graph_status(lg: Mapping[str, Any], ns: str = "") -> GraphState | None:
    """The state of namespace ``ns`` of a thread folded by :func:`fold_framework` (its
    ``["langgraph"]`` part), or None if it has no checkpoint there."""
    space = (lg.get("ns") or {}).get(ns)
    if space is None:
        return None
    step = space.get("step")
    tasks = list((space.get("tasks") or {}).values())
    waiting = [t for t in tasks if t["state"] == "interrupted"]
    failed = [t for t in tasks if t["state"] == "failed"]
    if waiting and not space.get("resume"):
        t = waiting[0]
        what = "; ".join(t["interrupts"]) or "a resume value"
        return GraphState(
            "interrupted", f"interrupted at node {t['node']} waiting for {what}", step, t["node"]
        )
    if waiting:
        t = waiting[0]
        return GraphState(
            "resuming",
            f"resumed at node {t['node']} with {'; '.join(space['resume'])}: running",
            step,
            t["node"],
        )
    if failed:
        t = failed[0]
        return GraphState("failed", f"failed at node {t['node']}: {t['error']}", step, t["node"])
    nxt = list(space.get("next") or [])
    if nxt or space.get("sends"):
        sends = f" and {space['sends']} pending send(s)" if space.get("sends") else ""
        return GraphState("running", f"running: next {', '.join(nxt) or '—'}{sends}", step)
    return GraphState("done", "done", step)


def _text(v: Any) -> str:
    return v if isinstance(v, str) else render(v, None)


# -- OpenAI Agents ------------------------------------------------------------------------------

_WRAPPED = "ledger.item.base64"


def item_view(item: Any) -> tuple[str, str]:
    """An OpenAI Agents session item as (role or kind, its content in one line, whole)."""
    if isinstance(item, dict) and list(item) == [_WRAPPED] and isinstance(item[_WRAPPED], str):
        try:
            item = json.loads(base64.b64decode(item[_WRAPPED]).decode("utf-8", "surrogatepass"))
        except (ValueError, binascii.Error):
            return "item", render(item, None)
    if not isinstance(item, dict):
        return "item", render(item, None)
    kind = str(item.get("type") or "message")
    if kind == "message" or "role" in item:
        role = str(item.get("role") or "message")
        content = item.get("content")
        if isinstance(content, list):
            texts = [
                str(c.get("text") or c.get("refusal") or "")
                if isinstance(c, dict) and ("text" in c or "refusal" in c)
                else render(c, None)
                for c in content
            ]
            return role, " ".join(texts)
        return role, content if isinstance(content, str) else render(content, None)
    if kind == "function_call":
        return (
            "tool call",
            f"{item.get('name')}({item.get('arguments', '')}) · {item.get('call_id')}",
        )
    if kind == "function_call_output":
        out = item.get("output")
        return (
            "tool result",
            f"{item.get('call_id')} → {out if isinstance(out, str) else render(out, None)}",
        )
    if kind == "reasoning":
        summary = item.get("summary")
        texts = (
            [s.get("text", "") for s in summary if isinstance(s, dict)]
            if isinstance(summary, list)
            else []
        )
        return "reasoning", " ".join(texts) or "(no summary)"
    rest = {k: v for k, v in item.items() if k not in ("type", "id")}
    return kind.replace("_", " "), render(rest, None)


def _fold_openai(state: dict[str, Any], ev: LedgerEvent) -> None:
    oa: dict[str, Any] = state.setdefault(
        "openai_agents", {"items": 0, "added": 0, "popped": 0, "cleared": 0, "roles": {}}
    )
    p = ev.payload
    if isinstance(p, ItemsAdded):
        roles = oa["roles"]
        for it in p.items:
            role, _ = item_view(it)
            roles[role] = roles.get(role, 0) + 1
        oa["items"] += len(p.items)
        oa["added"] += len(p.items)
        if p.items:
            role, text = item_view(p.items[-1])
            oa["last"] = {"role": role, "text": text[:PREVIEW]}
    elif isinstance(p, ItemPopped):
        oa["items"] = max(oa["items"] - 1, 0)
        oa["popped"] += 1
    elif isinstance(p, ItemsCleared):
        oa["items"] = 0
        oa["cleared"] += 1


# -- Pydantic AI --------------------------------------------------------------------------------


def _message_parts(messages: Any) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for m in messages if isinstance(messages, list) else []:
        for part in m.get("parts", []) if isinstance(m, dict) else []:
            if not isinstance(part, dict):
                continue
            kind = str(part.get("part_kind", "part"))
            if kind == "tool-call":
                args = part.get("args")
                text = f"{part.get('tool_name')}({_text(args)})"
            elif kind == "tool-return":
                text = f"{part.get('tool_name')} → {render(part.get('content'), None)}"
            else:
                c = part.get("content")
                text = c if isinstance(c, str) else render(c, None)
            out.append((kind, text))
    return out


def record_view(event_type: str, record: Mapping[str, Any]) -> tuple[str, str]:
    """A Pydantic AI harness record as (kind, what it says in one line, whole)."""
    if event_type == "pydantic.run.registered":
        who = record.get("agent_name") or "agent"
        return "run", f"{who} · run {record.get('run_id')}" + (
            f" · parent {record['parent_run_id']}" if record.get("parent_run_id") else ""
        )
    if event_type == "pydantic.step":
        kind = str(record.get("kind", "step"))
        bits = [f"step {record.get('step_index')}"]
        if record.get("tool_name"):
            bits.append(f"{record['tool_name']} · {record.get('tool_call_id')}")
        if record.get("error"):
            bits.append(f"✗ {record['error']}")
        return kind.replace("_", " "), " · ".join(bits)
    if event_type == "pydantic.snapshot":
        parts = _message_parts(record.get("messages"))
        last = f" · last {parts[-1][0]}: {parts[-1][1]}" if parts else ""
        n = len(record.get("messages") or [])
        return (
            "snapshot",
            f"{record.get('state')} at step {record.get('step_index')} · {n} message(s){last}",
        )
    if event_type == "pydantic.tool.effect":
        return "tool effect", (
            f"{record.get('tool_name')} {record.get('status')} · {record.get('tool_call_id')}"
            + (f" · {record['effect_summary']}" if record.get("effect_summary") else "")
        )
    return event_type, render(dict(record), None)


_RUN_END = {"run_completed": "completed", "run_failed": "failed", "run_started": "running"}


def _fold_pydantic(state: dict[str, Any], ev: LedgerEvent) -> None:
    pa: dict[str, Any] = state.setdefault(
        "pydantic_ai", {"status": "registered", "steps": 0, "kinds": {}, "snapshots": 0}
    )
    p = ev.payload
    if not isinstance(p, HarnessRecord):
        return
    r = p.record
    if ev.event_type == "pydantic.run.registered":
        pa["run_id"] = str(r.get("run_id"))
        if r.get("agent_name") is not None:
            pa["agent"] = str(r["agent_name"])
    elif ev.event_type == "pydantic.step":
        kind = str(r.get("kind"))
        pa["steps"] += 1
        pa["kinds"][kind] = pa["kinds"].get(kind, 0) + 1
        pa["status"] = _RUN_END.get(kind, pa["status"])
        if kind == "run_failed" and r.get("error") is not None:
            pa["error"] = str(r["error"])[:PREVIEW]
    elif ev.event_type == "pydantic.snapshot":
        pa["snapshots"] += 1
        step = r.get("step_index")
        pa["last_snapshot"] = {
            "state": str(r.get("state")),
            "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
            "messages": len(r["messages"]) if isinstance(r.get("messages"), list) else 0,
        }


# -- the projection -----------------------------------------------------------------------------

_FOLDS: dict[str, Callable[[dict[str, Any], LedgerEvent], None]] = {
    **dict.fromkeys(
        (
            "langgraph.checkpoint",
            "langgraph.writes",
            "langgraph.thread.deleted",
            "langgraph.checkpoints.hidden",
        ),
        _fold_langgraph,
    ),
    **dict.fromkeys(
        ("openai.items.added", "openai.item.popped", "openai.items.cleared"), _fold_openai
    ),
    **dict.fromkeys(
        ("pydantic.run.registered", "pydantic.step", "pydantic.snapshot", "pydantic.tool.effect"),
        _fold_pydantic,
    ),
}
_copy_enc = msgspec.json.Encoder()
_copy_dec = msgspec.json.Decoder()


def fold_framework(state: Any, ev: LedgerEvent) -> dict[str, Any]:
    """The ``agent_framework`` projection: ``state`` and one framework event → the new state
    (a new object: ``state`` is not touched, so an event that raises leaves nothing behind)."""
    fn = _FOLDS.get(ev.event_type)
    new: dict[str, Any] = (
        _copy_dec.decode(_copy_enc.encode(state)) if isinstance(state, dict) else {}
    )
    if fn is not None and not isinstance(ev.payload, dict):
        fn(new, ev)
        new["events"] = new.get("events", 0) + 1
    return new
