"""The importer's line reader: what a file saved by an editor holds reads as the same events."""

from __future__ import annotations

import json
import uuid

import pytest

from ledger_cdc.admin.importer import read_lines
from ledger_cdc.errors import InvalidEventError

LINE = json.dumps(
    {
        "session_id": str(uuid.uuid4()),
        "agent_id": "a",
        "event_type": "tool.invoked",
        "payload": {"call_id": "c", "tool": "t"},
        "created_at": "2026-01-01T00:00:00Z",
    }
)


@pytest.mark.parametrize("first", [b"\xef\xbb\xbf" + LINE.encode(), "\ufeff" + LINE])
def test_a_byte_order_mark_opening_the_file_is_skipped(first: bytes | str) -> None:
    plain = [ev for _, ev in read_lines([LINE.encode(), LINE.encode()])]
    assert [ev for _, ev in read_lines([first, LINE.encode()])] == plain


def test_a_byte_order_mark_past_the_first_line_is_no_event() -> None:
    with pytest.raises(InvalidEventError, match="line 2"):
        list(read_lines([LINE.encode(), b"\xef\xbb\xbf" + LINE.encode()]))
