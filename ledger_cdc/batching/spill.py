"""A big transaction's changes grouped by session (:func:`by_session`), with bounded memory:
what does not fit is pickled to a temporary file in the spill directory and read back. Errors of
that file (a full disk, a directory gone) are raised as :class:`~ledger_cdc.errors.SpillError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from ledger_cdc.errors import SpillError
from ledger_cdc.stream.route import Item, session_of

__all__ = ["by_session"]

_BUCKETS = 64
_HELD = 32  # changes a bucket holds in memory before they are written out
_LEVELS = 6  # times a bucket over the budget is spread again
# odd 128-bit multipliers, one per level: the top bits of sid × M (mod 2**128) depend on every
# bit of the id, so ids that differ only in their high or only in their low bits still spread
_MIX = tuple(
    int.from_bytes(hashlib.sha256(b"ledger-cdc by_session %d" % n).digest()[:16], "big") | 1
    for n in range(_LEVELS + 1)
)
_MASK = (1 << 128) - 1


def by_session(
    sized: Iterable[tuple[Item, int]],
    directory: str | None,
    budget: int,
    *,
    level: int = 0,
    buckets: int = _BUCKETS,
) -> Iterator[tuple[Item, int]]:
    """The same changes, grouped by session: each session's together and in their order, so
    that a fold loads each context once. Spread by session over ``buckets`` parts of one
    temporary file (a few dozen changes per bucket in memory at a time); a bucket whose changes
    fit ``budget`` bytes is read back whole and grouped in memory, a larger one is spread again,
    by other bits of the session id, over as many buckets as it takes to fit (a bucket of one
    session is read back as it is). A change is written once per level: one level for a
    transaction of up to 64 budgets, two up to thousands."""
    file: Any = None
    at: list[list[int]] = [[] for _ in range(buckets)]  # where each bucket's parts start
    held: list[list[tuple[Item, int]]] = [[] for _ in range(buckets)]
    sizes = [0] * buckets
    first: list[uuid.UUID | None] = [None] * buckets  # the bucket's first session
    mixed = [False] * buckets  # whether it holds more than one session (or a change of none)
    mix = _MIX[level]

    def spill(k: int) -> None:
        nonlocal file
        try:
            if file is None:
                file = tempfile.TemporaryFile(prefix="ledger-cdc-group-", dir=directory)  # noqa: SIM115
            at[k].append(file.tell())
            pickle.dump(held[k], file, protocol=pickle.HIGHEST_PROTOCOL)
        except OSError as e:  # (full, gone, not writable: said with its path, not a bug)
            raise SpillError(directory, e, "sorting a large transaction by session") from e
        held[k] = []

    def read_back(k: int) -> Iterator[tuple[Item, int]]:
        """Bucket ``k``'s changes in the order they came: what was written, then what is held."""
        for offset in at[k]:
            try:
                file.seek(offset)  # (writes what is still buffered: the disk may be full now)
            except OSError as e:
                raise SpillError(directory, e, "sorting a large transaction by session") from e
            chunk: list[tuple[Item, int]] = pickle.load(file)
            yield from chunk
        yield from held[k]
        held[k] = []

    try:
        for pair in sized:
            sid = session_of(pair[0])
            k = 0 if sid is None else (((sid.int * mix) & _MASK) * buckets) >> 128
            held[k].append(pair)
            sizes[k] += pair[1]
            if not mixed[k]:
                if first[k] is None:
                    first[k] = sid
                mixed[k] = sid is None or sid != first[k]
            if len(held[k]) >= _HELD:
                spill(k)
        for k in range(buckets):
            if not mixed[k]:
                yield from read_back(k)
            elif sizes[k] <= budget or level >= _LEVELS:
                yield from _grouped(read_back(k))
            else:
                parts = min(_BUCKETS, 2 + 2 * sizes[k] // max(1, budget))  # (room for skew)
                yield from by_session(
                    read_back(k), directory, budget, level=level + 1, buckets=parts
                )
    finally:
        if file is not None:
            with contextlib.suppress(OSError):  # (a full disk refuses its last write)
                file.close()


def _grouped(pairs: Iterable[tuple[Item, int]]) -> Iterator[tuple[Item, int]]:
    """The changes, each session's together in their order, sessions in the order of their
    first change (held in memory: the caller gives no more than it can hold)."""
    groups: dict[uuid.UUID | None, list[tuple[Item, int]]] = {}
    for pair in pairs:
        sid = session_of(pair[0])
        group = groups.get(sid)
        if group is None:
            groups[sid] = [pair]
        else:
            group.append(pair)
    for group in groups.values():
        yield from group
        group.clear()  # (let go of each session's changes once handed on)
