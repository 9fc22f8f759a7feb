"""Payloads as JSON: the writer's limits and checks on the way in, the reader's lenient load on
the way out.

A payload is validated against the type registered for its event type
(:mod:`ledger_cdc.events.catalogue`). Writers are strict (:func:`encode_payload` refuses a field
the type does not declare, a payload past its :class:`Limits`, NaN, a NUL character); readers
are lenient (:func:`load_payload` ignores undeclared fields and turns anything it cannot read
into :class:`~ledger_cdc.errors.InvalidEventError` with the reason, never another exception).
"""

from __future__ import annotations

import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi

from ledger_cdc.errors import InvalidEventError
from ledger_cdc.events.catalogue import payload_decoder, payload_type
from ledger_cdc.events.depth import READ_MAX_DEPTH, too_deep

__all__ = [
    "DEFAULT_LIMITS",
    "Limits",
    "decode_payload",
    "encode_json",
    "encode_payload",
    "load_payload",
    "refuse_nul",
]

_encoder = msgspec.json.Encoder()
# A NUL character, as JSON writes it: an escape preceded by an even number of backslashes.
_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


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
    dec = payload_decoder(event_type) or _free
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


def _name(typ: Any) -> str:
    return getattr(typ, "__name__", repr(typ))
