"""Bad bytes never escape as anything but DecodeError, and the error says where.

Inputs: the real captures in ``tests/data`` (PostgreSQL 15 and 18 walsender output), mutated by
hypothesis, plus random bytes; and every truncation of one message of each type.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ledger_cdc.errors import DecodeError
from ledger_cdc.pgoutput import Decoder, Insert, StreamAbort
from ledger_cdc.pgoutput.spec import build_message

DATA = Path(__file__).resolve().parents[1] / "data"
FUZZ_EXAMPLES = int(os.environ.get("LEDGER_CDC_FUZZ_EXAMPLES", "4000"))  # per fuzz test


def _corpus() -> list[tuple[bool, int, bytes]]:
    out = []
    for path in sorted(DATA.glob("pgoutput_pg*.txt")):
        for line in path.read_text().splitlines():
            flag, lsn, data = line.split()
            out.append((flag == "1", int(lsn, 16), bytes.fromhex(data)))
    return out


CORPUS = _corpus()
# keep the fuzz inputs small and varied: one of each (type, length) shape, short ones first
_SHAPES: dict[tuple[bytes, int, bool], tuple[bool, int, bytes]] = {}
for _item in CORPUS:
    _SHAPES.setdefault((_item[2][:1], min(len(_item[2]), 400) // 40, _item[0]), _item)
SAMPLES = sorted(_SHAPES.values(), key=lambda x: len(x[2]))


def _primed() -> Decoder:
    d = Decoder()
    for in_stream, lsn, data in CORPUS:
        d.in_stream = in_stream
        d.decode(data, lsn)
    d.in_stream = False
    return d


PRIMED = _primed()


def test_corpus_covers_every_message_kind() -> None:
    kinds = {data[:1] for _, _, data in CORPUS}
    assert set(b"BCORYIUDTMSEcAbPKr") <= {k[0] for k in kinds}


def _decode_only_decode_error(d: Decoder, data: bytes, in_stream: bool, lsn: int) -> None:
    d.in_stream = in_stream
    d.stream_xid = None
    try:
        d.decode(data, lsn)
    except DecodeError as e:
        assert e.lsn == lsn
        assert str(e)


mutation = st.tuples(
    st.sampled_from(["flip", "set", "insert", "delete", "truncate", "extend"]),
    st.integers(0, 10_000),
    st.integers(0, 255),
)


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    phases=[Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)
@given(
    sample=st.sampled_from(SAMPLES),
    edits=st.lists(mutation, min_size=1, max_size=4),
    stream_flag=st.booleans(),
)
def test_fuzz_mutated_real_messages(
    sample: tuple[bool, int, bytes], edits: list[tuple[str, int, int]], stream_flag: bool
) -> None:
    in_stream, lsn, data = sample
    buf = bytearray(data)
    for op, pos, byte in edits:
        at = pos % (len(buf) + 1)
        if op == "flip" and buf:
            buf[at % len(buf)] ^= 1 << (byte % 8)
        elif op == "set" and buf:
            buf[at % len(buf)] = byte
        elif op == "insert":
            buf.insert(at, byte)
        elif op == "delete" and buf:
            del buf[at % len(buf)]
        elif op == "truncate":
            del buf[at:]
        elif op == "extend":
            buf.extend(bytes([byte]) * (pos % 7 + 1))
    _decode_only_decode_error(PRIMED, bytes(buf), in_stream ^ (stream_flag and byte % 5 == 0), lsn)


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    first=st.sampled_from(b"BCORYIUDTMSEcAbPKrpZ\x00"),
    rest=st.binary(max_size=64),
    in_stream=st.booleans(),
)
def test_fuzz_random_bytes(first: int, rest: bytes, in_stream: bool) -> None:
    _decode_only_decode_error(PRIMED, bytes([first]) + rest, in_stream, 0x16B3A40)


def _one_of_each() -> list[tuple[bool, int, bytes]]:
    """The shortest message of each type (and of each in-stream row type) in the corpus."""
    seen: dict[bytes, tuple[bool, int, bytes]] = {}
    for item in CORPUS:
        key = item[2][:1] + (b"s" if item[0] else b"")
        if key not in seen or len(item[2]) < len(seen[key][2]):
            seen[key] = item
    return list(seen.values())


@pytest.mark.parametrize(
    "sample", _one_of_each(), ids=lambda s: repr(s[2][:1]) + ("-stream" if s[0] else "")
)
def test_every_truncation_is_a_decode_error(sample: tuple[bool, int, bytes]) -> None:
    in_stream, lsn, data = sample
    parallel = True if data[:1] == b"A" and len(data) == 25 else None
    d = _primed()
    d.parallel = parallel
    for cut in range(len(data)):
        d.in_stream = in_stream
        with pytest.raises(DecodeError) as info:
            d.decode(data[:cut], lsn)
        assert info.value.lsn == lsn
        assert info.value.offset is not None and 0 <= info.value.offset <= cut


def test_error_names_type_field_offset_lsn_and_bytes() -> None:
    d = Decoder()
    d.decode(
        build_message(
            b"R",
            {
                "xid": None,
                "relation_id": 9,
                "namespace": "public",
                "name": "t",
                "replica_identity": b"d",
                "columns": [
                    {"flags": 0, "name": f"c{i}", "type_oid": 25, "type_modifier": -1}
                    for i in range(5)
                ],
            },
        ),
        0,
    )
    cols = [{"kind": b"t", "data": b"x" * 10} for _ in range(5)]
    raw = build_message(b"I", {"xid": None, "relation_id": 9, "new": {"columns": cols}})
    bad = bytearray(raw)
    bad[8 + 4 * 15 + 1 : 8 + 4 * 15 + 5] = (120).to_bytes(4, "big")  # column 4 length 120
    with pytest.raises(DecodeError) as info:
        d.decode(bytes(bad), 0x16B3A40)
    e = info.value
    assert e.message_type == "Insert" and e.lsn == 0x16B3A40
    assert e.field is not None and "new" in e.field and "data" in e.field
    assert e.offset is not None and e.offset > 8
    assert "0/16B3A40" in str(e) and e.excerpt and f"message of {len(bad)} bytes" in str(e)


def test_unknown_message_type() -> None:
    with pytest.raises(DecodeError, match=r"unknown message type b'Z'.*offset 0.*0/10"):
        Decoder().decode(b"Z\x00\x01", 0x10)


def test_empty_message() -> None:
    with pytest.raises(DecodeError, match="empty message"):
        Decoder().decode(b"", 0)


def test_insert_for_unannounced_relation() -> None:
    raw = build_message(
        b"I", {"xid": None, "relation_id": 4242, "new": {"columns": [{"kind": b"n", "data": None}]}}
    )
    with pytest.raises(DecodeError, match="relation id 4242 was never announced"):
        Decoder().decode(raw, 0)


def test_unknown_tuple_kind() -> None:
    d = _primed()
    (_, lsn, raw) = next(x for x in CORPUS if x[2][:1] == b"I" and not x[0])
    bad = bytearray(raw)
    bad[8] = ord("z")  # first column's kind byte
    with pytest.raises(DecodeError, match=r"Insert\.new"):
        d.decode(bytes(bad), lsn)


def test_unannounced_relation_then_announced_decodes() -> None:
    d = _primed()
    (_, lsn, raw) = next(x for x in CORPUS if x[2][:1] == b"I" and not x[0])
    m = d.decode(raw, lsn)
    assert isinstance(m, Insert)


def test_parallel_abort_truncated_to_v2_length_is_refused_when_parallel() -> None:
    raw = build_message(b"A", {"xid": 1, "subxid": 1, "abort_lsn": 5, "abort_ts": 6}, parallel=True)
    assert isinstance(Decoder(parallel=True).decode(raw, 0), StreamAbort)
    with pytest.raises(DecodeError):
        Decoder(parallel=True).decode(raw[:9], 0)
    with pytest.raises(DecodeError):
        Decoder(parallel=False).decode(raw, 0)
