"""The payload types of the three framework backends on the ledger: LangGraph's checkpoints,
the OpenAI Agents SDK's sessions and Pydantic AI's harness step stores.

They are standard event types (registered in :mod:`ledger_cdc.events.catalogue`), so that every
reader, the consumer included, knows them without importing any framework; the integrations
(:mod:`ledger_cdc.integrations`) write them and :mod:`ledger_cdc.fold` folds their own
projections from them.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec

__all__ = [
    "Blob",
    "CheckpointSaved",
    "CheckpointsHidden",
    "HarnessRecord",
    "ItemPopped",
    "ItemsAdded",
    "ItemsCleared",
    "ThreadDeleted",
    "Typed",
    "Write",
    "WritesPut",
]

# -- LangGraph's checkpoints (ledger_cdc.integrations.langgraph writes them): standard types, so
# every reader (the consumer included) knows them without importing LangGraph; no reducer folds
# them (a session context counts them as ignored events).


class Typed(msgspec.Struct, array_like=True, frozen=True):
    """A value as ``serde.dumps_typed`` gives it: its type tag and its bytes (base64)."""

    type: str
    data: str

    @classmethod
    def of(cls, pair: tuple[str, bytes]) -> Typed:
        return cls(pair[0], base64.b64encode(pair[1]).decode("ascii"))

    def pair(self) -> tuple[str, bytes]:
        return self.type, base64.b64decode(self.data)


class Blob(msgspec.Struct, array_like=True, frozen=True):
    """A channel's value at a version; with ``base``, only the items appended to the list the
    channel held at version ``base`` (a growing message list is stored once, not per step)."""

    channel: str
    version: str
    value: Typed
    base: str | None = None


class CheckpointSaved(msgspec.Struct, frozen=True):
    thread_id: str
    ns: str
    checkpoint_id: str
    parent_id: str | None
    checkpoint: Typed  # without channel_values
    metadata: Typed
    blobs: list[Blob] = []


class Write(msgspec.Struct, array_like=True, frozen=True):
    idx: int
    channel: str
    value: Typed


class WritesPut(msgspec.Struct, frozen=True):
    thread_id: str
    ns: str
    checkpoint_id: str
    task_id: str
    task_path: str
    writes: list[Write]


class ThreadDeleted(msgspec.Struct, frozen=True):
    thread_id: str


class CheckpointsHidden(msgspec.Struct, frozen=True):
    """Checkpoints (namespace, id) the saver no longer shows: pruned, or of deleted runs."""

    thread_id: str
    checkpoints: list[tuple[str, str]]
    reason: str = ""


# -- OpenAI Agents SDK sessions (ledger_cdc.integrations.openai_agents writes them).


class ItemsAdded(msgspec.Struct, frozen=True):
    """One ``add_items`` call: its items, in order, as the SDK gives them (JSON objects)."""

    items: list[Any]


class ItemPopped(msgspec.Struct, frozen=True):
    """``pop_item``: the item it removed, named by the event that added it and its index."""

    added_at: int  # position of the items.added event
    index: int


class ItemsCleared(msgspec.Struct, frozen=True):
    """``clear_session``: the items before this event are no longer the session's."""

    reason: str = ""


# -- Pydantic AI harness step stores (ledger_cdc.integrations.pydantic_ai writes them): each
# carries the harness's record as JSON; tool effects also append the standard tool.* events.


class HarnessRecord(msgspec.Struct, frozen=True):
    """A run record, step event, snapshot or tool-effect record of the harness, as JSON."""

    record: dict[str, Any]
