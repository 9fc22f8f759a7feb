"""The sessions' contexts a fold works on: a bounded cache (:class:`SessionCache`), and
:class:`Contexts`, which asks the sink (the ``load`` callable: a query) for those the cache
lacks, a few hundred sessions at a time.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator

from ledger_cdc.fold import REFERENCE_MIN, SessionContext
from ledger_cdc.stream.assemble import Transaction
from ledger_cdc.stream.route import Item, session_of

__all__ = ["CONTEXT_FACTOR", "LOAD_AT_ONCE", "Contexts", "Loader", "SessionCache", "context_size"]

LOAD_AT_ONCE = 512  # sessions whose contexts are loaded by one query
CONTEXT_FACTOR = 3  # a decoded context's Python objects for each byte of its JSON (bench/memory.py)

# session ids → the projected context (and its estimated size) of each that has one
Loader = Callable[[list[uuid.UUID]], dict[uuid.UUID, tuple[SessionContext, int]]]


def context_size(ctx: SessionContext, stored: bytes | str) -> int:
    """Estimated bytes a context takes in memory, from its stored JSON (and the messages that
    leaves in their events: its window's, the long ones taken from events)."""
    w = ctx.window
    extra = 0 if w is None else w.chars + 48 * w.length
    extra += sum(s.chars for s in ctx.sources if s.chars >= REFERENCE_MIN)
    return CONTEXT_FACTOR * (len(stored) + extra)


class SessionCache:
    """Contexts by session, least recently used first, bounded by their estimated bytes
    (CONTEXT_FACTOR × their JSON: what the Python objects take)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0
        self._ctx: OrderedDict[uuid.UUID, SessionContext] = OrderedDict()
        self._size: dict[uuid.UUID, int] = {}

    def __len__(self) -> int:
        return len(self._ctx)

    def __contains__(self, sid: object) -> bool:
        return sid in self._ctx

    def get(self, sid: uuid.UUID) -> SessionContext | None:
        return self._ctx.get(sid)  # recency is marked once per batch (touch), not per event

    def touch(self, sid: uuid.UUID, size: int) -> None:
        """A session the batch changed: most recently used now, at its new size."""
        if sid in self._ctx:
            self._ctx.move_to_end(sid)
        self.resize(sid, size)

    def put(self, sid: uuid.UUID, ctx: SessionContext, size: int) -> None:
        self._ctx[sid] = ctx
        self._ctx.move_to_end(sid)
        self.resize(sid, size)

    def resize(self, sid: uuid.UUID, size: int) -> None:
        self.bytes += size - self._size.get(sid, 0)
        self._size[sid] = size

    def evict(self) -> None:
        while self.bytes > self.budget and len(self._ctx) > 1:
            sid, _ = self._ctx.popitem(last=False)
            self.bytes -= self._size.pop(sid, 0)

    def clear(self) -> None:
        self._ctx.clear()
        self._size.clear()
        self.bytes = 0


class Contexts:
    """The cache, filled from the sink: a session the cache lacks is loaded (its projected
    context, or a new one for a session without a projection, so that a session missing from
    the cache later was evicted, and is read back), up to ``at_once`` sessions by one call of
    ``load``. Counts the bytes it loaded, which the batch in hand then pins.

    With :attr:`projected` set (the sessions that had a projection when it was read, e.g. by
    a bootstrap), a session outside it starts from an empty context without a query the first
    time it is loaded; loaded again (evicted since), it is asked of the sink, which may hold
    what was written of it meanwhile."""

    def __init__(self, load: Loader, cache: SessionCache, at_once: int = LOAD_AT_ONCE) -> None:
        self.load_contexts = load
        self.cache = cache
        self.at_once = at_once
        self.loaded_bytes = 0  # contexts loaded since the caller last took the count
        self.projected: Container[uuid.UUID] | None = None
        self._started: set[uuid.UUID] = set()  # sessions outside projected, started empty

    def expect(self, projected: Container[uuid.UUID] | None) -> None:
        """Set :attr:`projected` (None: any session may have a projection)."""
        self.projected = projected
        self._started = set()

    def take_loaded(self) -> int:
        """Bytes of the contexts loaded since the last call."""
        n, self.loaded_bytes = self.loaded_bytes, 0
        return n

    def get(self, sid: uuid.UUID) -> SessionContext:
        """The session's context, read back if it was evicted since it was loaded (its
        projection has what it had)."""
        ctx = self.cache.get(sid)
        if ctx is None:
            self.load([sid])
            ctx = self.cache.get(sid)
            assert ctx is not None
        return ctx

    def uncached(self, items: Iterable[Item]) -> Iterator[uuid.UUID]:
        """The sessions of these changes whose contexts the cache lacks."""
        cache = self.cache
        for it in items:
            sid = session_of(it)
            if sid is not None and sid not in cache:
                yield sid

    def load_for(self, txns: list[Transaction[Item]], i: int) -> int:
        """Load the contexts that the transactions from ``i`` on need and the cache lacks, up to
        ``at_once`` sessions in one query; returns the index of the first transaction not
        covered."""
        missing: dict[uuid.UUID, None] = {}
        j = i
        while j < len(txns) and len(missing) < self.at_once:
            items = txns[j].items
            assert isinstance(items, list)
            missing.update(dict.fromkeys(self.uncached(items)))
            j += 1
        self.load(list(missing))
        return j

    def load_missing(self, items: Iterable[Item]) -> None:
        """Load, in one query, the contexts these changes need and the cache lacks."""
        self.load(list(dict.fromkeys(self.uncached(items))))

    def load(self, missing: list[uuid.UUID]) -> None:
        """Bring these sessions into the cache."""
        if missing:
            projected, started = self.projected, self._started
            ask = missing
            if projected is not None:
                ask = [sid for sid in missing if sid in projected or sid in started]
                started.update(missing)
            found = self.load_contexts(ask) if ask else {}
            for sid in missing:
                ctx, size = found.get(sid) or (SessionContext(sid), 0)
                self.cache.put(sid, ctx, size)
                self.loaded_bytes += size
