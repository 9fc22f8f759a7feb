"""Framework values as the ledger stores them (no server): a large value compressed when that
makes it smaller, read back byte for byte; a small or incompressible one left as it was, in the
form every earlier version wrote; a serializer's own tag that looks like ours never misread; and
a hostile compressed value (a bomb, a broken frame) refused with ValueError before it is
inflated."""

from __future__ import annotations

import base64
import os

import msgspec
import pytest
import zstandard

from ledger_cdc.events import Typed
from ledger_cdc.events.frameworks import PACK_FROM, ZSTD, unpack
from ledger_cdc.fold.frameworks import decode_typed


def _text(n: int) -> bytes:
    words = [b"tide", b"harbour", b"gull", b"north", b"rope", b"salt"]
    return b" ".join(words[(i * 7) % len(words)] for i in range(n // 5))[:n]


def test_a_large_value_is_stored_compressed_and_read_back_byte_for_byte() -> None:
    raw = msgspec.msgpack.encode([_text(600).decode() for _ in range(80)])
    t = Typed.packed(("msgpack", raw))
    assert t.type == "zstd:msgpack" and len(t.data) < len(base64.b64encode(raw)) // 2
    assert t.pair() == ("msgpack", raw)
    back = msgspec.json.decode(msgspec.json.encode(t), type=Typed)  # as an event carries it
    assert back == t and back.pair() == ("msgpack", raw)
    assert decode_typed(t) == [_text(600).decode() for _ in range(80)]


def test_a_small_or_incompressible_value_keeps_the_form_earlier_versions_wrote() -> None:
    small = Typed.packed(("msgpack", _text(PACK_FROM - 1)))
    noise = Typed.packed(("bytes", os.urandom(64 << 10)))
    assert small.type == "msgpack" and small.pair() == ("msgpack", _text(PACK_FROM - 1))
    assert noise.type == "bytes"
    assert msgspec.json.encode(small) == msgspec.json.encode(Typed.of(small.pair()))
    old = msgspec.json.decode(b'["json", "eyJhIjogMX0="]', type=Typed)  # as written before
    assert old.pair() == ("json", b'{"a": 1}')


def test_a_serializers_tag_that_starts_like_ours_reads_back_as_it_was_given() -> None:
    for t in (Typed.of(("zstd:x", b"abc")), Typed.packed(("zstd:x", b"abc" * 1000))):
        assert t.pair()[0] == "zstd:x" and t.pair()[1] in (b"abc", b"abc" * 1000)
        assert t.type == "zstd:zstd:x"


def test_a_frame_that_claims_or_gives_more_than_the_limit_is_refused_uninflated() -> None:
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))  # says 64 MiB in its header
    assert len(bomb) < 4096
    with pytest.raises(ValueError, match="over the 1048576 allowed"):
        unpack(bomb, limit=1 << 20)
    stream = zstandard.ZstdCompressor().compressobj()  # a frame that does not say its size
    unsized = stream.compress(bytes(4 << 20)) + stream.flush()
    assert zstandard.frame_content_size(unsized) == -1
    with pytest.raises(ValueError):
        unpack(unsized, limit=1 << 20)
    assert unpack(unsized, limit=8 << 20) == bytes(4 << 20)
    with pytest.raises(ValueError, match="does not decompress"):
        unpack(b"\x28\xb5\x2f\xfd" + b"\x00" * 12)
    with pytest.raises(ValueError, match="does not decompress"):
        unpack(b"not a frame at all")


def test_decode_typed_refuses_a_bomb_and_a_broken_frame() -> None:
    bomb = zstandard.ZstdCompressor().compress(bytes(300 << 20))  # over what any read allows
    broken = Typed(ZSTD + "msgpack", base64.b64encode(b"\x28\xb5\x2f\xfd broken").decode())
    for value in (Typed(ZSTD + "msgpack", base64.b64encode(bomb).decode()), broken):
        with pytest.raises(ValueError):
            decode_typed(value)
        with pytest.raises(ValueError):
            value.pair()
    shown = zstandard.ZstdCompressor().compress(bytes(100 << 20))  # readable, not shown
    with pytest.raises(ValueError, match="over the 67108864 allowed"):
        decode_typed(Typed(ZSTD + "bytes", base64.b64encode(shown).decode()))
