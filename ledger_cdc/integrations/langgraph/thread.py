"""A LangGraph thread as its ledger events fold: the saver's in-memory state of one thread, the
queries that fetch a thread's events (or every thread's), and what is derived from a folded
thread without the saver (the events that copy it, prune it, or hide a run's checkpoints).
Pure but for the SQL steps, which ``client.steps`` runs."""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from langgraph.checkpoint.serde.base import SerializerProtocol

from ledger_cdc.client.steps import Step, Steps
from ledger_cdc.errors import ConfigError
from ledger_cdc.events import (
    READ_MAX_DEPTH,
    Blob,
    CheckpointSaved,
    CheckpointsHidden,
    ThreadDeleted,
    Typed,
    Write,
    WritesPut,
    decode_bounded,
)

log = logging.getLogger(__name__)
LANGGRAPH_NAMESPACE = uuid.UUID("5f0e0c3a-8d1b-5a44-9a3e-6c6564676572")
AGENT = "langgraph"
FULL_EVERY = 32  # a full value at least every this many versions of a list channel
MISSING = object()


@functools.lru_cache(maxsize=4096)  # a name-based UUID: a hash each time otherwise
def thread_session(thread_id: str) -> uuid.UUID:
    """The ledger session of a LangGraph thread."""
    return uuid.uuid5(LANGGRAPH_NAMESPACE, str(thread_id))


_EVENTS: dict[str, type[msgspec.Struct]] = {
    "langgraph.checkpoint": CheckpointSaved,
    "langgraph.writes": WritesPut,
    "langgraph.thread.deleted": ThreadDeleted,
    "langgraph.checkpoints.hidden": CheckpointsHidden,
}
_decoders = {name: msgspec.json.Decoder(t) for name, t in _EVENTS.items()}

_THREAD = (
    "SELECT position, event_type, payload::text FROM agent_events "
    "WHERE session_id = %s AND position > %s AND event_type LIKE 'langgraph.%%' "
    "ORDER BY position"
)
_ALL = (
    "SELECT session_id, position, event_type, payload::text FROM agent_events "
    "WHERE event_type LIKE 'langgraph.%%' ORDER BY session_id, position"
)


def decode_event(thread_id: str, event_type: str, text: str) -> Any:
    """The event, or None for a type of a newer version (not this saver's to read) or a row that
    does not fit (as every reader does: one bad row, one nested deeper than the consumer reads
    too, is skipped)."""
    dec = _decoders.get(event_type)
    if dec is None:
        return None
    try:
        return decode_bounded(dec.decode, text, READ_MAX_DEPTH)
    except msgspec.DecodeError as e:
        log.warning(
            "thread %r: a %s event that does not fit, skipped: %s", thread_id, event_type, e
        )
        return None


@dataclass
class Thread:
    """One thread as its events fold (events before its last deletion are skipped)."""

    thread_id: str = ""
    position: int = 0  # the last position folded (a saver keeps threads and reads only what is new)
    # (ns, checkpoint id) → the latest checkpoint event for it
    checkpoints: dict[tuple[str, str], CheckpointSaved] = field(default_factory=dict)
    blobs: dict[tuple[str, str, str], Blob] = field(default_factory=dict)  # ns, channel, version
    # the blobs a deletion hid: only ever the base of a delta stored after it
    hidden: dict[tuple[str, str, str], Blob] = field(default_factory=dict)
    # (ns, checkpoint id) → (task id, index) → (task path, channel, value)
    writes: dict[tuple[str, str], dict[tuple[str, int], tuple[str, str, Typed]]] = field(
        default_factory=dict
    )

    def fold(self, event_type: str, text: str) -> None:
        ev = decode_event(self.thread_id, event_type, text)
        if isinstance(ev, ThreadDeleted):
            self.checkpoints.clear()
            self.hidden.update(self.blobs)
            self.blobs.clear()
            self.writes.clear()
        elif isinstance(ev, CheckpointSaved):
            self.thread_id = ev.thread_id
            self.checkpoints[(ev.ns, ev.checkpoint_id)] = ev
            for b in ev.blobs:
                self.blobs[(ev.ns, b.channel, b.version)] = b
        elif isinstance(ev, CheckpointsHidden):
            for ns, cid in ev.checkpoints:
                self.checkpoints.pop((ns, cid), None)
                self.writes.pop((ns, cid), None)
        elif isinstance(ev, WritesPut):
            self.thread_id = ev.thread_id
            table = self.writes.setdefault((ev.ns, ev.checkpoint_id), {})
            for w in ev.writes:
                key = (ev.task_id, w.idx)
                if w.idx >= 0 and key in table:
                    continue  # a regular write keeps its first value
                table[key] = (ev.task_path, w.channel, w.value)

    def base(self, key: tuple[str, str, str]) -> Blob | None:
        """The blob a delta names as its base: visible, or hidden by a deletion the delta's
        writer had not seen (it had the base's value in hand)."""
        return self.blobs.get(key) or self.hidden.get(key)

    def on_hidden(self, ns: str, blob: Blob) -> bool:
        """Whether a delta's chain of bases passes through a blob a deletion hid."""
        seen = 0
        while blob.base is not None and seen <= FULL_EVERY:
            key = (ns, blob.channel, blob.base)
            if key not in self.blobs:
                return key in self.hidden
            blob, seen = self.blobs[key], seen + 1
        return False

    def chain(self, ns: str, channel: str, version: str) -> list[Blob] | None:
        """The blobs of a channel's value at a version, newest first, down to a full value (a
        chain no longer than FULL_EVERY); None if one is missing. The version a checkpoint
        names is a visible one; a base may be hidden."""
        chain: list[Blob] = []
        v: str | None = version
        while v is not None:
            blob = self.base((ns, channel, v)) if chain else self.blobs.get((ns, channel, v))
            if blob is None or len(chain) > FULL_EVERY:
                return None
            chain.append(blob)
            v = blob.base
        return chain

    def fold_rows(self, rows: list[tuple[Any, ...]]) -> Thread:
        for position, event_type, text in rows:
            if position > self.position:  # in order, once (two readers may fetch the same)
                self.fold(event_type, text)
                self.position = position
        return self


def thread_steps(thread_id: str, after: int = 0) -> Steps[list[tuple[Any, ...]]]:
    """The thread's events after ``after``, in position order."""
    rows = yield Step(_THREAD, (thread_session(thread_id), after))
    return rows


def all_steps() -> Steps[list[Thread]]:
    """Every thread, folded."""
    rows = yield Step(_ALL, ())
    out: list[Thread] = []
    current: Any = None
    part: list[tuple[Any, ...]] = []
    for sid, position, event_type, text in rows:
        if sid != current and part:
            out.append(Thread().fold_rows(part))
            part = []
        current = sid
        part.append((position, event_type, text))
    if part:
        out.append(Thread().fold_rows(part))
    return [t for t in out if t.thread_id]


def hidden_for_runs(
    serde: SerializerProtocol, threads: list[Thread], run_ids: Sequence[str]
) -> list[tuple[str, CheckpointsHidden]]:
    """Per thread, the checkpoints whose metadata ``run_id`` is one of ``run_ids``."""
    wanted = set(run_ids)
    out = []
    for t in threads:
        hide = [
            key
            for key, cp in t.checkpoints.items()
            if serde.loads_typed(cp.metadata.pair()).get("run_id") in wanted
        ]
        if hide:
            out.append((t.thread_id, CheckpointsHidden(t.thread_id, hide, "runs deleted")))
    return out


def copied(t: Thread, target: str, whole: Callable[[str, Blob], Blob]) -> list[tuple[str, Any]]:
    """The events that give ``target`` the visible checkpoints and writes of ``t``; a delta on a
    base a deletion hid is copied whole (by ``whole``): the target holds no hidden values."""
    out: list[tuple[str, Any]] = []
    blobs_sent: set[str] = set()
    for (ns, cid), cp in sorted(t.checkpoints.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        versions_blobs = []
        if ns not in blobs_sent:  # a namespace's values travel once, with its first checkpoint
            blobs_sent.add(ns)
            versions_blobs = [
                whole(ns, b) if t.on_hidden(ns, b) else b
                for (bns, _, _), b in t.blobs.items()
                if bns == ns
            ]
        out.append(
            (
                "langgraph.checkpoint",
                CheckpointSaved(
                    target, ns, cid, cp.parent_id, cp.checkpoint, cp.metadata, versions_blobs
                ),
            )
        )
        by_task: dict[tuple[str, str], list[Write]] = {}
        for (task_id, idx), (path, ch, value) in t.writes.get((ns, cid), {}).items():
            by_task.setdefault((task_id, path), []).append(Write(idx, ch, value))
        for (task_id, path), writes in by_task.items():
            out.append(("langgraph.writes", WritesPut(target, ns, cid, task_id, path, writes)))
    return out


def pruned(t: Thread, strategy: str) -> CheckpointsHidden | None:
    """``keep_latest``: the event that hides all but the latest checkpoint of each namespace."""
    if strategy != "keep_latest":
        raise ConfigError(f"unknown prune strategy {strategy!r} (keep_latest or delete)")
    latest: dict[str, str] = {}
    for ns, cid in t.checkpoints:
        if cid > latest.get(ns, ""):
            latest[ns] = cid
    hide = [(ns, cid) for ns, cid in t.checkpoints if cid != latest[ns]]
    return CheckpointsHidden(t.thread_id, hide, "pruned") if hide else None
