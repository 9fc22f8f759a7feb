"""redact takes a DSN's password out of any text: as given, as libpq quotes it, as written."""

from __future__ import annotations

import pytest

from ledger_cdc.redact import redact


@pytest.mark.parametrize(
    ("text", "dsn"),
    [
        ("password=s3cret host=db", None),
        ("PASSWORD = 's3 cret' host=db", None),
        ("postgresql://app:s3cret@db:5432/ledger", None),
        ('connection to "db" failed for user:s3cret', "postgresql://user:s3cret@db/ledger"),
        ("role refused with s3 cret", "postgresql://user:s3%20cret@db/ledger"),
        ("bad option near s3cret", "host=db password='s3cret' user=app"),
    ],
)
def test_the_password_is_gone(text: str, dsn: str | None) -> None:
    out = redact(text, dsn)
    assert "s3cret" not in out and "s3 cret" not in out and "***" in out


def test_text_without_a_password_is_unchanged() -> None:
    text = "could not connect to server: Connection refused (host=db port=5432)"
    assert redact(text) == text
    assert redact(text, "postgresql://app@db/ledger") == text
