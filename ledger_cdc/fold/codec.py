"""The canonical encoding of a context: equal contexts give equal bytes, however each was loaded
(Struct fields in declaration order, every object's keys sorted; jsonb, which the projection goes
through, reorders keys), so the hashes of snapshots and projections compare across processes."""

from __future__ import annotations

import hashlib

import msgspec

from ledger_cdc.fold.context import SessionContext

__all__ = ["content_hash", "copy_context", "decode_context", "encode_context", "encode_snapshot"]

_encoder = msgspec.json.Encoder(order="deterministic")
_decoder = msgspec.json.Decoder(SessionContext)


def encode_context(ctx: SessionContext) -> bytes:
    """Canonical JSON of a context: the same bytes for equal contexts, however each was loaded
    (Struct fields in declaration order, every object's keys sorted)."""
    return _encoder.encode(ctx)


def decode_context(data: bytes | str) -> SessionContext:
    return _decoder.decode(data)


def encode_snapshot(ctx: SessionContext) -> bytes:
    """What a snapshot stores: the context without its completed calls (in ``agent_memo``, one
    row each, written no later than the snapshot), with ``memo_position`` set to its last
    position."""
    return _encoder.encode(
        msgspec.structs.replace(
            ctx, completed_tools={}, completed_models={}, memo_position=ctx.last_position
        )
    )


def copy_context(ctx: SessionContext) -> SessionContext:
    return _decoder.decode(_encoder.encode(ctx))


def content_hash(ctx: SessionContext) -> bytes:
    return hashlib.sha256(encode_context(ctx)).digest()
