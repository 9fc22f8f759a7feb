"""LSN text as PostgreSQL's pg_lsn reads it: two groups of 1–8 hex digits, nothing else."""

from __future__ import annotations

import pytest

from ledger_cdc.lsn import format_lsn, parse_lsn


@pytest.mark.parametrize("text", ["0/0", "0/16B3A40", "FFFFFFFF/FFFFFFFF", "a/b", " 1/2 "])
def test_what_pg_lsn_reads_round_trips(text: str) -> None:
    assert parse_lsn(format_lsn(parse_lsn(text))) == parse_lsn(text)


@pytest.mark.parametrize(
    "text",
    ["", "0", "0/", "/0", "0/1/2", "-1/0", "+1/0", "1_0/0", "0x1/0", "١/0", "100000000/0", "0/ 1"],
)
def test_anything_else_is_refused(text: str) -> None:
    """``int(x, 16)`` alone takes signs, underscores, other scripts' digits and values past 64
    bits: the server then refuses them, and a worker retrying such a message loops for ever."""
    with pytest.raises(ValueError, match="not an LSN"):
        parse_lsn(text)
