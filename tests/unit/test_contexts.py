"""The contexts a fold works on (batching.Contexts): with the sessions that had a projection
given (a bootstrap knows them), any other starts empty without a query the first time, and is
asked of the sink when it is loaded again (what was written of it since is there)."""

from __future__ import annotations

import uuid

from ledger_cdc.batching import SessionCache
from ledger_cdc.batching.contexts import Contexts
from ledger_cdc.fold import SessionContext

A, B, C = (uuid.UUID(int=n) for n in (1, 2, 3))


def test_only_projected_sessions_are_asked_until_loaded_again() -> None:
    asked: list[list[uuid.UUID]] = []

    def load(ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[SessionContext, int]]:
        asked.append(list(ids))
        return {sid: (SessionContext(sid, last_position=7), 10) for sid in ids if sid == A}

    cache = SessionCache(1 << 20)
    contexts = Contexts(load, cache)
    contexts.expect({A})
    contexts.load([A, B])
    assert asked == [[A]]
    assert cache.get(A).last_position == 7  # type: ignore[union-attr]
    assert cache.get(B) == SessionContext(B)
    contexts.load([C])
    assert asked == [[A]]  # (no query at all)
    cache.clear()  # evicted: B may have been written since, so it is asked this time
    contexts.load([B])
    assert asked == [[A], [B]]
    contexts.expect(None)
    contexts.load([C])
    assert asked == [[A], [B], [C]]
