"""The canonical encoding of a context: equal contexts give equal bytes, however each was loaded
(Struct fields in declaration order, every object's keys sorted; jsonb, which the projection goes
through, reorders keys), so the hashes of snapshots and projections compare across processes.

What is stored (a snapshot, a projection) copies nothing the ledger already holds: no completed
calls (each is a row of ``agent_memo``; ``memo_position`` says up to where), not the context
window a ``context.loaded`` event loaded (``window``: that event's position), and not the long
messages taken from an event (``sources``: their events' positions), nor any field that holds
its default (a reader's decoder gives it back). :func:`encode_stored` writes that form;
:func:`references` says which events a stored context needs read back, and :func:`attach` puts
what they hold back in place.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

from ledger_cdc.errors import WindowMissingError
from ledger_cdc.events import Message
from ledger_cdc.fold.context import (
    REFERENCE_MIN,
    CompletedModel,
    CompletedTool,
    ContextWindow,
    MessageSource,
    SessionContext,
)

__all__ = [
    "attach",
    "comparable",
    "content_hash",
    "copy_context",
    "decode_context",
    "decode_messages",
    "encode_context",
    "encode_memo_entry",
    "encode_snapshot",
    "encode_stored",
    "memo_key",
    "referable",
    "references",
    "window_chars",
]

_encoder = msgspec.json.Encoder(order="deterministic")
_decoder = msgspec.json.Decoder(SessionContext)
_messages = msgspec.json.Decoder(list[Message])


def encode_context(ctx: SessionContext) -> bytes:
    """Canonical JSON of a context: the same bytes for equal contexts, however each was loaded
    (Struct fields in declaration order, every object's keys sorted)."""
    return _encoder.encode(ctx)


def decode_context(data: bytes | str) -> SessionContext:
    """A context from its JSON (a stored one may still lack what it references: see
    :func:`references`). Bytes nested past what the decoder takes (msgspec's RecursionError)
    are a DecodeError, as any other JSON that is no context: every reader handles one kind."""
    try:
        return _decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError("JSON nested past what the decoder takes") from None


def window_chars(messages: Sequence[Message], length: int) -> int:
    return sum(len(m.content) for m in messages[:length])


def _valid_window(ctx: SessionContext) -> ContextWindow | None:
    """The context's window if it still opens its messages (length and characters match)."""
    w = ctx.window
    if w is None or w.omitted:
        return None
    msgs = ctx.messages
    if len(msgs) < w.length or window_chars(msgs, w.length) != w.chars:
        ctx.window = None  # a reducer changed the window's messages: copy them from now on
        return None
    return w


def _omit_sources(
    msgs: list[Message], base: int, sources: list[MessageSource]
) -> tuple[list[Message], list[MessageSource]]:
    """The messages with the long ones taken from an event emptied, and the sources marked so
    (``base``: the index in the whole list of ``msgs[0]``)."""
    out: list[Message] | None = None
    marked: list[MessageSource] = []
    for s in sources:
        i = s.index - base
        if (
            not s.omitted
            and s.chars >= REFERENCE_MIN
            and 0 <= i < len(msgs)
            and len(msgs[i].content) == s.chars
        ):
            if out is None:
                out = list(msgs)
            m = out[i]
            out[i] = Message(m.role, "", m.name, m.tool_call_id)
            marked.append(MessageSource(s.index, s.position, s.chars, True))
        else:
            marked.append(s)
    return (msgs if out is None else out), marked


def encode_stored(ctx: SessionContext, *, reference: bool = True) -> bytes:
    """What a snapshot and a projection store: the context without its completed calls (in
    ``agent_memo``, one row each, written no later than this), ``memo_position`` set to its
    last position, and (``reference``) the messages of its window and the long messages taken
    from an event left in those events. A stored context read back and not yet attached encodes
    to the same bytes."""
    win = ctx.window
    msgs = ctx.messages
    base = 0
    if win is not None and win.omitted:  # a stored context, read back: already in this form
        base = win.length
    elif (
        reference
        and win is not None
        and win.chars >= REFERENCE_MIN
        and _valid_window(ctx) is not None
    ):
        msgs = msgs[win.length :]
        base = win.length
        win = ContextWindow(win.position, win.length, win.chars, True)
    else:
        win = ctx.window
    sources = ctx.sources
    if reference and sources:
        msgs, sources = _omit_sources(msgs, base, sources)
    fields = msgspec.structs.asdict(ctx)
    fields.update(
        completed_tools={},
        completed_models={},
        memo_position=ctx.last_position,
        messages=msgs,
        window=win,
        sources=sources,
    )
    return _encoder.encode(_Stored(**fields))


class _Stored(SessionContext, omit_defaults=True):
    """A context as stored: a field that holds its default is left out (a reader's decoder
    gives it back; SQL's ``ledger_full_context`` puts the defaults back in front)."""


encode_snapshot = encode_stored  # the same form (the name snapshots have always used)


def references(ctx: SessionContext) -> tuple[int | None, list[int]]:
    """What a stored context lacks: the position of the event whose messages open it (None if
    it holds them) and the positions of the events whose strings its emptied messages are."""
    w = ctx.window
    return (
        w.position if w is not None and w.omitted else None,
        [s.position for s in ctx.sources if s.omitted],
    )


def referable(result: Any) -> bool:
    """Whether the readers of a stored context give back the text of this ``tool.observed``
    result exactly as the fold wrote it into a message, so that the message may be left in its
    event: a string as it is; any other value holds no float anywhere. SQL's ``ledger_message``
    writes a non-string result as jsonb's text made compact, which for such a value is the
    fold's text byte for byte (keys in jsonb's order, as the fold read them; integers of any
    size, every string escaped alike); jsonb keeps a fractional number's own digits (1.50,
    0.0000001) where the fold writes the float it decoded (1.5, 1e-07)."""
    stack = [result]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind is float:
            return False
        if kind is dict:
            stack.extend(value.values())
        elif kind is list:
            stack.extend(value)
    return True


def decode_messages(data: bytes | str) -> list[Message]:
    return _messages.decode(data)


def attach(
    ctx: SessionContext,
    window: Sequence[Message] | bytes | str | None,
    contents: Sequence[str | None] | None = None,
) -> None:
    """Make a stored context whole, in place: ``window`` the messages of its window's event (a
    list or its JSON), ``contents`` the strings of its emptied messages' events, in the order
    :func:`references` gave their positions. Raises :class:`WindowMissingError` when any is
    missing or does not match what was stored (counts and characters)."""
    w = ctx.window
    sid = ctx.session_id
    if w is not None and w.omitted:
        if window is None:
            raise WindowMissingError(
                f"session {sid}: the context.loaded event at position {w.position}, whose "
                "messages the stored context references, is not in the ledger (nor kept by an "
                "archive)"
            )
        msgs = decode_messages(window) if isinstance(window, (bytes, str)) else list(window)
        if len(msgs) != w.length or window_chars(msgs, w.length) != w.chars:
            raise WindowMissingError(
                f"session {sid}: the event at position {w.position} holds {len(msgs)} messages "
                f"({window_chars(msgs, len(msgs))} characters), the stored context references "
                f"{w.length} ({w.chars} characters)"
            )
        msgs.extend(ctx.messages)
        ctx.messages = msgs
        ctx.window = ContextWindow(w.position, w.length, w.chars)
    omitted = [s for s in ctx.sources if s.omitted]
    if not omitted:
        return
    got = list(contents or ())
    if len(got) != len(omitted):
        raise WindowMissingError(
            f"session {sid}: {len(omitted)} messages are stored by reference, {len(got)} read back"
        )
    msgs = ctx.messages
    for s, text in zip(omitted, got, strict=True):
        if text is None or len(text) != s.chars or not 0 <= s.index < len(msgs):
            raise WindowMissingError(
                f"session {sid}: message {s.index} references the event at position "
                f"{s.position}, which {'is missing' if text is None else 'does not hold it'}"
            )
        m = msgs[s.index]
        msgs[s.index] = Message(m.role, text, m.name, m.tool_call_id)
    ctx.sources = [
        MessageSource(s.index, s.position, s.chars) if s.omitted else s for s in ctx.sources
    ]


def encode_memo_entry(done: CompletedTool | CompletedModel, *, by_reference: bool = True) -> bytes:
    """An ``agent_memo`` row's entry: the call without a tool's ``result`` or a model's
    ``content`` of REFERENCE_MIN characters or more, which stay in the completing event (SQL
    ``ledger_memo_entry`` reads them back); the whole call if not ``by_reference``."""
    if not by_reference:
        return _encoder.encode(done)
    if isinstance(done, CompletedTool):
        key, value = "result", done.result
        long = len(value) if isinstance(value, str) else len(_encoder.encode(value))
    else:
        key, long = "content", len(done.content)
    if long < REFERENCE_MIN:
        return _encoder.encode(done)
    entry = msgspec.to_builtins(done)
    del entry[key]
    return _encoder.encode(entry)


MEMO_KEY_BYTES = 512
_MEMO_DIGEST = "sha256~"


def memo_key(value: str) -> str:
    """How ``agent_memo`` stores (and is searched by) a call id, idempotency key or prompt hash:
    the value itself up to MEMO_KEY_BYTES of UTF-8, else ``sha256~`` and its hex digest — an
    index entry has a size limit (about 2.7 kB) that a payload's strings do not. A value that
    already starts with ``sha256~`` is digested too, so no two values share a stored form."""
    data = value.encode("utf-8", "surrogatepass")
    if len(data) <= MEMO_KEY_BYTES and not value.startswith(_MEMO_DIGEST):
        return value
    return _MEMO_DIGEST + hashlib.sha256(data).hexdigest()


def comparable(ctx: SessionContext) -> SessionContext:
    """The context without its storage hints (what ``verify`` compares)."""
    return msgspec.structs.replace(ctx, window=None, sources=[])


def copy_context(ctx: SessionContext) -> SessionContext:
    return _decoder.decode(_encoder.encode(ctx))


def content_hash(ctx: SessionContext) -> bytes:
    return hashlib.sha256(encode_context(ctx)).digest()
