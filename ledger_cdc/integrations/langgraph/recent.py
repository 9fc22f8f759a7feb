"""One checkpoint read from the recent events of its thread: what a saver that never folded the
thread (a process resuming after a crash) reads, instead of the thread's whole history.

``ledger_langgraph_checkpoint`` (sql/functions/langgraph.sql) walks the thread back from its
head: a first call finds the checkpoint (the newest put, or the one asked for), a second fetches
its pending writes and the blobs of the versions it names, down to the full value of each delta.
The saver stores every channel's full value at least once every ``FULL_EVERY`` checkpoints of a
namespace, so the walk is short. What the two calls give is folded as the whole thread would be,
for that checkpoint; when they cannot answer for it as the whole thread would (a version not
found before the walk stopped, a delta whose base a deletion hid, a checkpoint written before
LangGraph's format 4) the answer is None and the saver reads the whole thread.
"""

from __future__ import annotations

from typing import Any

import msgspec
from langgraph.checkpoint.serde.base import SerializerProtocol

from ledger_cdc.client.steps import Step, Steps
from ledger_cdc.events import Blob, CheckpointSaved, Typed
from ledger_cdc.integrations.langgraph.thread import Thread, thread_session

_CHECKPOINT = (
    "SELECT event_position, event_type, payload, data "
    "FROM ledger_langgraph_checkpoint(%s, %s, %s, %s::text[], %s::text[])"
)
_NEWER = (
    "SELECT 1 FROM agent_events WHERE session_id = %s AND position > %s "
    "AND event_type LIKE 'langgraph.%%' LIMIT 1"
)
_blob_head = msgspec.json.Decoder(tuple[str, str, str, str | None])


class _Bytes(Typed, frozen=True):
    """A value as the function gives it: its bytes, decoded from base64 by the server."""

    raw: bytes = b""

    def pair(self) -> tuple[str, bytes]:
        return self.serialisation, self.unpacked(self.raw)


def _position(row: tuple[Any, ...]) -> int:
    return -1 if row[0] is None else int(row[0])


def _folded(thread_id: str, ns: str, rows: list[tuple[Any, ...]]) -> tuple[Thread, bool, int]:
    """What the rows give, folded; whether the walk read the thread back to its start; and the
    position it started from."""
    t = Thread(thread_id=thread_id)
    whole, head = False, 0
    for position, event_type, payload, data in sorted(rows, key=_position):  # writes in order
        if event_type == "blob":
            channel, version, kind, base = _blob_head.decode(payload)
            t.blobs[(ns, channel, version)] = Blob(channel, version, _Bytes(kind, "", data), base)
        elif event_type == "langgraph.window":
            whole, head = payload == "whole", position or 0
        else:
            t.fold(event_type, payload)
    return t, whole, head


def _versions(serde: SerializerProtocol, cp: CheckpointSaved) -> dict[str, str] | None:
    """The versions a checkpoint names; None if its body cannot be read back (the whole
    thread's read tells what) or was written before LangGraph's format 4 (its pending sends
    are its parent's writes)."""
    try:
        checkpoint: Any = serde.loads_typed(cp.checkpoint.pair())
    except Exception:  # whatever a serializer raises
        return None
    if not isinstance(checkpoint, dict) or checkpoint.get("v", 4) < 4:
        return None
    return {str(k): str(v) for k, v in (checkpoint.get("channel_versions") or {}).items()}


def recent_steps(
    serde: SerializerProtocol, thread_id: str, ns: str, checkpoint_id: str | None
) -> Steps[tuple[Thread | None, int]]:
    """A thread holding the checkpoint (if the thread has it), its pending writes and the values
    it names, or None when the recent events do not answer for it; and the position of the
    thread's last LangGraph event then (an answer holds until one comes after it)."""
    sid = thread_session(thread_id)
    rows = yield Step(_CHECKPOINT, (sid, ns, checkpoint_id, None, None), binary=True)
    for attempt in range(2):  # the versions guessed, then those the checkpoint names
        t, whole, head = _folded(thread_id, ns, rows)
        if not t.checkpoints:  # none visible; or one that does not fit, or hidden since
            met = any(r[1] == "langgraph.checkpoint" for r in rows)
            return (t if attempt == 0 and not met else None), head
        cp = next(iter(t.checkpoints.values()))
        versions = _versions(serde, cp)
        if versions is None:
            return None, head
        if whole or all(t.chain(ns, ch, v) is not None for ch, v in versions.items()):
            return t, head
        params = (sid, ns, cp.checkpoint_id, list(versions), list(versions.values()))
        rows = yield Step(_CHECKPOINT, params, binary=True)
    return None, head


def newer_steps(thread_id: str, head: int) -> Steps[bool]:
    """Whether the thread has a LangGraph event after ``head``."""
    rows = yield Step(_NEWER, (thread_session(thread_id), head))
    return bool(rows)
