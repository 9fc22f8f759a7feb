"""Ledger events and the registry of event types with their payload Structs.

A :class:`LedgerEvent` is one row of ``agent_events``. Its payload is validated against the Struct
registered for its ``event_type`` at append time (and again by the consumer, which dead-letters a
payload that fails). The standard agent steps are registered here; applications add their own with
:func:`register_event_type`. This module knows nothing about PostgreSQL.
"""

from __future__ import annotations

import base64
import datetime as dt
import itertools
import math
import re
import types
import typing
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from ledger_cdc.errors import InvalidEventError, UnknownEventTypeError

__all__ = [
    "DOC_MAX_DEPTH",
    "EVENT_TYPES",
    "MAX_TIME",
    "MIN_TIME",
    "PAYLOAD_DECODERS",
    "READ_MAX_DEPTH",
    "Blob",
    "CheckpointSaved",
    "CheckpointsHidden",
    "ContextLoaded",
    "HandoffEmitted",
    "HandoffReceived",
    "HarnessRecord",
    "ItemPopped",
    "ItemsAdded",
    "ItemsCleared",
    "LedgerEvent",
    "Limits",
    "Message",
    "ModelRequested",
    "ModelResponded",
    "Rejected",
    "RunLeased",
    "RunQueued",
    "RunReleased",
    "RunSuspended",
    "SessionForked",
    "SignalReceived",
    "TaskCompleted",
    "TaskFailed",
    "ThreadDeleted",
    "ToolCall",
    "ToolInvoked",
    "ToolObserved",
    "Typed",
    "Usage",
    "Write",
    "WritesPut",
    "admit_time",
    "as_digest",
    "decode_bounded",
    "decode_payload",
    "encode_json",
    "encode_payload",
    "event_types",
    "json_depth",
    "load_payload",
    "payload_type",
    "refuse_nul",
    "register_event_type",
    "too_deep",
    "unidentified",
    "unplaced",
]

_TYPE_RE = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")


class Message(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """One chat message of an agent's context window."""

    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None


class Usage(msgspec.Struct, frozen=True, gc=False):
    input_tokens: int = 0
    output_tokens: int = 0


class ToolCall(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """A tool call a model asked for, as part of its response."""

    call_id: str
    tool: str
    arguments: dict[str, Any] = {}


class ContextLoaded(msgspec.Struct, frozen=True):
    """The context window the agent starts (or restarts) from."""

    messages: list[Message]
    task: str | None = None


class ModelRequested(msgspec.Struct, frozen=True):
    """A model call about to be made; ``request_id`` pairs it with its response."""

    request_id: str
    model: str
    prompt_hash: str | None = None
    idempotency_key: str | None = None


class ModelResponded(msgspec.Struct, frozen=True):
    request_id: str
    model: str
    content: str = ""
    usage: Usage = Usage()
    tool_calls: list[ToolCall] = []
    stop_reason: str | None = None


class ToolInvoked(msgspec.Struct, frozen=True):
    """A tool call about to be performed; the idempotency key travels with any retry."""

    call_id: str
    tool: str
    arguments: dict[str, Any] = {}
    idempotency_key: str | None = None


class ToolObserved(msgspec.Struct, frozen=True):
    """The result of a tool call (``error`` set when it failed)."""

    call_id: str
    result: Any = None
    error: str | None = None


class HandoffEmitted(msgspec.Struct, frozen=True):
    handoff_id: str
    to_agent: str
    message: str = ""
    data: dict[str, Any] = {}


class HandoffReceived(msgspec.Struct, frozen=True):
    handoff_id: str
    from_agent: str


class SessionForked(msgspec.Struct, frozen=True):
    """First event of a forked session: the events that follow are copies of the origin's
    events up to ``upto_seq`` (see ``ledger-cdc fork``)."""

    origin_session_id: uuid.UUID
    upto_seq: int
    upto_position: int
    events: int
    reason: str | None = None


class RunQueued(msgspec.Struct, frozen=True):
    """The run is ready for a worker to lease it."""

    reason: str | None = None


class RunLeased(msgspec.Struct, frozen=True):
    """A worker holds the run for ``ttl`` seconds from the event's commit-time ``created_at``
    (the server's clock). Renewal is another ``run.leased`` by the same worker."""

    worker: str
    ttl: float


class RunReleased(msgspec.Struct, frozen=True):
    """The worker gives the run back (it is pending again)."""

    worker: str
    reason: str | None = None


class RunSuspended(msgspec.Struct, frozen=True):
    """The run waits for one of ``wait_for`` (signal names); its lease ends."""

    reason: str
    wait_for: list[str] = []


class SignalReceived(msgspec.Struct, frozen=True):
    """A signal sent to the run from outside (an approval, a webhook)."""

    name: str
    payload: Any = None
    sender: str | None = None


class TaskCompleted(msgspec.Struct, frozen=True):
    result: Any = None


class TaskFailed(msgspec.Struct, frozen=True):
    error: str
    retryable: bool = False


# A free-form payload for event types registered without a Struct.
FreeForm = dict[str, Any]

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


EVENT_TYPES: dict[str, Any] = {
    "context.loaded": ContextLoaded,
    "model.requested": ModelRequested,
    "model.responded": ModelResponded,
    "tool.invoked": ToolInvoked,
    "tool.observed": ToolObserved,
    "handoff.emitted": HandoffEmitted,
    "handoff.received": HandoffReceived,
    "task.completed": TaskCompleted,
    "task.failed": TaskFailed,
    "session.forked": SessionForked,
    "run.queued": RunQueued,
    "run.leased": RunLeased,
    "run.released": RunReleased,
    "run.suspended": RunSuspended,
    "signal.received": SignalReceived,
    "langgraph.checkpoint": CheckpointSaved,
    "langgraph.writes": WritesPut,
    "langgraph.thread.deleted": ThreadDeleted,
    "langgraph.checkpoints.hidden": CheckpointsHidden,
    "openai.items.added": ItemsAdded,
    "openai.item.popped": ItemPopped,
    "openai.items.cleared": ItemsCleared,
    "pydantic.run.registered": HarnessRecord,
    "pydantic.step": HarnessRecord,
    "pydantic.snapshot": HarnessRecord,
    "pydantic.tool.effect": HarnessRecord,
}
_BUILTIN = frozenset(EVENT_TYPES)
_decoders: dict[str, msgspec.json.Decoder[Any]] = {}
PAYLOAD_DECODERS: Mapping[str, msgspec.json.Decoder[Any]] = types.MappingProxyType(_decoders)
"""The decoders :func:`load_payload` has read a registered event type's payload with, by
type (read-only; a type appears once a payload of it was read): for a reader's hot path, which
applies the same depth rule (:func:`too_deep`) and leaves whatever does not decode, or whose
type is not here, to :func:`load_payload`, to be read and quarantined with its reason."""
_encoder = msgspec.json.Encoder()
# A NUL character, as JSON writes it: an escape preceded by an even number of backslashes.
_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def register_event_type(name: str, payload: Any = FreeForm, *, replace: bool = False) -> None:
    """Register an event type and the type its payload must have (a msgspec Struct, or a dict
    type for a free-form JSON object). Registering the same pair again is a no-op."""
    if not _TYPE_RE.match(name):
        raise ValueError(
            f"invalid event type {name!r}: use dotted lower-case words, e.g. 'review.approved'"
        )
    current = EVENT_TYPES.get(name)
    if current is not None and current is not payload and not replace:
        if name in _BUILTIN:
            raise ValueError(f"{name!r} is a standard event type and cannot be redefined")
        raise ValueError(f"{name!r} is already registered with {current!r}; pass replace=True")
    EVENT_TYPES[name] = payload
    _decoders.pop(name, None)


def event_types() -> dict[str, Any]:
    return dict(EVENT_TYPES)


def payload_type(event_type: str) -> Any:
    try:
        return EVENT_TYPES[event_type]
    except KeyError:
        raise UnknownEventTypeError(event_type) from None


# -- limits: writers are strict, readers are lenient -----------------------------------------

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

MIN_TIME = dt.datetime(1, 1, 2, tzinfo=dt.timezone.utc)
MAX_TIME = dt.datetime(9999, 12, 30, tzinfo=dt.timezone.utc)
"""``created_at`` outside this range (PostgreSQL admits years up to 294276 and ``infinity``;
Python's datetime stops at 9999) quarantines its event. A day inside Python's limits on each
side, so that no time-zone offset can carry a value in the range out of it."""


@dataclass(frozen=True)
class Limits:
    """What the writer refuses at append (with :class:`InvalidEventError`, before any write).

    ``max_depth`` counts nested arrays and objects (``{"a": [1]}`` is 2) and may not exceed
    :data:`READ_MAX_DEPTH`, past which readers quarantine the event; ``max_bytes`` is the size
    of the payload's JSON text."""

    max_depth: int = 64
    max_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 1 <= self.max_depth <= READ_MAX_DEPTH:
            raise ValueError(
                f"max_depth must be between 1 and {READ_MAX_DEPTH} (readers quarantine deeper "
                f"payloads), got {self.max_depth}"
            )
        if self.max_bytes < 2:
            raise ValueError(f"max_bytes must be at least 2, got {self.max_bytes}")


DEFAULT_LIMITS = Limits()

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


def _unknown_fields(value: Any, info: mi.Type, path: str, out: list[str]) -> None:
    """Names in ``value`` (plain data) that ``info`` (its declared type) does not have."""
    if len(out) >= 5:
        return
    if isinstance(info, mi.Metadata):
        info = info.type
    if isinstance(info, (mi.StructType, mi.TypedDictType, mi.DataclassType)):
        if not isinstance(value, Mapping):
            return
        fields = {f.encode_name: f for f in info.fields}
        if isinstance(info, mi.StructType) and info.tag_field is not None:
            fields.setdefault(info.tag_field, None)  # type: ignore[arg-type]
        for key, item in value.items():
            f = fields.get(key) if isinstance(key, str) else None
            if f is None:
                if key not in fields:
                    out.append(f"{path}.{key}")
                continue
            _unknown_fields(item, f.type, f"{path}.{key}", out)
    elif isinstance(info, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                _unknown_fields(item, info.item_type, f"{path}[{i}]", out)
    elif isinstance(info, mi.TupleType):
        if isinstance(value, (list, tuple)):
            for i, (item, t) in enumerate(zip(value, info.item_types, strict=False)):
                _unknown_fields(item, t, f"{path}[{i}]", out)
    elif isinstance(info, mi.DictType):
        if isinstance(value, Mapping):
            for key, item in value.items():
                _unknown_fields(item, info.value_type, f"{path}.{key}", out)
    elif isinstance(info, mi.UnionType) and isinstance(value, Mapping):
        shaped = [
            t
            for t in info.types
            if isinstance(t, (mi.StructType, mi.TypedDictType, mi.DataclassType, mi.DictType))
        ]
        if len(shaped) == 1:
            _unknown_fields(value, shaped[0], path, out)


_type_infos: dict[str, mi.Type] = {}


def _type_info(event_type: str, typ: Any) -> mi.Type:
    info = _type_infos.get(event_type)
    if info is None:
        info = _type_infos[event_type] = mi.type_info(typ)
    return info


def encode_payload(event_type: str, payload: Any, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Validate ``payload`` against its event type and return its JSON bytes.

    Accepts an instance of the registered Struct or a plain mapping that converts to it. The
    writer is strict: a field its type does not declare (``"args"`` for ``"arguments"``) is
    refused rather than dropped, and so is a payload deeper or larger than ``limits``."""
    typ = payload_type(event_type)
    built = isinstance(typ, type) and issubclass(typ, msgspec.Struct) and isinstance(payload, typ)
    if built:
        value = payload
    else:
        try:
            value = msgspec.convert(payload, typ, from_attributes=False)
        except msgspec.ValidationError as e:
            raise InvalidEventError(f"{event_type} payload does not match {_name(typ)}: {e}") from e
        except RecursionError as e:
            raise _too_deep(f"{event_type} payload", limits) from e
        except TypeError as e:
            raise InvalidEventError(
                f"{event_type} payload is not JSON-serialisable: {_short(e)}"
            ) from e
    data = encode_json(value, f"{event_type} payload", limits)
    if not data.startswith(b"{"):
        raise InvalidEventError(f"{event_type} payload must be a JSON object, got {data[:40]!r}")
    if len(data) > limits.max_bytes:
        raise InvalidEventError(
            f"{event_type} payload is {len(data):,} bytes of JSON, over the limit of "
            f"{limits.max_bytes:,} (Limits.max_bytes): store large blobs elsewhere and "
            "reference them"
        )
    if too_deep(data, limits.max_depth):
        raise _too_deep(f"{event_type} payload", limits)
    if built:
        # a Struct built by its constructor, which checks no type (RunLeased("w", True)): read
        # back as every reader will (free-form parts left as JSON: any JSON is one), or refused
        try:
            _checker(typ).decode(data)
        except msgspec.DecodeError as e:
            raise InvalidEventError(
                f"{event_type} payload is invalid: {_short(e)} (as built by "
                f"{type(payload).__name__}(…))"
            ) from None
    if value is not payload and isinstance(payload, Mapping):
        unknown: list[str] = []
        _unknown_fields(payload, _type_info(event_type, typ), "$", unknown)
        if unknown:
            raise InvalidEventError(
                f"{event_type} payload has field(s) {_name(typ)} does not declare: "
                f"{', '.join(unknown)} (misspelled? the declared fields are "
                f"{_declared(typ)})"
            )
    return refuse_nul(data, f"{event_type} payload")


def encode_json(value: Any, what: str, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """``value`` as JSON, or InvalidEventError naming ``what`` when JSON cannot hold it: nested
    past the encoder's depth, not serialisable (an int of more digits than Python prints, a
    lone surrogate), or holding NaN or an infinity (the encoder would write null, which readers
    quarantine). What every writer of JSON into the ledger checks, event or outbox row."""
    try:
        data = _encoder.encode(value)
    except RecursionError as e:
        raise _too_deep(what, limits) from e
    except (TypeError, OverflowError, ValueError, msgspec.EncodeError) as e:
        raise InvalidEventError(f"{what} is not JSON-serialisable: {_short(e)}") from e
    if b"null" in data and _has_non_finite(value):
        raise InvalidEventError(
            f"{what} holds NaN or an infinity, which JSON cannot: use a finite number (or a string)"
        )
    return data


# a msgpack float64 whose exponent is all ones: NaN, inf or -inf (or these bytes inside a string
# or bytes value: then the walk decides)
_MSGPACK_NON_FINITE = re.compile(rb"\xcb[\x7f\xff][\xf0-\xff]")


def _has_non_finite(value: Any) -> bool:
    """Whether a float NaN or ±inf is anywhere in ``value``: one C-speed pass over its msgpack
    form, and a walk only when that pass cannot rule one out."""
    try:
        if _MSGPACK_NON_FINITE.search(msgspec.msgpack.encode(value)) is None:
            return False
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError):
        pass  # an int past 64 bits, a type msgpack lacks: the walk decides
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            if not math.isfinite(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        elif isinstance(v, msgspec.Struct):
            stack.extend(getattr(v, f) for f in v.__struct_fields__)
    return False


_checkers: dict[Any, msgspec.json.Decoder[Any]] = {}


def _checker(typ: Any) -> msgspec.json.Decoder[Any]:
    """A decoder that checks what ``typ``'s decoder checks, but leaves its free-form parts
    (``Any``) as raw JSON: validating a writer's Struct costs the typed fields, not its
    result."""
    dec = _checkers.get(typ)
    if dec is None:
        try:
            fields = [
                (
                    f.encode_name,
                    _raw_any(f.type),
                    f.default  # NODEFAULT: required, as in typ
                    if f.default_factory is msgspec.NODEFAULT
                    else msgspec.field(default_factory=f.default_factory),
                )
                for f in msgspec.structs.fields(typ)
            ]
            shallow = msgspec.defstruct(
                f"_{typ.__name__}Check",
                fields,
                array_like=typ.__struct_config__.array_like,
            )
            dec = msgspec.json.Decoder(shallow)
        except (TypeError, ValueError):  # a type this cannot mirror: check it whole
            dec = msgspec.json.Decoder(typ)
        _checkers[typ] = dec
    return dec


def _raw_any(t: Any) -> Any:
    """``t`` with ``Any`` (at the top, in a dict's values or a list's items) as Raw."""
    if t is Any:
        return msgspec.Raw
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is dict and len(args) == 2:
        return types.GenericAlias(dict, (args[0], _raw_any(args[1])))
    if origin is list and len(args) == 1:
        return types.GenericAlias(list, (_raw_any(args[0]),))
    return t


def _too_deep(what: str, limits: Limits) -> InvalidEventError:
    return InvalidEventError(
        f"{what} nests deeper than {limits.max_depth} levels (Limits.max_depth): "
        "flatten it or encode the nested part as a string"
    )


def _declared(typ: Any) -> str:
    fields = getattr(typ, "__struct_encode_fields__", None)
    return ", ".join(fields) if fields else "in its type"


def _short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= 200 else text[:200] + "…"


def refuse_nul(data: bytes, what: str) -> bytes:
    """``data`` (JSON) unchanged, or InvalidEventError if it holds a NUL character."""
    if b"\\u0000" in data and _NUL.search(data):
        raise InvalidEventError(
            f"{what} contains a NUL character (\\u0000), which PostgreSQL's jsonb cannot store: "
            "remove it or encode the value (base64, hex) first"
        )
    return data


_free = msgspec.json.Decoder()


def load_payload(event_type: str, data: bytes | str | memoryview) -> Any:
    """Stored JSON → the registered payload type (plain JSON for a type this process does not
    know); raises :class:`InvalidEventError` with the reason when it does not fit or nests
    deeper than :data:`READ_MAX_DEPTH`. Lenient: fields the type does not declare are ignored
    (a newer writer during a rolling upgrade). Never raises anything else."""
    raw = data.encode() if isinstance(data, str) else data
    if too_deep(raw, READ_MAX_DEPTH):
        raise InvalidEventError(
            f"{event_type} payload nests deeper than {READ_MAX_DEPTH} levels (quarantined "
            "unread: the limit readers share)"
        )
    dec = _decoders.get(event_type)
    if dec is None:
        typ = EVENT_TYPES.get(event_type)
        dec = _free if typ is None else msgspec.json.Decoder(typ)
        if typ is not None:
            _decoders[event_type] = dec
    try:
        return dec.decode(raw)
    except msgspec.DecodeError as e:
        raise InvalidEventError(f"{event_type} payload is invalid: {_short(e)}") from e
    except (RecursionError, MemoryError, ValueError, OverflowError) as e:
        raise InvalidEventError(f"{event_type} payload cannot be read: {_short(e)}") from e


def decode_payload(event_type: str, data: bytes | str) -> Any:
    """JSON bytes → the registered payload type; raises InvalidEventError when it does not fit
    (:class:`UnknownEventTypeError` for a type never registered)."""
    payload_type(event_type)
    return load_payload(event_type, data)


def admit_time(value: Any) -> dt.datetime:
    """A row's ``created_at`` as a UTC datetime, or :class:`InvalidEventError` when it is not a
    time inside [:data:`MIN_TIME`, :data:`MAX_TIME`] (the same rule on every path)."""
    if type(value) is not dt.datetime or value.tzinfo is None:
        raise InvalidEventError(f"created_at {value!r} is not a time this reader can hold")
    if not MIN_TIME <= value <= MAX_TIME:
        raise InvalidEventError(
            f"created_at {value.isoformat()} is outside {MIN_TIME.date()}..{MAX_TIME.date()}"
        )
    if value.tzinfo is _UTC or value.utcoffset() == _ZERO:
        return value
    return value.astimezone(_UTC)


_ZERO = dt.timedelta(0)
_UTC = dt.timezone.utc


def _name(typ: Any) -> str:
    return getattr(typ, "__name__", repr(typ))


class LedgerEvent(msgspec.Struct, frozen=True, gc=False):
    """One committed row of ``agent_events``, with its payload decoded to its registered type
    (or left as a dict for event types this process does not know)."""

    seq: int
    session_id: uuid.UUID
    position: int
    agent_id: str
    event_type: str
    payload: Any
    created_at: dt.datetime
    idempotency_key: str | None = None
    hash: bytes | None = None
    prev_hash: bytes | None = None


class Rejected(msgspec.Struct, frozen=True, gc=False):
    """A row of ``agent_events`` that cannot become a :class:`LedgerEvent` (its payload does
    not fit its type, nests too deep, or its ``created_at`` is out of range). Every reader turns
    such a row into this, never an exception; folding it quarantines it (see
    ``ledger_cdc.fold.fold_one``)."""

    seq: int
    session_id: uuid.UUID
    position: int
    agent_id: str
    event_type: str
    reason: str
    created_at: str | None = None  # as stored, when it could not be read as a time
    idempotency_key: str | None = None
    hash: bytes | None = None
    # its session or position could not be read (NULL, retyped by hand, left out of the stream):
    # it is in no session's history, so every fold quarantines it without moving a session
    unplaced: bool = False
    # the stream lacked some of its columns (a publication's column list): the row itself is
    # whole in agent_events, and a reader that can reads it there
    incomplete: bool = False


_NIL = uuid.UUID(int=0)


def as_digest(value: object) -> bytes | None:
    """A row's hash as bytes. A ``hash`` column retyped by hand (text, or a domain over bytea
    read where its type is not known) gives ``\\x…`` text: read as the bytes it spells; any
    other value is no hash (None), never a value a sink cannot write."""
    if type(value) is bytes:
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if type(value) is str and value.startswith("\\x"):
        try:
            return bytes.fromhex(value[2:])
        except ValueError:
            return None
    return None


def unplaced(sid: Any, pos: Any) -> bool:
    """Whether a row whose session id and position read as these is in no session's history
    (NULL, retyped by hand, left out of the stream): the rule every reader shares."""
    return type(sid) is not uuid.UUID or type(pos) is not int or pos < 1


def unidentified(
    seq: Any, sid: Any, pos: Any, agent: Any, etype: Any, key: Any, digest: Any
) -> Rejected | None:
    """A row an identity column of which is NULL or not of the ledger's type (dropped NOT NULL,
    ALTER TABLE by hand) as :class:`Rejected`, under what could be read of it; None for a row
    whose identity columns are all there. Every reader, stream or table, applies this rule."""
    if (
        type(seq) is int
        and type(sid) is uuid.UUID
        and type(pos) is int
        and type(agent) is str
        and type(etype) is str
    ):  # every row but a hand-altered table's: one check
        return None
    odd = [
        name
        for name, value, kind in (
            ("seq", seq, int),
            ("session_id", sid, uuid.UUID),
            ("position", pos, int),
            ("agent_id", agent, str),
            ("event_type", etype, str),
        )
        if type(value) is not kind
    ]
    return Rejected(
        seq if type(seq) is int else 0,
        sid if type(sid) is uuid.UUID else _NIL,
        pos if type(pos) is int else 0,
        agent if type(agent) is str else "",
        etype if type(etype) is str else "",
        f"event seq {seq}: {', '.join(odd)} NULL or not of the ledger's column type",
        None,
        key if type(key) is str else None,
        digest if type(digest) is bytes else None,
        unplaced(sid, pos),
    )
