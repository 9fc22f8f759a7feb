"""The payload types of the three framework backends on the ledger: LangGraph's checkpoints,
the OpenAI Agents SDK's sessions and Pydantic AI's harness step stores.

They are standard event types (registered in :mod:`ledger_cdc.events.catalogue`), so that every
reader, the consumer included, knows them without importing any framework; the integrations
(:mod:`ledger_cdc.integrations`) write them and :mod:`ledger_cdc.fold` folds their own
projections from them.
"""

from __future__ import annotations

import base64
import threading
from typing import Any

import msgspec
import zstandard

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


ZSTD = "zstd:"  # a stored type tag so prefixed: the data is a Zstandard frame of the bytes
PACK_FROM = 2048  # bytes from which a value is stored compressed (when that makes it smaller)
MAX_UNPACKED = 256 << 20  # bytes a compressed value may give back (none larger is compressed)

_codecs = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_codecs, "d", None)
    if d is None:  # one a thread: a decompressor is not shared between threads
        d = _codecs.d = zstandard.ZstdDecompressor()
    return d


def _compressed(raw: bytes) -> bytes:
    c: zstandard.ZstdCompressor | None = getattr(_codecs, "c", None)
    if c is None:
        c = _codecs.c = zstandard.ZstdCompressor(level=3)
    return c.compress(raw)


def unpack(frame: bytes, limit: int = MAX_UNPACKED) -> bytes:
    """The bytes of a Zstandard frame, refused (ValueError) when it is malformed or says, or
    turns out, to hold more than ``limit`` bytes: never inflated past that."""
    try:
        size = zstandard.frame_content_size(frame)
        if size > limit:
            raise ValueError(f"a compressed value of {size} bytes, over the {limit} allowed")
        out = _decompressor().decompress(frame, max_output_size=limit if size < 0 else 0)
    except zstandard.ZstdError as e:
        raise ValueError(f"a compressed value that does not decompress: {e}") from None
    if len(out) > limit:
        raise ValueError(f"a compressed value of over {limit} bytes")
    return out


class Typed(msgspec.Struct, array_like=True, frozen=True):
    """A value as ``serde.dumps_typed`` gives it: its type tag and its bytes (base64). A tag
    that starts ``zstd:`` is the serializer's tag so prefixed, and the data a Zstandard frame of
    the bytes: a large value stored compressed (:meth:`packed`). :meth:`pair` gives back what
    the serializer gave either way."""

    type: str
    data: str

    @classmethod
    def of(cls, pair: tuple[str, bytes]) -> Typed:
        return cls._stored(pair, pack=False)

    @classmethod
    def packed(cls, pair: tuple[str, bytes]) -> Typed:
        """As :meth:`of`, compressed when the bytes are ``PACK_FROM`` or more (and at most
        ``MAX_UNPACKED``) and that makes them smaller: a read then moves, and the server
        detoasts and decodes, fewer bytes."""
        return cls._stored(pair, pack=True)

    @classmethod
    def _stored(cls, pair: tuple[str, bytes], *, pack: bool) -> Typed:
        t, raw = pair
        own = t.startswith(ZSTD)  # a serializer's own tag like ours: always stored compressed,
        if own or (pack and PACK_FROM <= len(raw) <= MAX_UNPACKED):  # so that none is misread
            frame = _compressed(raw)
            if own or len(frame) < len(raw) * 0.9:
                return cls(ZSTD + t, base64.b64encode(frame).decode("ascii"))
        return cls(t, base64.b64encode(raw).decode("ascii"))

    @property
    def serialisation(self) -> str:
        """The serializer's type tag (without the prefix of a compressed value)."""
        return self.type[len(ZSTD) :] if self.type.startswith(ZSTD) else self.type

    def pair(self) -> tuple[str, bytes]:
        """The serializer's type tag and bytes (ValueError: a compressed value that does not
        decompress, or would give back more than ``MAX_UNPACKED`` bytes)."""
        return self.serialisation, self.unpacked(base64.b64decode(self.data))

    def unpacked(self, data: bytes, limit: int = MAX_UNPACKED) -> bytes:
        """The value's bytes from its stored ones (``data``, base64 decoded), at most ``limit``
        of them when compressed (ValueError)."""
        return unpack(data, limit) if self.type.startswith(ZSTD) else data


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
