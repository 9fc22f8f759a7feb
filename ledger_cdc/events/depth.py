"""How deep JSON text nests, told without parsing it, and the fixed depth rule readers share.

Decoding JSON is recursive: a payload nested deep enough exhausts the stack of one process and
not another's. Every reader therefore measures the depth first (:func:`json_depth`,
:func:`too_deep`, in a bounded number of C-speed passes) and refuses what nests past a fixed
limit (:data:`READ_MAX_DEPTH` for a payload, :data:`DOC_MAX_DEPTH` for a stream message around
one), so that whether a row is read never depends on the Python reading it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

__all__ = [
    "DOC_MAX_DEPTH",
    "READ_MAX_DEPTH",
    "decode_bounded",
    "json_depth",
    "too_deep",
]

READ_MAX_DEPTH = 256
"""Nesting depth (arrays and objects) beyond which a stored payload is quarantined, whatever
wrote it: a fixed rule, so the consumer, a rebuild and ``verify`` always decide alike (decoding
is recursive; a deeper payload could exhaust the stack in one process and not in another)."""

DOC_MAX_DEPTH = READ_MAX_DEPTH + 64
"""Nesting depth beyond which a message of the JetStream stream (an event around its payload)
is no event to any reader: room for the levels around a payload of :data:`READ_MAX_DEPTH`.
Fixed, as that one is, rather than left to the decoder's recursion limit, which is the
Python's (about 1,000 levels on 3.10 and 3.11, 1,500 on 3.12, 10,000 on 3.13): the same
message is read, or not, whichever Python reads it (see :func:`decode_bounded`)."""

# json_depth: escapes go first (an escaped backslash, then an escaped quote), then everything
# but brackets and quotes; what lies between quotes is string content; objects and arrays nest
# alike, so braces become brackets. Then two ways to the depth, each at C speed where the other
# is slow: a pass removing every innermost "[]" takes off one level (quick on wide, leafy data:
# it shrinks fast), and a running sum over the lengths of the runs of "[" and "]" (quick when
# the runs are few: deep chains). Each step takes the cheaper: never seconds per megabyte.
_NOT_SYNTAX = bytes(b for b in range(256) if b not in b'[]{}"')
_SQUARE = bytes.maketrans(b"{}", b"[]")
_RUN = re.compile(rb"\[+|\]+")
_OPENING = re.compile(rb"[{\[]")


def json_depth(data: bytes, stop_at: int = READ_MAX_DEPTH) -> int:
    """Nesting depth of JSON text (``stop_at + 1`` for anything deeper), without parsing it: no
    recursion whatever the input, and a bounded number of C-speed passes over the bytes.
    Assumes well-formed JSON, which is all a jsonb column can hold."""
    if not (b"{" in data or b"[" in data):
        return 0
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # two quotes side by side close a string with no bracket in it, or close one and open the
    # next with nothing between: either way no bracket outside a string goes with them (most
    # strings hold none, and this pass is far quicker than the split that sorts the rest)
    syntax = data.translate(None, _NOT_SYNTAX).replace(b'""', b"")
    brackets = b"".join(syntax.split(b'"')[::2]) if b'"' in syntax else syntax
    brackets = brackets.translate(_SQUARE)
    depth = 0
    while brackets and depth <= stop_at:
        if brackets.count(b"[]") * 16 < len(brackets):  # few runs: sum them
            runs = [len(r) if r[0] == 91 else -len(r) for r in _RUN.findall(brackets)]
            return min(stop_at + 1, depth + max(itertools.accumulate(runs)))
        brackets = brackets.replace(b"[]", b"")  # one level off (a pass does not cascade)
        depth += 1
    return depth


def too_deep(data: bytes | str | memoryview, limit: int) -> bool:
    """Whether JSON text nests deeper than ``limit`` (free when it is too short to)."""
    if len(data) <= 2 * limit:  # n levels take 2n brackets
        return False
    # n levels take n opening brackets: most payloads (a context window of a few hundred
    # messages) have fewer than the limit in all, which json_depth need not confirm
    if not _openings_over(data, limit):
        return False
    return json_depth(data.encode() if isinstance(data, str) else bytes(data), limit) > limit


T = TypeVar("T")


def decode_bounded(decode: Callable[[Any], T], data: bytes | str, limit: int) -> T:
    """``decode(data)``, for JSON that nests at most ``limit`` levels: msgspec.DecodeError for
    deeper JSON, as for JSON nested past the decoder's own depth (its RecursionError). What
    the readers of payloads and of stream messages decode with: :data:`READ_MAX_DEPTH` for an
    event's payload (an integration's record) or an outbox row's, :data:`DOC_MAX_DEPTH` for a
    JetStream message around one. A fixed rule, so that whether a row is read does not depend
    on the Python reading it, as the consumer's quarantine does not."""
    if too_deep(data, limit):
        raise msgspec.DecodeError(f"JSON nested deeper than {limit} levels")
    try:
        return decode(data)
    except RecursionError:
        raise msgspec.DecodeError("JSON nested past what the decoder takes") from None


def _openings_over(data: bytes | str | memoryview, limit: int) -> bool:
    """Whether ``data`` holds more than ``limit`` opening brackets. Found one by one (find is
    memchr, many times faster than a pass that counts or translates every byte), at most
    ``limit + 1`` of them: bounded whatever the data. A view (a long value of a stream message,
    not copied out of it) has no find: a regular expression finds them there."""
    n = 0
    if isinstance(data, memoryview):
        for _ in _OPENING.finditer(data):
            n += 1
            if n > limit:
                return True
        return False
    find: Any = data.find
    for bracket in ("{", "[") if isinstance(data, str) else (b"{", b"["):
        i = find(bracket)
        while i >= 0:
            n += 1
            if n > limit:
                return True
            i = find(bracket, i + 1)
    return False
